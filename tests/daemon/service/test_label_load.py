"""The labelling page under load, over real sockets: 200 answers posted at once while a daemon-like holder of the
data directory's lock serves the answers' queue. Every request gets an HTTP reply (303, or 503 with
``Retry-After`` and nothing of it applied), every answer is applied exactly once, and no result is left in the
queue beyond the mailbox's bounds; an answer whose waiter gave up is shown on the page once the daemon applied
it, its result collected."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse

import pytest

from edgerev_daemon import DataDirLock, Store, prepare
from edgerev_daemon.learning import answers
from edgerev_daemon.service.http import StatusServer
from edgerev_daemon.storage import mailbox
from edgerev_daemon.storage.records import NewSample
from tests.daemon.conftest import make_config
from tests.daemon.service.test_http import http_config, sha

N = 200
SLOTS = 8
WAIT = 30.0  # the most any condition below is awaited (a deadline, never a pause)


class Holder:
    """Stands for a running daemon: holds the data directory's lock and, each time it is woken, serves the
    answers' queue (:func:`edgerev_daemon.learning.answers.serve`) in a thread of its own; :attr:`busy` (set at
    the start) keeps it from serving, as a cycle in a job does, until :meth:`free`."""

    def __init__(self, config) -> None:
        self.config = config
        self.lock = DataDirLock(config.layout.root).acquire()
        self.woken, self.freed, self.stopping = threading.Event(), threading.Event(), False
        self.passes = self.wakes = 0
        self.served = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="holder")
        self.thread.start()

    def wake(self) -> None:
        with self.served:
            self.wakes += 1
            self.served.notify_all()
        self.woken.set()

    def free(self) -> None:
        self.freed.set()

    def _run(self) -> None:
        with Store(self.config.layout.database) as store:
            while True:
                self.woken.wait()
                self.freed.wait()
                if self.stopping:
                    return
                self.woken.clear()  # before serving: a request posted meanwhile wakes it again
                answers.serve(self.config, store)
                with self.served:
                    self.passes += 1
                    self.served.notify_all()

    def wait_queue_empty(self) -> None:
        queue = answers.answers_dir(self.config.layout.root)
        with self.served:
            assert self.served.wait_for(lambda: not list(queue.glob("*.request")), timeout=WAIT)

    def stop(self) -> None:
        self.stopping = True
        self.freed.set()
        self.woken.set()
        self.thread.join(WAIT)
        self.lock.release()


@pytest.fixture
def unlabelled(tmp_path):
    """A data directory whose store knows the labels cat and dog and holds N unlabelled samples (no image
    files: an answer only needs the rows): (config, the samples' hashes)."""
    config = http_config(make_config(tmp_path))
    prepare(config.layout, config.inbox_path)
    known = [NewSample(sha(-1), "cat", 32, 32, sha(-2), "cat/0.png"),
             NewSample(sha(-3), "dog", 32, 32, sha(-4), "dog/0.png")]
    samples = [sha(i) for i in range(N)]
    with Store(config.layout.database) as store:
        store.record_batch(known + [NewSample(s, None, 32, 32, sha(N + i), f"unlabeled/{i}.png")
                                    for i, s in enumerate(samples)], [], heldout_fraction=0.15)
    return config, samples


def label_of(i: int) -> str:
    return "cat" if i % 2 else "dog"


def post(port: int, form: dict) -> tuple[int, str | None, str]:
    """``(status, Retry-After, body)`` of a POST /label on a connection of its own (a failure to get a reply
    raises)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT)
    try:
        c.request("POST", "/label", urllib.parse.urlencode(form), {"Content-Type": "application/x-www-form-urlencoded"})
        r = c.getresponse()
        return r.status, r.getheader("Retry-After"), r.read().decode()
    finally:
        c.close()


def get_page(port: int) -> str:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT)
    try:
        c.request("GET", "/label")
        r = c.getresponse()
        assert r.status == 200
        return r.read().decode()
    finally:
        c.close()


def journal_labels(config) -> dict[str, int]:
    """How many times the journal labels each sample (one line per label given)."""
    count: dict[str, int] = {}
    for line in (config.layout.root / "journal.jsonl").read_text().splitlines():
        d = json.loads(line)
        if "labeled" in d:
            count[d["labeled"]] = count.get(d["labeled"], 0) + 1
    return count


@pytest.mark.slow
def test_200_answers_at_once_each_get_a_reply_and_each_is_applied_once(unlabelled):
    config, samples = unlabelled
    holder = Holder(config)
    queue = answers.answers_dir(config.layout.root)
    try:
        # the holder is busy: the first SLOTS answers wait for it (long enough not to give up), the rest are refused
        with StatusServer(config, poll_interval=0.02, wakeup=holder.wake, answer_wait=WAIT,
                          answer_slots=SLOTS) as server:
            forms = [{"token": server.token, "sample": s, "label": label_of(i)} for i, s in enumerate(samples)]
            replies: list = [None] * N
            done = threading.Condition()
            barrier = threading.Barrier(N)

            def one(i: int) -> None:
                barrier.wait()
                try:
                    got = post(server.port, forms[i])
                except OSError as e:  # no HTTP reply (reset, timed out): what this test rules out
                    got = (type(e).__name__, None, str(e))
                with done:
                    replies[i] = got
                    done.notify_all()

            clients = [threading.Thread(target=one, args=(i,)) for i in range(N)]
            for t in clients:
                t.start()
            with done:  # every answer but those waiting for the holder is refused at once
                assert done.wait_for(lambda: sum(r is not None for r in replies) == N - SLOTS, timeout=WAIT)
            with holder.served:  # and those waiting are in the queue (each woke the holder after it posted)
                assert holder.served.wait_for(lambda: holder.wakes == SLOTS, timeout=WAIT)
            assert len(list(queue.glob("*.request"))) == SLOTS  # a refused answer left nothing in the queue
            holder.free()
            for t in clients:
                t.join(WAIT)
            codes = [r[0] for r in replies]
            assert codes.count(303) == SLOTS and codes.count(503) == N - SLOTS, codes
            for code, retry_after, body in replies:
                if code == 503:
                    assert retry_after == "1" and body.startswith(f"busy: {SLOTS} answers wait for the daemon")
            refused = [i for i, r in enumerate(replies) if r[0] == 503]
            with Store(config.layout.database) as store:
                assert store.count_samples(labeled=True) == 2 + SLOTS
                assert all(store.get_sample(samples[i]).label is None for i in refused)

            # the refused answers sent again, by at most SLOTS clients at a time: each is taken
            todo = list(refused)
            take = threading.Lock()

            def again() -> None:
                while True:
                    with take:
                        if not todo:
                            return
                        i = todo.pop()
                    replies[i] = post(server.port, forms[i])

            workers = [threading.Thread(target=again) for _ in range(SLOTS)]
            for t in workers:
                t.start()
            for t in workers:
                t.join(WAIT)
            assert [r[0] for r in replies] == [303] * N
            holder.wait_queue_empty()
            get_page(server.port)  # collects the results of answers whose waiter gave up, if any did
        with Store(config.layout.database) as store:
            assert [store.get_sample(s).label for s in samples] == [label_of(i) for i in range(N)]
        assert journal_labels(config) == {s: 1 for s in samples}  # each applied exactly once
        assert len(list(queue.glob("*.result"))) <= mailbox.RESULT_KEEP
    finally:
        holder.stop()
    with DataDirLock(config.layout.root), Store(config.layout.database) as store:  # a pass an hour later
        answers.serve(config, store, now=time.time() + mailbox.RESULT_MAX_AGE + 1)
    assert list(queue.iterdir()) == []


def test_an_answer_whose_waiter_gave_up_is_shown_once_applied_and_its_result_collected(unlabelled):
    config, samples = unlabelled
    holder = Holder(config)
    queue = answers.answers_dir(config.layout.root)
    try:
        with StatusServer(config, poll_interval=0.02, wakeup=holder.wake, answer_wait=0.0) as server:
            code, _, _ = post(server.port, {"token": server.token, "sample": samples[0], "label": "cat"})
            assert code == 303
            assert "handed to the running daemon" in get_page(server.port)
            holder.free()
            holder.wait_queue_empty()
            assert len(list(queue.glob("*.result"))) == 1  # applied; its waiter is gone
            page = get_page(server.port)
            assert f"{samples[0][:12]}: labelled &#x27;cat&#x27;" in page and "handed to the running" not in page
            assert list(queue.iterdir()) == []  # collected by the page
    finally:
        holder.stop()


def test_the_guide_states_the_bounds_the_code_keeps():
    import inspect
    from pathlib import Path

    from edgerev_daemon.service import http

    guide = " ".join((Path(__file__).parents[3] / "docs" / "guides" / "labelling.md").read_text().split())
    defaults = inspect.signature(StatusServer).parameters
    assert defaults["answer_slots"].default == 8 and "At most 8 answers wait at a time" in guide
    assert defaults["answer_wait"].default == 5.0 and "waits up to 5 seconds" in guide
    assert http._RETRY_AFTER == 1 and "`Retry-After: 1`" in guide
    assert mailbox.RESULT_MAX_AGE == 3600 and mailbox.RESULT_KEEP == 64
    assert "for an hour at most (and only the newest 64)" in guide

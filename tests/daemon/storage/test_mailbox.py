"""The one queue through which another process hands requests to the daemon holding a data directory
(edgerev_daemon.storage.mailbox): the fleet's requests and the owner's answers both take it."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edgerev_daemon.learning import answers
from edgerev_daemon.storage import mailbox

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)


@settings(max_examples=40, deadline=None)
@given(meta=st.dictionaries(st.text(min_size=1, max_size=8).filter(lambda k: k != "sha256"), JSON, max_size=5))
def test_a_request_and_its_result_come_back_as_they_were_posted(tmp_path_factory, meta):
    queue = tmp_path_factory.mktemp("q") / "requests"
    rid = mailbox.post(queue, meta)
    assert mailbox.waiting(queue, rid) and [r for r, _ in mailbox.pending(queue)] == [rid]
    assert mailbox.read(mailbox.pending(queue)[0][1]) == (meta, None)
    assert mailbox.collect(queue, rid) is None  # not answered yet
    mailbox.answer(queue, rid, {"echo": meta})
    assert not mailbox.waiting(queue, rid) and mailbox.pending(queue) == []
    assert mailbox.collect(queue, rid) == ({"echo": meta}, None)
    assert mailbox.collect(queue, rid) is None  # read once
    assert list(queue.iterdir()) == []


def test_tensors_travel_beside_the_json_and_are_checked_against_their_hash(tmp_path):
    queue = tmp_path / "q"
    shared = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    rid = mailbox.post(queue, {"kind": "round"}, shared)
    meta, tensors = mailbox.read(queue / f"{rid}.request")
    assert meta["kind"] == "round" and torch.equal(tensors["w"], shared["w"])
    (queue / f"{rid}.request" / "shared.safetensors").write_bytes(b"\0" * 16)  # damaged
    with pytest.raises(ValueError):
        mailbox.read(queue / f"{rid}.request")


def test_requests_are_taken_oldest_first_and_a_link_or_a_half_written_one_never(tmp_path):
    queue, elsewhere = tmp_path / "q", tmp_path / "elsewhere"
    ids = [mailbox.post(queue, {"n": i}) for i in range(3)]
    for i, rid in enumerate(ids):
        os.utime(queue / f"{rid}.request", (1000 - i, 1000 - i))  # the last posted is the oldest
    outside = mailbox.post(elsewhere, {"n": "outside"})
    (queue / f"{outside}.request").symlink_to(elsewhere / f"{outside}.request")
    (queue / ".half.request.tmp").mkdir()  # a writer killed before its rename
    (queue / "stray.request").write_text("{}")  # a file, not a request folder
    assert [r for r, _ in mailbox.pending(queue)] == ids[::-1]


def test_a_writer_killed_before_its_rename_leaves_no_request(tmp_path, monkeypatch):
    queue = tmp_path / "q"
    real = Path.rename

    def killed(self, target):
        raise KeyboardInterrupt  # stands for the kill: nothing after it runs

    monkeypatch.setattr(Path, "rename", killed)
    with pytest.raises(KeyboardInterrupt):
        mailbox.post(queue, {"kind": "classes"})
    monkeypatch.setattr(Path, "rename", real)
    assert mailbox.pending(queue) == []
    rid = mailbox.post(queue, {"kind": "classes"})  # the next one is not hindered by the leftover
    assert [r for r, _ in mailbox.pending(queue)] == [rid]


def test_a_daemon_killed_between_its_answer_and_the_removal_does_not_carry_a_request_out_twice(tmp_path, monkeypatch):
    queue = tmp_path / "q"
    rid = mailbox.post(queue, {"kind": "classes"})
    monkeypatch.setattr(mailbox.shutil, "rmtree", lambda *a, **k: None)  # the kill: the request is not removed
    mailbox.answer(queue, rid, {"counts": {"a": 1}})
    monkeypatch.undo()
    assert mailbox.waiting(queue, rid)
    assert mailbox.pending(queue) == [] and not mailbox.waiting(queue, rid)  # answered: removed, not returned
    assert mailbox.collect(queue, rid) == ({"counts": {"a": 1}}, None)
    # restarted after its result's time: the result still says the request was carried out
    rid = mailbox.post(queue, {"kind": "classes"})
    monkeypatch.setattr(mailbox.shutil, "rmtree", lambda *a, **k: None)
    mailbox.answer(queue, rid, {"counts": {"a": 1}})
    monkeypatch.undo()
    assert mailbox.pending(queue, now=time.time() + 10 * mailbox.RESULT_MAX_AGE) == []
    assert not mailbox.waiting(queue, rid)


def test_a_result_that_cannot_be_read_is_removed_and_said(tmp_path):
    queue = tmp_path / "q"
    rid = mailbox.post(queue, {})
    mailbox.answer(queue, rid, {"ok": True})
    (queue / f"{rid}.result" / "meta.json").write_text("[1, 2")  # torn
    with pytest.raises(ValueError):
        mailbox.collect(queue, rid)
    assert mailbox.collect(queue, rid) is None


def test_an_owners_unreadable_result_is_an_outcome_that_says_so(tmp_path):
    root = tmp_path
    rid = answers.submit(root, [answers.Answer("abc", "cat")])
    mailbox.answer(answers.answers_dir(root), rid, {"outcomes": "not a list of outcomes"})
    [outcome] = answers.result(root, rid)
    assert not outcome.ok and f"result for request {rid} could not be read" in outcome.text
    assert answers.wait(root, rid, 0.0, 0.01) is None  # removed: the request is gone too


def test_a_result_is_taken_by_one_reader_only(tmp_path):
    queue = tmp_path / "q"
    rid = mailbox.post(queue, {})
    mailbox.answer(queue, rid, {"ok": True})
    barrier, got = threading.Barrier(8), []

    def reader():
        barrier.wait()
        got.append(mailbox.collect(queue, rid))  # an exception would leave got short

    readers = [threading.Thread(target=reader) for _ in range(8)]
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    assert got.count(({"ok": True}, None)) == 1 and got.count(None) == 7
    assert list(queue.iterdir()) == []


def test_results_nobody_collects_expire_by_age_and_count_and_what_a_kill_left_goes_too(tmp_path):
    queue, now = tmp_path / "q", time.time()
    ids = [mailbox.post(queue, {"n": i}) for i in range(5)]
    for i, rid in enumerate(ids):
        mailbox.answer(queue, rid, {"n": i})
        os.utime(queue / f"{rid}.result", (now - 100 * (5 - i),) * 2)  # aged 500, 400, ... 100 s
    (queue / ".killed.request.tmp").mkdir()  # a writer killed before its rename, long ago
    os.utime(queue / ".killed.request.tmp", (now - 1000,) * 2)
    (queue / ".busy.result.tmp").mkdir()  # a writer at work now
    waiting = mailbox.post(queue, {"n": "waits"})
    # 500 s and 400 s are past the age, 300 s past the two newest kept; a request is never expired
    assert mailbox.expire(queue, now=now, max_age=350, keep=2) == 3
    assert sorted(p.name for p in queue.iterdir()) == sorted(
        [f"{ids[3]}.result", f"{ids[4]}.result", ".busy.result.tmp", f"{waiting}.request"])
    assert mailbox.collect(queue, ids[4]) == ({"n": 4}, None)
    # the daemon's pass over the queue expires what is left at its clock (an hour on), and lists the request
    assert [r for r, _ in mailbox.pending(queue, now=now + mailbox.RESULT_MAX_AGE + 1)] == [waiting]
    assert [p.name for p in queue.iterdir()] == [f"{waiting}.request"]
    assert mailbox.RESULT_KEEP >= 8  # more than the labelling page's waits at a time (StatusServer's answer_slots)

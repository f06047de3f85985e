"""The questions and the answers: the ranking's spread, the list the daemon keeps (refreshed, never naming a
sample removed or labelled since), ``edgerev daemon label`` with and without a running daemon, and the
status figures, on copies of conftest's ``served`` data directory with unlabelled images dropped in."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from edgerev.cli import main
from edgerev_daemon.learning import answers, questions
from edgerev_daemon.learning.answers import Answer
from edgerev_daemon.service.daemon import Daemon
from edgerev_daemon.service.demo import write_images
from edgerev_daemon.service.http import format_metrics
from edgerev_daemon.service.labelling import give
from edgerev_daemon.service.lock import DataDirLock
from edgerev_daemon.service.status import format_status, status
from edgerev_daemon.storage import mailbox
from edgerev_daemon.storage.records import JobState
from edgerev_daemon.storage.store import Store
from tests.daemon.conftest import Clock
from tests.daemon.service.test_service import make_config as service_config


def drop_unlabeled(config, n: int, seed: int = 7) -> dict[str, str]:
    """``n`` generated images of class0 and class1 dropped in ``inbox/unlabeled/``; ``{file name: class}``."""
    stage = Path(config.data_dir).parent / f"stage-{seed}"
    truth = {}
    for path in write_images(stage, n, range(2), seed=seed, start=50_000, num_classes=4, size=16):
        name = f"{path.parent.name}-{path.name}"
        (config.inbox_path / "unlabeled").mkdir(parents=True, exist_ok=True)
        path.rename(config.inbox_path / "unlabeled" / name)
        truth[name] = path.parent.name
    return truth


def asked_copy(served: Path, tmp: Path, n: int = 60, **over):
    """A copy of ``served`` after a cycle that stored ``n`` unlabelled images (and made the first list)."""
    shutil.copytree(served, tmp / "data", symlinks=True)
    config, path = service_config(tmp, **over)
    truth = drop_unlabeled(config, n)
    with Daemon(config, clock=Clock()) as d:
        report = d.cycle()
    assert report.ingest["accepted"] == n and report.job is None, report.to_json()
    return config, path, truth, report


@pytest.fixture(scope="module")
def asked(served, tmp_path_factory):
    return asked_copy(served, tmp_path_factory.mktemp("asked"))


@pytest.fixture
def fresh(served, tmp_path):
    return asked_copy(served, tmp_path, n=30)


def true_label(store: Store, truth: dict, sha: str) -> str:
    return truth[store.get_sample(sha).source.rpartition("/")[2]]


# the ranking -------------------------------------------------------------------------------------------------

def test_the_ranking_spreads_its_questions_over_kinds_of_doubt():
    # twenty frames of one scene, the least sure of all, and five other doubts a little less close
    scene = torch.tensor([0.505, 0.495, 0.0]).repeat(20, 1) + torch.linspace(0, 1e-4, 20)[:, None] * torch.tensor(
        [1.0, -1.0, 0.0])
    others = torch.tensor([[0.0, 0.52, 0.48], [0.47, 0.0, 0.53], [0.4, 0.35, 0.25], [0.3, 0.3, 0.4],
                           [0.55, 0.2, 0.25]])
    confident = torch.tensor([[0.98, 0.01, 0.01]]).repeat(30, 1)
    probs = torch.cat([confident, scene, others])
    by_margin = torch.argsort(questions.margins(probs))[:5].tolist()
    assert all(30 <= i < 50 for i in by_margin)  # margin alone: five frames of the one scene
    picked = questions.rank(probs.clamp_min(1e-6).log(), count=5, pool=6)
    assert len(picked) == 5 and sum(1 for i in picked if 30 <= i < 50) <= 2
    assert not set(picked) & set(range(30))  # never a sample the model is sure of
    m = questions.margins(probs)
    assert [float(m[i]) for i in picked] == sorted(float(m[i]) for i in picked)  # smallest margin first


def test_copies_of_one_picture_are_asked_once():
    logits = torch.tensor([[2.0, 2.0]]).repeat(10, 1)
    assert questions.rank(logits, count=5, pool=4) == [0]
    sure = torch.tensor([[9.0, -9.0], [8.0, -9.5], [-9.0, 9.0], [-7.0, 8.0]])  # a model sure of everything
    assert len(questions.rank(sure, count=3, pool=4)) == 3
    assert questions.rank(torch.zeros(0, 2), count=5, pool=4) == []


# the list ------------------------------------------------------------------------------------------------------

def test_the_list_asks_about_unlabelled_samples_least_sure_first(asked):
    config, _, truth, report = asked
    ql = questions.read_list(config.layout.root)
    assert ql is not None and ql.version == "v0001" and ql.scored == 60
    assert report.questions == len(ql.questions) and 1 <= len(ql.questions) <= config.questions.count
    with Store(config.layout.database) as store:
        unlabeled = set(store.unlabeled_hashes())
        assert all(q.sample in unlabeled for q in ql.questions)
        assert questions.waiting(config.layout.root, store) == list(ql.questions)
    assert [q.margin for q in ql.questions] == sorted(q.margin for q in ql.questions)
    assert all(q.guess in ("class0", "class1") and q.source.startswith("unlabeled/") for q in ql.questions)
    assert len({q.sample for q in ql.questions}) == len(ql.questions)


def test_a_sample_labelled_or_removed_since_leaves_the_list(fresh):
    config, _, _, _ = fresh
    root = config.layout.root
    with DataDirLock(root), Store(config.layout.database) as store:
        first, second, *_ = questions.waiting(root, store)
        answers.apply(config, store, [Answer(first.sample, "class0")])
        store.remove_samples([second.sample], "max_samples")
        left = [q.sample for q in questions.waiting(root, store)]
    assert first.sample not in left and second.sample not in left
    assert len(left) == len(questions.read_list(root).questions) - 2
    # a skipped sample is not asked again; once removed, the skipped file forgets it
    third, fourth = left[:2]
    with DataDirLock(root), Store(config.layout.database) as store:
        answers.apply(config, store, [Answer(third, None)])
        assert questions.skipped(root) == {third} and third not in questions.waiting(root, store)
        store.remove_samples([third], "max_samples")
        answers.apply(config, store, [Answer(fourth, None)])
    assert questions.skipped(root) == {fourth}


def test_the_list_is_made_again_after_a_job_and_after_the_version_changes(fresh):
    config, _, _, _ = fresh
    root = config.layout.root
    with Daemon(config, clock=Clock()) as d:
        assert questions.due(config, d.store, d.registry) is None
        job = d.store.create_job("test")
        d.store.set_job_state(job.id, JobState.RUNNING)
        d.store.set_job_state(job.id, JobState.FAILED, error="made up")
        assert questions.due(config, d.store, d.registry) == "a job finished"  # promoted or not: a new list
        assert d.cycle().questions is not None and questions.due(config, d.store, d.registry) is None
        ql = questions.read_list(root)
        questions.write_list(root, questions.QuestionList("v0000", ql.job, ql.newest_batch, ql.made_at, ql.scored,
                                                          ql.questions))
        assert "in service is v0001" in questions.due(config, d.store, d.registry)
        questions.list_path(root).write_text("{half a li")  # what no atomic write leaves; read as no list
        assert questions.read_list(root) is None and questions.due(config, d.store, d.registry) == "no list yet"


def test_a_stop_while_scoring_keeps_the_old_list(fresh):
    config, _, _, _ = fresh
    root = config.layout.root
    before = questions.list_path(root).read_bytes()
    with Daemon(config, clock=Clock()) as d:
        assert questions.refresh(config, d.store, d.blobs, d.registry, 0.0, stop=lambda: True) is None
    assert questions.list_path(root).read_bytes() == before


WRITER = """
import sys
from edgerev_daemon.learning import questions as q
root = sys.argv[1]
lists = [q.QuestionList("v0001", k, k, 0.0, 0, tuple(q.Question(f"{k:064x}", "class0", 0.5, (("class0", 0.7),),
         "unlabeled/x.png") for _ in range(2000))) for k in (1, 2)]
n = 0
while True:
    q.write_list(root, lists[n % 2])
    n += 1
    print(n, flush=True)
"""


def test_a_kill_while_the_list_is_written_leaves_the_old_list_or_the_new_one(tmp_path):
    import signal
    import subprocess
    import sys

    for kill_after in (1, 3, 8):
        child = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(kill_after):
            assert child.stdout.readline()  # a list written whole; the next one is under way
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
        ql = questions.read_list(tmp_path)
        assert ql is not None and ql.job in (1, 2) and len(ql.questions) == 2000


# edgerev daemon label ----------------------------------------------------------------------------------------

def test_label_lists_the_questions_and_takes_answers(fresh, capsys):
    config, path, truth, _ = fresh
    root = config.layout.root
    assert main(["daemon", "label", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    with Store(config.layout.database) as store:
        asked = questions.waiting(root, store)
        a, b, c, d = (q.sample for q in asked[:4])
        assert f"{len(asked)} questions" in out and all(q.sample[:12] in out and q.source in out for q in asked)
        label_a = true_label(store, truth, a)
    assert main(["daemon", "label", "--config", str(path), "--set", f"{a[:8]}={label_a}", "--skip", b[:10]]) == 0
    out = capsys.readouterr().out
    assert f"labelled '{label_a}'" in out and "skipped" in out
    # a typo is refused with the labels the store knows; --new-label adds one
    assert main(["daemon", "label", "--config", str(path), "--set", f"{c}=clas0"]) == 1
    assert "'clas0' is no label the store knows (known: class0, class1)" in capsys.readouterr().out
    assert main(["daemon", "label", "--config", str(path), "--set", f"{c}=bird", "--new-label", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["ok"]
    with Store(config.layout.database) as store:
        store.remove_samples([d], "max_samples")
    assert main(["daemon", "label", "--config", str(path), "--set", f"{d}=class1"]) == 1
    assert "removed by the retention policy (max_samples)" in capsys.readouterr().out
    with Store(config.layout.database) as store:
        assert store.get_sample(a).label == label_a and store.get_sample(c).label == "bird"
        assert store.get_sample(b).label is None and questions.skipped(root) == {b}
        left = {q.sample for q in questions.waiting(root, store)}
        assert not left & {a, b, c, d}
        assert store.labels() == ["class0", "class1", "bird"]
    assert main(["daemon", "label", "--config", str(path), "--set", "nolabel"]) == 2


def test_answers_reach_a_running_daemon_through_its_data_directory(fresh, capsys):
    config, path, truth, _ = fresh
    root = config.layout.root
    with Daemon(config, clock=Clock()) as d:
        first = questions.waiting(root, d.store)[0].sample
        label = true_label(d.store, truth, first)
        given = give(config, [Answer(first, label)], wait=0)  # the daemon holds the lock: handed over
        assert given.outcomes is None and mailbox.waiting(answers.answers_dir(root), given.request)
        assert main(["daemon", "label", "--config", str(path), "--skip", first, "--wait", "0"]) == 0
        assert "handed to the running daemon" in capsys.readouterr().out
        assert d.store.get_sample(first).label is None  # nothing written beside the daemon
        report = d.cycle()
        assert report.answers == 2 and d.store.get_sample(first).label == label
    got = answers.result(root, given.request)
    assert [o.ok for o in got] == [True] and got[0].text.startswith(f"labelled '{label}'")
    assert not list(answers.answers_dir(root).glob("*.request"))


def test_label_reaches_a_daemon_running_in_a_process_of_its_own(fresh, capsys):
    import signal

    from tests.daemon.running import LIMIT, Running

    config, path, truth, _ = fresh
    with Store(config.layout.database) as store:
        sample = questions.waiting(config.layout.root, store)[0].sample
        label = true_label(store, truth, sample)
    with Running(path) as d:
        d.wait_for("serving")
        argv = ["daemon", "label", "--config", str(path), "--set", f"{sample[:12]}={label}", "--wait", str(LIMIT)]
        assert main(argv) == 0
        assert f"labelled '{label}'" in capsys.readouterr().out
        d.wait_for(f"answer for {sample[:12]}: labelled '{label}'")  # the daemon wrote it, under its lock
        d.send(signal.SIGTERM)
        assert d.finish() == 0
    with Store(config.layout.database) as store:
        assert store.get_sample(sample).label == label
        assert sample not in {q.sample for q in questions.waiting(config.layout.root, store)}


# status --------------------------------------------------------------------------------------------------------

def test_status_tells_the_questions_and_what_the_answers_gained(served, tmp_path, capsys):
    over = {"schedule": {"min_new_samples": 20, "max_interval_seconds": 3600.0}}
    config, path, truth, _ = asked_copy(served, tmp_path, n=60, **over)
    s = status(config)
    q = s["questions"]
    assert q["waiting"] == len(questions.read_list(config.layout.root).questions) and q["answers"] == 0
    assert q["gain"] is None and "accuracy gained from the last answers: not yet" in format_status(s)
    assert "edgerev_questions_waiting " + str(q["waiting"]) in format_metrics(s)
    # the owner answers every unlabelled image (an oracle); the next cycle trains on them
    with Store(config.layout.database) as store:
        sets = [f"{sha}={true_label(store, truth, sha)}" for sha in store.unlabeled_hashes()]
    argv = ["daemon", "label", "--config", str(path)]
    for s_ in sets:
        argv += ["--set", s_]
    assert main(argv) == 0
    capsys.readouterr()
    with Daemon(config, clock=Clock()) as d:
        report = d.cycle()
    assert report.job is not None and report.job.get("version") == "v0002", report.to_json()
    assert report.questions == 0  # a new list after the job: nothing left to ask
    s = status(config)
    gain = s["questions"]["gain"]
    assert gain["job"] == report.job["job"] and gain["answers"] == 60 and gain["version"] == "v0002"
    assert gain["promoted"] == report.job["promoted"]
    expected = (gain["after"] - gain["before"]) if gain["promoted"] else 0.0
    assert gain["gained"] == pytest.approx(expected)
    assert f"accuracy gained from the last answers: {100 * gain['gained']:+.1f} points" in format_status(s)
    assert s["questions"]["answers"] == 60 and s["questions"]["waiting"] == 0
    assert f"edgerev_answers_accuracy_gain {float(gain['gained'])!r}" in format_metrics(s)

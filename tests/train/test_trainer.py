"""The trainer end to end on tiny generated data: files, resume (in process, after SIGTERM, after kill -9),
memory-saving against plain training, budgets, and bad input."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from edgerev.config import ConfigError, from_dict
from edgerev.errors import ShapeError
from edgerev.memory.solve.costs import BudgetTooSmall
from edgerev.models.directory import CheckpointError, load_model
from edgerev.train.config import RunConfig
from edgerev.train.data import DataError
from edgerev.train.state import load_checkpoint
from edgerev.train.trainer import RunError, lr_at, train


def recipe(**over) -> dict:
    """A run of a few seconds: a narrow RevNeXt on 16x16 generated images of four classes."""
    cfg = {
        "model": {"arch": "revnext", "args": {"width": 8, "blocks": [1, 1, 1, 1, 1]}},
        "data": {"size": 16, "train": {"samples": 256, "num_classes": 4, "noise": 20.0},
                 "val": {"samples": 128, "num_classes": 4, "noise": 20.0, "start": 100_000}},
        "augment": {"pad": 1, "flip": 0.0},
        "optim": {"lr": 0.05},
        "train": {"epochs": 3, "batch": 32, "log_every": 2, "checkpoint_every": 4},
    }
    for key, value in over.items():
        section, name = key.split("__")
        cfg.setdefault(section, {})[name] = value
    return cfg


def run(tmp_path, name="run", **over):
    return train(from_dict(RunConfig, recipe(**over)), tmp_path / name, progress=False)


def test_a_run_writes_its_folder_and_learns(tmp_path):
    r = run(tmp_path)
    out = r.out
    assert r.status == "done" and r.step == r.total_steps == 3 * (256 // 32)
    for name in ("config.yaml", "metrics.jsonl", "model.safetensors", "model.json", "summary.json", "curves.png",
                 "classes.png", "progress.json"):
        assert (out / name).is_file(), name
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [row for row in rows if row["kind"] == "eval"]
    assert [e["epoch"] for e in evals] == [1, 2, 3]
    assert r.summary["final"]["acc"] > 0.6  # four classes: chance is 0.25
    conf = r.summary["final"]["confusion"]
    assert conf["labels"] == conf["predicted"] == ["class0", "class1", "class2", "class3"]
    assert sum(map(sum, conf["matrix"])) == r.summary["val_samples"]
    right = [conf["matrix"][i][i] / sum(row) for i, row in enumerate(conf["matrix"]) if sum(row)]
    assert right == [r.summary["final"]["per_class"][c] for c in conf["labels"] if c in r.summary["final"]["per_class"]]
    model, info, sha = load_model(out)
    assert info.classes == ("class0", "class1", "class2", "class3") and info.input_size == 16
    assert sha == r.summary["weights_sha256"]
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["optim"]["momentum"] == 0.9 and resolved["data"]["train"]["kind"] == "synthetic"


def test_one_cycle_schedule():
    from edgerev.train.config import OptimConfig

    cfg = OptimConfig(lr=0.4, warmup=0.25)
    assert lr_at(0, 100, cfg) == pytest.approx(0.4 / 25)
    assert lr_at(25, 100, cfg) == pytest.approx(0.4)
    assert lr_at(99, 100, cfg) < 0.001
    values = [lr_at(s, 100, cfg) for s in range(100)]
    assert values.index(max(values)) == 25
    assert lr_at(50, 100, OptimConfig(lr=0.1, schedule="constant")) == 0.1


def _weights(folder):
    model, _, _ = load_model(folder)
    return model.state_dict()


@pytest.mark.slow
def test_a_stopped_run_resumes_to_the_same_weights(tmp_path):
    whole = run(tmp_path, "whole")
    polls = []

    def stop_after_five():
        polls.append(1)
        return len(polls) == 5

    cfg = from_dict(RunConfig, recipe())
    first = train(cfg, tmp_path / "cut", stop=stop_after_five, progress=False)
    assert first.status == "stopped" and first.step == 5
    assert not (tmp_path / "cut" / "model.json").exists()
    second = train(None, tmp_path / "cut", resume=True, progress=False)
    assert second.status == "done" and second.step == whole.step
    a, b = _weights(whole.out), _weights(second.out)
    assert all(torch.equal(a[k], b[k]) for k in a), "a resumed run must take the very same steps"
    rows = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    steps = [(r["kind"], r["step"]) for r in rows]
    assert len(steps) == len(set(steps)), "resuming must not log a step twice"


@pytest.mark.slow
def test_a_stop_in_an_epochs_evaluation_waits_one_batch_and_the_resume_evaluates_first(tmp_path, monkeypatch):
    """A stop asked during an epoch's evaluation ends it before its next batch, with no step after it; the
    checkpoint says the evaluation is due, and the resumed run makes it before any step: the same weights and
    the same evaluation rows as a run never stopped."""
    import edgerev.train.evaluate as evaluation
    import edgerev.train.trainer as trainer

    whole = run(tmp_path, "whole", train__eval_batch=16)  # 128 validation samples: 8 batches an evaluation
    batches, steps = [], []  # each evaluation batch (the steps taken before it), each training step
    real_normalize, real_step = evaluation.normalize, trainer.train_step
    monkeypatch.setattr(evaluation, "normalize", lambda *a: batches.append(len(steps)) or real_normalize(*a))
    monkeypatch.setattr(trainer, "train_step", lambda *a, **k: steps.append(1) or real_step(*a, **k))

    def stop() -> bool:  # says so once the first epoch's evaluation has scored two batches
        return len(batches) >= 2

    first = train(from_dict(RunConfig, recipe(train__eval_batch=16)), tmp_path / "cut", stop=stop, progress=False)
    assert first.status == "stopped" and first.step == 256 // 32  # the first epoch's last step
    assert (len(steps), len(batches)) == (8, 2), "a batch or a step ran after the stop was asked for"
    model, optimizer = _model_and_optimizer(tmp_path / "cut")
    assert load_checkpoint(tmp_path / "cut", model, optimizer).extra["evaluation_due"] is True
    rows = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in rows if r["kind"] == "eval"], "a cut evaluation left a row"

    second = train(None, tmp_path / "cut", resume=True, progress=False)
    assert second.status == "done" and second.step == whole.step
    assert batches[2:10] == [8] * 8, "the due evaluation comes before any step of the resumed run"
    a, b = _weights(whole.out), _weights(second.out)
    assert all(torch.equal(a[k], b[k]) for k in a), "a resumed run must take the very same steps"

    def evals(folder):
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        return [(r["epoch"], r["step"], r["acc"], r["loss"]) for r in rows if r["kind"] == "eval"]

    assert evals(tmp_path / "cut") == evals(whole.out) and [e[0] for e in evals(whole.out)] == [1, 2, 3]


def test_a_stop_in_the_starting_models_evaluation_writes_nothing(tmp_path):
    """Fine-tuning evaluates the starting model first: a stop there ends the run after the evaluation's first
    batch, before anything is written."""
    start = run(tmp_path, "start", train__epochs=1)
    tuned = recipe(model__init=str(start.out), train__eval_batch=16)  # 128 validation samples: 8 batches
    stopped = train(from_dict(RunConfig, tuned), tmp_path / "tuned", stop=lambda: True, progress=False)
    assert stopped.status == "stopped" and stopped.summary == {"stopped_in": "the starting model's evaluation"}
    assert not (tmp_path / "tuned").exists()


def _write_recipe(tmp_path, **over):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe(**over)))
    return path


CHILD = os.path.join(os.path.dirname(__file__), "train_child.py")
LIMIT = 600  # seconds: only reached when something is truly broken, however loaded the machine


def _spawn(point, args):
    """``edgerev ARGS`` in a child that prints ``@POINT N`` each time the run reaches POINT."""
    return subprocess.Popen([sys.executable, CHILD, point, "--", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def _wait_until(proc, line: str) -> list[str]:
    """Read the child's stdout up to ``line`` (a blocking read: no clock involved); the lines before it."""
    seen = []
    for out in proc.stdout:
        if out.rstrip("\n") == line:
            return seen
        seen.append(out)
    proc.wait(LIMIT)
    pytest.fail(f"the run ended before {line!r}: {proc.stderr.read()[-3000:]}")


@pytest.mark.slow
def test_kill_9_then_resume(tmp_path):
    """A real process killed with SIGKILL mid-run continues from its checkpoint with --resume."""
    cfg = _write_recipe(tmp_path, train__checkpoint_every=1, train__epochs=6)
    out = tmp_path / "run"
    proc = _spawn("checkpoint", ["train", "--config", str(cfg), "--out", str(out), "--quiet"])
    _wait_until(proc, "@checkpoint 2")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=LIMIT)
    killed_at = json.loads((out / "checkpoints" / "latest.json").read_text())["step"]
    total = 6 * (256 // 32)
    assert 2 <= killed_at < total
    assert not (out / "model.json").exists()
    result = train(None, out, resume=True, progress=False)
    assert result.status == "done" and result.step == total
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["epoch"] for r in rows if r["kind"] == "eval") == list(range(1, 7))


@pytest.mark.slow
def test_sigterm_stops_at_a_step_boundary_with_a_checkpoint(tmp_path):
    cfg = _write_recipe(tmp_path, train__checkpoint_every=1000, train__epochs=20)
    out = tmp_path / "run"
    proc = _spawn("step", ["train", "--config", str(cfg), "--out", str(out), "--quiet", "--json"])
    _wait_until(proc, "@step 1")
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=LIMIT)
    assert proc.returncode == 0, stderr
    report = json.loads("".join(line for line in stdout.splitlines(keepends=True) if not line.startswith("@")))
    assert report["status"] == "stopped" and 0 < report["step"] < report["total_steps"]
    model, optimizer = _model_and_optimizer(out)
    assert load_checkpoint(out, model, optimizer).step == report["step"]


def _model_and_optimizer(out):
    from edgerev.models import create_model

    model = create_model("revnext", width=8, blocks=(1, 1, 1, 1, 1), num_classes=4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)


def test_a_half_written_checkpoint_is_never_loaded(tmp_path):
    stopped = train(from_dict(RunConfig, recipe()), tmp_path / "run", stop=lambda: True, progress=False)
    assert stopped.status == "stopped"
    ckpt = next((tmp_path / "run" / "checkpoints").glob("step-*.safetensors"))
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 2])  # as if the rename had happened before the data was whole
    model, optimizer = _model_and_optimizer(tmp_path / "run")
    with pytest.raises(CheckpointError, match="does not match the hash"):
        load_checkpoint(tmp_path / "run", model, optimizer)
    with pytest.raises(CheckpointError):
        train(None, tmp_path / "run", resume=True, progress=False)


def test_output_folder_rules(tmp_path):
    run(tmp_path, train__epochs=1)
    with pytest.raises(RunError, match="already holds a run; pass --resume"):
        run(tmp_path, train__epochs=1)
    with pytest.raises(RunError, match="holds no checkpoint to resume"):
        train(None, tmp_path / "empty", resume=True)
    stopped = train(from_dict(RunConfig, recipe()), tmp_path / "s", stop=lambda: True, progress=False)
    assert stopped.status == "stopped"
    with pytest.raises(RunError, match="config differs"):
        train(from_dict(RunConfig, recipe(train__epochs=9)), tmp_path / "s", resume=True)


@pytest.mark.slow
def test_memory_saving_and_plain_training_agree(tmp_path):
    """Same weights, same seed, same steps: the engine's run and plain autograd's end at the same accuracy."""
    saving = run(tmp_path, "saving", memory__mode="invert")
    plain = run(tmp_path, "plain", memory__mode="plain")
    a, b = saving.summary["final"], plain.summary["final"]
    assert abs(a["acc"] - b["acc"]) <= 0.1 and abs(a["loss"] - b["loss"]) <= 0.2 * max(a["loss"], b["loss"]) + 0.05
    assert saving.summary["plan"]["stages"][1]["mode"] == "invert"


@pytest.mark.slow
def test_training_under_a_budget(tmp_path):
    r = run(tmp_path, memory__budget="6MiB", memory__profile="estimate", train__epochs=1)
    plan = r.summary["plan"]
    assert plan["mode"] == "planned" and plan["budget_bytes"] == 6 * 2**20
    assert plan["predicted_peak_bytes"] <= 6 * 2**20
    # the tracker's figure for the steps it verified: real bytes, under the cap
    assert 0 < plan["measured_peak_bytes"] <= 6 * 2**20
    assert plan["micro_batch"] * plan["micro_batches"] >= 32
    with pytest.raises(BudgetTooSmall, match="smallest"):
        run(tmp_path, "tiny", memory__budget="200KiB", memory__profile="estimate", train__epochs=1)


def test_bad_inputs_get_one_clear_error(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        run(tmp_path, "a", data__train={"kind": "folder", "path": str(tmp_path / "missing")})
    (tmp_path / "imgs" / "cat").mkdir(parents=True)
    with pytest.raises(DataError, match="holds no PNG or JPEG"):
        run(tmp_path, "b", data__train={"kind": "folder", "path": str(tmp_path / "imgs")})
    with pytest.raises(ShapeError, match="divisible by 16"):
        run(tmp_path, "c", data__size=24)
    base = run(tmp_path, "base", train__epochs=1)
    with pytest.raises(RunError, match="holds a revnext model, but model.arch is revnet"):
        run(tmp_path, "d", model__arch="revnet", model__init=str(base.out), model__args={"width": 8})
    with pytest.raises(RunError, match="trained at 16x16, but data.size is 32"):
        run(tmp_path, "e", model__init=str(base.out), data__size=32)


def test_cli_train(tmp_path, capsys):
    from edgerev.cli import main

    cfg = _write_recipe(tmp_path, train__epochs=1)
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    assert "done: 8 steps, validation accuracy" in capsys.readouterr().out
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("edgerev train: error:") and "already holds a run" in err and err.count("\n") == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {epochs: ten}\n")
    assert main(["train", "--config", str(bad), "--out", str(tmp_path / "x")]) == 2
    assert "train.epochs: expected int, got str 'ten'" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path / "y")]) == 2
    assert "give --config" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.longest  # collected sixth from last: started there, it ran alone at the end of a run
def test_cpu_demo_preset_reaches_its_stated_accuracy(tmp_path):
    """configs/cpu-demo.yaml: at least 95 % on the generated data set (configs/README.md states it)."""
    from pathlib import Path

    from edgerev.train.config import load_config

    preset = Path(__file__).parents[2] / "configs" / "cpu-demo.yaml"
    t0 = time.perf_counter()
    result = train(load_config(preset), tmp_path / "demo", progress=False)
    seconds = time.perf_counter() - t0
    print(f"cpu demo: accuracy {result.summary['final']['acc']:.4f} in {seconds:.1f} s")
    assert result.summary["final"]["acc"] >= 0.95


def test_divergence_is_one_clear_error(tmp_path):
    with pytest.raises(RunError, match=r"training diverged at step \d+ .*lower optim.lr .* optim.clip_grad_norm"):
        run(tmp_path, optim__lr=1e6, optim__schedule="constant", memory__mode="invert")
    with pytest.raises(RunError, match="training diverged"):
        run(tmp_path, "plain", optim__lr=1e6, optim__schedule="constant", memory__mode="plain")


def test_paper_recipe_trains_without_clipping(tmp_path):
    """The RevNeXt authors' recipe (peak lr 0.4, linear warm-up and decay, no clipping) stays finite.

    With edgerev's earlier stem (a bare convolution) and head (a mean and a biased linear layer) the
    demo model diverged at this learning rate at batch 256 (``benchmarks/high_lr.py`` runs that case).
    At this small scale the earlier model did not diverge either: this run guards the recipe, it does
    not reproduce the old failure.
    """
    r = run(tmp_path, optim__lr=0.4, optim__schedule="linear", optim__warmup=0.1, train__batch=64, train__epochs=4)
    assert r.status == "done"
    losses = [json.loads(line)["loss"] for line in (r.out / "metrics.jsonl").read_text().splitlines()
              if '"train"' in line]
    assert max(losses) < 20 and r.summary["final"]["loss"] < 10


def test_linear_schedule_rises_from_zero_then_falls_to_zero():
    from edgerev.train.config import OptimConfig

    cfg = OptimConfig(lr=0.4, schedule="linear", warmup=0.1)
    lrs = [lr_at(step, 100, cfg) for step in range(100)]
    assert lrs[0] == 0.0 and lrs[10] == pytest.approx(0.4) and max(lrs) == pytest.approx(0.4)
    assert lrs[5] == pytest.approx(0.2) and lrs[55] == pytest.approx(0.2) and lrs[-1] == pytest.approx(0.4 / 90)
    assert all(a <= b for a, b in zip(lrs[:11], lrs[1:11])) and all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


def test_unknown_schedule_is_one_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"optim.schedule: expected one of 'onecycle' or 'linear' or 'constant'"):
        from_dict(RunConfig, recipe(optim__schedule="cosine"))


def test_clipping_keeps_a_high_learning_rate_finite(tmp_path):
    r = run(tmp_path, optim__lr=0.4, optim__clip_grad_norm=2.0, train__batch=64)
    assert r.summary["final"]["loss"] < 10
    assert yaml.safe_load((r.out / "config.yaml").read_text())["optim"]["clip_grad_norm"] == 2.0

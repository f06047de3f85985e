"""The command line: JSON output of memory, diagnose and plan, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import edgerev.models
from edgerev.cli import PAPER_PEAK_BYTES, main
from edgerev.memory.measure import profile as profile_mod
from edgerev.memory.solve.knapsack import exact_only, smallest_budget
from tests.profiles import SMALL_REVNEXT, measured


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def run_json(capsys, *argv: str):
    rc, out, err = run(capsys, *argv)
    assert rc == 0, err
    return json.loads(out)


def assert_one_line_error(capsys, *argv: str, match: str = "") -> str:
    rc, out, err = run(capsys, *argv)
    assert rc == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"edgerev {argv[0]}: error: "), lines[0]
    assert match in lines[0]
    return lines[0]


# ---- memory and diagnose --------------------------------------------------------------------------------------------


def test_memory_json(capsys):
    d = run_json(capsys, "memory", "--arch", "revnext", "--batch", "2", "--size", "32", "--json")
    for key in ("arch", "params", "batch", "size", "device", "peak_bytes", "bytes_per_pixel", "model_bytes_per_pixel"):
        assert key in d, key
    assert (d["arch"], d["batch"], d["size"], d["device"]) == ("revnext", 2, 32, "cpu")
    assert d["params"] == sum(p.numel() for p in edgerev.models.create_model("revnext").parameters())
    assert d["peak_bytes"] > 4 * d["params"]  # at least the weights
    assert d["bytes_per_pixel"] > 0 and d["model_bytes_per_pixel"] > 0
    assert d["paper_peak_bytes"] == PAPER_PEAK_BYTES["revnext"]


@pytest.mark.slow
def test_memory_table_json(capsys):
    rows = run_json(capsys, "memory", "--table", "--batch", "1", "--size", "16", "--fake", "--json")
    assert isinstance(rows, list) and len(rows) == 5
    assert [r["arch"] for r in rows] == list(PAPER_PEAK_BYTES)
    for r in rows:
        assert r["fake"] is True and r["batch"] == 1 and r["size"] == 16
        assert r["peak_bytes"] > 0 and r["paper_peak_bytes"] == PAPER_PEAK_BYTES[r["arch"]]


@pytest.mark.slow
def test_memory_text(capsys):
    rc, out, _ = run(capsys, "memory", "--arch", "revnext", "--batch", "1", "--size", "16", "--fake")
    assert rc == 0
    assert "revnext" in out and "predicted with fake tensors" in out


def test_diagnose_json(capsys):
    d = run_json(capsys, "diagnose", "--arch", "revnext", "--depth", "1", "--batch", "2", "--size", "16", "--json")
    assert d["arch"] == "revnext" and d["batch"] == 2 and d["size"] == 16
    stages = d["stages"]
    assert len(stages) == 12  # stem (conv, batch norm, leaky ReLU), five levels of one block, four poolings
    assert all("snr_db" in s for s in stages)
    with_params = [s for s in stages if s["type"] in ("Conv2d", "InvBatchNorm2d", "HybridBlock")]
    assert len(with_params) == 7
    assert all(s["grad_angle_deg"] < 1e-2 for s in with_params)  # float32, nearly exact
    assert any(s["snr_db"] is not None and s["snr_db"] > 60 for s in stages)
    assert d["max_grad_angle_deg"] == max(s["grad_angle_deg"] for s in with_params)


def test_diagnose_mode_floor_hands_down_block_inputs_without_layer_inverses(capsys):
    """``floor`` runs ``F`` and ``G`` forward on copies of the block's halves and subtracts; ``invert``
    rebuilds the halves through the layer inverses, whose rounding the blocks below inherit (about 10 dB
    here at depth 2; 12 to 18 dB at depths 1 to 8, batch 8, 32x32)."""
    argv = ("diagnose", "--arch", "revnext", "--depth", "2", "--batch", "4", "--size", "16", "--json")
    inv = run_json(capsys, *argv, "--mode", "invert")
    flo = run_json(capsys, *argv, "--mode", "floor")
    assert {s["mode"] for s in flo["stages"] if s["type"] == "HybridBlock"} == {"floor"}
    assert {s["mode"] for s in inv["stages"] if s["type"] == "HybridBlock"} == {"invert"}
    assert flo["min_snr_db"] >= inv["min_snr_db"] + 6.0, (flo["min_snr_db"], inv["min_snr_db"])
    assert flo["min_param_cosine"] >= inv["min_param_cosine"]


def test_diagnose_mode_error(capsys):
    assert_one_line_error(capsys, "diagnose", "--arch", "revnet", "--mode", "floor", "--depth", "1",
                          match="no stage of revnet can run in floor mode")


# ---- plan -----------------------------------------------------------------------------------------------------------


@pytest.fixture
def small_revnext(tmp_path, monkeypatch):
    """``revnext`` builds the small RevNeXt, whose profile (measured once per process) stands in for a measurement.

    Measuring the default RevNeXt takes 20 s at 32x32 and more at 16x16 (its last level is 512 channels at 1x1),
    so the plan command runs end to end on the small model.
    """
    monkeypatch.setenv("EDGEREV_CACHE", str(tmp_path / "cache"))
    real = edgerev.models.create_model
    arch, overrides = SMALL_REVNEXT

    def create_model(name, **kw):
        return real(name, **(kw or dict(overrides))) if name == arch else real(name, **kw)

    monkeypatch.setattr(edgerev.models, "create_model", create_model)
    prof = measured()
    calls = []

    def measure_profile(model, size, device="cpu", modes=None, exact=False, batches=(16, 32), **kw):
        calls.append((size, device, exact))
        assert model.stages[0].out_channels == 8  # the small model's stem
        timed = replace(prof, batches=tuple(batches))  # as the real one records the batches it timed at
        return replace(exact_only(timed), source="measured exact") if exact else timed

    monkeypatch.setattr(profile_mod, "measure_profile", measure_profile)
    return prof, calls, tmp_path / "cache"


def test_plan_json_verify(capsys, small_revnext):
    prof, calls, cache = small_revnext
    budget = 2 * 2**20
    assert budget > 2 * smallest_budget(prof)
    d = run_json(capsys, "plan", "--arch", "revnext", "--size", "16", "--budget", "2MiB", "--json", "--verify")
    assert calls == [(16, "cpu", True)]  # the exact modes: an exact plan fits
    assert len(list(cache.glob("*.json"))) == 1
    assert d["arch"] == "revnext" and d["budget_bytes"] == budget
    assert d["batch"] >= 1
    assert d["predicted_peak_bytes"] <= budget
    assert d["samples_per_second"] > 0
    assert [s["mode"] for s in d["stages"]] and all(set(s) >= {"name", "mode"} for s in d["stages"])
    assert [s["type"] for s in d["stages"]] == prof.names
    assert all(s["mode"] in stage for s, stage in zip(d["stages"], prof.stages))
    assert d["measured_peak_bytes"] <= budget
    assert abs(d["measured_peak_bytes"] - d["predicted_peak_bytes"]) <= 0.1 * d["measured_peak_bytes"]
    # a second run reads the cached profile
    d2 = run_json(capsys, "plan", "--arch", "revnext", "--size", "16", "--budget", "2MiB", "--json")
    assert calls == [(16, "cpu", True)]  # the exact modes: an exact plan fits
    assert (d2["batch"], d2["stages"]) == (d["batch"], d["stages"])
    assert "measured_peak_bytes" not in d2


@pytest.mark.slow
def test_plan_plain_model_json_verify(capsys, tmp_path, monkeypatch):
    """The default ResNet-18 (no invertible stage) end to end: a plan that the measured step keeps to."""
    monkeypatch.setenv("EDGEREV_CACHE", str(tmp_path))
    budget = 64 * 2**20
    d = run_json(capsys, "plan", "--arch", "resnet18", "--size", "16", "--budget", "64MiB", "--json", "--verify")
    assert d["arch"] == "resnet18" and d["budget_bytes"] == budget
    assert d["batch"] >= 1 and d["samples_per_second"] > 0
    assert d["predicted_peak_bytes"] <= budget
    stages = d["stages"]
    assert len(stages) == len(edgerev.models.create_model("resnet18").body.stages)
    assert all(set(s) >= {"name", "mode"} for s in stages)
    assert d["measured_peak_bytes"] <= budget
    assert abs(d["measured_peak_bytes"] - d["predicted_peak_bytes"]) <= 0.1 * d["measured_peak_bytes"]


def test_plan_text(capsys, small_revnext, monkeypatch):
    from edgerev.memory.plan import progress

    monkeypatch.setattr(progress, "REPORT_AFTER", 0.0)  # as if it had taken a while: every phase is named
    rc, out, err = run(capsys, "plan", "--arch", "revnext", "--size", "16", "--budget", "2MiB")
    assert rc == 0, err
    assert "budget 2,097,152 bytes" in out and "predicted peak" in out and "HybridBlock" in out
    assert "planning:" not in out  # progress goes to stderr, the plan alone to stdout
    phases = [line for line in err.splitlines() if line.startswith("planning: ")]
    assert any("accounting the smallest step" in line for line in phases), err
    assert any("solving for the fastest plan (round 1)" in line for line in phases), err


@pytest.mark.slow
def test_plan_budget_too_small(capsys, small_revnext):
    prof, _, _ = small_revnext
    line = assert_one_line_error(capsys, "plan", "--arch", "revnext", "--size", "16", "--budget", "1B")
    smallest = re.search(r"the smallest budget that fits is ([0-9,]+) bytes", line)
    assert smallest, line
    budget = smallest.group(1).replace(",", "")
    rc, out, err = run(capsys, "plan", "--arch", "revnext", "--size", "16", "--budget", budget, "--json")
    assert rc == 0, err
    assert json.loads(out)["predicted_peak_bytes"] <= int(budget)


@pytest.mark.slow
def test_plan_estimate(capsys, small_revnext):
    rc, out, err = run(capsys, "plan", "--arch", "revnext", "--size", "16", "--budget", "2MiB", "--estimate", "--json")
    assert rc == 0, err
    assert "estimated" in json.loads(out)["planner"]


@pytest.mark.parametrize("argv, match", [
    (["plan", "--arch", "nope", "--size", "16", "--budget", "64MiB"], "unknown architecture 'nope'"),
    (["plan", "--arch", "revnext", "--size", "30", "--budget", "64MiB"], "divisible by 16"),
    (["plan", "--arch", "revnext", "--size", "16", "--budget", "abc"], "cannot read 'abc'"),
    (["plan", "--arch", "revnext", "--size", "16", "--budget", "-1"], "positive"),
    (["plan", "--arch", "revnext", "--size", "16", "--budget", "0"], "at least one byte"),
    (["memory", "--batch", "2"], "--arch"),
    (["memory", "--arch", "revnext", "--table", "--fake"], "--arch"),
    (["memory", "--arch", "nope", "--fake"], "unknown architecture"),
    (["memory", "--arch", "revnext", "--device", "tpu"], "unknown device"),
    (["diagnose", "--arch", "nope"], "unknown architecture"),
])
def test_bad_input_is_one_line_and_exit_code_2(capsys, tmp_path, monkeypatch, argv, match):
    monkeypatch.setenv("EDGEREV_CACHE", str(tmp_path))
    assert_one_line_error(capsys, *argv, match=match)
    assert not any(tmp_path.iterdir())  # refused before any profile is measured


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("argv", [
    ["plan", "--arch", "revnext", "--size", "16", "--budget", "64MiB", "--device", "cuda"],
    ["memory", "--arch", "revnext", "--device", "cuda"],
])
def test_cuda_without_cuda(capsys, tmp_path, monkeypatch, argv):
    monkeypatch.setenv("EDGEREV_CACHE", str(tmp_path))
    assert_one_line_error(capsys, *argv, match="CUDA")


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["memory", "--arch", "revnext", "--batch", "0"])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("edgerev memory: error: ")


def test_module_help():
    res = subprocess.run([sys.executable, "-m", "edgerev", "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    for command in ("memory", "plan", "diagnose"):
        assert command in res.stdout


def test_memory_mode_floor(capsys):
    d = run_json(capsys, "memory", "--arch", "revnext", "--mode", "floor", "--batch", "1", "--size", "16", "--fake",
                 "--json")
    assert d["modes"] == ["floor", "invert", "store"]  # hybrid blocks, pools, the stem


@pytest.mark.parametrize("argv,match", [
    (("--arch", "revnet", "--mode", "floor"), "no stage of revnet can run in floor mode; its stages support recompute"),
    (("--arch", "revnet", "--mode", "store,floor" + ",store" * 12), "stage 1 (Coupling) cannot run in floor mode"),
    (("--arch", "revnext", "--mode", "bogus"), "unknown mode 'bogus'"),
])
def test_memory_mode_errors(capsys, argv, match):
    assert_one_line_error(capsys, "memory", *argv, "--batch", "1", "--size", "16", "--fake", match=match)

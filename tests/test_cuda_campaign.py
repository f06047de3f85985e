"""benchmarks/cuda.py, the CUDA campaign: its CPU dry run through every part, a part that fails or overruns,
and (with CUDA) the real thing in little."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from edgerev.engine import Mode

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "cuda.py"
PARTS = {"environment", "predict", "profile", "memory", "cap", "cap_expandable", "step_time", "train"}
# a small model and sizes: every part runs, in about two minutes on a loaded 2-core machine
SMALL = ["--models", "revnext,resnet18", "--size", "16", "--batch", "2", "--width", "8", "--repeats", "2",
         "--time-size", "16", "--time-batch", "2", "--workers", "1", "--steps", "3", "--recipe-size", "16",
         "--recipe-batch", "32", "--recipe-args", '{"width": 8, "blocks": [1, 1, 1, 1, 1]}', "--epochs", "1",
         "--train-samples", "200"]


def _load_script():
    """benchmarks/cuda.py as a module (benchmarks/ is not a package; a plain ``import cuda`` could find NVIDIA's)."""
    sys.path.insert(0, str(SCRIPT.parent))  # for its own imports (_common)
    try:
        spec = importlib.util.spec_from_file_location("edgerev_cuda_campaign", SCRIPT)
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return module


script = _load_script()


def campaign(tmp_path: Path, *args: str, timeout: float = 600) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "cuda.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EDGEREV_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=timeout)
    return r, json.loads(out.read_text())


def modes_of(arch: str) -> set[str]:
    return {"resnet18": {"store", "store8", "store4"}}.get(arch, {m.value for m in Mode})


def check_memory(result: dict, cuda: bool) -> None:
    mem = result["parts"]["memory"]["result"]
    rows = result["parts"]["predict"]["result"]["rows"]
    predicted = {(r["arch"], r["mode"]): r["predicted_peak_bytes"] for r in rows}
    seen = {(r["arch"], r["mode"]) for r in mem["rows"]}
    assert seen == {(a, m) for a in ("revnext", "resnet18") for m in modes_of(a)} == set(predicted)
    assert set(mem["plain"]) == {"revnext", "resnet18"}  # plain autograd's step, the ratios' reference
    assert all(p["allocated_peak_bytes"] > p["allocated_baseline_bytes"] > 0 for p in mem["plain"].values())
    for r in mem["rows"]:
        assert "error" not in r, r
        assert r["relative_to_plain"] > 0
        assert r["allocated_peak_bytes"] > r["allocated_baseline_bytes"] > 0
        p = predicted[(r["arch"], r["mode"])]
        if cuda:  # the allocator rounds blocks up and adds workspaces the tracker cannot see
            assert r["reserved_peak_bytes"] >= r["allocated_peak_bytes"]
            assert 0.9 * p <= r["allocated_peak_bytes"] <= 3 * p, r
        else:  # the same tracker, on real and on fake tensors: the same bytes
            assert r["reserved_peak_bytes"] is None
            assert r["allocated_peak_bytes"] == r["tracker_peak_bytes"] == p, r


def check_cap(result: dict, cuda: bool) -> None:
    for name, conf in (("cap", None), ("cap_expandable", "expandable_segments:True")):
        c = result["parts"][name]["result"]
        assert c["alloc_conf"] == conf
        assert c["micro_batch"] >= 1 and c["predicted_peak_bytes"] <= c["cap_bytes"]
        planned = c["planned"]
        assert planned["steps"] >= 1 and planned["oom_retries"] == 0
        assert all(math.isfinite(loss) for loss in planned["loss_first_last"])
        last = c["forced"][-1]
        assert last["retries"] >= 1 and last["micro_batches"] > 1 and last["stepped"] and last["finite"], c["forced"]
        assert all(a["retries"] == 0 for a in c["forced"][:-1])
        assert c["recovered"]
        if cuda:
            assert c["reserved_under_cap"] and c["reserved_peak_bytes"] <= c["cap_bytes"], (name, c)
        else:
            assert planned["steps"] == planned["steps_asked"] == 3
            assert c["predicted_peak_bytes"] == planned["tracker_peak_bytes"] <= c["cap_bytes"]


def check_rest(result: dict) -> None:
    st = result["parts"]["step_time"]["result"]
    for r in st["rows"]:
        variants = {"plain"} | modes_of(r["arch"])
        assert set(r["relative_to_plain"]) == variants
        assert r["relative_to_plain"]["plain"] == 1.0
        assert all(0 < t < 60 for t in r["median_seconds"].values())
        # the memory part's steps at its own size, over plain autograd's there
        assert set(r["at_size"]["relative_to_plain"]) == variants and r["at_size"]["relative_to_plain"]["plain"] == 1
        # kernel ops per step on the meta device, plain's first, the rest while the part has time
        ops = r["kernel_ops"]
        assert "plain" in ops and set(ops) <= variants and all(isinstance(n, int) and n > 0 for n in ops.values())
    assert (st["at_size"]["batch"], st["at_size"]["size"]) == (result["parts"]["memory"]["result"]["batch"],
                                                               result["parts"]["memory"]["result"]["size"])
    t = result["parts"]["train"]["result"]
    assert t["steps"] >= 1 and 0.0 <= t["final"]["acc"] <= 1.0 and t["seconds"] > 0
    assert t["plan"]["micro_batch"] >= 1
    env = result["parts"]["environment"]["result"]
    assert env["torch"] == torch.__version__


@pytest.mark.slow
@pytest.mark.longest  # about a minute: first, beside the rest (tests/conftest.py)
def test_the_cpu_dry_run_goes_through_every_part(tmp_path):
    r, result = campaign(tmp_path, "--device", "cpu", "--cap", "8MiB", "--profile", "estimate", *SMALL)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert set(result["parts"]) == PARTS
    assert {p["status"] for p in result["parts"].values()} == {"ok"}
    assert result["device"] == "cpu" and "--device cpu" in result["command"]
    assert "PYTORCH_CUDA_ALLOC_CONF" in result["daemon_alloc_conf"]
    check_memory(result, cuda=False)
    check_cap(result, cuda=False)
    check_rest(result)
    lines = r.stdout.splitlines()
    first = max(i for i, line in enumerate(lines) if line.startswith("CUDA campaign on cpu"))
    assert first > lines.index("}") and len(lines) - first < 50  # the summary comes last: tail -50 shows it
    assert any(line.startswith("train: revnext") for line in lines[first:])


@pytest.mark.parametrize(("only", "expected"), [
    (None, ["environment", "predict", "profile", "memory", "cap", "cap_expandable", "step_time", "train"]),
    ("memory", ["memory"]),
    ("cap", ["profile", "cap"]),  # the parts that plan bring the profile they plan from
    ("environment,train", ["environment", "profile", "train"]),
])
def test_only_runs_the_parts_named_and_the_profile_they_plan_from(only, expected):
    args = script.parse([] if only is None else ["--only", only])
    assert [p.name for p in script.selected(args)] == expected


def test_only_refuses_a_part_that_does_not_exist():
    with pytest.raises(SystemExit, match="no part kap; the parts: environment, predict"):
        script.selected(script.parse(["--only", "cap,kap"]))


def test_a_failing_part_is_recorded_and_the_campaign_goes_on(tmp_path):
    r, result = campaign(tmp_path, "--device", "cpu", "--only", "environment,memory", "--models", "nosuchmodel",
                         timeout=300)
    assert r.returncode == 1
    mem = result["parts"]["memory"]
    assert mem["status"] == "failed" and "nosuchmodel" in mem["log_tail"]
    assert result["parts"]["environment"]["status"] == "ok"
    assert "memory: failed" in r.stdout


@pytest.mark.slow
def test_a_part_over_the_budget_is_killed_and_what_it_measured_is_kept(tmp_path):
    # ResNet-18's three modes at 16 x 240 x 240 under the CPU tracker: minutes of work for an 8-second budget
    r, result = campaign(tmp_path, "--device", "cpu", "--only", "memory", "--models", "resnet18", "--batch", "16",
                         "--budget-seconds", "8", timeout=300)
    assert r.returncode == 1
    mem = result["parts"]["memory"]
    assert mem["status"] == "timed_out" and mem["error"].startswith("over its limit")
    rows = mem.get("result", {"rows": []})["rows"]  # the rows it finished, if any, are kept whole
    assert len(rows) < 3 and all("allocated_peak_bytes" in row for row in rows)
    assert "memory: timed_out" in r.stdout


@pytest.mark.gpu
@pytest.mark.slow
def test_the_cuda_campaign_in_little(tmp_path):
    r, result = campaign(tmp_path, "--models", "revnext,resnet18", "--size", "64", "--batch", "4", "--steps", "5",
                         "--epochs", "1", "--train-samples", "1000", "--workers", "2", "--forced-tries", "8")
    assert r.returncode == 0, r.stdout[-3000:]
    assert {p["status"] for p in result["parts"].values()} == {"ok"}
    env = result["parts"]["environment"]["result"]
    assert env["cuda_available"] and env["total_memory_bytes"] > 0
    check_memory(result, cuda=True)
    check_cap(result, cuda=True)
    check_rest(result)

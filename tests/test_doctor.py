"""edgerev doctor: the judgement on constructed facts (the GPU cases this CPU machine cannot show), the facts
of this machine, and the whole command for real (text, --json, exit status by the worst line)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from edgerev.cli import main
from edgerev.doctor import facts as gather
from edgerev.doctor.judge import (
    Check,
    Status,
    exit_status,
    has_kernels,
    judge_disk,
    judge_flwr,
    judge_gpu,
    judge_gpu_memory,
    judge_onnxruntime,
    judge_plan,
    judge_python,
    judge_torch,
    worst,
)
from edgerev.doctor.plan import PlanFacts, verified_plan
from edgerev.exits import OK, PARTIAL, USAGE, WARNINGS
from edgerev_daemon.service.doctor_cli import target_of
from tests.helpers import own_process

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
# torch.cuda.get_arch_list() of PyTorch's wheels: CUDA 12.6 (still sm_50) and CUDA 12.8 (from sm_75 on)
CU126 = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")
CU128 = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")
GTX750 = gather.CudaFacts(True, 1, "NVIDIA GeForce GTX 750", (5, 0), CU128, 420 * MiB, 1024 * MiB)
CUDA_TORCH = gather.TorchFacts("2.14.1+cu128", "12.8", 91002, 4)


# ---- judgement on constructed facts ---------------------------------------------------------------------------


def test_a_gtx750_under_a_torch_without_sm50_fails_and_names_the_build_to_install():
    c = judge_gpu(GTX750, CUDA_TORCH, "cuda")
    assert c.status is Status.FAILING
    assert "compute capability 5.0" in c.found and "not sm_50" in c.found
    assert "torch==2.14.1" in c.advice and "cu126" in c.advice and "GTX750.md" in c.advice
    assert judge_gpu(GTX750, CUDA_TORCH, "auto").status is Status.FAILING  # auto would pick the GPU and fail
    assert judge_gpu(GTX750, CUDA_TORCH, "cpu").status is Status.WARNING  # trains on the CPU, the GPU idles
    good = replace(GTX750, arch_list=CU126)
    assert judge_gpu(good, CUDA_TORCH, "cuda").status is Status.OK


def test_kernels_run_within_a_major_and_ptx_compiles_upwards():
    assert has_kernels(CU126, (5, 0)) and not has_kernels(CU128, (5, 0))
    assert has_kernels(("sm_50",), (5, 2))  # binary compatible within Maxwell
    assert not has_kernels(("sm_52",), (5, 0))
    assert has_kernels(("sm_80", "sm_86"), (8, 7))  # a Jetson Orin with a build that has sm_86
    assert not has_kernels(("sm_90",), (8, 6)) and not has_kernels(("sm_75",), (8, 6))
    assert has_kernels(("sm_90", "compute_50"), (8, 6))  # PTX of an older architecture is compiled by the driver
    assert not has_kernels(("compute_90",), (8, 6)) and not has_kernels((), (8, 6))


@given(st.lists(st.tuples(st.integers(3, 12), st.integers(0, 9)), max_size=8), st.integers(3, 12), st.integers(0, 9))
def test_a_build_with_the_gpus_own_kernels_always_runs_it_and_one_with_only_newer_majors_never(archs, major, minor):
    listed = tuple(f"sm_{a}{b}" for a, b in archs)
    assert has_kernels((*listed, f"sm_{major}{minor}"), (major, minor))
    assert not has_kernels(tuple(f"sm_{a}{b}" for a, b in archs if a > major), (major, minor))


def test_no_gpu_is_ok_on_cpu_and_failing_when_the_config_wants_cuda_a_cuda_build_there_a_warning():
    cpu_torch = gather.TorchFacts("2.14.1+cpu", None)
    none = gather.CudaFacts(False)
    assert judge_gpu(none, cpu_torch, "cpu").status is Status.OK
    c = judge_gpu(none, cpu_torch, "cuda")
    assert c.status is Status.FAILING and "CPU-only build" in c.found and "CUDA build" in c.advice
    for device in ("cpu", "auto"):  # a CUDA build where no GPU is: several GB of NVIDIA libraries for nothing
        c = judge_gpu(none, CUDA_TORCH, device)
        assert c.status is Status.WARNING and f"is a CUDA {CUDA_TORCH.cuda} build" in c.found, c
        assert "download.pytorch.org/whl/cpu" in c.advice and "+" not in c.advice.split("torch==")[1].split()[0]
    c = judge_gpu(gather.CudaFacts(False, error="driver too old"), CUDA_TORCH, "cuda")
    assert c.status is Status.FAILING and "driver" in c.advice
    assert judge_gpu_memory(none, "cuda", 400 * MiB) is None


def test_gpu_memory_against_the_cap():
    assert judge_gpu_memory(GTX750, "cuda", 400 * MiB).status is Status.OK
    c = judge_gpu_memory(GTX750, "cuda", 500 * MiB)  # 420 MiB free after the context
    assert c.status is Status.FAILING and "less is free than the cap" in c.found and "420 MiB" in c.advice
    c = judge_gpu_memory(GTX750, "cuda", 2048 * MiB)
    assert c.status is Status.FAILING and "more than the device has" in c.found
    assert judge_gpu_memory(GTX750, "cpu", 2048 * MiB).status is Status.OK  # the GPU is not what trains


def test_onnxruntime_missing_or_installed_twice_fails():
    missing = gather.OrtFacts((), error="ModuleNotFoundError: No module named 'onnxruntime'")
    c = judge_onnxruntime(missing)
    assert c.status is Status.FAILING and "edgerev[runtime]" in c.advice
    both = gather.OrtFacts((("onnxruntime", "1.19.2"), ("onnxruntime-training-cpu", "1.19.2")), "1.19.2",
                           ("CPUExecutionProvider",))
    c = judge_onnxruntime(both)
    assert c.status is Status.FAILING and "overwrite" in c.found
    assert "pip uninstall -y onnxruntime onnxruntime-training-cpu" in c.advice
    one = gather.OrtFacts((("onnxruntime", "1.19.2"),), "1.19.2", ("CPUExecutionProvider",), "onnxruntime<1.20,>=1.17")
    assert judge_onnxruntime(one).status is Status.OK
    newer = replace(one, distributions=(("onnxruntime", "1.22.0"),), version="1.22.0")
    assert judge_onnxruntime(newer).status is Status.WARNING


def test_flower_is_optional_and_pinned():
    assert judge_flwr(gather.FlwrFacts(None, "flwr==1.41.*")).status is Status.OK
    assert judge_flwr(gather.FlwrFacts("1.41.3", "flwr==1.41.*")).status is Status.OK
    c = judge_flwr(gather.FlwrFacts("1.45.0", "flwr==1.41.*"))
    assert c.status is Status.WARNING and "edgerev[fleet]" in c.advice


def test_python_and_torch():
    assert judge_python(gather.PythonFacts("3.11.7", "CPython", ">=3.10")).status is Status.OK
    assert judge_python(gather.PythonFacts("3.9.18", "CPython", ">=3.10")).status is Status.FAILING
    assert "Python <= 3.11" in judge_python(gather.PythonFacts("3.12.1", "CPython", ">=3.10")).found
    assert judge_torch(gather.TorchFacts(None, error="ImportError: libcudart.so.12")).status is Status.FAILING
    assert judge_torch(CUDA_TORCH).status is Status.OK
    assert judge_torch(gather.TorchFacts("2.6.0a0+df5bbc09d1.nv24.12", "12.6")).status is Status.OK  # the Jetson's
    c = judge_torch(gather.TorchFacts("2.15.0", "13.2"))
    assert c.status is Status.WARNING and "torch>=2.6,<2.15" in c.advice


def test_disk_against_the_free_space_floor():
    def disk(free: int, writable: bool = True, error: str | None = None) -> gather.DiskFacts:
        return gather.DiskFacts("/srv/edgerev", True, "/srv/edgerev", free, 10_000 * MiB, writable, error)

    assert judge_disk(disk(1000 * MiB), 100 * MiB).status is Status.OK
    assert judge_disk(disk(150 * MiB), 100 * MiB).status is Status.WARNING
    c = judge_disk(disk(50 * MiB), 100 * MiB)
    assert c.status is Status.FAILING and "storage.min_free_space" in c.found
    assert judge_disk(disk(50 * MiB), 0).status is Status.OK  # no floor
    c = judge_disk(disk(1000 * MiB, False, "Permission denied"), 100 * MiB)
    assert c.status is Status.FAILING and "Permission denied" in c.found


def test_the_plan_verdicts():
    base = PlanFacts("revnext", 32, "cpu", 64, 256 * MiB, "x", 64, 1, None, 100 * MiB, 14 * MiB, 100 * MiB, 2, 1.0)
    assert judge_plan(base).status is Status.OK
    assert judge_plan(replace(base, measured_peak_bytes=300 * MiB)).status is Status.FAILING
    assert judge_plan(replace(base, retries=1)).status is Status.WARNING
    c = judge_plan(replace(base, budget_bytes=None))
    assert c.status is Status.WARNING and "training.memory.budget" in c.advice
    c = judge_plan(replace(base, error="below the floor", advice="raise it"))
    assert c.status is Status.FAILING and c.advice == "raise it"


@given(st.lists(st.sampled_from(list(Status)), max_size=8))
def test_the_exit_status_is_the_worst_lines(statuses):
    checks = [Check(str(i), s, "") for i, s in enumerate(statuses)]
    expected = PARTIAL if Status.FAILING in statuses else WARNINGS if Status.WARNING in statuses else OK
    assert exit_status(checks) == expected
    assert worst(checks) is (Status.FAILING if expected == PARTIAL else Status.WARNING if expected == WARNINGS
                             else Status.OK)


# ---- the facts of this machine ---------------------------------------------------------------------------------


def test_disk_facts_of_a_real_folder_and_of_one_not_created_yet(tmp_path):
    f = gather.disk_facts(tmp_path)
    assert f.exists and f.writable and 0 < f.free_bytes <= f.total_bytes
    assert [p.name for p in tmp_path.iterdir()] == []  # the probe file is gone
    g = gather.disk_facts(tmp_path / "a" / "b")
    assert not g.exists and g.probed == str(tmp_path) and g.writable
    (tmp_path / "file").write_text("x")
    h = gather.disk_facts(tmp_path / "file" / "data")
    assert not h.writable and "not a directory" in h.error


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_disk_facts_of_a_read_only_folder(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        f = gather.disk_facts(ro / "data")
        assert not f.writable and f.error
        assert judge_disk(f, 0).status is Status.FAILING
    finally:
        ro.chmod(0o700)


def test_the_installed_packages_as_found():
    import onnxruntime
    import torch

    o = gather.onnxruntime_facts()
    assert o.version == onnxruntime.__version__ and "CPUExecutionProvider" in o.providers
    assert len(o.distributions) >= 1 and o.wanted and o.wanted.startswith("onnxruntime")
    t = gather.torch_facts()
    assert t.version == str(torch.__version__) and t.cuda == torch.version.cuda
    assert gather.cuda_facts().available == torch.cuda.is_available()
    assert gather.flwr_facts().wanted == "flwr==1.41.*"
    assert gather.python_facts().requires == ">=3.10"


def test_without_config_the_cpu_presets_model_cap_and_floor_are_checked():
    from edgerev_daemon.config import load_config

    preset = load_config(ROOT / "configs" / "daemon" / "cpu.yaml")
    embedded = target_of(None)
    assert embedded.recipe.model == preset.training.model
    assert embedded.recipe.memory == preset.training.memory
    assert embedded.recipe.train.batch == preset.training.train.batch
    assert embedded.recipe.optim == preset.training.optim
    assert embedded.recipe.continual == preset.training.continual
    assert embedded.recipe.data.size == preset.image_size and embedded.recipe.device == preset.training.device
    assert embedded.min_free_bytes == preset.storage.min_free_space
    assert embedded.data_dir == str(Path.cwd().absolute()) and "no --config" in embedded.source


# ---- the whole command ----------------------------------------------------------------------------------------


def write_config(tmp_path: Path, budget: str | int = "64MiB", min_free: str | int = "1MiB", **training) -> Path:
    cfg = {"data_dir": str(tmp_path / "data"), "image_size": 16,
           "training": {"model": {"arch": "revnext", "args": {"width": 8, "blocks": [1, 1, 1, 1, 1]}},
                        "train": {"batch": 16}, "memory": {"budget": budget}, "device": "cpu", **training},
           "storage": {"min_free_space": min_free}}
    path = tmp_path / "daemon.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty profile cache: the least-memory plan unless a test measures a profile."""
    monkeypatch.setenv("EDGEREV_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("semi", [True, False])
def test_doctor_json_on_this_machine(tmp_path, cache, capsys, semi):
    """The plan line verifies a job's costliest step: with FixMatch on (the daemon's default), two strong views per
    labelled sample join its batch after their weak views' forward."""
    status = main(["doctor", "--config", str(write_config(tmp_path, semi={"enabled": semi})), "--json", "--steps",
                   "2"])
    report = json.loads(capsys.readouterr().out)
    checks = {c["check"]: c for c in report["checks"]}
    assert list(checks)[:3] == ["python", "torch", "gpu"]
    assert {"onnxruntime", "flower", "data directory", "plan"} <= set(checks)
    plan = checks["plan"]
    assert plan["status"] == "ok", plan
    f = plan["facts"]
    assert f["unlabeled"] == (32 if semi else 0)
    assert f["steps"] == 2 and f["micro_batch"] * f["micro_batches"] >= 16 + f["unlabeled"]
    assert 0 < f["smallest_bytes"] <= f["measured_peak_bytes"] <= f["budget_bytes"] == 64 * MiB
    if semi:  # the weak views' forward and the step run apart, each under the account (as the trainer's do)
        assert f["measured_peak_bytes"] <= f["predicted_peak_bytes"]
    else:
        assert f["measured_peak_bytes"] == f["predicted_peak_bytes"]  # CPU accounting is exact
    assert "least-memory modes" in f["planner"]
    assert checks["data directory"]["facts"]["writable"] and not (tmp_path / "data").exists()  # nothing created
    expected = {"ok": OK, "warning": WARNINGS, "failing": PARTIAL}[report["status"]]
    assert status == report["exit_status"] == expected


def test_a_cap_below_the_floor_and_a_full_disk_fail_with_what_to_do(tmp_path, cache, capsys):
    status = main(["doctor", "--config", str(write_config(tmp_path, budget=100_000, min_free="1000TiB"))])
    out = capsys.readouterr().out
    assert status == PARTIAL
    lines = out.splitlines()
    plan = next(i for i, line in enumerate(lines) if line.split()[1:2] == ["plan"])
    assert lines[plan].startswith("FAILING") and "below the least this step needs" in lines[plan]
    assert "-> raise training.memory.budget to at least" in lines[plan + 1]
    disk = next(line for line in lines if "data directory" in line)
    assert disk.startswith("FAILING") and "storage.min_free_space" in disk
    assert lines[-1] == "worst: failing (exit status 1)"


def test_a_config_for_cuda_without_a_usable_gpu_still_checks_the_cap_against_the_floor(tmp_path, cache, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a usable GPU")
    status = main(["doctor", "--config", str(write_config(tmp_path, budget=100_000, device="cuda"))])
    lines = capsys.readouterr().out.splitlines()
    assert status == PARTIAL
    assert next(line for line in lines if line.split()[1:2] == ["gpu"]).startswith("FAILING")
    plan = next(line for line in lines if line.split()[1:2] == ["plan"])
    assert plan.startswith("FAILING") and "on cuda" in plan and "below the least this step needs" in plan
    main(["doctor", "--config", str(write_config(tmp_path, device="cuda")), "--json"])
    plan = next(c for c in json.loads(capsys.readouterr().out)["checks"] if c["check"] == "plan")
    assert plan["status"] == "failing" and "not run: the GPU is not usable" in plan["found"]
    assert plan["facts"]["steps"] == 0 and plan["facts"]["smallest_bytes"] > 0


def test_no_cap_is_a_warning_with_the_measured_peak(tmp_path, cache, capsys):
    path = write_config(tmp_path)
    data = yaml.safe_load(path.read_text())
    del data["training"]["memory"]
    path.write_text(yaml.safe_dump(data))
    status = main(["doctor", "--config", str(path), "--json", "--steps", "1"])
    report = json.loads(capsys.readouterr().out)
    plan = next(c for c in report["checks"] if c["check"] == "plan")
    assert plan["status"] == "warning" and plan["facts"]["measured_peak_bytes"] > 0
    assert status in (WARNINGS, PARTIAL) and status == report["exit_status"]


def test_bad_input_is_one_line_and_status_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data_dir: x\ntraining: {memory: {budget: lots}}\n")
    assert main(["doctor", "--config", str(bad)]) == USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("edgerev doctor: error:") and "budget" in err[0]
    with pytest.raises(SystemExit) as e:
        main(["doctor", "--steps", "0"])
    assert e.value.code == USAGE


@pytest.mark.slow
def test_the_command_in_its_own_process_text_and_exit_status(tmp_path):
    env = {**os.environ, "EDGEREV_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "edgerev", "doctor", "--config", str(write_config(tmp_path)),
                        "--steps", "1"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    lines = r.stdout.splitlines()
    assert lines[0].startswith("edgerev doctor: config ")
    marks = [line.split()[0] for line in lines[1:-1] if not line.lstrip().startswith("->")]
    assert set(marks) <= {"ok", "WARNING", "FAILING"} and len(marks) >= 7
    expected = PARTIAL if "FAILING" in marks else WARNINGS if "WARNING" in marks else OK
    assert r.returncode == expected, r.stdout + r.stderr
    assert lines[-1].endswith(f"(exit status {expected})")
    assert "doctor" in subprocess.run([sys.executable, "-m", "edgerev", "--help"], capture_output=True, text=True,
                                      env=env).stdout


@pytest.mark.slow
def test_with_a_measured_profile_the_daemons_own_plan_is_verified(tmp_path, cache):
    from edgerev.memory.measure.profile import cached_profile
    from edgerev.models import create_model

    # the labelled step, whose account is exact on the CPU (FixMatch's views: test_doctor_json_on_this_machine)
    cfg = target_of(str(write_config(tmp_path, semi={"enabled": False}))).recipe
    model = create_model(cfg.model.arch, **cfg.model.args, num_classes=10)
    assert cached_profile(model, 16, exact=True) is None
    measured = verified_plan(cfg, "cpu", steps=1, profile="measure")
    assert cached_profile(model, 16, exact=True) is not None  # kept for the daemon (the exact modes: one fits)
    assert measured.error is None and measured.planner.startswith("the daemon's plan"), measured
    assert measured.measured_peak_bytes == measured.predicted_peak_bytes <= measured.budget_bytes
    again = verified_plan(cfg, "cpu", steps=1)  # now cached: the same plan without measuring
    assert again.planner == measured.planner and again.micro_batch == measured.micro_batch


@pytest.mark.slow
def test_without_config_the_cpu_preset_runs_in_the_current_directory(tmp_path, cache, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    status = main(["doctor", "--json", "--steps", "1"])
    report = json.loads(capsys.readouterr().out)
    assert "no --config" in report["source"] and status == report["exit_status"]
    checks = {c["check"]: c for c in report["checks"]}
    assert checks["data directory"]["facts"]["path"] == str(tmp_path)
    plan = checks["plan"]["facts"]
    assert checks["plan"]["status"] == "ok" and plan["budget_bytes"] == 256 * MiB and plan["batch"] == 64


@pytest.mark.gpu
@own_process
def test_on_cuda_the_plan_runs_under_the_allocators_cap(tmp_path, cache, capsys):
    status = main(["doctor", "--config", str(write_config(tmp_path, budget="400MiB", device="cuda")), "--json"])
    report = json.loads(capsys.readouterr().out)
    checks = {c["check"]: c for c in report["checks"]}
    assert checks["gpu"]["status"] == "ok" and checks["gpu memory"]["status"] == "ok"
    plan = checks["plan"]
    assert plan["status"] == "ok", plan
    assert plan["facts"]["device"] == "cuda" and 0 < plan["facts"]["measured_peak_bytes"] <= 400 * MiB
    assert status == report["exit_status"]

"""``edgerev doctor``: the first thing an owner runs on a device.

One screen (or ``--json``): Python, torch and its CUDA, the GPU and whether this torch has kernels for it, its
free and total memory against the cap, ONNX Runtime and its providers, Flower if installed, the data
directory's disk, and a verified plan of the configured model under the configured cap (a few real steps).
Each line is ok, warning or failing, with what to do; the exit status is the worst line's
(:func:`edgerev.doctor.judge.exit_status`).

Facts are gathered by :mod:`edgerev.doctor.facts` and :mod:`edgerev.doctor.plan`, judged by the pure
:mod:`edgerev.doctor.judge`. The command, which reads the daemon's config, is the daemon's
(:mod:`edgerev_daemon.service.doctor_cli`, added to ``edgerev``'s through the ``edgerev.cli`` entry points), so
this package needs nothing of the daemon.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from edgerev.doctor import facts as gather
from edgerev.doctor import judge
from edgerev.doctor.judge import Check, Status, exit_status, worst
from edgerev.doctor.plan import PlanFacts, verified_plan
from edgerev.train.config import RunConfig

__all__ = ["Check", "PlanFacts", "Status", "Target", "exit_status", "run_doctor", "verified_plan", "worst"]


@dataclass(frozen=True)
class Target:
    """What the device is checked for: a daemon job's recipe, its data directory and free-space floor.

    ``source``: where these came from, said on the report's first line.
    """

    recipe: RunConfig
    data_dir: str
    min_free_bytes: int
    source: str


def training_device(name: str, cuda: gather.CudaFacts) -> str:
    """The device a job trains on: ``auto`` is CUDA when this torch sees one (as the trainer decides)."""
    return ("cuda" if cuda.available else "cpu") if name == "auto" else name


def run_doctor(target: Target, steps: int = 2, classes: int = 10, profile: str = "cached") -> list[Check]:
    """Every check, in the report's order (see :func:`edgerev.doctor.plan.verified_plan` for the arguments)."""
    cfg = target.recipe
    budget = None if cfg.memory.budget is None else int(cfg.memory.budget)
    torch_f = gather.torch_facts()
    cuda_f = gather.cuda_facts() if torch_f.version is not None else gather.CudaFacts(False)
    device = training_device(cfg.device, cuda_f)
    checks = [judge.judge_python(gather.python_facts()), judge.judge_torch(torch_f),
              gpu := judge.judge_gpu(cuda_f, torch_f, cfg.device)]
    memory = judge.judge_gpu_memory(cuda_f, device, budget)
    if memory is not None:
        checks.append(memory)
    checks += [judge.judge_onnxruntime(gather.onnxruntime_facts()), judge.judge_flwr(gather.flwr_facts()),
               judge.judge_disk(gather.disk_facts(target.data_dir), target.min_free_bytes)]
    if torch_f.version is None:
        checks.append(Check("plan", Status.FAILING, "not run: torch is not usable (see above)",
                            "fix the torch line, then run edgerev doctor again"))
    elif device == "cuda" and gpu.status is Status.FAILING:
        # no step can run, but the cap can still be set against the step's floor (exact on fake tensors), so a
        # GTX 750 owner learns both problems at once
        f = replace(verified_plan(cfg, "cpu", classes, steps=0, profile="cached"), device="cuda")
        if f.error is not None:
            checks.append(judge.judge_plan(f))
        else:
            cap = f"the cap {judge.mib(budget)} is above" if budget is not None else "no cap is set; the least is"
            checks.append(Check("plan", Status.FAILING, f"not run: the GPU is not usable (see above); {cap} this "
                                f"step's floor, {judge.mib(f.smallest_bytes)} (batch 1 in the least-memory modes)",
                                "fix the gpu line, then run edgerev doctor again",
                                f.to_json()))
    else:
        checks.append(judge.judge_plan(verified_plan(cfg, device, classes, steps, profile)))
    return checks

"""Facts to verdicts: each check's status (ok / warning / failing), what was found, and what to do.

Pure functions of the dataclasses in :mod:`edgerev.doctor.facts` and :mod:`edgerev.doctor.plan` (no torch, no
file system), so every case a device can present is tested with facts built by hand.

Exit status by the worst line: 0 all ok, 3 warnings only (the device runs, something deserves a look), 1 a
failing line (the daemon will not train, or not as configured).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from edgerev.doctor.facts import CudaFacts, DiskFacts, FlwrFacts, OrtFacts, PythonFacts, TorchFacts
from edgerev.doctor.plan import PlanFacts
from edgerev.enums import TextEnum
from edgerev.exits import OK, PARTIAL, WARNINGS
from edgerev.torch_range import problem as torch_problem

GTX750_TORCH = "torch==2.14.1 --index-url https://download.pytorch.org/whl/cu126"


class Status(TextEnum):
    OK = "ok"
    WARNING = "warning"
    FAILING = "failing"


_RANK = {Status.OK: 0, Status.WARNING: 1, Status.FAILING: 2}


@dataclass(frozen=True)
class Check:
    """One line of the report: ``found`` says what is there, ``advice`` what to do (empty when ok)."""

    name: str
    status: Status
    found: str
    advice: str = ""
    facts: dict | None = None  # the gathered facts, for --json

    def to_json(self) -> dict:
        return {"check": self.name, "status": self.status.value, "found": self.found, "advice": self.advice,
                "facts": self.facts or {}}


def worst(checks: list[Check]) -> Status:
    return max((c.status for c in checks), key=_RANK.__getitem__, default=Status.OK)


def exit_status(checks: list[Check]) -> int:
    return {Status.OK: OK, Status.WARNING: WARNINGS, Status.FAILING: PARTIAL}[worst(checks)]


def mib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**20:,.0f} MiB"


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3])


def _satisfies(version: str, spec: str | None) -> bool | None:
    """Whether ``version`` meets a requirement like ``flwr==1.41.*`` (None: cannot tell)."""
    if not spec:
        return None
    try:
        from packaging.requirements import Requirement
        from packaging.version import Version

        return Requirement(spec).specifier.contains(Version(version), prereleases=True)
    except Exception:  # packaging is pip's, not ours: without it, say nothing rather than guess
        return None


def judge_python(f: PythonFacts) -> Check:
    found = f"Python {f.version} ({f.implementation})"
    if f.requires and _satisfies(f.version, f"python{f.requires}") is False:
        return Check("python", Status.FAILING, found, f"edgerev needs Python {f.requires}", f.__dict__)
    notes = []
    if _release(f.version)[:2] >= (3, 12):
        notes.append("ONNX Runtime training (finetune-head --backend onnxruntime) needs Python <= 3.11")
    if _release(f.version)[:2] < (3, 11):
        notes.append("Flower (edgerev fleet) needs Python >= 3.11")
    return Check("python", Status.OK, found + ("; " + "; ".join(notes) if notes else ""), "", f.__dict__)


def judge_torch(f: TorchFacts) -> Check:
    if f.version is None:
        return Check("torch", Status.FAILING, f"torch cannot be imported ({f.error})",
                     "install torch (deploy/README.md names the build for each device)", f.__dict__)
    build = f"CUDA {f.cuda}" if f.cuda else "CPU-only build"
    found = f"torch {f.version} ({build}" + (f", cuDNN {f.cudnn}" if f.cudnn else "") + \
        (f", {f.threads} thread{'s' if f.threads > 1 else ''}" if f.threads else "") + ")"
    text = torch_problem(f.version)
    if text is not None:
        return Check("torch", Status.WARNING, found, text.split(": ", 1)[-1], f.__dict__)
    return Check("torch", Status.OK, found, "", f.__dict__)


def has_kernels(arch_list: tuple[str, ...], capability: tuple[int, int]) -> bool:
    """Whether a build whose ``get_arch_list()`` is ``arch_list`` runs on a GPU of ``capability``.

    Kernels for ``sm_XY`` run on a GPU of the same major ``X`` and minor at least ``Y`` (binary compatibility
    within a major); PTX for ``compute_XY`` is compiled by the driver for any GPU of capability at least XY.
    """
    major, minor = capability
    for a in arch_list:
        m = re.fullmatch(r"(sm|compute)_(\d+)(\d)[a-z]?", a)
        if m is None:
            continue
        amaj, amin = int(m.group(2)), int(m.group(3))
        if m.group(1) == "sm" and amaj == major and amin <= minor:
            return True
        if m.group(1) == "compute" and (amaj, amin) <= (major, minor):
            return True
    return False


def _build_to_install(capability: tuple[int, int]) -> str:
    major, minor = capability
    if major == 5:  # Maxwell: CUDA 12.6 wheels of 2.14.x are the last with sm_50 kernels
        return f"pip install {GTX750_TORCH} (the last torch with sm_50 kernels; see deploy/GTX750.md)"
    if (major, minor) == (8, 7):
        return "NVIDIA's torch for JetPack 6 (deploy/Dockerfile.jetson)"
    return f"a torch build whose torch.cuda.get_arch_list() has sm_{major}{minor} (deploy/README.md)"


def judge_gpu(f: CudaFacts, t: TorchFacts, device: str) -> Check:
    """The GPU and whether this torch has kernels for it. ``device``: the config's training.device."""
    facts = {**f.__dict__, "training_device": device}
    wants = device == "cuda"
    if not f.available:
        why = f" ({f.error})" if f.error else ""
        if t.version is not None and not t.cuda:
            found = f"no CUDA: torch {t.version} is a CPU-only build"
            advice = "install a CUDA build of torch (deploy/README.md), or set training.device: cpu"
        else:
            found = f"no usable CUDA device{why}"
            advice = "check the NVIDIA driver (nvidia-smi), or set training.device: cpu"
        if not wants and t.cuda:  # NVIDIA's libraries (several GB) installed for a GPU that is not there
            public = (t.version or "").split("+")[0]
            return Check("gpu", Status.WARNING,
                         found + f"; torch {t.version} is a CUDA {t.cuda} build; training.device is {device}: "
                         "training runs on the CPU",
                         "without an NVIDIA GPU the CPU build trains the same in a tenth of the disk: pip install "
                         f"torch=={public} --index-url https://download.pytorch.org/whl/cpu (with a GPU: "
                         "check the NVIDIA driver, nvidia-smi)", facts)
        if not wants:
            return Check("gpu", Status.OK, found + f"; training.device is {device}: training runs on the CPU",
                         "", facts)
        return Check("gpu", Status.FAILING, found + "; training.device is cuda", advice, facts)
    cap = f.capability or (0, 0)
    found = f"{f.name}, compute capability {cap[0]}.{cap[1]}"
    if not has_kernels(f.arch_list, cap):
        found += f"; this torch has kernels for {' '.join(f.arch_list) or 'no architecture'}, not sm_{cap[0]}{cap[1]}"
        status = Status.FAILING if device in ("cuda", "auto") else Status.WARNING
        advice = "install " + _build_to_install(cap)
        if device == "cpu":
            advice += " to train on it (training.device is cpu now)"
        return Check("gpu", status, found, advice, facts)
    if f.error:
        return Check("gpu", Status.FAILING if wants else Status.WARNING, found + f"; no context: {f.error}",
                     "check the driver against this torch's CUDA (nvidia-smi; deploy/README.md)", facts)
    note = "" if device != "cpu" else "; training.device is cpu: set cuda to train on the GPU"
    return Check("gpu", Status.OK, found + f", kernels in this torch{note}", "", facts)


def judge_gpu_memory(f: CudaFacts, device: str, budget: int | None) -> Check | None:
    """Free and total device memory against the cap (None: no GPU to speak of)."""
    if not f.available or f.total_bytes is None or f.free_bytes is None:
        return None
    facts = {"free_bytes": f.free_bytes, "total_bytes": f.total_bytes, "budget_bytes": budget}
    found = f"{mib(f.free_bytes)} free of {mib(f.total_bytes)}"
    if device == "cpu" or budget is None:
        return Check("gpu memory", Status.OK, found + (" (no cap configured)" if device != "cpu" else ""), "", facts)
    found += f", cap {mib(budget)}"
    if budget > f.total_bytes:
        return Check("gpu memory", Status.FAILING, found + ": the cap is more than the device has",
                     f"lower training.memory.budget below {mib(f.total_bytes)}", facts)
    if budget > f.free_bytes:
        return Check("gpu memory", Status.FAILING, found + ": less is free than the cap",
                     f"close what else uses the GPU (nvidia-smi), or lower training.memory.budget to at most "
                     f"{mib(f.free_bytes)}", facts)
    return Check("gpu memory", Status.OK, found, "", facts)


def judge_onnxruntime(f: OrtFacts) -> Check:
    facts = {**f.__dict__, "distributions": dict(f.distributions)}
    names = [n for n, _ in f.distributions]
    if len(names) > 1:
        listed = ", ".join(f"{n} {v}" for n, v in f.distributions)
        return Check("onnxruntime", Status.FAILING, f"{listed} installed: they share the onnxruntime module and "
                     "overwrite each other's files",
                     f"pip uninstall -y {' '.join(names)}, then install one: pip install 'edgerev[runtime]' "
                     "(inference) or 'edgerev[ort-training]' (inference and head training)", facts)
    if f.version is None:
        return Check("onnxruntime", Status.FAILING, f"ONNX Runtime cannot be imported ({f.error})",
                     "pip install 'edgerev[runtime]': every promoted version is exported and verified with it",
                     facts)
    found = f"onnxruntime {f.version}" + (f" ({names[0]})" if names else "") + \
        f", providers {', '.join(f.providers) or 'none'}"
    if names and names[0].startswith("onnxruntime-training"):
        return Check("onnxruntime", Status.OK, found, "", facts)
    if f.wanted and _satisfies(f.version, f.wanted) is False:
        return Check("onnxruntime", Status.WARNING, found + f"; edgerev is tested with {f.wanted}",
                     "pip install 'edgerev[runtime]' (ONNX Runtime 1.19 loads the exported models)", facts)
    return Check("onnxruntime", Status.OK, found, "", facts)


def judge_flwr(f: FlwrFacts) -> Check:
    if f.version is None:
        return Check("flower", Status.OK, "not installed (only a fleet needs it: pip install 'edgerev[fleet]')",
                     "", f.__dict__)
    found = f"flwr {f.version}"
    if _satisfies(f.version, f.wanted) is False:
        return Check("flower", Status.WARNING, found + f"; edgerev's fleet is written against {f.wanted}",
                     "pip install 'edgerev[fleet]'", f.__dict__)
    return Check("flower", Status.OK, found, "", f.__dict__)


def judge_disk(f: DiskFacts, min_free: int) -> Check:
    """The data directory: writable, and free space against ``storage.min_free_space`` (``min_free`` bytes)."""
    facts = {**f.__dict__, "min_free_bytes": min_free}
    where = f.path if f.exists else f"{f.path} (not created yet; measured at {f.probed})"
    if f.error is not None or not f.writable:
        return Check("data directory", Status.FAILING, f"{where}: cannot write ({f.error})",
                     "give the daemon's user write access to it, or choose another data_dir", facts)
    found = f"{where}: {mib(f.free_bytes)} free of {mib(f.total_bytes)}, writable"
    if min_free and f.free_bytes < min_free:
        return Check("data directory", Status.FAILING, found + f"; below storage.min_free_space {mib(min_free)}: "
                     "ingest and training wait", "free space on that file system, or lower storage.min_free_space",
                     facts)
    if min_free and f.free_bytes < 2 * min_free:
        return Check("data directory", Status.WARNING, found + f"; less than twice storage.min_free_space "
                     f"{mib(min_free)}", "free space before ingest stops at the floor", facts)
    return Check("data directory", Status.OK, found, "", facts)


def judge_plan(f: PlanFacts) -> Check:
    facts = f.to_json()
    what = f"{f.arch} at {f.size}x{f.size} on {f.device}, batch {f.batch}" + \
        (f" and {f.unlabeled} unlabelled views (FixMatch)" if f.unlabeled else "")
    if f.error is not None:
        return Check("plan", Status.FAILING, f"{what}: {f.error}", f.advice, facts)
    measured = f"measured peak {mib(f.measured_peak_bytes)}"
    steps = f"{f.steps} real steps, {f.step_seconds:.2f} s each" if f.step_seconds is not None else ""
    if f.budget_bytes is None:
        return Check("plan", Status.WARNING, f"{what}, no cap: {measured}; {steps}",
                     f"set training.memory.budget (the least that trains is {mib(f.smallest_bytes)})", facts)
    found = (f"{what} under cap {mib(f.budget_bytes)}: micro-batch {f.micro_batch} ({f.planner}), predicted peak "
             f"{mib(f.predicted_peak_bytes)}, {measured}; {steps}")
    if f.measured_peak_bytes is not None and f.measured_peak_bytes > f.budget_bytes:
        return Check("plan", Status.FAILING, found + ": above the cap",
                     "report it (the plan's accounting missed); lower training.train.batch meanwhile", facts)
    if f.retries:
        return Check("plan", Status.WARNING, found + f"; ran out of memory and split the batch {f.retries} times",
                     "leave more room: lower training.memory.budget below what is free, or close other programs",
                     facts)
    return Check("plan", Status.OK, found, "", facts)

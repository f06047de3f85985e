"""What ``edgerev doctor`` reads from the machine: one small function per subject, no judgement.

Each gatherer returns a frozen dataclass of plain values (JSON-ready through :func:`dataclasses.asdict`), so
:mod:`edgerev.doctor.judge` can be tested on facts built by hand: a GTX 750 under a torch without ``sm_50``,
a GPU with too little free memory, two ONNX Runtime distributions, none of which this CPU machine has.
A gatherer never raises for what it finds: an import that fails is a fact (``error``), not a crash.
"""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from edgerev.errors import described

#: the distributions that install the ``onnxruntime`` module (each overwrites the others' files)
ORT_DISTRIBUTIONS = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-training", "onnxruntime-training-cpu")


@dataclass(frozen=True)
class PythonFacts:
    version: str  # "3.11.9"
    implementation: str
    requires: str | None  # edgerev's Requires-Python, None when edgerev is not installed as a distribution


@dataclass(frozen=True)
class TorchFacts:
    version: str | None  # None: torch cannot be imported
    cuda: str | None = None  # the CUDA this build was made for (torch.version.cuda); None: a CPU-only build
    cudnn: int | None = None
    threads: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class CudaFacts:
    available: bool  # torch.cuda.is_available()
    devices: int = 0
    name: str | None = None  # device 0
    capability: tuple[int, int] | None = None
    arch_list: tuple[str, ...] = ()  # torch.cuda.get_arch_list(): the kernels (sm_XY) and PTX (compute_XY) built in
    free_bytes: int | None = None
    total_bytes: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class OrtFacts:
    distributions: tuple[tuple[str, str], ...]  # (name, version) of each installed ORT_DISTRIBUTIONS member
    version: str | None = None  # the importable module's; None: it cannot be imported
    providers: tuple[str, ...] = ()
    wanted: str | None = None  # edgerev's requirement of its runtime extra, e.g. "onnxruntime<1.20,>=1.17"
    error: str | None = None


@dataclass(frozen=True)
class FlwrFacts:
    version: str | None  # None: not installed
    wanted: str | None = None  # edgerev's requirement of its fleet extra, e.g. "flwr==1.41.*"


@dataclass(frozen=True)
class DiskFacts:
    path: str  # the data directory
    exists: bool
    probed: str  # the folder measured and written in: the data directory or its nearest existing parent
    free_bytes: int | None = None
    total_bytes: int | None = None
    writable: bool = False
    error: str | None = None


def _extra_requirement(extra: str, project: str) -> str | None:
    """edgerev's requirement on ``project`` in its ``extra``, as written in its metadata (markers dropped)."""
    try:
        requires = metadata.requires("edgerev") or []
    except metadata.PackageNotFoundError:
        return None
    for r in requires:
        spec, _, marker = r.partition(";")
        name = spec.strip().split("[")[0]
        for op in ("==", ">=", "<=", "!=", "~=", "<", ">"):
            name = name.split(op)[0]
        if name.strip().lower() == project and f'extra == "{extra}"' in marker.replace("'", '"'):
            return spec.strip()
    return None


def python_facts() -> PythonFacts:
    try:
        requires = metadata.metadata("edgerev").get("Requires-Python")
    except metadata.PackageNotFoundError:
        requires = None
    return PythonFacts(platform.python_version(), platform.python_implementation(), requires)


def torch_facts() -> TorchFacts:
    try:
        import torch
    except Exception as e:  # a broken install raises more than ImportError (an OSError for a missing library)
        return TorchFacts(None, error=described(e))
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return TorchFacts(str(torch.__version__), torch.version.cuda, cudnn, torch.get_num_threads())


def cuda_facts() -> CudaFacts:
    """The first CUDA device as this torch sees it (creating a CUDA context only when one is there)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return CudaFacts(False)
        arch = tuple(torch.cuda.get_arch_list())
        props = torch.cuda.get_device_properties(0)
        facts = CudaFacts(True, torch.cuda.device_count(), props.name, (props.major, props.minor), arch,
                          None, int(props.total_memory))
        try:  # free memory needs a context on the device, which a driver too old for this build refuses
            free, total = torch.cuda.mem_get_info(0)
        except RuntimeError as e:
            return CudaFacts(**{**facts.__dict__, "error": str(e).strip().splitlines()[0]})
        return CudaFacts(**{**facts.__dict__, "free_bytes": int(free), "total_bytes": int(total)})
    except Exception as e:
        return CudaFacts(False, error=described(e))


def onnxruntime_facts() -> OrtFacts:
    installed = []
    for name in ORT_DISTRIBUTIONS:
        try:
            installed.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            pass
    wanted = _extra_requirement("runtime", "onnxruntime")
    try:
        import onnxruntime
    except Exception as e:
        return OrtFacts(tuple(installed), wanted=wanted, error=described(e))
    return OrtFacts(tuple(installed), str(onnxruntime.__version__), tuple(onnxruntime.get_available_providers()),
                    wanted)


def flwr_facts() -> FlwrFacts:
    """Flower's version from its distribution's metadata: importing flwr takes seconds and starts its logging."""
    try:
        version = metadata.version("flwr")
    except metadata.PackageNotFoundError:
        version = None
    return FlwrFacts(version, _extra_requirement("fleet", "flwr"))


def disk_facts(data_dir: str | Path) -> DiskFacts:
    """Free and total bytes of the data directory's file system, and whether a file can be created there.

    A data directory that does not exist yet is measured at its nearest existing parent, where the daemon
    would create it. Writing is tested by creating and removing a file (root, ACLs, read-only mounts and
    sandboxes all answer that truthfully; ``os.access`` does not).
    """
    path = Path(data_dir)
    probed = path
    while not probed.exists() and probed != probed.parent:
        probed = probed.parent
    facts = {"path": str(path), "exists": path.exists(), "probed": str(probed)}
    if not probed.is_dir():
        return DiskFacts(**facts, error=f"{probed} is not a directory")
    try:
        usage = shutil.disk_usage(probed)
    except OSError as e:
        return DiskFacts(**facts, error=e.strerror or str(e))
    facts.update(free_bytes=int(usage.free), total_bytes=int(usage.total))
    try:
        fd, name = tempfile.mkstemp(prefix=".edgerev-doctor-", dir=probed)
    except OSError as e:
        return DiskFacts(**facts, error=e.strerror or str(e))
    os.close(fd)
    os.unlink(name)
    return DiskFacts(**facts, writable=True)


"""ONNX Runtime, imported on demand with one clear error when it is missing, and its sessions.

Two distributions provide the ``onnxruntime`` module: ``onnxruntime`` (inference) and
``onnxruntime-training-cpu`` (inference and on-device training). They overwrite each other's files,
so edgerev lists them as alternative extras (``edgerev[runtime]``, ``edgerev[ort-training]``) and
never depends on either. No torch here (see :mod:`edgerev.export.predict`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import re
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from edgerev.errors import ExportError

INSTALL_HINT = ("pip install 'edgerev[runtime]' for inference, or 'edgerev[ort-training]' for inference and "
                "head fine-tuning (one of the two: they provide the same module)")


def onnxruntime() -> types.ModuleType:
    """The ``onnxruntime`` module, or :class:`ExportError` saying how to install it."""
    # onnxruntime-training's import loads torch.utils.cpp_extension where torch is installed; a CUDA build of torch
    # (PyPI's 2.14.1) on a machine with nvcc and no GPU then logs "No CUDA runtime is found, using CUDA_HOME=..."
    # to stderr, which ends up in every predict and daemon command's output. Nothing here compiles extensions.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    try:
        import onnxruntime as ort
    except ImportError:
        raise ExportError(f"ONNX Runtime is not installed: {INSTALL_HINT}") from None
    return ort


def logits_apart(got, expected, tolerance: float) -> tuple[float, float]:
    """How far two computations of the same logits lie apart, and how far they may.

    float32 rounding grows with the values summed: ``tolerance`` holds for logits up to 1 and scales with
    the largest logit above that (one rule for export and fine-tuning).

    Returns:
        ``(difference, allowed)``: the largest absolute difference (NaN when either holds a NaN) and
        ``tolerance * max(1, max |expected|)``.
    """
    got, expected = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    diff = float(np.max(np.abs(got - expected)))
    return diff, tolerance * max(1.0, float(np.max(np.abs(expected))))


#: how many times float32's own rounding of the exact logits another runtime's may be off them
ROUNDING_FACTOR = 4.0


def rounding_apart(got, expected, exact) -> tuple[float, float]:
    """How far ``got`` lies from the ``exact`` logits (float64), and how far it may: :data:`ROUNDING_FACTOR` times
    PyTorch's float32 ``expected`` off them.

    A model whose logits depend steeply on its inputs and weights (no batch norm left, activations in the
    thousands) rounds far in float32 whatever runs it: a trained EfficientNet-B0 whose batch norms were folded
    gave logits of 1,277 that PyTorch's float32 put 0.08 off float64's and ONNX Runtime 0.26 off, beyond a
    tolerance of 1e-4 of the largest logit (0.13) that both runtimes meet on a model that rounds less. The
    check against the exact result tells such rounding from a runtime computing another function.

    Returns:
        ``(difference, allowed)``: ``got``'s largest absolute difference from ``exact`` (NaN when either holds a
        NaN) and ``ROUNDING_FACTOR`` times ``expected``'s.
    """
    got, expected, exact = (np.asarray(a, dtype=np.float64) for a in (got, expected, exact))
    return float(np.max(np.abs(got - exact))), ROUNDING_FACTOR * float(np.max(np.abs(expected - exact)))


def check_logits(got, expected, tolerance: float, exact: Callable[[], np.ndarray | None], what: str,
                 batch: int) -> float:
    """The largest difference of ``got`` (ONNX Runtime's logits) from ``expected`` (PyTorch's float32), checked:
    within ``tolerance`` (:func:`logits_apart`), or past it within float32's rounding of the ``exact`` float64
    logits (:func:`rounding_apart`; ``exact()`` computes them, None where the model does not run in float64).

    Raises:
        ExportError: neither holds (``what`` names the file or model; nothing is written).
    """
    diff, allowed = logits_apart(got, expected, tolerance)
    if diff <= allowed:  # NaN fails
        return diff
    apart = (f"ONNX Runtime and PyTorch disagree on {what}: max abs difference of logits {diff:.3g} at batch {batch} "
             f"exceeds the tolerance {allowed:.3g}")
    logits = exact()
    if logits is None:
        raise ExportError(f"{apart}; nothing written")
    off, rounding = rounding_apart(got, expected, logits)
    if not off <= rounding:
        raise ExportError(f"{apart}, and ONNX Runtime lies {off:.3g} from the float64 logits, more than "
                          f"{ROUNDING_FACTOR:g} times PyTorch's float32 ({rounding / ROUNDING_FACTOR:.3g}); "
                          "nothing written")
    return diff


def first_line(e: BaseException) -> str:
    """The first line of an exception's message, without ONNX Runtime's ``[ONNXRuntimeError] : 7 : NAME :`` prefix."""
    text = str(e).strip()
    if not text:
        return type(e).__name__
    return re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text.splitlines()[0])


def inference_session(model: str | Path | bytes, what: str | None = None):
    """An ``InferenceSession`` on the CPU for a file or serialized model; one-line errors.

    Args:
        model: path of an ``.onnx`` file, or its bytes.
        what: how errors name the model (default: the path).
    """
    ort = onnxruntime()
    if not isinstance(model, bytes):
        path = Path(model)
        what = what or str(path)
        if not path.is_file():
            raise ExportError(f"ONNX model {what} does not exist")
        model = str(path)
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: ORT's warnings about unused initializers are noise here
    try:
        return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    except Exception as e:  # ORT's pybind exceptions derive from Exception only
        raise ExportError(f"ONNX Runtime cannot load {what or 'the model'}: {first_line(e)}") from None


def training_modules() -> tuple[types.ModuleType, types.ModuleType]:
    """``(onnxruntime.training.api, onnxruntime.training.artifacts)`` from ``onnxruntime-training-cpu``.

    The package's ``__init__`` imports its PyTorch helpers (``optim``, ``amp``), so it fails on a
    device without torch, although the two modules needed here use only the C extension, onnx and
    numpy. Without torch, the package is registered as a bare namespace over its own folder, and
    the two submodules are imported from it without that ``__init__``.
    """
    ort = onnxruntime()
    folder = Path(ort.__file__).parent / "training"
    if not (folder / "api").is_dir():
        raise ExportError(f"ONNX Runtime training is not installed (found plain onnxruntime {ort.__version__}): "
                          "pip uninstall onnxruntime && pip install 'edgerev[ort-training]'")
    if "onnxruntime.training" not in sys.modules and not _torch_importable():
        stub = types.ModuleType("onnxruntime.training")
        stub.__path__ = [str(folder)]
        stub.__package__ = "onnxruntime.training"
        sys.modules["onnxruntime.training"] = stub
        ort.training = stub
    try:
        api = importlib.import_module("onnxruntime.training.api")
        artifacts = importlib.import_module("onnxruntime.training.artifacts")
    except ImportError as e:
        raise ExportError(f"ONNX Runtime training cannot be imported: {first_line(e)}") from None
    return api, artifacts


def _torch_importable() -> bool:
    if "torch" in sys.modules:
        return sys.modules["torch"] is not None
    return importlib.util.find_spec("torch") is not None


@contextlib.contextmanager
def quiet_artifact_generation() -> Iterator[None]:
    """Keep ``generate_artifacts`` from printing ONNX Runtime's info log (a hundred lines per call).

    onnxruntime-training 1.19.2 (the last release) optimizes the training graph with a
    ``SessionOptions`` it creates itself at the default verbosity; give it one that logs errors only.
    """
    try:
        from onnxruntime.training.onnxblock import _training_graph_utils as graph_utils
    except ImportError:  # another layout: leave it as it is
        yield
        return
    original = graph_utils.SessionOptions

    def options():
        o = original()
        o.log_severity_level = 3
        return o

    graph_utils.SessionOptions = options
    try:
        yield
    finally:
        graph_utils.SessionOptions = original

"""ONNX export of a model directory (or a model), verified against PyTorch with ONNX Runtime.

The export runs the model's plain-autograd path in eval mode (:func:`edgerev.engine.plain`: the
engine's custom autograd Function is not traceable, and the legacy exporter fails on it with
``RuntimeError: unordered_map::at``). The batch axis is symbolic: the pooling reshapes read the batch
from the traced shapes, so one file runs at any batch. The file carries the metadata of
:mod:`edgerev.export.metadata`, is checked with ONNX Runtime before it is written, and is written
atomically: a model that does not match PyTorch is never left where a predictor would load it.

ONNX Runtime 1.19 (the last release with on-device training) loads opset <= 21 and IR <= 10; onnx
>= 1.18 writes a newer IR by default, so the IR is lowered to 10 (nothing in these graphs needs more).

Which exporter (``exporter="auto"``, the default): the ``torch.export``-based one (``dynamo``) from torch 2.7
on, falling back to the TorchScript one (``legacy``) where it fails; ``legacy`` straight away before 2.7. Both
files pass the same verification against PyTorch before anything is written, so neither choice trades
correctness for a file. Torch 2.6 (NVIDIA's on a Jetson, the oldest release edgerev supports) beside onnxscript
0.7 fails to translate ``_native_batch_norm_legit_no_training`` (``'tuple' object has no attribute 'dtype'``)
while the TorchScript exporter writes the same models; there the failed attempt cost 15-20 s against 1.5 s for
the export itself (tiny RevNeXt, one thread), per export, so 2.6 does not try. 2.13 and 2.14 export with dynamo
(CI checks that they do not fall back); the fallback covers the releases between, which CI does not run, and an
onnxscript that breaks a pair that worked. A fallback is logged with its reason, and ``ExportResult.exporter``
names the exporter that wrote the file. Asking for ``dynamo`` or ``legacy`` by name never falls back.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import logging
import re
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from edgerev.atomic import atomic_write
from edgerev.engine import plain
from edgerev.errors import ExportError
from edgerev.export.graph import give_head_a_bias
from edgerev.export.images import normalize
from edgerev.export.metadata import ModelMeta, set_props
from edgerev.export.runtime import check_logits, first_line, inference_session
from edgerev.models.directory import ModelInfo, load_handle
from edgerev.models.handle import Exporter, ModelHandle, describe
from edgerev.models.head import ScaledLinear
from edgerev.torch_range import release

MAX_OPSET = 21
MAX_IR = 10
INPUT, OUTPUT = "pixels", "logits"
EXPORTERS = ("auto", "dynamo", "legacy")
#: (major, minor) of the first torch whose dynamo exporter ``auto`` tries (see the module's docs)
DYNAMO_FROM = (2, 7)

log = logging.getLogger(__name__)


class _NoOnnxscript(ExportError):
    """The dynamo exporter cannot import onnxscript: a broken install, which ``auto`` reports instead of hiding."""


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_onnx` wrote and how close it is to PyTorch."""

    path: Path
    arch: str
    opset: int
    ir_version: int
    max_abs_diff: float  # logits, ONNX Runtime against PyTorch, over the verification batches
    batches: tuple[int, ...]  # batch sizes verified
    seconds: float  # export (trace, convert, serialize)
    verify_seconds: float
    size_bytes: int
    weights_sha256: str
    exporter: str  # the exporter that wrote the file: dynamo or legacy (auto says which it fell back to)

    def to_json(self) -> dict:
        d = asdict(self)
        d["path"], d["batches"] = str(self.path), list(self.batches)
        return d


def weights_sha256(model: nn.Module) -> str:
    """SHA-256 of the model's weights as :func:`edgerev.models.directory.save_model` would write them."""
    from safetensors.torch import save

    data = save({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()})
    return hashlib.sha256(data).hexdigest()


def export_onnx(source: str | Path | nn.Module | ModelHandle, out_path: str | Path, *, info: ModelInfo | None = None,
                batch: int = 4, tolerance: float = 1e-4, opset: int | None = None, exporter: str = "auto",
                seed: int = 0, trust_factories: Iterable[str | Callable] = ()) -> ExportResult:
    """Export a model to ONNX with a dynamic batch, verify it with ONNX Runtime, write it atomically.

    Args:
        source: a model directory (``model.json`` + ``model.safetensors``), or a model (its handle, or a module).
        out_path: the ``.onnx`` file to write.
        info: classes, input size and normalization; required with a model, read from a directory.
        batch: verification batch size (batch 1 is verified too).
        tolerance: largest accepted difference between ONNX Runtime's and PyTorch's logits, relative to the
            largest logit when that is above 1 (float32 rounding grows with the logits).
        opset: ONNX opset (<= 21); default: the exporter's.
        exporter: ``"auto"`` (dynamo, and legacy where dynamo fails: see the module's docs), ``"dynamo"``
            (``torch.export``, needs onnxscript) or ``"legacy"`` (TorchScript tracing; deprecated in torch, kept
            for torch releases whose dynamo exporter fails and for installs without onnxscript).
        seed: seed of the random verification pixels.
        trust_factories: the factories a model directory's ``model.json`` may name (one's own runs of a factory:
            :func:`edgerev.models.resolve.load_model`).

    Raises:
        ExportError: bad arguments, a failed export, or a verification above ``tolerance``.
        CheckpointError: the model directory is missing or broken.
        edgerev.errors.TrustError: the directory names a factory not in ``trust_factories``.
    """
    if batch < 1:
        raise ExportError(f"verification batch must be positive, got {batch}")
    if not tolerance >= 0:
        raise ExportError(f"tolerance must be a non-negative number, got {tolerance}")
    if exporter not in EXPORTERS:
        raise ExportError(f"unknown exporter {exporter!r}; choose from {', '.join(EXPORTERS)}")
    if opset is not None and not 7 <= opset <= MAX_OPSET:
        raise ExportError(f"opset must lie in 7..{MAX_OPSET} (ONNX Runtime 1.19 loads up to {MAX_OPSET}), got {opset}")
    out_path = Path(out_path)
    if not out_path.parent.is_dir():
        raise ExportError(f"cannot write {out_path}: folder {out_path.parent} does not exist")
    if isinstance(source, (nn.Module, ModelHandle)):
        if info is None:
            raise ExportError("exporting a model object needs its ModelInfo (classes, input size, normalization)")
        handle = describe(source)
        sha = weights_sha256(handle.module)
    else:
        handle, info, sha = load_handle(source, trust_factories=trust_factories)
    return _EXPORTERS[handle.exporter](handle, info, sha, out_path, batch=batch, tolerance=tolerance, opset=opset,
                                       exporter=exporter, seed=seed)


def _export_traced(handle: ModelHandle, info: ModelInfo, sha: str, out_path: Path, *, batch: int, tolerance: float,
                   opset: int | None, exporter: str, seed: int) -> ExportResult:
    """A model of edgerev's or of the owner's, traced by torch's exporters (``exporter``) and verified."""
    arch = handle.arch or info.arch
    # a copy: eval() and tracing never touch the caller's model (its mode, its batch-norm statistics)
    handle = handle.replace(module=copy.deepcopy(handle.module).cpu().eval())
    model = handle.module
    head = model.get_submodule(handle.head) if handle.head is not None else None
    if isinstance(head, ScaledLinear):
        # the same logits from a plain Gemm(features, weight, bias): what head fine-tuning looks for
        handle.replace_head(head.folded())
    example = torch.zeros(2, len(info.mean), info.input_size, info.input_size)
    handle.check_size(info.input_size)  # one clear error for an input size the model cannot take

    start = time.perf_counter()
    if exporter == "auto" and (release(str(torch.__version__)) or (0, 0)) < DYNAMO_FROM:
        exporter = "legacy"
    if exporter == "auto":
        try:
            proto, exporter = _export(model, example, opset, "dynamo", arch), "dynamo"
        except _NoOnnxscript:
            raise
        except ExportError as e:
            log.warning("%s; exporting with the TorchScript exporter instead (verified the same way)", e)
            proto, exporter = _export(model, example, opset, "legacy", arch), "legacy"
    else:
        proto = _export(model, example, opset, exporter, arch)
    give_head_a_bias(proto)  # a bias-free head (the paper's RevNeXt) exports without one; fine-tuning needs it
    if proto.ir_version > MAX_IR:
        proto.ir_version = MAX_IR
    used_opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    if used_opset > MAX_OPSET:
        raise ExportError(f"the exporter wrote opset {used_opset}; ONNX Runtime 1.19 loads up to {MAX_OPSET}: "
                          f"pass opset={MAX_OPSET} or lower")
    import edgerev

    meta = ModelMeta(classes=info.classes, input_size=info.input_size, mean=info.mean, std=info.std, arch=info.arch,
                     weights_sha256=sha, edgerev_version=edgerev.__version__)
    set_props(proto, meta.to_props())
    data = proto.SerializeToString()
    seconds = time.perf_counter() - start

    start = time.perf_counter()
    batches = tuple(dict.fromkeys((batch, 1)))
    diff = verify_onnx(data, model, meta, batches=batches, tolerance=tolerance, seed=seed, what=str(out_path))
    verify_seconds = time.perf_counter() - start
    atomic_write(out_path, data)
    return ExportResult(path=out_path, arch=info.arch, opset=used_opset, ir_version=proto.ir_version,
                        max_abs_diff=diff, batches=batches, seconds=seconds, verify_seconds=verify_seconds,
                        size_bytes=len(data), weights_sha256=sha, exporter=exporter)


def _export_imported(handle: ModelHandle, info: ModelInfo, sha: str, out_path: Path, *, batch: int,
                     tolerance: float, opset: int | None, exporter: str, seed: int) -> ExportResult:
    """A model imported from ONNX goes back into its own file (:func:`edgerev.export.imported.export_imported`: the
    original's graph, input and output names, dynamic batch and opset, verified with ONNX Runtime), with edgerev's
    metadata beside the original's, so ``edgerev predict`` and ``edgerev finetune-head`` read its classes, input
    size, normalization and whether it outputs probabilities. Nothing is traced, so no exporter is named."""
    import edgerev
    from edgerev.export.imported import export_imported

    start = time.perf_counter()
    meta = ModelMeta(classes=info.classes, input_size=info.input_size, mean=info.mean, std=info.std, arch=info.arch,
                     weights_sha256=sha, edgerev_version=edgerev.__version__)
    # one write, the metadata with it: export_imported adds ``outputs`` (probabilities where the original ends in
    # its Softmax), which tells edgerev predict not to apply a softmax of its own
    done = export_imported(handle.module, out_path, batches=tuple(dict.fromkeys((batch, 1))), tolerance=tolerance,
                           seed=seed,
                           props=meta.to_props())
    opset, ir_version, data_size = done.opset, done.ir_version, done.size_bytes
    return ExportResult(path=out_path, arch=info.arch, opset=opset, ir_version=ir_version,
                        max_abs_diff=done.max_abs_diff, batches=done.batches, seconds=time.perf_counter() - start,
                        verify_seconds=0.0, size_bytes=data_size, weights_sha256=sha, exporter="imported")


#: each handle's exporter (:class:`edgerev.models.handle.Exporter`) and its function
_EXPORTERS = {Exporter.TRACED: _export_traced, Exporter.IMPORTED: _export_imported}


def verify_onnx(onnx_model: str | Path | bytes, model: nn.Module, meta: ModelMeta, batches: tuple[int, ...] = (4, 1),
                tolerance: float = 1e-4, seed: int = 0, what: str | None = None) -> float:
    """Largest absolute difference of logits between ONNX Runtime and PyTorch on random pixels.

    Each batch size in ``batches`` is run (a file exported with a fixed batch fails here).

    Raises:
        ExportError: the difference exceeds ``tolerance`` (scaled as in :func:`logits_apart`) or is not finite,
            or ONNX Runtime fails.
    """
    session = inference_session(onnx_model, what)
    name = session.get_inputs()[0].name
    rng = np.random.default_rng(seed)
    worst = 0.0
    for b in batches:
        pixels = rng.integers(0, 256, size=(b, len(meta.mean), meta.input_size, meta.input_size), dtype=np.uint8)
        x = normalize(pixels, meta.mean, meta.std)
        try:
            got = session.run(None, {name: x})[0]
        except Exception as e:  # ORT's pybind exceptions derive from Exception only
            raise ExportError(f"ONNX Runtime failed on {what or 'the model'} at batch {b}: {first_line(e)}") from None
        ref = _reference_logits(model, x)
        if got.shape != ref.shape:
            raise ExportError(f"{what or 'the ONNX model'} returns logits of shape {got.shape} at batch {b}, "
                              f"PyTorch {ref.shape}")
        diff = check_logits(got, ref, tolerance, lambda x=x: _exact_logits(model, x), what or "the model",
                            b)
        worst = max(worst, diff)
    return worst


def _reference_logits(model: nn.Module, x: np.ndarray, dtype: torch.dtype = torch.float32) -> np.ndarray:
    with plain(model), torch.no_grad():
        return model(torch.from_numpy(x).to(dtype)).numpy()


def _exact_logits(model: nn.Module, x: np.ndarray) -> np.ndarray | None:
    """The logits in float64 (a copy of ``model``), or None where the model does not run so."""
    try:
        return _reference_logits(copy.deepcopy(model).double(), x, torch.float64)
    except (RuntimeError, TypeError):
        return None


def _export(model: nn.Module, example: torch.Tensor, opset: int | None, exporter: str, arch: str):
    """Trace ``model`` to an ``onnx.ModelProto`` with a symbolic batch axis."""
    import onnx

    try:
        with plain(model), torch.no_grad(), _quiet_exporter():
            if exporter == "dynamo":
                batch = torch.export.Dim("batch")
                program = torch.onnx.export(model, (example,), dynamo=True, input_names=[INPUT], output_names=[OUTPUT],
                                            dynamic_shapes=({0: batch},), opset_version=opset, verbose=False)
                return program.model_proto
            buf = io.BytesIO()
            torch.onnx.export(model, (example,), buf, dynamo=False, input_names=[INPUT], output_names=[OUTPUT],
                              dynamic_axes={INPUT: {0: "batch"}, OUTPUT: {0: "batch"}}, opset_version=opset or 17)
            return onnx.load_from_string(buf.getvalue())
    except ImportError as e:
        raise _NoOnnxscript(f"the dynamo exporter needs onnxscript ({first_line(e)}): pip install onnxscript, "
                          "or use the legacy exporter") from None
    except Exception as e:  # the exporters raise many types; the CLI needs one line
        raise ExportError(f"torch.onnx.export failed for {arch}: {_reason(e)}") from None


def _reason(e: BaseException) -> str:
    """One line for an exporter's error: its type, and the first error of its chain of causes.

    The dynamo exporter wraps the error that stopped it in two ``ConversionError``s whose first lines say only
    which step failed (with terminal colour codes); the root says what went wrong.
    """
    root = e
    while root.__cause__ is not None:
        root = root.__cause__
    text = f"{type(e).__name__}: " + (f"{type(root).__name__}: " if root is not e else "") + first_line(root)
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Hide the exporters' chatter (tracer warnings, 'torchvision is not installed', deprecation)."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._export", "onnxscript", "onnx_ir")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)

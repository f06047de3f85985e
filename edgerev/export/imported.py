"""The export of an imported model: its weights written back into the original graph, verified, atomically.

Writing the trained weights into the original file keeps everything the owner's application relies on: the
input and output names, shapes and dynamic batch, the opset and IR version, the metadata, and the final Softmax
if the original ended in one (the import left it out for training). Nothing is re-traced, so no exporter can
change the graph, and the same holds on every torch release edgerev supports. What may differ is only what
training changed: the weights, the batch-norm statistics, and the head's row count when classes were added.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from edgerev.atomic import atomic_write
from edgerev.errors import ExportError
from edgerev.export.metadata import set_props
from edgerev.export.runtime import check_logits, first_line, inference_session
from edgerev.models.onnx_import.model import ImportedModel

#: spatial size verified where the file leaves height and width dynamic
FALLBACK_SIZE = 32


@dataclass(frozen=True)
class ImportedExport:
    """What :func:`export_imported` wrote and how close ONNX Runtime is to PyTorch on it."""

    path: Path
    max_abs_diff: float  # the outputs (probabilities where the original outputs them), over the batches
    batches: tuple[int, ...]
    size_bytes: int
    seconds: float
    opset: int
    ir_version: int


def updated_proto(model: ImportedModel) -> onnx.ModelProto:
    """The original ModelProto with the model's current weights and statistics as the initializers its nodes read.

    A weight whose initializer only its node reads is replaced in place (same name); one that reached the node
    another way (through an Identity, a folded Transpose, an initializer two nodes share) goes into a new
    initializer that this node input now names. Initializers nothing reads any more are dropped.
    """
    proto = onnx.load_from_string(model.onnx_source)
    graph = proto.graph
    state = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    inits = {t.name: t for t in graph.initializer}
    readers = Counter(i for n in graph.node for i in n.input)
    readers.update(o.name for o in graph.output)
    taken = set(inits) | {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
    producer = {o: n for n in graph.node for o in n.output}
    for key, (node_index, input_index, how) in model.onnx_links.items():
        node = graph.node[node_index]
        name = node.input[input_index]
        value = state[key]
        old_shape = tuple(inits[name].dims) if name in inits else tuple(state[key].shape)
        if how in ("transpose", "gemm_weight_t"):
            value = value.T
        elif how in ("bias", "gemm_bias") and old_shape is not None:  # the original rank, the class count last
            value = value.reshape((*old_shape[:-1], value.size) if old_shape else (value.size,))
        elif old_shape is not None and value.size == int(np.prod(old_shape)):
            value = value.reshape(old_shape)
        root = name
        while root not in inits and root in producer and producer[root].op_type == "Identity" and readers[root] == 1:
            root = producer[root].input[0]  # exporters without constant folding read weights through Identity
        if root in inits and readers[root] == 1:
            inits[root].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(value, np.float32), root))
        else:
            new = _fresh(f"{name or key}.trained", taken)
            graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(value, np.float32), new))
            node.input[input_index] = new
        if how.startswith("gemm"):  # the Linear holds alpha * B and beta * C
            _set_float(node, "alpha" if how != "gemm_bias" else "beta", 1.0)
    _drop_dead_nodes(graph)
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    kept = [t for t in graph.initializer if t.name in used]
    if len(kept) != len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(kept)
        inputs = [i for i in graph.input if i.name in used or i.name not in inits]
        del graph.input[:]
        graph.input.extend(inputs)
    return proto


def _drop_dead_nodes(graph: onnx.GraphProto) -> None:
    """Remove nodes whose outputs nothing reads (an Identity that fed a weight now held by a new initializer)."""
    while True:
        used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
        alive = [n for n in graph.node if any(o in used for o in n.output)]
        if len(alive) == len(graph.node):
            return
        del graph.node[:]
        graph.node.extend(alive)


def _fresh(name: str, taken: set[str]) -> str:
    out, k = name, 1
    while out in taken:
        out, k = f"{name}{k}", k + 1
    taken.add(out)
    return out


def export_imported(model: ImportedModel, out_path: str | Path, *, batches: tuple[int, ...] = (4, 1),
                    tolerance: float = 1e-4, seed: int = 0, props: Mapping[str, str] | None = None) -> ImportedExport:
    """Write ``model``'s weights into its original ONNX graph, verify it with ONNX Runtime, write it atomically.

    Args:
        model: a model :func:`~edgerev.models.onnx_import.load_onnx` imported, trained or not.
        out_path: the ``.onnx`` file to write.
        batches: batch sizes verified (the batch stays dynamic).
        tolerance: largest accepted difference against PyTorch, scaled as in :func:`logits_apart`.
        seed: seed of the random verification inputs.
        props: metadata to set (edgerev's classes, input size, normalization); the original's other keys stay.
            ``outputs`` says ``probabilities`` where the file ends in the original's Softmax.

    Raises:
        ExportError: the folder is missing, ONNX Runtime fails, or its outputs differ from PyTorch's.
    """
    start = time.perf_counter()
    out_path = Path(out_path)
    if not out_path.parent.is_dir():
        raise ExportError(f"cannot write {out_path}: folder {out_path.parent} does not exist")
    proto = updated_proto(model)
    reference = copy.deepcopy(model).cpu().eval()
    io = model.io
    shape = [d or FALLBACK_SIZE for d in io.input_shape[1:]]
    if io.fixed_batch is not None:  # the file keeps the batch it fixed
        batches = (io.fixed_batch,)
    rng = np.random.default_rng(seed)
    inputs = {b: rng.standard_normal((b, *shape)).astype(np.float32) for b in batches}
    expected = {b: _reference(reference, x) for b, x in inputs.items()}
    _fix_output_shape(proto, next(iter(expected.values())).shape)
    if props is not None:
        outputs = {"outputs": "probabilities" if io.softmax_axis is not None else "logits"}
        set_props(proto, {**props, **outputs})
    data = proto.SerializeToString()
    session = inference_session(data, str(out_path))
    worst = 0.0
    for b, x in inputs.items():
        try:
            got = session.run(None, {io.input_name: x})[0]
        except Exception as e:  # ORT's pybind exceptions derive from Exception only
            raise ExportError(f"ONNX Runtime failed on {out_path} at batch {b}: {first_line(e)}") from None
        if got.shape != expected[b].shape:
            raise ExportError(f"{out_path} outputs shape {got.shape} at batch {b}, PyTorch {expected[b].shape}")
        diff = check_logits(got, expected[b], tolerance, lambda x=x: _exact(reference, x), str(out_path), b)
        worst = max(worst, diff)
    atomic_write(out_path, data)
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    return ImportedExport(path=out_path, max_abs_diff=worst, batches=tuple(batches), size_bytes=len(data),
                          seconds=time.perf_counter() - start, opset=opset, ir_version=proto.ir_version)


def _exact(model: ImportedModel, x: np.ndarray) -> np.ndarray | None:
    """The logits in float64 (a copy of ``model``), or None where its graph does not run so (a cast to float32)."""
    try:
        return _reference(copy.deepcopy(model).double(), x, torch.float64)
    except (RuntimeError, TypeError):
        return None


def _reference(model: ImportedModel, x: np.ndarray, dtype: torch.dtype = torch.float32) -> np.ndarray:
    with torch.no_grad():
        y = model(torch.from_numpy(x).to(dtype))
        if model.io.softmax_axis is not None:
            y = torch.softmax(y, model.io.softmax_axis)
    return y.numpy()


def _fix_output_shape(proto: onnx.ModelProto, shape: tuple[int, ...]) -> None:
    """A grown head changes the output's fixed class count; stale inferred shapes inside the graph go."""
    del proto.graph.value_info[:]
    dims = proto.graph.output[0].type.tensor_type.shape.dim
    if len(dims) == len(shape):
        for d, n in zip(dims, shape):
            if d.HasField("dim_value") and d.dim_value != n and d is not dims[0]:
                d.dim_value = n


def _set_float(node: onnx.NodeProto, name: str, value: float) -> None:
    for a in node.attribute:
        if a.name == name:
            a.f = value
            return
    node.attribute.append(helper.make_attribute(name, value))

"""Reading an ONNX file for import, and every refusal that needs no conversion: one line, nothing run.

A file is refused when it is not ONNX (it does not parse, or parses to something without a graph), is
truncated, names external data that is missing or short, uses an opset outside :data:`MIN_OPSET` to the newest
the installed ``onnx`` knows, has more than one input or output, or an input that is not a float32 image.
Op by op refusals (unsupported op, data type, a shape that is not constant) come from the conversion, which also
runs before anything trains.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto, numpy_helper

from edgerev.errors import UnsupportedModel
from edgerev.models.onnx_import.signature import OnnxIO

MIN_OPSET = 13
#: the newest default-domain opset the installed onnx writes and checks
MAX_OPSET = onnx.defs.onnx_opset_version()
OPS_PAGE = "docs/reference/onnx-ops.md"
#: element types an initializer may hold: float32 weights, integer shapes and indices, booleans for masks
INITIALIZER_TYPES = (TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32, TensorProto.BOOL)


@dataclass
class OnnxFile:
    """A parsed, checked ONNX model and what the conversion needs of it."""

    proto: onnx.ModelProto
    what: str  # how messages name the file
    opset: int
    #: inferred shapes: value name -> dims (int, or the str name of a symbolic dimension, or None)
    shapes: dict[str, tuple] = field(default_factory=dict)
    #: inferred element types: value name -> TensorProto type
    types: dict[str, int] = field(default_factory=dict)
    sidecar: dict = field(default_factory=dict)


def read_onnx(path: str | Path) -> OnnxFile:
    """Parse and check an ONNX file (external data loaded), without converting it.

    Raises:
        UnsupportedModel: one line naming the problem (see the module's docs).
    """
    path = Path(path)
    what = path.name
    if not path.is_file():
        raise UnsupportedModel(f"{path}: no such file")
    data = path.read_bytes()
    try:
        proto = onnx.load_from_string(data)
    except (DecodeError, ValueError, RuntimeError) as e:
        raise UnsupportedModel(f"{what} is not an ONNX model, or is truncated ({_line(e)})") from None
    if not proto.graph.node or not proto.opset_import or proto.ir_version <= 0:
        raise UnsupportedModel(f"{what} is not an ONNX model, or is truncated: it holds no graph"
                               if data else f"{what} is empty: not an ONNX model")
    _load_external(proto, path)
    try:
        onnx.checker.check_model(proto)
    except Exception as e:  # checker raises ValidationError, and C++ errors as others
        raise UnsupportedModel(f"{what} is not a valid ONNX model: {_line(e)}") from None
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise UnsupportedModel(f"{what} uses opset {opset}; edgerev imports opsets {MIN_OPSET} to {MAX_OPSET} "
                               f"(see {OPS_PAGE})")
    for node in proto.graph.node:
        if node.domain not in ("", "ai.onnx"):
            raise UnsupportedModel(f"{what}: node {node.name!r} ({node.domain}.{node.op_type}) is not supported: "
                                   f"see {OPS_PAGE} for the ops edgerev imports")
    for t in proto.graph.initializer:
        if t.data_type not in INITIALIZER_TYPES:
            raise UnsupportedModel(f"{what}: initializer {t.name!r} holds {_type(t.data_type)}; edgerev imports "
                                   f"float32 models (see {OPS_PAGE})")
    file = OnnxFile(proto=proto, what=what, opset=opset, sidecar=_sidecar(path))
    _infer(file)
    return file


def graph_inputs(proto: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The graph's real inputs (IR < 4 lists initializers as inputs too)."""
    inits = {t.name for t in proto.graph.initializer}
    return [i for i in proto.graph.input if i.name not in inits]


def read_io(file: OnnxFile) -> OnnxIO:
    """The original's interface; refuses anything but one float32 image input and one output."""
    what, graph = file.what, file.proto.graph
    inputs = graph_inputs(file.proto)
    if len(inputs) != 1:
        names = ", ".join(repr(i.name) for i in inputs)
        raise UnsupportedModel(f"{what} has {len(inputs)} inputs ({names}); edgerev imports models with one "
                               "image input")
    if len(graph.output) != 1:
        names = ", ".join(repr(o.name) for o in graph.output)
        raise UnsupportedModel(f"{what} has {len(graph.output)} outputs ({names}); edgerev imports classifiers "
                               "with one output of scores")
    x = inputs[0]
    elem = x.type.tensor_type.elem_type
    if elem != TensorProto.FLOAT:
        raise UnsupportedModel(f"{what}: input {x.name!r} holds {_type(elem)}; edgerev imports float32 image inputs")
    dims = x.type.tensor_type.shape.dim
    if len(dims) != 4:
        raise UnsupportedModel(f"{what}: input {x.name!r} has {len(dims)} dimensions; an image input has 4 "
                               "(batch, channels, height, width or batch, height, width, channels)")
    shape = tuple(d.dim_value if d.HasField("dim_value") else None for d in dims)
    # the channel axis is the small one; NCHW unless only the last axis looks like channels
    layout = "NHWC" if shape[3] in (1, 3, 4) and shape[1] not in (1, 3, 4) else "NCHW"
    if (shape[1] if layout == "NCHW" else shape[3]) is None:
        raise UnsupportedModel(f"{what}: input {x.name!r} has a dynamic channel count; edgerev needs it fixed")
    batch_name = dims[0].dim_param or "batch"
    fixed_batch = dims[0].dim_value if dims[0].HasField("dim_value") else None
    shape = (None,) + shape[1:]  # the batch is dynamic in the import, whatever the file fixed
    out = graph.output[0]
    out_shape = tuple(d.dim_value if d.HasField("dim_value") else None for d in out.type.tensor_type.shape.dim)
    meta = {p.key: p.value for p in file.proto.metadata_props}
    side = file.sidecar
    classes = side.get("classes") or _json_list(meta.get("classes"))
    mean, std = side.get("mean") or _json_list(meta.get("mean")), side.get("std") or _json_list(meta.get("std"))
    return OnnxIO(input_name=x.name, input_shape=shape, layout=layout, dtype="float32", output_names=(out.name,),
                  output_shape=out_shape, batch_name=batch_name, opset=file.opset,
                  classes=tuple(str(c) for c in classes or ()), mean=tuple(float(m) for m in mean or ()),
                  std=tuple(float(s) for s in std or ()), resize=side.get("resize"), fixed_batch=fixed_batch)


def sidecar_path(path: str | Path) -> Path:
    """``model.onnx.json`` beside ``model.onnx``: classes, mean, std and resize, for files that do not carry them."""
    path = Path(path)
    return path.with_name(path.name + ".json")


def _sidecar(path: Path) -> dict:
    side = sidecar_path(path)
    if not side.is_file():
        return {}
    try:
        data = json.loads(side.read_text())
    except (ValueError, OSError) as e:
        raise UnsupportedModel(f"{side.name}: not a JSON object of preprocessing ({_line(e)})") from None
    if not isinstance(data, dict) or set(data) - {"classes", "mean", "std", "resize"}:
        raise UnsupportedModel(f"{side.name}: a JSON object with keys classes, mean, std, resize expected")
    return data


def _json_list(text: str | None) -> list | None:
    try:
        value = json.loads(text) if text else None
    except ValueError:
        return None
    return value if isinstance(value, list) else None


def _load_external(proto: onnx.ModelProto, path: Path) -> None:
    """Load external tensor data beside ``path``, refusing a missing or short file before onnx reads it."""
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    folder = path.parent.resolve()
    for t in _get_all_tensors(proto):
        if not uses_external_data(t):
            continue
        info = {e.key: e.value for e in t.external_data}
        file = (folder / info.get("location", "")).resolve()
        if folder not in file.parents:
            raise UnsupportedModel(f"{path.name}: external data of {t.name!r} lies outside the model's folder")
        if not file.is_file():
            raise UnsupportedModel(f"{path.name}: external data file {info.get('location')!r} of initializer "
                                   f"{t.name!r} is missing")
        end = int(info.get("offset", 0)) + int(info.get("length", 0))
        if file.stat().st_size < end:
            raise UnsupportedModel(f"{path.name}: external data file {info.get('location')!r} is truncated "
                                   f"({file.stat().st_size} bytes, {t.name!r} ends at {end})")
    onnx.load_external_data_for_model(proto, str(folder))


def _infer(file: OnnxFile) -> None:
    """Shapes and types of every value, with the batch dynamic even where the file fixed it."""
    proto = file.proto
    inputs = graph_inputs(proto)
    if len(inputs) == 1 and len(inputs[0].type.tensor_type.shape.dim) > 0:
        first = inputs[0].type.tensor_type.shape.dim[0]
        if first.HasField("dim_value"):  # infer on a copy whose batch is a symbol
            proto = onnx.ModelProto()
            proto.CopyFrom(file.proto)
            del proto.graph.value_info[:]
            fixed = first.dim_value
            for v in [graph_inputs(proto)[0], *proto.graph.output]:
                dims = v.type.tensor_type.shape.dim
                if dims and dims[0].HasField("dim_value") and dims[0].dim_value == fixed:
                    dims[0].dim_param = "batch"
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=True, data_prop=True)
    except Exception as e:  # InferenceError, and C++ errors as others
        raise UnsupportedModel(f"{file.what}: shapes cannot be inferred: {_line(e)}") from None
    g = inferred.graph
    for v in list(g.input) + list(g.value_info) + list(g.output):
        tt = v.type.tensor_type
        file.types[v.name] = tt.elem_type
        if tt.HasField("shape"):
            file.shapes[v.name] = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                                        for d in tt.shape.dim)
    for t in g.initializer:
        file.types[t.name] = t.data_type
        file.shapes[t.name] = tuple(t.dims)


def initializers(proto: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The initializers as numpy arrays."""
    return {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}


def _type(elem: int) -> str:
    try:
        return TensorProto.DataType.Name(elem).lower()
    except ValueError:
        return f"element type {elem}"


def _line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__

"""Reading an ONNX file for import, and every refusal that needs no conversion: one line, nothing run.

A file is refused when it is not ONNX (it does not parse, or parses to something without a graph), is
truncated, names external data that is missing or short, uses an opset outside :data:`MIN_OPSET` to the newest
the installed ``onnx`` knows, has more than one input or output, or an input that is not a float32 image.
Op by op refusals (unsupported op, data type, a shape that is not constant) come from the conversion, which also
runs before anything trains.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto, numpy_helper

from edgerev.errors import UnsupportedModel
from edgerev.models.onnx_import.signature import OnnxIO
from edgerev.models.trust import confined

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
    sidecar_name: str = ""  # how messages name the sidecar


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
    file = OnnxFile(proto=proto, what=what, opset=opset, sidecar=_sidecar(path), sidecar_name=sidecar_path(path).name)
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
    pre = {**_metadata(file), **{k: (v, f"{file.sidecar_name}: {k}") for k, v in file.sidecar.items() if v}}
    classes, mean, std = (pre.get(k, ((), ""))[0] for k in ("classes", "mean", "std"))
    channels = shape[1] if layout == "NCHW" else shape[3]
    if len(mean) != len(std):
        raise UnsupportedModel(f"{pre['std' if 'std' in pre else 'mean'][1]}: {len(std)} values of std for "
                               f"{len(mean)} of mean; one of each per channel expected")
    if mean and len(mean) != channels:
        raise UnsupportedModel(f"{pre['mean'][1]}: {len(mean)} values for {channels} input channels")
    return OnnxIO(input_name=x.name, input_shape=shape, layout=layout, dtype="float32", output_names=(out.name,),
                  output_shape=out_shape, batch_name=batch_name, opset=file.opset, classes=tuple(map(str, classes)),
                  mean=tuple(float(m) for m in mean), std=tuple(float(s) for s in std),
                  resize=file.sidecar.get("resize"), fixed_batch=fixed_batch)


def check_classifier(file: OnnxFile) -> None:
    """Refuse a graph whose one output is not a classifier's: one row of scores per image, ``(batch, classes)``.

    Raises:
        UnsupportedModel: naming the output, the node that computes it and its rank.
    """
    out = file.proto.graph.output[0].name
    shape = file.shapes.get(out)
    if shape is not None and len(shape) == 2:
        return
    node = next((n for n in file.proto.graph.node if out in n.output), None)
    by = f" of node {node.name!r} ({node.op_type})" if node is not None else ""
    rank = "a shape that cannot be inferred" if shape is None else f"{len(shape)} dimensions {_dims(shape)}"
    raise UnsupportedModel(f"{file.what}: output {out!r}{by} has {rank}; edgerev trains classifiers, whose output "
                           f"is one row of scores per image (batch, classes)")


def _dims(shape: tuple) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"


def sidecar_path(path: str | Path) -> Path:
    """``model.onnx.json`` beside ``model.onnx``: classes, mean, std and resize, for files that do not carry them."""
    path = Path(path)
    return path.with_name(path.name + ".json")


#: what a sidecar (or the file's metadata) may say, and how each is checked
PREPROCESSING = ("classes", "mean", "std", "resize")


def _sidecar(path: Path) -> dict:
    """The sidecar beside ``path`` (read only inside its folder), each key checked; ``{}`` when there is none."""
    side = sidecar_path(path)
    if not side.is_file() and not side.is_symlink():
        return {}
    confined(path.parent, side.name, side.name)
    try:
        data = json.loads(side.read_text())
    except (ValueError, OSError, RecursionError) as e:
        raise UnsupportedModel(f"{side.name}: not a JSON object of preprocessing ({_line(e)})") from None
    if not isinstance(data, dict) or set(data) - set(PREPROCESSING):
        raise UnsupportedModel(f"{side.name}: a JSON object with keys {', '.join(PREPROCESSING)} expected")
    for key, value in data.items():
        if value is not None:
            _check_preprocessing(key, value, f"{side.name}: {key}")
    return data


def _metadata(file: OnnxFile) -> dict[str, tuple[list, str]]:
    """``classes``, ``mean`` and ``std`` from the file's metadata, each checked, with where it came from.

    A value that is not a JSON list is another tool's convention and is left alone; a JSON list is edgerev's,
    and is refused when its entries are not what the key needs (a sidecar overrides the file's metadata).
    """
    meta = {p.key: p.value for p in file.proto.metadata_props}
    out = {}
    for key in ("classes", "mean", "std"):
        value = _json_list(meta.get(key))
        if value:
            where = f"{file.what}: metadata {key}"
            _check_preprocessing(key, value, where, f" (a sidecar {file.sidecar_name} overrides the file's metadata)")
            out[key] = (value, where)
    return out


def _check_preprocessing(key: str, value, where: str, hint: str = "") -> None:
    """``classes``: distinct non-empty names (or integers); ``mean``, ``std``: finite numbers (``std`` positive);
    ``resize``: a positive integer."""
    def bad(expected: str):
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise UnsupportedModel(f"{where}: {expected} expected, got {shown}{hint}")

    if key == "classes":  # names, or numbers as some exporters write them (read as their text)
        if not isinstance(value, list) or not all(isinstance(c, str) and c or type(c) is int for c in value) \
                or len({str(c) for c in value}) != len(value):
            bad("a list of distinct, non-empty class names")
    elif key in ("mean", "std"):
        if not isinstance(value, list) or not all(_finite(v) and (key == "mean" or v > 0) for v in value):
            bad("a list of finite numbers, one per channel" + (", each above 0" if key == "std" else ""))
    elif not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):  # resize
        bad("a positive integer (the side images are resized to)")


def _finite(v) -> bool:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _json_list(text: str | None) -> list | None:
    try:
        value = json.loads(text) if text else None
    except (ValueError, RecursionError):
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
        where = f"{path.name}: external data of {t.name!r}"
        location = info.get("location", "")
        file = confined(folder, location, f"{where}: location")
        span = {}
        for key in ("offset", "length"):
            text = info.get(key, "0")
            if not (text.isascii() and text.isdigit()):
                raise UnsupportedModel(f"{where}: {key}: a number of bytes expected, got {text!r}")
            span[key] = int(text)
        if not file.is_file():
            raise UnsupportedModel(f"{path.name}: external data file {location!r} of initializer "
                                   f"{t.name!r} is missing")
        end = span["offset"] + span["length"]
        if file.stat().st_size < end:
            raise UnsupportedModel(f"{path.name}: external data file {location!r} is truncated "
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

"""Model files for the trust-boundary tests: a model directory of any description, a tiny ONNX classifier."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from safetensors.numpy import save

VALID_INFO = {"arch": "revnext", "classes": ["a", "b"], "input_size": 8, "mean": [0.5] * 3, "std": [0.25] * 3}


def model_directory(folder: Path, described: dict | str, weights: bytes | None = None) -> Path:
    """``folder`` holding ``model.json`` (``described``, a dict with the hash of ``weights`` added, or the text
    as it is) and ``model.safetensors`` (``weights``: a one-tensor file by default)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = save({"x": np.zeros(1, np.float32)}) if weights is None else weights
    (folder / "model.safetensors").write_bytes(data)
    if isinstance(described, dict):
        described = json.dumps({"weights_sha256": hashlib.sha256(data).hexdigest(), **described})
    (folder / "model.json").write_text(described)
    return folder


def classifier(out_rank: int = 2) -> onnx.ModelProto:
    """A tiny image classifier X [N, 3, 8, 8] -> Y [N, 3] (Conv, GlobalAveragePool, Flatten, Gemm); with
    ``out_rank`` 4 its output is the convolution's feature map instead (not a classifier)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float32), "G"),
             numpy_helper.from_array(np.zeros(3, np.float32), "B")]
    nodes = [helper.make_node("Conv", ["X", "W"], ["c"], name="conv", pads=[1, 1, 1, 1])]
    if out_rank == 2:
        nodes += [helper.make_node("GlobalAveragePool", ["c"], ["g"], name="pool"),
                  helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
                  helper.make_node("Gemm", ["f", "G", "B"], ["Y"], name="head", transB=1)]
        out = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 3])
    else:
        nodes[0].output[0] = "Y"
        out = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 4, 8, 8])
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3, 8, 8])
    graph = helper.make_graph(nodes, "g", [x], [out], initializer=inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def save_onnx(m: onnx.ModelProto, path: Path, sidecar: dict | None = None, metadata: dict | None = None) -> Path:
    """``m`` written to ``path``, with ``metadata`` (values as given: strings) and a sidecar ``path.json``."""
    m = onnx.ModelProto.FromString(m.SerializeToString())
    for k, v in (metadata or {}).items():
        m.metadata_props.add(key=k, value=v)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(m, str(path))
    if sidecar is not None:
        path.with_name(path.name + ".json").write_text(json.dumps(sidecar))
    return path


def with_external_data(path: Path, **fields: str) -> Path:
    """``path`` rewritten with its initializers in ``path.data`` beside it, their external-data fields then set
    to ``fields`` (``offset``, ``length``, ``location``: as the file holds them, strings)."""
    m = onnx.load(str(path))
    onnx.save(m, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=0)
    m = onnx.load(str(path), load_external_data=False)
    for t in m.graph.initializer:
        entries = {e.key: e.value for e in t.external_data}
        entries.update(fields)
        del t.external_data[:]
        for k, v in entries.items():
            t.external_data.add(key=k, value=v)
    onnx.save(m, str(path))
    return path

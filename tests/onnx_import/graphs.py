"""Tiny ONNX graphs built with onnx.helper, and running them with ONNX Runtime or onnx's reference evaluator.

ONNX Runtime 1.19 (the last release with training, which the suite installs) loads opsets up to 21 and IR up to
10; files of a newer opset are run by onnx's own reference implementation instead.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from edgerev.models.onnx_import import MAX_OPSET, load_onnx

ORT_MAX_OPSET = 21
#: the opsets every op is tested at: the oldest imported, the newest ONNX Runtime 1.19 runs, the newest onnx writes
OPSETS = sorted({13, ORT_MAX_OPSET, MAX_OPSET})
INT64_MAX = 2**63 - 1


def init(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def model(nodes, shape, *, inits=(), opset: int = 13, out_shape=None, out_name="Y", in_name="X",
          in_type=TensorProto.FLOAT, extra_inputs=()) -> onnx.ModelProto:
    """A model of ``nodes`` from input ``X`` (batch dynamic, named ``N``) to output ``Y``."""
    x = helper.make_tensor_value_info(in_name, in_type, ["N", *shape[1:]])
    y = helper.make_tensor_value_info(out_name, TensorProto.FLOAT, out_shape)
    graph = helper.make_graph(nodes, "g", [x, *extra_inputs], [y], initializer=list(inits))
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8 if opset <= 17 else 10 if opset <= ORT_MAX_OPSET else onnx.IR_VERSION
    if out_shape is None:  # the inferred shape, as an exporter writes it
        inferred = onnx.shape_inference.infer_shapes(m, strict_mode=True, data_prop=True)
        m.graph.output[0].CopyFrom(inferred.graph.output[0])
    return m


def save(m: onnx.ModelProto, path: Path) -> Path:
    onnx.save(m, str(path))
    return path


def run_reference(m: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """The model's output from ONNX Runtime where it loads the opset, else from onnx's reference evaluator."""
    opset = next(o.version for o in m.opset_import if o.domain == "")
    name = m.graph.input[0].name
    if opset <= ORT_MAX_OPSET:
        import onnxruntime as ort

        session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        return session.run(None, {name: x})[0]
    from onnx.reference import ReferenceEvaluator

    return np.asarray(ReferenceEvaluator(m).run(None, {name: x})[0])


def imported_output(path: Path, x: np.ndarray) -> np.ndarray:
    """The imported model's output in eval mode, with the Softmax the import left out put back."""
    net = load_onnx(path)
    with torch.no_grad():
        y = net(torch.from_numpy(x))
        if net.io.softmax_axis is not None:
            y = torch.softmax(y, net.io.softmax_axis)
    return y.numpy()


def assert_matches(m: onnx.ModelProto, tmp_path: Path, x: np.ndarray, atol: float = 1e-5) -> None:
    path = save(m, tmp_path / "m.onnx")
    expected = run_reference(m, x)
    got = imported_output(path, x)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, atol=atol, rtol=1e-5)


def node(op: str, inputs, outputs=("Y",), **attrs) -> onnx.NodeProto:
    # named by op and output (unique in SSA form): a graph may hold two nodes of one op
    name = f"{op.lower()}_node" if list(outputs) == ["Y"] else f"{op.lower()}_{outputs[0]}"
    return helper.make_node(op, list(inputs), list(outputs), name=name, **attrs)

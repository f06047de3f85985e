"""ONNX graph surgery for head fine-tuning: find the head, cut the backbone off, swap the head's weights.

An edgerev export ends in one ``Gemm(features, head.weight, head.bias) -> logits`` (the model's
``nn.Linear`` head; both exporters write it so). Cutting the graph at ``features`` gives a backbone
that turns images into ``[B, F]`` features and a head small enough to train with ONNX Runtime.

Also here: the two repairs ONNX Runtime 1.19 needs from files that newer tools write (IR <= 10;
batch normalization in inference mode with one output). onnx and numpy only, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgerev.errors import ExportError

MAX_IR = 10


@dataclass(frozen=True)
class Head:
    """Where the linear head sits in a graph.

    Attributes:
        node: index of the ``Gemm`` node in ``graph.node``.
        features: name of its input tensor ``[B, F]``.
        weight, bias: names of its initializers.
        trans_b: True when the weight is stored ``[classes, F]`` (``transB=1``, as ``nn.Linear`` keeps it).
        output: name of the logits tensor.
        softmax: index of a final ``Softmax`` over the classes that the logits feed (a file that outputs
            probabilities: an ONNX import's export keeps the original's), or None.
    """

    node: int
    features: str
    weight: str
    bias: str
    trans_b: bool
    output: str
    softmax: int | None = None


def lower_ir(model: onnx.ModelProto) -> onnx.ModelProto:
    """Set the IR version to at most 10, the newest ONNX Runtime 1.19 loads (in place; returns ``model``).

    onnx >= 1.18 stamps IR 11+ on every model it builds (training artifacts included) although
    these graphs use nothing newer.
    """
    if model.ir_version > MAX_IR:
        model.ir_version = MAX_IR
    return model


def drop_extra_bn_outputs(model: onnx.ModelProto) -> int:
    """Give every inference-mode ``BatchNormalization`` its single output (in place); returns how many changed.

    An eval model exported through a training-mode path keeps the running-mean and running-variance
    outputs on its batch-norm nodes; in inference mode (``training_mode=0``) ONNX allows only ``Y``,
    and ONNX Runtime's training graph builder refuses the node.
    """
    used = {name for n in model.graph.node for name in n.input} | {o.name for o in model.graph.output}
    changed = 0
    for node in model.graph.node:
        if node.op_type != "BatchNormalization" or len(node.output) <= 1:
            continue
        training = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "training_mode"), 0)
        if training:
            continue
        extra = [o for o in node.output[1:] if o]
        if any(o in used for o in extra):
            raise ExportError(f"batch norm {node.name or node.output[0]} feeds its running statistics to the graph; "
                              "export the model in eval mode")
        del node.output[1:]
        changed += 1
    return changed


def give_head_a_bias(model: onnx.ModelProto, name: str = "head.bias") -> bool:
    """Give the ``Gemm`` that produces the logits a zero bias if the exporter wrote it without one.

    A head without a bias (the paper's RevNeXt) exports as ``Gemm(features, weight)``: the exporter
    drops a zero bias. Head fine-tuning trains a weight and a bias (:func:`find_head`), so the bias is
    put back as an initializer of zeros: the logits do not change. Returns whether one was added.
    """
    i, node = _logits_node(model)
    inits = {t.name: t for t in model.graph.initializer}
    if node is None or node.op_type != "Gemm" or len(node.input) != 2 or node.input[1] not in inits:
        return False
    trans_b = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "transB"), 0)
    dims = list(inits[node.input[1]].dims)
    rows = dims[0] if trans_b else dims[1]
    while name in inits:
        name += "_"
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(rows, dtype=np.float32), name))
    node.input.append(name)
    return True


def _logits_node(model: onnx.ModelProto) -> tuple[int, onnx.NodeProto | None]:
    """The node that writes the logits (the graph's first output) and its index; ``(-1, None)``: no output,
    or no such node."""
    graph = model.graph
    if not graph.output:
        return -1, None
    return next(((i, n) for i, n in enumerate(graph.node) if graph.output[0].name in n.output), (-1, None))


def find_head(model: onnx.ModelProto) -> Head:
    """Locate the ``Gemm`` that produces the logits (the graph's first output).

    Raises:
        ExportError: the logits come from anything else (not an edgerev export).
    """
    graph = model.graph
    if not graph.output:
        raise ExportError("the ONNX graph has no output")
    logits = graph.output[0].name
    inits = {t.name for t in graph.initializer}
    i, node = _logits_node(model)
    softmax = None
    if node is not None and node.op_type == "Softmax" and _over_classes(node):
        # probabilities out: the head is the Gemm that feeds the Softmax, and nothing else reads its logits
        feeding = [(j, n) for j, n in enumerate(graph.node) if node.input[0] in n.output]
        readers = [n for n in graph.node if node.input[0] in n.input]
        if len(feeding) == 1 and len(readers) == 1:
            softmax, (i, node) = i, feeding[0]
    if node is not None:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        plain_gemm = (node.op_type == "Gemm" and len(node.input) == 3 and attrs.get("transA", 0) == 0
                      and attrs.get("alpha", 1.0) == 1.0 and attrs.get("beta", 1.0) == 1.0)
        if plain_gemm and node.input[1] in inits and node.input[2] in inits:
            return Head(node=i, features=node.input[0], weight=node.input[1], bias=node.input[2],
                        trans_b=bool(attrs.get("transB", 0)), output=node.output[0], softmax=softmax)
    raise ExportError(f"the logits {logits!r} do not come from a linear head (Gemm with weight and bias): "
                      "not a model written by 'edgerev export'")


def _over_classes(node: onnx.NodeProto) -> bool:
    """A Softmax of ``[B, classes]`` scores over the classes (axis 1 or -1; opsets before 13 default to 1)."""
    axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), None)
    return axis in (None, 1, -1)


def head_weights(model: onnx.ModelProto, head: Head) -> tuple[np.ndarray, np.ndarray]:
    """``(weight [classes, F], bias [classes])`` of the head, as float32 copies."""
    inits = {t.name: t for t in model.graph.initializer}
    w = numpy_helper.to_array(inits[head.weight]).astype(np.float32)
    b = numpy_helper.to_array(inits[head.bias]).astype(np.float32)
    if not head.trans_b:
        w = w.T
    return np.ascontiguousarray(w), b.copy()


def backbone(model: onnx.ModelProto, head: Head) -> onnx.ModelProto:
    """A copy of ``model`` without its head: images in, ``[B, F]`` features out."""
    w, _ = head_weights(model, head)
    cut = onnx.ModelProto()
    cut.CopyFrom(model)
    graph = cut.graph
    for index in sorted({head.node, head.softmax} - {None}, reverse=True):  # the later first: indices stay valid
        del graph.node[index]
    for name in (head.weight, head.bias):
        if not any(name in n.input for n in graph.node):
            keep = [t for t in graph.initializer if t.name != name]
            del graph.initializer[:]
            graph.initializer.extend(keep)
    batch = graph.input[0].type.tensor_type.shape.dim[0]
    batch_dim = batch.dim_param or (batch.dim_value if batch.dim_value else "batch")
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info(head.features, TensorProto.FLOAT, [batch_dim, w.shape[1]]))
    return cut


def head_model(weight: np.ndarray, bias: np.ndarray, head: Head, opset: int = 17) -> onnx.ModelProto:
    """The head alone: ``Gemm(features, weight, bias, transB=1) -> logits``, initializers named as in the full model."""
    classes, features = weight.shape
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["features", head.weight, head.bias], ["logits"], transB=1)], "head",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", features])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])],
        [numpy_helper.from_array(weight.astype(np.float32), head.weight),
         numpy_helper.from_array(bias.astype(np.float32), head.bias)])
    return lower_ir(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))


def with_head(model: onnx.ModelProto, head: Head, weight: np.ndarray, bias: np.ndarray) -> onnx.ModelProto:
    """A copy of ``model`` whose head initializers hold ``weight [classes, F]`` and ``bias``."""
    old_w, old_b = head_weights(model, head)
    if weight.shape != old_w.shape or bias.shape != old_b.shape:
        raise ExportError(f"new head {weight.shape}/{bias.shape} does not fit the model's {old_w.shape}/{old_b.shape}")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    stored = weight if head.trans_b else weight.T
    for t in out.graph.initializer:
        if t.name == head.weight:
            t.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(stored, dtype=np.float32), head.weight))
        elif t.name == head.bias:
            t.CopyFrom(numpy_helper.from_array(bias.astype(np.float32), head.bias))
    return out

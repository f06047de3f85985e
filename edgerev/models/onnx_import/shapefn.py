"""Values a file computes from its input's shape alone, evaluated when the model runs.

Some exporters write tensors that depend on the batch but on no pixel: EdgeNeXt's Fourier positional encoding is
``ConstantOfShape([batch, h, w]) -> CumSum -> Sin, Cos -> Concat``, and the dynamo exporter writes ``as_strided``
as a ``Gather`` whose indices come from ``Range(0, batch * n)``. They do not fold at import (the batch is not
known) and are not run-time data either. :class:`ShapeFunction` is such a value: the subgraph that computes it,
evaluated by onnx's reference implementation (:mod:`onnx.reference`) once for each input shape the model meets,
kept, and given to the graph as a tensor; on tensors without data (the planner's meta and fake tensors) a tensor
of its shape and type.
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper
from torch import Tensor, nn

from edgerev._torchapi import is_fake
from edgerev.models.onnx_import.fold import ShapeValue, Sym

#: the sizes a shape function keeps its values for at once (one per micro-batch size a run meets, and a few)
CACHED_SHAPES = 8


class ShapeFunction(nn.Module):
    """One value of a file computed from the sizes of some of its tensors (see the module docstring).

    Args:
        model: the subgraph as an ONNX model: an int64 input per shape value it reads, its constants as
            initializers, the value as its one output.
        feeds: per input of ``model``, its entries: an ``int``, or ``(k, scale)``: ``scale`` times the ``k``-th
            size given to :meth:`forward`; and whether the input is a scalar.
        axes: the axis of each tensor given to :meth:`forward` whose size is read.
    """

    #: a graph capture keeps it whole (:mod:`edgerev.memory.graph`): its forward reads sizes as Python numbers
    graph_leaf = True

    def __init__(self, model: onnx.ModelProto, feeds: dict[str, tuple[tuple, bool]], axes: tuple[int, ...]) -> None:
        super().__init__()
        self.model_bytes = model.SerializeToString()
        self.feeds, self.axes = feeds, axes
        self._values: dict[tuple[int, ...], np.ndarray] = {}
        self._tensors: dict[tuple, Tensor] = {}

    def __deepcopy__(self, memo):  # the kept values are not copied: a copy computes its own
        return ShapeFunction(onnx.load_from_string(self.model_bytes), self.feeds, self.axes)

    def extra_repr(self) -> str:
        return f"reads {len(self.axes)} size(s)"

    def values(self, sizes: tuple[int, ...]) -> np.ndarray:
        """The value for these sizes (numpy, as the file computes it)."""
        if sizes not in self._values:
            from onnx.reference import ReferenceEvaluator

            inputs = {}
            for name, (entries, scalar) in self.feeds.items():
                a = np.array([e if isinstance(e, int) else sizes[e[0]] * e[1] for e in entries], dtype=np.int64)
                inputs[name] = a.reshape(()) if scalar else a
            (out,) = ReferenceEvaluator(onnx.load_from_string(self.model_bytes)).run(None, inputs)
            if len(self._values) >= CACHED_SHAPES:
                self._values.clear()
                self._tensors.clear()
            self._values[sizes] = np.asarray(out)
        return self._values[sizes]

    def forward(self, *tensors: Tensor) -> Tensor:
        sizes = tuple(int(t.shape[a]) for t, a in zip(tensors, self.axes, strict=True))
        value = self.values(sizes)
        dtype = _TORCH_DTYPES.get(value.dtype.kind, torch.float32)
        device = tensors[0].device
        if is_fake(tensors[0]):
            return torch.empty(value.shape, dtype=dtype, device=device)
        key = (sizes, device)
        if key not in self._tensors:
            self._tensors[key] = torch.from_numpy(np.ascontiguousarray(value)).to(device, dtype)
        return self._tensors[key]


#: a computed value's torch type, by numpy's kind: floats run as the import's float32, integers as int64
_TORCH_DTYPES = {"f": torch.float32, "i": torch.int64, "u": torch.int64, "b": torch.bool}


def shape_function(name: str, nodes: list[onnx.NodeProto], constants: dict[str, np.ndarray],
                   shapes: dict[str, ShapeValue], opset: int) -> tuple[ShapeFunction, list[tuple[str, int]]]:
    """The :class:`ShapeFunction` of value ``name`` computed by ``nodes`` (in graph order) from ``constants`` and
    the shape values ``shapes``; with the ``(tensor, axis)`` pairs whose sizes it reads, in the order its
    :meth:`~ShapeFunction.forward` takes the tensors."""
    reads: list[tuple[str, int]] = []
    feeds: dict[str, tuple[tuple, bool]] = {}
    for key, value in shapes.items():
        entries = []
        for e in value.entries:
            if isinstance(e, Sym):
                if (e.tensor, e.axis) not in reads:
                    reads.append((e.tensor, e.axis))
                entries.append((reads.index((e.tensor, e.axis)), e.scale))
            else:
                entries.append(int(e))
        feeds[key] = (tuple(entries), value.scalar)
    inputs = [helper.make_tensor_value_info(k, onnx.TensorProto.INT64, [] if v.scalar else [len(v.entries)])
              for k, v in shapes.items()]
    graph = helper.make_graph(nodes, "shape_function", inputs, [helper.make_empty_tensor_value_info(name)],
                              initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in constants.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return ShapeFunction(model, feeds, tuple(a for _, a in reads)), reads

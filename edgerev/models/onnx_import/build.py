"""From an ONNX file to an :class:`ImportedModel`, node by node, refusing what it cannot train before it runs.

No maintained converter fits: onnx2torch has had no release since 2024 and does not train batch norm;
onnx2pytorch runs batch norm on its inference statistics. This one builds a ``torch.fx`` graph directly: each
node's converter (:mod:`~edgerev.models.onnx_import.ops`) adds torch ops, constants and shape arithmetic fold at
import (:mod:`~edgerev.models.onnx_import.fold`), and every refusal names the node, its op type and the page that
lists the supported ops.
"""

from __future__ import annotations

import math
import operator
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.fx as fx
from onnx import TensorProto, helper
from torch import nn

from edgerev.errors import UnsupportedModel
from edgerev.models.onnx_import.fold import ShapeValue, Sym, evaluate, fold_shape_op, shape_entries
from edgerev.models.onnx_import.model import ImportedModel
from edgerev.models.onnx_import.ops import LAYER_OPS, OPS
from edgerev.models.onnx_import.read import OPS_PAGE, OnnxFile, check_classifier, initializers, read_io, read_onnx
from edgerev.models.onnx_import.shapefn import shape_function
from edgerev.models.onnx_import.signature import OnnxIO

#: the batches of the runs that read sizes shape inference left unknown (:meth:`Builder._probe`)
PROBE_BATCHES = (1, 2)


@dataclass(frozen=True)
class Unfolded:
    """A value of shape arithmetic that depends on a dynamic dimension in a way that does not fold: computed when
    the model runs, from the sizes it reads (:meth:`Builder.computed`), where a run-time op takes it."""

    node: str
    op: str


def load_onnx(path: str | Path, *, classifier: bool = False) -> ImportedModel:
    """Import an ONNX graph as a trainable :class:`ImportedModel` (train mode off: it starts in eval mode).

    Args:
        classifier: refuse a graph whose output is not one row of scores per image (``(batch, classes)``), as
            the trainer needs; the op-by-op tests import any graph.

    Raises:
        UnsupportedModel: one line naming the file, the node and its op type, before anything runs.
        edgerev.errors.TrustError: external data or the sidecar leads outside the file's folder.
    """
    file = read_onnx(path)
    io = read_io(file)
    if classifier:
        check_classifier(file)
    return Builder(file, io).build()


def check_onnx(path: str | Path) -> OnnxIO:
    """Refuse a file edgerev cannot import (see :func:`load_onnx`), or return its interface."""
    return load_onnx(path).io


def _identifier(name: str) -> str:
    name = re.sub(r"\W+", "_", name.strip("/")).strip("_")
    return f"n_{name}" if not name or name[0].isdigit() else name


class Builder:
    """The state of one import: the fx graph, its modules and constants, and each ONNX value's torch value."""

    def __init__(self, file: OnnxFile, io: OnnxIO) -> None:
        self.file, self.io = file, io
        self.graph = fx.Graph()
        self.root = nn.Module()
        self.env: dict[str, object] = {}
        self.links: dict[str, tuple[int, int, str]] = {}
        self.heads: list[str] = []
        self.fused: dict[str, fx.Node] = {}  # output of an Add folded into a Linear's bias -> that Linear's output
        self._names: set[str] = set()
        self._buffers: dict[int, fx.Node] = {}
        self._probed: dict[fx.Node, list] = {}  # each node's values in the runs of :meth:`_probe`
        self._inits = {t.name for t in file.proto.graph.initializer}
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        # a node by its first output (unique in SSA form; node names need not be, and protobuf wrappers change)
        self._index = {n.output[0]: i for i, n in enumerate(file.proto.graph.node)}
        self._producer = {o: n for n in file.proto.graph.node for o in n.output if o}
        self._computed: dict[str, fx.Node] = {}
        for node in file.proto.graph.node:
            for i in node.input:
                self.consumers[i].append(node)

    # ------------------------------------------------------------ what converters call

    def refuse(self, node: onnx.NodeProto, reason: str):
        raise UnsupportedModel(f"{self.file.what}: node {node.name!r} ({node.op_type}) {reason} (see {OPS_PAGE})")

    @staticmethod
    def attrs(node: onnx.NodeProto) -> dict:
        out = {}
        for a in node.attribute:
            v = helper.get_attribute_value(a)
            out[a.name] = v.decode() if isinstance(v, bytes) else v
        return out

    def value(self, name: str):
        return self.env.get(name) if name else None

    def const(self, node: onnx.NodeProto, i: int, what: str) -> np.ndarray:
        v = self.value(node.input[i])
        if isinstance(v, np.ndarray):
            return v
        self.refuse(node, f"needs a constant {what}, but {node.input[i]!r} is computed at run time")

    def tensor(self, name: str) -> fx.Node:
        v = self.env.get(name)
        if isinstance(v, fx.Node):
            return v
        if isinstance(v, np.ndarray):
            return self.buffer(v, key=name)
        if isinstance(v, (Unfolded, ShapeValue)):
            return self.computed(name)
        self.refuse(self.node, f"uses {name!r} as a tensor, but it is not computed by the graph")

    def computed(self, name: str) -> fx.Node:
        """Value ``name``, computed from shapes alone (an :class:`Unfolded` value or a :class:`ShapeValue`), as a
        tensor the model computes when it runs (:class:`~edgerev.models.onnx_import.shapefn.ShapeFunction`: the
        nodes that make it, evaluated once for each input shape)."""
        if name in self._computed:
            return self._computed[name]
        nodes, constants, shapes, seen, stack = {}, {}, {}, set(), [name]
        while stack:
            v = stack.pop()
            if not v or v in seen:
                continue
            seen.add(v)
            value = self.env.get(v)
            if isinstance(value, Unfolded):
                node = self._producer[v]
                nodes[self._index[node.output[0]]] = node
                stack.extend(node.input)
            elif isinstance(value, np.ndarray):
                constants[v] = value
            elif isinstance(value, ShapeValue):
                shapes[v] = value
            else:
                self.refuse(self.node, f"computes {name!r} from shapes and from {v!r}, which is neither")
        ordered = [nodes[k] for k in sorted(nodes)]
        out = name
        if not ordered:  # a shape value itself: the subgraph passes it through
            out = f"{name}__value"
            ordered = [helper.make_node("Identity", [name], [out])]
        fn, reads = shape_function(out, ordered, constants, shapes, self.file.opset)
        if not reads:  # nothing in it changes from run to run, yet it did not fold
            self.refuse(self.node, f"computes {name!r} from shapes in a way the import cannot evaluate")
        for tensor, _ in reads:
            if not isinstance(self.env.get(tensor), fx.Node):
                self.refuse(self.node, f"needs the size of {tensor!r} at run time, which the import cannot read")
        module = self.add_module(self._producer[name] if name in self._producer else self.node, fn)
        self._computed[name] = self.graph.call_module(module, tuple(self.env[t] for t, _ in reads))
        return self._computed[name]

    def buffer(self, a: np.ndarray, key: str | None = None) -> fx.Node:
        """A constant as a buffer of the model (kept in its state dict, not trained)."""
        cache = id(a) if key is None else key
        if cache not in self._buffers:
            name = f"const_{len(self._buffers)}"
            t = torch.from_numpy(np.ascontiguousarray(a).copy())
            self.root.register_buffer(name, t.float() if t.is_floating_point() else t)
            self._buffers[cache] = self.graph.get_attr(name)
        return self._buffers[cache]

    def add_module(self, node: onnx.NodeProto, module: nn.Module) -> str:
        base = _identifier(node.name or f"{node.op_type.lower()}_{len(self._names)}")
        name, k = base, 1
        while name in self._names:
            name, k = f"{base}_{k}", k + 1
        self._names.add(name)
        self.root.add_module(name, module)
        return name

    def call_module(self, name: str, x) -> fx.Node:
        return self.graph.call_module(name, (x,))

    def call(self, fn, *args, **kwargs) -> fx.Node:
        return self.graph.call_function(fn, args, kwargs)

    def link(self, key: str, node: onnx.NodeProto, index: int, how: str) -> None:
        """Where the export writes state ``key``: input ``index`` of ``node``, transformed by ``how``."""
        self.links[key] = (self._index[node.output[0]], index, how)

    def shape(self, name: str) -> tuple | None:
        """The inferred shape of ``name``; where inference left a size unknown that is not the batch (a Slice whose
        end is arithmetic on a shape, which onnx's data propagation does not follow), the sizes it has when the
        graph built so far runs (:meth:`_probe`)."""
        shape = self.file.shapes.get(name)
        if shape is not None and any(not (isinstance(d, int) and d > 0) and d != self.io.batch_name for d in shape):
            probed = self._probe(name, shape)
            if probed is not None:
                self.file.shapes[name] = shape = probed
        return shape

    def _probe(self, name: str, inferred: tuple) -> tuple | None:
        """``inferred`` with each unknown size read from two runs of the graph built so far, on zeros of batch 1
        and 2: a size the same in both is fixed, one that follows the batch is the batch; None when ``name`` is
        not computed from the input. The input's size is fixed, so every other size is too; the runs are kept
        (:attr:`_probed`) so each node runs once whatever the number of probes."""
        target = self.env.get(name)
        if not isinstance(target, fx.Node):
            return None
        self.root.eval()  # batch norm on its running statistics: a probe changes nothing
        with torch.no_grad():
            for n in self.graph.nodes:
                if n not in self._probed:
                    self._probed[n] = [self._run(n, k) for k in range(len(PROBE_BATCHES))]
        got = [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in self._probed[target]]
        if None in got or len({len(g) for g in got}) != 1 or len(got[0]) != len(inferred):
            return None
        out = []
        for d, *sizes in zip(inferred, *got):
            if isinstance(d, int) and d > 0 or d == self.io.batch_name:
                out.append(d)
            elif len(set(sizes)) == 1:
                out.append(sizes[0])
            else:
                out.append(self.io.batch_name if list(sizes) == list(PROBE_BATCHES) else d)
        return tuple(out)

    def _run(self, n: fx.Node, k: int):
        """Node ``n``'s value in probe run ``k``."""
        if n.op == "placeholder":
            return torch.zeros([PROBE_BATCHES[k] if d is None else d for d in self.io.input_shape])
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: self._probed[a][k])
        if n.op == "get_attr":
            return getattr(self.root, n.target)
        if n.op == "call_module":
            return self.root.get_submodule(n.target)(*args, **kwargs)
        if n.op == "call_method":
            return getattr(args[0], n.target)(*args[1:], **kwargs)
        return n.target(*args, **kwargs)

    def rank(self, name: str) -> int:
        shape = self.shape(name)
        if shape is None:
            self.refuse(self.node, f"takes {name!r}, whose rank cannot be inferred")
        return len(shape)

    def shape_entries(self, name: str) -> tuple | None:
        shape = self.shape(name)
        return None if shape is None else shape_entries(shape, name)

    def resolve_shape(self, node: onnx.NodeProto, entries: list, data: tuple | None) -> tuple:
        """A Reshape target for torch: the one dynamic dimension (the batch) becomes -1 where the data's other
        dimensions are fixed; otherwise the dynamic sizes are read from their tensors at run time."""
        syms = [e for e in entries if isinstance(e, Sym)]
        if not syms:
            return tuple(int(e) for e in entries)
        if data is not None and len(syms) == 1:
            dsyms = [e for e in data if isinstance(e, Sym)]
            if len(dsyms) == 1 and dsyms[0].name == syms[0].name and dsyms[0].scale == 1:
                known = math.prod(e for e in data if isinstance(e, int))
                fixed = math.prod(e for e in entries if isinstance(e, int) and e != -1) * syms[0].scale
                # per sample, the target must hold the data's elements: exactly, or with a whole -1 entry
                if known % fixed if -1 in entries else known != fixed:
                    self.refuse(node, f"reshapes {known} elements per sample into {_sizes(entries)}, "
                                      "which does not hold them")
                return tuple(-1 if isinstance(e, Sym) else (known // fixed if e == -1 else int(e)) for e in entries)
        out = []
        for e in entries:
            if isinstance(e, Sym):
                if not isinstance(self.env.get(e.tensor), fx.Node):
                    self.refuse(node, f"needs the size of {e.tensor!r} at run time, which the import cannot read")
                size = self.graph.call_method("size", (self.env[e.tensor], e.axis))
                e = size if e.scale == 1 else self.graph.call_function(operator.mul, (size, e.scale))
            out.append(e)
        return tuple(out)

    def bias_after(self, node: onnx.NodeProto, n: int):
        """The Add right after ``node`` that adds a bias initializer of ``n`` values, and that bias, if any."""
        out = node.output[0]
        users = self.consumers.get(out, [])
        if len(users) != 1 or users[0].op_type != "Add" or out in {o.name for o in self.file.proto.graph.output}:
            return None, None
        add = users[0]
        other = add.input[1] if add.input[0] == out else add.input[0]
        v = self.env.get(other)
        if other not in self._inits or not isinstance(v, np.ndarray) or v.size != n or v.ndim > 2:
            return None, None
        if v.ndim == 2 and v.shape[0] != 1:
            return None, None
        return (add, list(add.input).index(other)), v.reshape(-1).astype(np.float32)

    # ------------------------------------------------------------ the import

    def build(self) -> ImportedModel:
        proto, io = self.file.proto, self.io
        self.env.update(initializers(proto))
        self.env[io.input_name] = self.graph.placeholder(_identifier(io.input_name))
        output = proto.graph.output[0].name
        dropped = self._final_softmax(output)
        for node in proto.graph.node:
            self.node = node
            if node.output[0] in self.fused:
                self.env[node.output[0]] = self.fused[node.output[0]]
            elif dropped is not None and node is dropped:
                self.env[node.output[0]] = self.tensor(node.input[0])
            else:
                self._convert(node)
        self._probed.clear()
        result = self.env.get(output)
        if not isinstance(result, fx.Node):
            raise UnsupportedModel(f"{self.file.what}: output {output!r} does not depend on the input")
        self.graph.output(result)
        model = ImportedModel(self.root, self.graph, class_name="ImportedModel")
        if dropped is not None:
            axis = int(self.attrs(dropped).get("axis", -1))
            io = _replace(io, softmax_axis=axis)
        object.__setattr__(model, "io", io)
        object.__setattr__(model, "onnx_links", dict(self.links))
        object.__setattr__(model, "onnx_source", proto.SerializeToString())
        object.__setattr__(model, "head_name", self.heads[-1] if self.heads else None)
        return model.eval()

    def _final_softmax(self, output: str) -> onnx.NodeProto | None:
        """The Softmax over the classes that produces the output (probabilities), if any: training needs logits."""
        node = next((n for n in self.file.proto.graph.node if output in n.output), None)
        if node is None or node.op_type != "Softmax" or len(self.consumers.get(node.input[0], [])) != 1:
            return None
        rank = len(self.shape(output) or ())
        axis = int(self.attrs(node).get("axis", -1))
        return node if rank and axis in (-1, rank - 1) else None

    def _convert(self, node: onnx.NodeProto) -> None:
        args = [self.value(i) if i else None for i in node.input]
        present = [a for i, a in zip(node.input, args) if i]
        runtime = any(isinstance(a, fx.Node) for a in present)
        if not runtime and any(isinstance(a, Unfolded) for a in present):
            if node.op_type not in LAYER_OPS:
                self._mark_unfolded(node)
                return
            args = [self.computed(i) if isinstance(a, Unfolded) else a for i, a in zip(node.input, args)]
            present, runtime = [a for i, a in zip(node.input, args) if i], True
        if all(isinstance(a, np.ndarray) for a in present) and node.op_type != "Dropout":
            out = evaluate(node, present, self.file.opset)
            if out is not None:
                self.env.update(zip(node.output, out))
                return
        if node.op_type == "Shape":
            self._shape(node)
            return
        if not runtime and any(isinstance(a, ShapeValue) for a in present):
            folded = fold_shape_op(node, args, self.attrs(node))
            if folded is None:
                self._mark_unfolded(node)
            else:
                self.env[node.output[0]] = folded.array() if isinstance(folded, ShapeValue) and folded.static \
                    else folded
            return
        convert = OPS.get(node.op_type)
        if convert is None:
            self.refuse(node, "is not supported")
        for o in node.output:
            t = self.file.types.get(o, 0)
            if o and t not in (0, TensorProto.FLOAT) and self.consumers.get(o):
                name = TensorProto.DataType.Name(t).lower()
                self.refuse(node, f"computes {name} at run time; edgerev imports float32 graphs")
        self.env.update(zip(node.output, convert(self, node)))

    def _shape(self, node: onnx.NodeProto) -> None:
        entries = self.shape_entries(node.input[0])
        if entries is None:
            self.refuse(node, f"reads the shape of {node.input[0]!r}, which cannot be inferred")
        a = self.attrs(node)
        n = len(entries)
        start, end = a.get("start", 0), a.get("end", n)
        start, end = (max(0, min(n, v + n if v < 0 else v)) for v in (start, end))
        value = ShapeValue(entries[start:end])
        self.env[node.output[0]] = value.array() if value.static else value

    def _mark_unfolded(self, node: onnx.NodeProto) -> None:
        for o in node.output:
            self.env[o] = Unfolded(node.name, node.op_type)


def _replace(io: OnnxIO, **changes) -> OnnxIO:
    from dataclasses import replace

    return replace(io, **changes)


def _sizes(entries: list) -> str:
    """A Reshape target as the refusal shows it: the batch's multiples by name."""
    return "[" + ", ".join(e.name if isinstance(e, Sym) and e.scale == 1 else f"{e.scale}*{e.name}"
                           if isinstance(e, Sym) else str(e) for e in entries) + "]"

"""Any classifier's graph as a chain of segments: Re-forwarding's reduction of a graph to a chain.

Feng and Huang (Re-forwarding, section 5) plan an arbitrary computation graph by first finding the
vertices every path from the input to the output passes through: between two of them the graph may
branch and join (a residual block, a squeeze-and-excitation gate), but nothing crosses them. A tensor
there is the only activation alive, so the network is a *chain* of pieces between such vertices, and
the linear-graph planner of :mod:`edgerev.memory.solve.segments` applies to it unchanged: each segment of
pieces is stored, checkpointed (re-run in the backward) or kept as an 8- or 4-bit copy.

:func:`capture` traces a module with ``torch.fx`` (the ops it calls, its submodules as leaves), or with
``torch.export`` where ``torch.fx`` cannot follow its Python (control flow on shapes). In-place ops
become out-of-place ones first: a re-run segment must find its input as the forward did.
:func:`cut_points` walks the graph in its (topological) order and cuts after node ``n`` where ``n`` is
the only activation still needed later. Parameters and constants are not activations: each piece
reads the ones it uses.

:class:`ChainModel` runs the pieces. It shares every module, parameter and buffer with the model it
was made from, so training it trains that model, which stays what is saved and exported. Its
leading pieces with no trainable parameter (a frozen backbone) run under ``no_grad``: they keep no
activation and no gradient. The rest is an :class:`~edgerev.engine.InvertibleSequence` run as
checkpoint segments, which the planner (:func:`edgerev.memory.plan.autoplan.plan_training`) chooses
exactly as for :class:`~edgerev.models.base.SequentialModel`.
"""

from __future__ import annotations

import copy
import hashlib
import operator
import weakref

import torch
from torch import Tensor, fx, nn

from edgerev._torchapi import left_as_it_was
from edgerev.engine import Execution, InvertibleSequence, engine_body
from edgerev.errors import EdgerevError, UnsupportedModel, described
from edgerev.layers.base import replaying
from edgerev.memory.solve.costs import Segment
from edgerev.models.handle import describes

#: out-of-place twins of in-place functions that a traced graph may call
_OUT_OF_PLACE = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
                 operator.itruediv: operator.truediv}
#: ops whose result may share its input's storage: an in-place op on it would also change the input
_VIEWS = {"view", "view_as", "narrow", "transpose", "permute", "unsqueeze", "squeeze", "reshape", "expand",
          "expand_as", "select", "chunk", "split", "flatten", "unflatten", "t", "unbind", "__getitem__",
          "getitem", "as_strided", "diagonal", "movedim", "unfold", "contiguous", "detach"}


class GraphError(UnsupportedModel):
    """A model's graph cannot be captured or cut into a chain; the message names the node."""


# ---- capture ------------------------------------------------------------------------------------------------------


def capture(model: nn.Module, example: Tensor) -> fx.GraphModule:
    """``model`` as a graph of ops whose modules, parameters and buffers are ``model``'s own.

    ``torch.fx`` first; where it cannot follow the forward's Python, ``torch.export`` on ``example``
    (its shapes are then fixed but for nothing the chain needs: every piece is a function of its input).
    Either traces the model in training mode, whatever mode it is in: the graph is what a training step runs,
    and a forward's Python that asks ``self.training`` is fixed where it is traced (timm's ``BatchNormAct2d``
    chooses there between the batch's statistics and the running ones: a MobileOne given in eval mode trained
    as a network normalized by its running statistics, at a loss of 20 where the module's was 2.4).
    """
    # each module's mode as it was (a module in eval mode may hold batch norms in training), and the statistics
    # torch.export's run of the model moved
    with left_as_it_was(model):
        model.train()
        try:
            gm = fx.GraphModule(model, _Tracer().trace(model), type(model).__name__)
        except Exception as fx_error:  # noqa: BLE001 - any failure of the tracer means: try export
            try:
                gm = _export(model, example)
            except Exception as export_error:  # noqa: BLE001
                raise GraphError(f"cannot capture {type(model).__name__} as a graph: torch.fx failed "
                                 f"({described(fx_error)[:200]}) and torch.export failed "
                                 f"({described(export_error)[:200]})") from None
    _out_of_place(gm)
    return gm


class _Tracer(fx.Tracer):
    """torch.fx's tracer, with every batch norm a module of the graph, whatever package it comes from: timm's
    ``BatchNormAct2d`` traced through is a ``F.batch_norm`` call whose training flag and momentum are fixed where it
    was traced, so a checkpointed segment's re-run moved its running statistics a second time (``replaying`` sets a
    module's momentum to 0) and ``bn_stats: frozen`` (eval mode) did not reach it. A module whose class says
    ``graph_leaf = True`` is kept whole too: its forward reads sizes as Python numbers, which a trace cannot follow
    (an ONNX import's :class:`~edgerev.models.onnx_import.shapefn.ShapeFunction`)."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return (isinstance(m, nn.modules.batchnorm._BatchNorm) or getattr(type(m), "graph_leaf", False)
                or super().is_leaf_module(m, qualname))


def _export(model: nn.Module, example: Tensor) -> fx.GraphModule:
    """A graph from ``torch.export`` of ``model`` in training mode, its parameters and buffers rebound to
    ``model``'s own tensors, each training-mode batch norm a module again (so a re-run leaves its running statistics
    alone). Tracing runs the batch norms: the caller puts their statistics back (:func:`capture`)."""
    export = getattr(torch.export, "export_for_training", None) or torch.export.export  # torch 2.6: training IR
    batch = torch.export.Dim("batch")  # a batch of two: export specializes a dimension of size one
    exported = export(model, (example.expand(2, *example.shape[1:]).contiguous(),),
                      dynamic_shapes=({0: batch},), strict=False).module()
    graph = exported.graph
    graph._codegen = fx.graph.CodeGen()  # plain arguments and result instead of export's flattened ones
    out = next(n for n in graph.nodes if n.op == "output")
    if isinstance(out.args[0], (tuple, list)) and len(out.args[0]) == 1:
        out.args = (out.args[0][0],)
    gm = fx.GraphModule(exported, graph)  # a plain module again (the exported one refuses train())
    owned = dict(model.named_parameters(remove_duplicate=False))
    owned.update(dict(model.named_buffers(remove_duplicate=False)))
    for name, _ in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]:
        if name in owned:
            parent, _, leaf = name.rpartition(".")
            holder = gm.get_submodule(parent) if parent else gm
            if isinstance(owned[name], nn.Parameter):
                holder._parameters[leaf] = owned[name]
            else:
                holder._buffers[leaf] = owned[name]
    _batch_norms_as_modules(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


class _SharedBatchNorm(nn.modules.batchnorm._BatchNorm):
    """A batch norm over tensors another module owns (any rank: the exported op did not say)."""

    def __init__(self, weight, bias, mean, var, momentum: float, eps: float) -> None:
        nn.Module.__init__(self)
        self.affine, self.track_running_stats = weight is not None, True
        self.momentum, self.eps, self.num_features = momentum, eps, mean.shape[0]
        self.weight, self.bias = weight, bias
        self.register_buffer("running_mean", mean)
        self.register_buffer("running_var", var)
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def _check_input_dim(self, input: Tensor) -> None:
        pass


def _batch_norms_as_modules(gm: fx.GraphModule) -> None:
    ops = {torch.ops.aten.batch_norm.default}
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in ops:
            continue
        x, w, b, mean, var, training, momentum, eps = (list(n.args) + [None] * 8)[:8]
        if not training or any(a is not None and a.op != "get_attr" for a in (w, b, mean, var)):
            continue
        def attr(a):
            return None if a is None else _fetch(gm, a.target)

        name = f"_batch_norm_{len(list(gm.named_modules()))}"
        gm.add_submodule(name, _SharedBatchNorm(attr(w), attr(b), attr(mean), attr(var), momentum, eps))
        with gm.graph.inserting_after(n):
            m = gm.graph.call_module(name, (x,))
        n.replace_all_uses_with(m)
        gm.graph.erase_node(n)


def _fetch(gm: nn.Module, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _mutated(n: fx.Node, gm: fx.GraphModule) -> bool:
    """True when ``n`` writes into its first argument (and the graph reads that tensor through ``n``)."""
    if n.op == "call_module":
        return bool(getattr(gm.get_submodule(n.target), "inplace", False))
    if n.op == "call_method":
        return n.target.endswith("_") and not n.target.startswith("_")
    if n.op == "call_function":
        if _aten(n.target):  # torch.export's graph: silu_.default, relu_.default...
            name = n.target.overloadpacket.__name__
            return name.endswith("_") and not name.startswith("_")
        name = getattr(n.target, "__name__", "")
        return n.target in _OUT_OF_PLACE or n.kwargs.get("inplace", False) is True or n.target is operator.setitem \
            or (name.endswith("_") and not name.startswith("_") and getattr(n.target, "__module__", "") in
                ("torch", "torch._C._VariableFunctions"))
    return False


def _aten(target) -> bool:
    """Whether ``target`` is an overload of an aten op (what torch.export's graphs call)."""
    return hasattr(target, "overloadpacket")


def _is_view(n: fx.Node) -> bool:
    if _aten(n.target):
        return n.op == "call_function" and n.target.overloadpacket.__name__ in _VIEWS | {"slice", "alias"}
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    return n.op in ("call_method", "call_function") and name in _VIEWS


def _out_of_place(gm: fx.GraphModule) -> None:
    """Rewrite every in-place op as its out-of-place twin, its later readers reading the result instead.

    A checkpointed segment is re-run from its input in the backward: an op that wrote into the input
    would have changed what the re-run sees. An in-place write into a view is rewritten the same way where
    nothing reads the viewed tensor after it (:func:`_read_later`); into a view of a tensor read again later it
    has no such rewrite and is refused, naming the node.
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in list(gm.graph.nodes):
        if not _mutated(n, gm):
            continue
        target = n.args[0] if n.args else None
        if not isinstance(target, fx.Node) or n.target is operator.setitem or _is_view(target) and _read_later(
                target, n, order):
            raise GraphError(f"cannot plan node {n.name} ({n.op} {_target_name(n)}): it writes in place into "
                             f"{'a view of another tensor' if _is_view(target) else 'a tensor'}; "
                             "write it out of place (x = x + y, inplace=False)")
        if n.op == "call_module":
            twin = copy.copy(gm.get_submodule(n.target))
            twin.inplace = False
            name = f"{n.target.replace('.', '_')}_out_of_place_{n.name}"
            gm.add_submodule(name, twin)
            n.meta["edgerev_module"] = n.target  # the piece is named after the module the model calls
            n.target = name
        elif n.op == "call_method":
            if not hasattr(torch.Tensor, n.target[:-1]):
                raise GraphError(f"cannot plan node {n.name} (method {n.target}): it writes in place and has no "
                                 "out-of-place form")
            n.target = n.target[:-1]
        elif _aten(n.target):
            packet = getattr(torch.ops.aten, n.target.overloadpacket.__name__[:-1], None)
            twin = getattr(packet, n.target.__name__.rpartition(".")[2], None) if packet is not None else None
            if twin is None:
                raise GraphError(f"cannot plan node {n.name} ({_target_name(n)}): it writes in place and has no "
                                 "out-of-place form")
            n.target = twin
        elif n.target in _OUT_OF_PLACE:
            n.target = _OUT_OF_PLACE[n.target]
        elif "inplace" in n.kwargs:
            n.kwargs = {**n.kwargs, "inplace": False}
        else:
            twin = getattr(torch, n.target.__name__[:-1], None)
            if twin is None:
                raise GraphError(f"cannot plan node {n.name} ({_target_name(n)}): it writes in place and has no "
                                 "out-of-place form")
            n.target = twin
        for user in list(target.users):  # those reading the tensor after the write read the result
            if user is not n and order[user] > order[n]:
                user.replace_input_with(target, n)
    gm.recompile()


def _read_later(view: fx.Node, n: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Whether a write by ``n`` into ``view`` would be seen after ``n`` other than through ``view``: the tensor it
    views, or another view of it, is read after ``n``. When none is (``Dropout(inplace=True)`` on a flattened
    feature map, as torchvision's EfficientNet writes it), the write and its out-of-place twin give the same
    numbers."""
    base = view
    while _is_view(base) and base.args and isinstance(base.args[0], fx.Node):
        base = base.args[0]
    family, todo = set(), [base]
    while todo:  # the base and every view of it, transitively
        m = todo.pop()
        if m not in family:
            family.add(m)
            todo.extend(u for u in m.users if _is_view(u))
    return any(order[u] > order[n] for m in family - {view} for u in m.users if u is not n)


def _target_name(n: fx.Node) -> str:
    return n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))


# ---- cut points ---------------------------------------------------------------------------------------------------


def _constants(graph: fx.Graph) -> set[fx.Node]:
    """Nodes computable without the input: parameters, buffers and what is computed from them alone."""
    out: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "get_attr" or (n.op in ("call_function", "call_method")
                                  and all(a in out for a in n.all_input_nodes)):
            out.add(n)
    return out


def _output(graph: fx.Graph) -> fx.Node:
    out = next(n for n in graph.nodes if n.op == "output")
    value = out.args[0]
    if not isinstance(value, fx.Node) or value.op == "placeholder":
        raise GraphError("a classifier's forward must return one tensor computed from its input (the logits), "
                         f"got {type(value).__name__}")
    return value


def cut_points(gm: fx.GraphModule, tensors: set[fx.Node] | None = None) -> list[fx.Node]:
    """The nodes after which the node itself is the only activation the rest of the graph reads.

    The input is the first; the logits the last. ``tensors``: the nodes known to produce a tensor (a
    cut must be a tensor; None: every node).
    """
    graph = gm.graph
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise GraphError(f"a classifier takes one input tensor; this graph takes {len(placeholders)} "
                         f"({', '.join(n.name for n in placeholders)})")
    const = _constants(graph)
    order = {n: i for i, n in enumerate(nodes)}
    last = {n: max((order[u] for u in n.users), default=order[n]) for n in nodes}
    out = _output(graph)
    cuts, live = [], set()
    for n in nodes:
        if n.op == "output":
            break
        if n not in const:
            live.add(n)
        live = {v for v in live if last[v] > order[n]}
        if live == {n} and (tensors is None or n in tensors):
            cuts.append(n)
    if not cuts or cuts[0] is not placeholders[0]:
        cuts.insert(0, placeholders[0])
    if cuts[-1] is not out:
        raise GraphError(f"the logits ({out.name}) are not the last value of the graph")
    return cuts


def _tensor_nodes(gm: fx.GraphModule, example: Tensor) -> dict[fx.Node, int]:
    """The nodes that produce a tensor, and its bytes, from one eval-mode forward of ``example`` (nothing moves)."""
    found: dict[fx.Node, int] = {}

    class Probe(fx.Interpreter):
        def run_node(self, n: fx.Node):
            value = super().run_node(n)
            if isinstance(value, Tensor):
                found[n] = value.numel() * value.element_size()
            return value

    was_training = gm.training
    try:
        gm.eval()
        with torch.no_grad():
            Probe(gm).run(example)
    finally:
        gm.train(was_training)
    return found


def _piece(gm: fx.GraphModule, nodes: list[fx.Node], start: fx.Node, end: fx.Node) -> fx.GraphModule:
    """The nodes after ``start`` up to ``end`` as a module of one input; constants copied where read."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {start: g.placeholder("x")}

    def get(a: fx.Node) -> fx.Node:
        if a not in env:
            env[a] = g.node_copy(a, get)  # a constant (parameter, buffer, or computed from them)
        return env[a]

    for n in nodes:
        env[n] = g.node_copy(n, get)
    g.output(env[end])
    return fx.GraphModule(gm, g)


class Piece(nn.Module):
    """Nodes of a captured graph between two cut points: one tensor in, one tensor out.

    Its printed form names the modules it calls and a digest of its code, so two pieces that wire the
    same modules differently are told apart (profiles and accounts are keyed by the printed model).
    """

    def __init__(self, gm: fx.GraphModule, name: str) -> None:
        super().__init__()
        self.gm = gm
        self.name = name
        self.digest = hashlib.sha256(gm.code.encode()).hexdigest()[:12]
        # a checkpointed re-run draws the forward's random numbers again (edgerev.checkpointing)
        self.random = any(word in _target_name(n) for n in gm.graph.nodes if n.op != "call_module"
                          for word in ("dropout", "bernoulli", "rand"))

    def forward(self, x: Tensor) -> Tensor:
        return self.gm(x)

    def extra_repr(self) -> str:
        return f"{self.name!r}, code {self.digest}"


#: at most this many pieces: the segment solver's dynamic program grows with the square of the chain's length
#: (70 pieces: a minute a solve on a small CPU; 24: about a second)
MAX_PIECES = 24


def pieces(gm: fx.GraphModule, example: Tensor, max_pieces: int = MAX_PIECES) -> list[Piece]:
    """The captured graph ``gm`` cut at its :func:`cut_points` into pieces that run one after another.

    Where there are more than ``max_pieces``, the cuts at the largest tensors go first (a MobileNet's expanded
    activations): a checkpoint is worth keeping where the tensor it keeps is small.
    """
    sizes = _tensor_nodes(gm, example)
    cuts = cut_points(gm, set(sizes))
    inner = sorted(cuts[1:-1], key=lambda n: sizes[n], reverse=True)  # stable: the earlier of equal sizes first
    drop = set(inner[:max(0, len(cuts) - 1 - max_pieces)])
    cuts = [c for c in cuts if c not in drop]
    const = _constants(gm.graph)
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output") and n not in const]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    out = []
    for a, b in zip(cuts, cuts[1:]):
        inside = [n for n in nodes if order[a] < order[n] <= order[b]]
        modules = [n.meta.get("edgerev_module", n.target) for n in inside if n.op == "call_module"]
        out.append(Piece(_piece(gm, inside, a, b), _common_name(modules) or b.name))
    return out


def _common_name(modules: list[str]) -> str:
    """The dotted prefix the modules of a piece share (``layers.0`` for a block), else the last one's name."""
    if not modules:
        return ""
    parts = [m.split(".") for m in modules]
    common = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common) or modules[-1]


# ---- the chain ----------------------------------------------------------------------------------------------------


def _spec(model: nn.Module) -> tuple[int, int]:
    """(input channels, classes), as :func:`edgerev.models.spec.model_spec` reads them."""
    from edgerev.models.spec import model_spec

    spec = model_spec(model)
    return spec.in_channels, spec.num_classes


def _default_plan(n: int) -> Execution:
    return Execution(segments=(Segment(0, n, "store"),) if n else None)


class ChainModel(nn.Module):
    """A captured model run as a chain of pieces (see the module docstring).

    Attributes:
        prefix: the leading pieces without a trainable parameter, run under ``no_grad``.
        body: the rest, planned as checkpoint segments (default: one stored segment, plain autograd).
        in_channels, num_classes, image_size: what the planner and the step's accounting read.
        bn_stats: ``"updated"`` (batch norms in training mode move their running statistics) or
            ``"frozen"`` (every batch norm normalizes with its running statistics and never moves them).
    """

    def __init__(self, chain: list[Piece], in_channels: int, num_classes: int, image_size: int) -> None:
        super().__init__()
        self.in_channels, self.num_classes, self.image_size = in_channels, num_classes, image_size
        self.arch = "graph"
        self.bn_stats = "updated"
        self.__dict__["_chain"] = list(chain)  # every piece, in order; each is registered in prefix or body
        self.__dict__["_split"] = None
        self.prefix = nn.ModuleList()
        self.body = InvertibleSequence([], pool=None)
        self.resplit()

    @property
    def chain(self) -> list[Piece]:
        return list(self._chain)

    def _trainable_key(self) -> tuple[bool, ...]:
        return tuple(any(p.requires_grad for p in piece.parameters()) for piece in self._chain)

    def resplit(self) -> None:
        """Put the leading pieces without a trainable parameter into ``prefix``; the plan goes back to plain."""
        key = self._trainable_key()
        k = next((i for i, t in enumerate(key) if t), len(key))
        self.prefix = nn.ModuleList(self._chain[:k])
        self.body = InvertibleSequence(self._chain[k:], pool=None)
        self.body.set_execution(_default_plan(len(self._chain) - k))
        self.__dict__["_split"] = key

    def train(self, mode: bool = True) -> ChainModel:
        super().train(mode)
        if self.bn_stats == "frozen":
            for m in self.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.eval()
        return self

    def forward(self, x: Tensor) -> Tensor:
        if self.bn_stats == "frozen":  # a model.train() on the source module may have switched them back
            for m in self.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.eval()
        if self._trainable_key() != self._split:
            planned = self.body.execution != _default_plan(len(self.body.stages))
            if planned and torch.is_grad_enabled():
                raise EdgerevError("the trainable parameters changed after the model was planned: plan it again "
                                   "(edgerev.memory.plan.autoplan.plan_training)")
            self.resplit()
        if len(self.prefix):
            with torch.no_grad():  # a frozen prefix keeps no activation and no gradient
                for piece in self.prefix:
                    x = piece(x)
        return self.body(x)

    def body_input(self, x: Tensor) -> Tensor:
        """The body's input for an image batch ``x`` (the frozen prefix run without moving any statistic)."""
        with torch.no_grad():
            for piece in self.prefix:
                with replaying(piece):
                    x = piece(x)
        return x


def chain(model: nn.Module, size: int, in_channels: int | None = None, num_classes: int | None = None,
          max_pieces: int = MAX_PIECES) -> ChainModel:
    """``model`` captured and cut into a :class:`ChainModel` that shares its weights.

    Args:
        size: the input's height and width (the example traced on where ``torch.export`` is needed).
        in_channels, num_classes: what the model takes and gives (default: read from the model).
        max_pieces: cut into at most this many pieces (see :func:`pieces`).
    """
    if isinstance(model, ChainModel):
        return model
    cin, classes = _spec(model)
    cin, classes = in_channels or cin, num_classes or classes
    like = next(iter([*model.parameters(), *model.buffers()]), torch.zeros(()))
    example = torch.zeros(1, cin, size, size, device=like.device,
                          dtype=like.dtype if like.is_floating_point() else torch.float32)
    gm = capture(model, example)
    cm = ChainModel(pieces(gm, example, max_pieces), cin, classes, size)
    cm.train(model.training)
    return cm


_CHAINS: weakref.WeakKeyDictionary[nn.Module, ChainModel] = weakref.WeakKeyDictionary()


def has_engine_body(model: nn.Module) -> bool:
    """True for a model the planner runs as it is (an edgerev model: its body is an engine sequence)."""
    return engine_body(model) is not None


def _chain_fields(model: ChainModel) -> dict:
    return {"in_channels": model.in_channels, "image_size": model.image_size, "fixed_classes": model.num_classes}


describes(ChainModel, _chain_fields)


def planned(model: nn.Module, size: int | None = None) -> nn.Module:
    """What the planner plans and the trainer runs for ``model``: the model itself when it has an engine body,
    else its :class:`ChainModel` (made once per model object and kept while the model lives)."""
    if has_engine_body(model):
        return model
    cm = _CHAINS.get(model)
    if cm is None:
        if size is None:
            raise EdgerevError(f"{type(model).__name__} has not been captured yet: give the input size")
        cm = _CHAINS[model] = chain(model, size)
    return cm

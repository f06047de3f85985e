"""Constant folding at import: what a graph computes from its weights and static shapes, computed once.

Exporters leave shape arithmetic in the graph: ``Shape -> Gather -> Unsqueeze -> Concat -> Reshape`` is how
``x.view(x.size(0), -1)`` reads in ONNX. Nodes whose inputs are all constants are evaluated by onnx's own
reference implementation (:class:`onnx.reference.ReferenceEvaluator`), whatever their op. Shapes are known
statically except for dynamic dimensions (the batch), so ``Shape`` folds to a :class:`ShapeValue` whose entries
are integers or :class:`Sym` (a named dynamic dimension, or a constant multiple of one); the few ops shape
arithmetic uses on it (Gather, Slice, Concat, Squeeze, Unsqueeze, Cast, Identity, Mul or Div by a constant) fold
on those entries. What still depends on a dynamic dimension reaches the converter as a :class:`ShapeValue`,
which a Reshape can use (the batch becomes ``-1``) and an op that needs a constant refuses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx


@dataclass(frozen=True)
class Sym:
    """A dynamic dimension, named by the file (``batch``) or by ``tensor:axis`` where the file has no name.

    Attributes:
        tensor, axis: one tensor and axis that has this size (read at run time when nothing else helps).
        scale: the entry is ``scale`` times that size (``x.reshape(b * c, ...)``: the batch times the channels).
    """

    name: str
    tensor: str
    axis: int
    scale: int = 1


@dataclass(frozen=True)
class ShapeValue:
    """An integer vector (or scalar) of shape arithmetic whose entries may be dynamic dimensions."""

    entries: tuple[int | Sym, ...]
    scalar: bool = False

    @property
    def static(self) -> bool:
        return all(isinstance(e, int) for e in self.entries)

    def array(self) -> np.ndarray:
        a = np.array(self.entries, dtype=np.int64)
        return a.reshape(()) if self.scalar else a


def shape_entries(shape: tuple, tensor: str) -> tuple[int | Sym, ...]:
    """A tensor's inferred dims as ShapeValue entries."""
    return tuple(d if isinstance(d, int) and d > 0 else Sym(d if isinstance(d, str) else f"{tensor}:{i}", tensor, i)
                 for i, d in enumerate(shape))


def evaluate(node: onnx.NodeProto, values: list[np.ndarray], opset: int) -> list[np.ndarray] | None:
    """Outputs of ``node`` on constant inputs with onnx's reference implementation, or None if it cannot."""
    from onnx.reference import ReferenceEvaluator

    named = [n for n in node.input if n]
    try:
        ev = ReferenceEvaluator(node, opsets={"": opset})
        out = ev.run(None, dict(zip(named, values)))
    except Exception:  # noqa: BLE001 - the reference raises many types; unfoldable means "convert it"
        return None
    return [np.asarray(o) for o in out]


def fold_shape_op(node: onnx.NodeProto, args: list, attrs: dict) -> ShapeValue | np.ndarray | None:
    """Fold one op of shape arithmetic whose inputs are ShapeValues or constants; None if it cannot.

    Args:
        args: per input, a :class:`ShapeValue`, a numpy constant, or None (absent or computed at run time).
        attrs: the node's attributes as Python values.
    """
    op = node.op_type
    if any(a is None for a in args[:1]):
        return None
    if op in ("Mul", "Div") and len(args) == 2:
        return _scaled(op, *args)
    x = args[0]
    if isinstance(x, np.ndarray):
        x = ShapeValue(tuple(int(v) for v in x.reshape(-1)), scalar=x.ndim == 0) if x.dtype.kind in "iu" else None
    if x is None:
        return None
    if op in ("Identity", "Cast"):
        return x if op == "Identity" or attrs.get("to") in (onnx.TensorProto.INT64, onnx.TensorProto.INT32) else None
    if op == "Gather" and attrs.get("axis", 0) == 0 and isinstance(args[1], np.ndarray) and not x.scalar:
        idx = args[1]
        picked = tuple(x.entries[int(i)] for i in idx.reshape(-1))
        return ShapeValue(picked, scalar=idx.ndim == 0) if idx.ndim <= 1 else None
    if op == "Unsqueeze" and x.scalar:
        return ShapeValue(x.entries)
    if op == "Squeeze" and not x.scalar and len(x.entries) == 1:
        return ShapeValue(x.entries, scalar=True)
    if op == "Concat":
        parts = []
        for a in args:
            if isinstance(a, np.ndarray) and a.dtype.kind in "iu":
                parts.extend(int(v) for v in a.reshape(-1))
            elif isinstance(a, ShapeValue):
                parts.extend(a.entries)
            else:
                return None
        return ShapeValue(tuple(parts))
    if op == "Reshape" and isinstance(args[1], np.ndarray):  # the batch as a vector of one, or a scalar
        target, n = [int(v) for v in args[1].reshape(-1)], len(x.entries)
        if target in ([-1], [n]):
            return ShapeValue(x.entries)
        return ShapeValue(x.entries, scalar=True) if not target and n == 1 else None
    if op == "Slice" and not x.scalar and all(isinstance(a, np.ndarray) for a in args[1:] if a is not None):
        starts, ends = args[1], args[2]
        axes = args[3] if len(args) > 3 and args[3] is not None else np.array([0])
        steps = args[4] if len(args) > 4 and args[4] is not None else np.array([1])
        if list(axes.reshape(-1)) not in ([0], [-1]):
            return None
        s, e, st = int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0]), int(steps.reshape(-1)[0])
        n = len(x.entries)
        e = max(min(e, n), -n - 1) if e < 0 else min(e, n)  # INT64_MAX ends are common
        return ShapeValue(x.entries[slice(s, e, st)])
    return None


def _scaled(op: str, x, c) -> ShapeValue | None:
    """``x * c`` or ``x / c`` of shape entries ``x`` and an integer constant ``c`` (a scalar, or one per entry)."""
    if op == "Mul" and isinstance(x, np.ndarray):
        x, c = c, x
    if not (isinstance(x, ShapeValue) and isinstance(c, np.ndarray) and c.dtype.kind in "iu"
            and c.size in (1, len(x.entries))):
        return None
    factors = [int(v) for v in np.broadcast_to(c.reshape(-1), (len(x.entries),))]
    out = []
    for e, f in zip(x.entries, factors):
        if op == "Div" and (f <= 0 or (e.scale if isinstance(e, Sym) else e) % f):  # only exact, positive division
            return None
        if isinstance(e, Sym):
            e = Sym(e.name, e.tensor, e.axis, e.scale * f if op == "Mul" else e.scale // f)
        else:
            e = e * f if op == "Mul" else e // f
        out.append(e)
    return ShapeValue(tuple(out), scalar=x.scalar and c.ndim == 0)

"""One converter per ONNX op: each adds the torch equivalent of one node to the graph being built.

A converter takes the :class:`~edgerev.models.onnx_import.build.Builder` and the node, and returns the node's
outputs as fx nodes. Weights (initializers) become parameters of real modules (``nn.Conv2d``,
``nn.BatchNorm2d``, ``nn.Linear``...), linked to their initializer so the export writes them back; every other op
is a ``call_function`` of a torch function. Anything the torch op would compute differently from the ONNX
semantics (an asymmetric pad, a resize mode torch has no twin for) is either made explicit (``F.pad`` before the
op) or refused with one line. The supported list is :data:`OPS`; docs/reference/onnx-ops.md mirrors it.
"""

from __future__ import annotations

import math
import operator

import numpy as np
import torch
import torch.nn.functional as F
from onnx import TensorProto
from torch import nn

from edgerev.models.onnx_import.fold import ShapeValue, Sym
from edgerev.models.onnx_import.layers import PRelu, crop, hard_sigmoid

BIG = 2**31  # Slice ends beyond this mean "to the end"


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).copy())


# ---------------------------------------------------------------- convolutions and pooling


def _spatial_pads(b, node, a: dict, kernel, strides, dilations, x: str) -> list[int]:
    """ONNX pads ``[h_begin, w_begin, h_end, w_end]``, with ``auto_pad`` resolved on the static input shape."""
    n = len(kernel)
    auto = a.get("auto_pad", "NOTSET")
    if auto in ("NOTSET", ""):
        return list(a.get("pads", [0] * 2 * n))
    if auto == "VALID":
        return [0] * 2 * n
    shape = b.shape(x)
    if shape is None or not all(isinstance(d, int) for d in shape[2:]):
        b.refuse(node, f"auto_pad={auto} needs the input's spatial size, which is not fixed")
    begin, end = [], []
    for i in range(n):
        size, k, s, d = shape[2 + i], kernel[i], strides[i], dilations[i]
        # as ONNX Runtime computes it: the total may be negative (a stride longer than the kernel), and halves
        # round toward zero
        total = (math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size
        head = int((total + 1) / 2) if auto == "SAME_LOWER" else int(total / 2)
        begin.append(head)
        end.append(total - head)
    return begin + end


def _torch_pad(pads: list[int]) -> tuple[int, ...]:
    """ONNX spatial pads ``[b1, b2, e1, e2]`` as F.pad's ``(b2, e2, b1, e1)`` (last axis first)."""
    n = len(pads) // 2
    return tuple(v for i in reversed(range(n)) for v in (pads[i], pads[n + i]))


def _layer(convert):
    """Mark ``convert`` as making a layer whose weights train (:data:`LAYER_OPS`)."""
    convert.makes_layer = True
    return convert


@_layer
def conv(b, node):
    a = b.attrs(node)
    w = b.const(node, 1, "weights")
    bias = b.const(node, 2, "bias") if len(node.input) > 2 and node.input[2] else None
    if w.ndim != 4:
        b.refuse(node, f"is a {w.ndim - 2}-d convolution; edgerev imports 2-d ones")
    kernel = list(a.get("kernel_shape", w.shape[2:]))
    strides, dilations = list(a.get("strides", [1, 1])), list(a.get("dilations", [1, 1]))
    group = int(a.get("group", 1))
    pads = _spatial_pads(b, node, a, kernel, strides, dilations, node.input[0])
    x = b.tensor(node.input[0])
    padding: tuple[int, ...] | int = tuple(pads[:2])
    if pads[:2] != pads[2:] or min(pads) < 0:  # asymmetric (SAME_UPPER on an even kernel), or a crop: explicit
        x = b.call(F.pad, x, _torch_pad(pads))
        padding = 0
    m = nn.Conv2d(w.shape[1] * group, w.shape[0], tuple(kernel), stride=tuple(strides), padding=padding,
                  dilation=tuple(dilations), groups=group, bias=bias is not None)
    name = _convolution(b, node, m, w, bias)
    return [b.call_module(name, x)]


def _convolution(b, node, m: nn.Module, w, bias) -> str:
    """``m`` (a convolution or a transposed one) with the node's weight (input 1) and bias (input 2): added to the
    graph and each weight linked to the input it came from, for the export back; its module name."""
    with torch.no_grad():
        m.weight.copy_(_t(w))
        if bias is not None:
            m.bias.copy_(_t(bias))
    name = b.add_module(node, m)
    b.link(f"{name}.weight", node, 1, "same")
    if bias is not None:
        b.link(f"{name}.bias", node, 2, "same")
    return name


@_layer
def conv_transpose(b, node):
    a = b.attrs(node)
    w = b.const(node, 1, "weights")
    bias = b.const(node, 2, "bias") if len(node.input) > 2 and node.input[2] else None
    if w.ndim != 4:
        b.refuse(node, f"is a {w.ndim - 2}-d transposed convolution; edgerev imports 2-d ones")
    if "output_shape" in a or a.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID", ""):
        b.refuse(node, "sets output_shape or auto_pad SAME; edgerev imports explicit pads")
    group = int(a.get("group", 1))
    kernel = tuple(a.get("kernel_shape", w.shape[2:]))
    pads = list(a.get("pads", [0, 0, 0, 0])) if a.get("auto_pad", "NOTSET") != "VALID" else [0, 0, 0, 0]
    symmetric = pads[:2] == pads[2:]
    m = nn.ConvTranspose2d(w.shape[0], w.shape[1] * group, kernel, stride=tuple(a.get("strides", [1, 1])),
                           padding=tuple(pads[:2]) if symmetric else 0,
                           output_padding=tuple(a.get("output_padding", [0, 0])), groups=group,
                           bias=bias is not None, dilation=tuple(a.get("dilations", [1, 1])))
    name = _convolution(b, node, m, w, bias)
    y = b.call_module(name, b.tensor(node.input[0]))
    if not symmetric:  # ONNX pads of a transposed convolution crop its output
        y = b.call(crop, y, tuple(pads[:2]), tuple(pads[2:]))
    return [y]


def _pool(b, node, kind: str):
    a = b.attrs(node)
    if len(node.output) > 1 and node.output[1]:
        b.refuse(node, "returns its indices; edgerev imports pooling without them")
    kernel = list(a["kernel_shape"])
    if len(kernel) != 2:
        b.refuse(node, f"pools over {len(kernel)} axes; edgerev imports 2-d pooling")
    strides, dilations = list(a.get("strides", [1, 1])), list(a.get("dilations", [1, 1]))
    if kind == "avg" and dilations != [1, 1]:
        b.refuse(node, "is dilated; torch's average pooling has no dilation")
    pads = _spatial_pads(b, node, a, kernel, strides, dilations, node.input[0])
    ceil = bool(a.get("ceil_mode", 0))
    include = bool(a.get("count_include_pad", 0))
    if ceil:
        ceil = _ceil_adds_a_window(b, node, kernel, strides, dilations, pads)
        if ceil and kind == "avg":
            b.refuse(node, "averages with ceil_mode over a last window past the padding, which runtimes divide "
                           "differently")
    x = b.tensor(node.input[0])
    padding = tuple(pads[:2])
    # torch pads symmetrically and at most half a kernel; anything else is padded explicitly first
    if pads[:2] != pads[2:] or any(p > k // 2 or p < 0 for p, k in zip(pads, kernel + kernel)):
        if kind == "avg" and not include and any(pads):
            b.refuse(node, "pads asymmetrically and excludes the padding from the average; torch cannot")
        x = b.call(F.pad, x, _torch_pad(pads), value=-math.inf if kind == "max" else 0.0)
        padding = (0, 0)
    if kind == "max":
        return [b.call(F.max_pool2d, x, tuple(kernel), tuple(strides), padding, tuple(dilations), ceil)]
    return [b.call(F.avg_pool2d, x, tuple(kernel), tuple(strides), padding, ceil, include)]


def _ceil_adds_a_window(b, node, kernel, strides, dilations, pads) -> bool:
    """Whether ``ceil_mode`` changes the output; refused where the window it adds starts past the input.

    ONNX Runtime 1.19, onnx's shape inference and torch disagree on a last window that begins in the end padding
    or beyond (torch drops it, ONNX Runtime keeps some); a window that begins inside the input all keep.
    """
    shape = b.shape(node.input[0])
    if shape is None or not all(isinstance(d, int) for d in shape[2:]):
        b.refuse(node, "pools with ceil_mode over a spatial size that is not fixed")
    adds = False
    for i, (k, s, d) in enumerate(zip(kernel, strides, dilations)):
        size, head, tail = shape[2 + i], pads[i], pads[len(kernel) + i]
        span = size + head + tail - ((k - 1) * d + 1)
        if span % s == 0:
            continue
        if (span // s + 1) * s >= size + head:
            b.refuse(node, "pools with ceil_mode whose last window starts past the input, where runtimes disagree")
        adds = True
    return adds


def max_pool(b, node):
    return _pool(b, node, "max")


def average_pool(b, node):
    return _pool(b, node, "avg")


def _global(fn):
    def convert(b, node):
        rank = b.rank(node.input[0])
        return [b.call(fn, b.tensor(node.input[0]), tuple(range(2, rank)), keepdim=True)]
    return convert


# ---------------------------------------------------------------- normalization, activations


@_layer
def batch_norm(b, node):
    a = b.attrs(node)
    if any(o for o in node.output[1:]):
        b.refuse(node, "returns its running statistics (training_mode); edgerev imports inference graphs")
    scale, bias, mean, var = (b.const(node, i, what) for i, what in
                              ((1, "scale"), (2, "bias"), (3, "mean"), (4, "variance")))
    rank = b.rank(node.input[0])
    cls = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}.get(rank)
    if cls is None:
        b.refuse(node, f"normalizes a {rank}-d tensor")
    # ONNX's momentum weighs the old statistics (running = momentum * running + (1 - momentum) * batch);
    # torch's weighs the new batch
    m = cls(scale.shape[0], eps=float(a.get("epsilon", 1e-5)), momentum=1.0 - float(a.get("momentum", 0.9)))
    with torch.no_grad():
        m.weight.copy_(_t(scale))
        m.bias.copy_(_t(bias))
        m.running_mean.copy_(_t(mean))
        m.running_var.copy_(_t(var))
    name = b.add_module(node, m)
    for key, i in (("weight", 1), ("bias", 2), ("running_mean", 3), ("running_var", 4)):
        b.link(f"{name}.{key}", node, i, "same")
    return [b.call_module(name, b.tensor(node.input[0]))]


@_layer
def layer_norm(b, node):
    """ONNX LayerNormalization: :func:`torch.nn.functional.layer_norm` over the axes from ``axis`` on, its scale and
    bias the weights of an ``nn.LayerNorm`` (trained, and written back by the export)."""
    a = b.attrs(node)
    if any(o for o in node.output[1:]):
        b.refuse(node, "returns its mean or inverse deviation; edgerev imports LayerNormalization without them")
    scale = b.const(node, 1, "scale")
    bias = b.const(node, 2, "bias") if len(node.input) > 2 and node.input[2] else None
    shape = b.shape(node.input[0])
    rank = b.rank(node.input[0])
    axis = int(a.get("axis", -1))
    axis = axis + rank if axis < 0 else axis
    normalized = tuple(shape[axis:])
    if not all(isinstance(d, int) and d > 0 for d in normalized):
        b.refuse(node, f"normalizes axes {axis}.. whose sizes {list(normalized)} are not fixed")
    m = nn.LayerNorm(normalized, eps=float(a.get("epsilon", 1e-5)), bias=bias is not None)
    with torch.no_grad():
        m.weight.copy_(_t(np.broadcast_to(scale, normalized)))
        if bias is not None:
            m.bias.copy_(_t(np.broadcast_to(bias, normalized)))
    name = b.add_module(node, m)
    # a scale or bias broadcast from fewer axes goes back at the normalized shape, which ONNX takes as well
    b.link(f"{name}.weight", node, 1, "same")
    if bias is not None:
        b.link(f"{name}.bias", node, 2, "same")
    return [b.call_module(name, b.tensor(node.input[0]))]


def _unary(fn, **kwargs):
    def convert(b, node):
        return [b.call(fn, b.tensor(node.input[0]), **kwargs)]
    return convert


def leaky_relu(b, node):
    return [b.call(F.leaky_relu, b.tensor(node.input[0]), float(b.attrs(node).get("alpha", 0.01)))]


def gelu(b, node):
    """ONNX Gelu (opset 20): ``approximate`` none (the error function) or tanh, as torch's."""
    approximate = b.attrs(node).get("approximate", "none")
    if approximate not in ("none", "tanh"):
        b.refuse(node, f"has approximate={approximate!r}; ONNX defines none and tanh")
    return [b.call(F.gelu, b.tensor(node.input[0]), approximate=approximate)]


def hard_sigmoid_op(b, node):
    a = b.attrs(node)
    return [b.call(hard_sigmoid, b.tensor(node.input[0]), float(a.get("alpha", 0.2)), float(a.get("beta", 0.5)))]


def clip(b, node):
    lo = b.const(node, 1, "minimum") if len(node.input) > 1 and node.input[1] else None
    hi = b.const(node, 2, "maximum") if len(node.input) > 2 and node.input[2] else None
    lo, hi = (None if v is None else float(v) for v in (lo, hi))
    x = b.tensor(node.input[0])
    if lo == 0.0 and hi == 6.0:
        return [b.call(F.relu6, x)]
    if lo is None and hi is None:
        return [x]
    return [b.call(torch.clamp, x, lo, hi)]


@_layer
def prelu(b, node):
    slope = b.const(node, 1, "slope")
    name = b.add_module(node, PRelu(_t(slope)))
    b.link(f"{name}.weight", node, 1, "same")
    return [b.call_module(name, b.tensor(node.input[0]))]


def softmax(fn):
    def convert(b, node):
        return [b.call(fn, b.tensor(node.input[0]), int(b.attrs(node).get("axis", -1)))]
    return convert


def dropout(b, node):
    if len(node.output) > 1 and node.output[1]:
        b.refuse(node, "returns its mask; edgerev imports dropout without it")
    ratio = b.const(node, 1, "ratio") if len(node.input) > 1 and node.input[1] else None
    p = float(ratio) if ratio is not None else float(b.attrs(node).get("ratio", 0.5))
    name = b.add_module(node, nn.Dropout(p))  # a module: it trains as dropout and is the identity in eval mode
    return [b.call_module(name, b.tensor(node.input[0]))]


# ---------------------------------------------------------------- arithmetic and linear layers


def _binary(fn):
    def convert(b, node):
        return [b.call(fn, b.tensor(node.input[0]), b.tensor(node.input[1]))]
    return convert


def _linear(b, node, weight: np.ndarray, bias: np.ndarray | None, x) -> tuple[str, object]:
    m = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        m.weight.copy_(_t(weight))
        if bias is not None:
            m.bias.copy_(_t(bias))
    name = b.add_module(node, m)
    b.heads.append(name)
    return name, b.call_module(name, x)


@_layer
def gemm(b, node):
    a = b.attrs(node)
    alpha, beta = float(a.get("alpha", 1.0)), float(a.get("beta", 1.0))
    trans_a, trans_b = int(a.get("transA", 0)), int(a.get("transB", 0))
    x = b.tensor(node.input[0])
    if trans_a:
        x = b.call(torch.transpose, x, 0, 1)
    w = b.value(node.input[1])
    c = b.value(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    if not isinstance(w, np.ndarray) or isinstance(c, (ShapeValue,)) or (c is not None and not isinstance(
            c, np.ndarray)):
        # two computed operands (attention-like): the formula itself
        y = b.call(torch.matmul, x, b.call(torch.transpose, b.tensor(node.input[1]), 0, 1) if trans_b
                   else b.tensor(node.input[1]))
        y = b.call(operator.mul, y, alpha) if alpha != 1.0 else y
        if c is not None:
            cc = b.tensor(node.input[2])
            y = b.call(operator.add, y, b.call(operator.mul, cc, beta) if beta != 1.0 else cc)
        return [y]
    weight = (w if trans_b else w.T) * alpha
    n = weight.shape[0]
    as_bias = c is not None and c.size in (1, n) and (c.ndim < 2 or c.shape[0] == 1)
    bias = (np.broadcast_to(c.reshape(-1), (n,)) * beta).astype(np.float32) if as_bias else None
    name, y = _linear(b, node, weight.astype(np.float32), bias, x)
    b.link(f"{name}.weight", node, 1, "gemm_weight" if trans_b else "gemm_weight_t")
    if as_bias:
        b.link(f"{name}.bias", node, 2, "gemm_bias")
    elif c is not None:  # a bias per row: a constant added as it is
        y = b.call(operator.add, y, b.buffer(c * beta))
    return [y]


@_layer
def matmul(b, node):
    w = b.value(node.input[1])
    if not (isinstance(w, np.ndarray) and w.ndim == 2):
        return [b.call(torch.matmul, b.tensor(node.input[0]), b.tensor(node.input[1]))]
    add, bias = b.bias_after(node, w.shape[1])
    name, y = _linear(b, node, w.T.astype(np.float32), bias, b.tensor(node.input[0]))
    b.link(f"{name}.weight", node, 1, "transpose")
    if add is not None:  # the Add that follows is this layer's bias: it trains with it
        b.link(f"{name}.bias", add[0], add[1], "bias")
        b.fused[add[0].output[0]] = y
    return [y]


# ---------------------------------------------------------------- tensor shapes


def _target(b, node) -> list:
    """The shape a Reshape or an Expand is given (its second input) as entries: integers, and :class:`Sym` for
    the sizes read at run time; refused when it is computed from data."""
    target = b.value(node.input[1])
    if not isinstance(target, (np.ndarray, ShapeValue)):
        b.refuse(node, f"needs a constant shape, but {node.input[1]!r} is computed at run time")
    return list(target.entries) if isinstance(target, ShapeValue) else [int(v) for v in target.reshape(-1)]


def reshape(b, node):
    entries = _target(b, node)
    data = b.shape_entries(node.input[0])
    if not int(b.attrs(node).get("allowzero", 0)) and data is not None:
        entries = [data[i] if e == 0 else e for i, e in enumerate(entries)]
    fixed = b.io.fixed_batch
    if fixed is not None and entries and entries[0] == fixed and data and isinstance(data[0], Sym):
        entries[0] = data[0]  # the file's fixed batch written into the target: the batch
    return [b.call(torch.reshape, b.tensor(node.input[0]), b.resolve_shape(node, entries, data))]


def expand(b, node):
    """ONNX's Expand: broadcast to the shape given, both ways (where the shape says 1, the input keeps its size)."""
    entries = _target(b, node)
    rank = b.rank(node.input[0])
    n = max(rank, len(entries))
    entries = [-1] * (n - len(entries)) + entries
    entries = [-1 if e == 1 and i >= n - rank else e for i, e in enumerate(entries)]  # -1: torch keeps the size
    return [b.graph.call_method("expand", (b.tensor(node.input[0]), *b.resolve_shape(node, entries, None)))]


def flatten(b, node):
    axis = int(b.attrs(node).get("axis", 1))
    rank = b.rank(node.input[0])
    axis = axis + rank if axis < 0 else axis
    x = b.tensor(node.input[0])
    if axis == 0:
        return [b.call(torch.reshape, x, (1, -1))]
    y = b.call(torch.flatten, x, axis) if axis < rank else b.call(torch.unsqueeze, x, rank)
    return [b.call(torch.flatten, y, 0, axis - 1) if axis > 1 else y]


def transpose(b, node):
    perm = b.attrs(node).get("perm") or list(reversed(range(b.rank(node.input[0]))))
    return [b.call(torch.permute, b.tensor(node.input[0]), tuple(int(p) for p in perm))]


def _axes(b, node, i: int = 1):
    """Axes from the input (opset 13 on, 18 for reductions) or the older attribute; None when absent."""
    if len(node.input) > i and node.input[i]:
        return [int(v) for v in b.const(node, i, "axes").reshape(-1)]
    axes = b.attrs(node).get("axes")
    return None if axes is None else [int(v) for v in axes]


def squeeze(b, node):
    axes = _axes(b, node)
    x = b.tensor(node.input[0])
    if axes is None:
        shape = b.shape(node.input[0])
        if shape is None or not all(isinstance(d, int) for d in shape):
            b.refuse(node, "squeezes every axis of size 1, but the input's shape is not fixed")
        axes = [i for i, d in enumerate(shape) if d == 1]
    return [b.call(torch.squeeze, x, tuple(axes))]


def unsqueeze(b, node):
    axes = _axes(b, node)
    out_rank = b.rank(node.input[0]) + len(axes)
    y = b.tensor(node.input[0])
    for axis in sorted(a + out_rank if a < 0 else a for a in axes):
        y = b.call(torch.unsqueeze, y, axis)
    return [y]


def concat(b, node):
    return [b.call(torch.cat, [b.tensor(i) for i in node.input], int(b.attrs(node)["axis"]))]


def split(b, node):
    a = b.attrs(node)
    axis = int(a.get("axis", 0))
    n = len(node.output)
    sizes = b.const(node, 1, "split") if len(node.input) > 1 and node.input[1] else a.get("split")
    x = b.tensor(node.input[0])
    if sizes is None:
        dim = (b.shape(node.input[0]) or [None] * (axis + 1))[axis]
        if not isinstance(dim, int):
            b.refuse(node, "splits an axis whose size is not fixed into equal parts")
        size = -(-dim // n)  # ONNX: equal parts, the last one smaller when the axis does not divide
        sizes = [size] * (n - 1) + [dim - size * (n - 1)]
    parts = b.call(torch.split, x, [int(s) for s in np.asarray(sizes).reshape(-1)], axis)
    return [b.call(operator.getitem, parts, i) for i in range(n)]


def slice_op(b, node):
    starts, ends = b.const(node, 1, "starts"), b.const(node, 2, "ends")
    rank = b.rank(node.input[0])
    axes = b.const(node, 3, "axes") if len(node.input) > 3 and node.input[3] else np.arange(len(starts))
    steps = b.const(node, 4, "steps") if len(node.input) > 4 and node.input[4] else np.ones(len(starts), np.int64)
    index = [slice(None)] * rank
    for s, e, ax, st in zip(starts.reshape(-1), ends.reshape(-1), axes.reshape(-1), steps.reshape(-1)):
        if st <= 0:
            b.refuse(node, "slices with a negative step; torch cannot")
        e = None if e >= BIG else int(max(e, -BIG))
        index[int(ax) % rank] = slice(int(max(s, -BIG)), e, int(st))
    return [b.call(operator.getitem, b.tensor(node.input[0]), tuple(index))]


def gather(b, node):
    axis = int(b.attrs(node).get("axis", 0))
    x = b.tensor(node.input[0])
    if not isinstance(b.value(node.input[1]), np.ndarray):  # indices computed from shapes (as_strided's)
        return [_gather_computed(b, node, x, axis)]
    idx = b.const(node, 1, "indices")
    if idx.ndim == 0:
        return [b.call(torch.select, x, axis, int(idx))]
    if idx.ndim != 1 or (idx < 0).any():
        b.refuse(node, "gathers with indices that are not one non-negative vector")
    return [b.call(torch.index_select, x, axis, b.buffer(idx.astype(np.int64)))]


def _gather_computed(b, node, x, axis: int):
    """Gather with indices computed when the model runs (any rank; a negative one counts from the end): one
    ``index_select`` on the flat indices, reshaped to the input's sizes around the indices' own."""
    rank, rank_i = b.rank(node.input[0]), b.rank(node.input[1])
    axis %= rank
    g = b.graph
    indices = b.tensor(node.input[1])
    flat = g.call_method("reshape", (b.call(torch.remainder, indices, g.call_method("size", (x, axis))), -1))
    picked = b.call(torch.index_select, x, axis, flat)
    sizes = ([g.call_method("size", (x, i)) for i in range(axis)] + [g.call_method("size", (indices, j))
             for j in range(rank_i)] + [g.call_method("size", (x, i)) for i in range(axis + 1, rank)])
    return g.call_method("reshape", (picked, *sizes))


def pad(b, node):
    a = b.attrs(node)
    mode = a.get("mode", "constant")
    pads = [int(v) for v in b.const(node, 1, "pads").reshape(-1)]
    value = b.const(node, 2, "value") if len(node.input) > 2 and node.input[2] else None
    rank = b.rank(node.input[0])
    axes = b.const(node, 3, "axes").reshape(-1) if len(node.input) > 3 and node.input[3] else np.arange(rank)
    begin, end = [0] * rank, [0] * rank
    for i, ax in enumerate(axes):
        begin[int(ax) % rank], end[int(ax) % rank] = pads[i], pads[len(axes) + i]
    torch_mode = {"constant": "constant", "reflect": "reflect", "edge": "replicate", "wrap": "circular"}.get(mode)
    if torch_mode is None:
        b.refuse(node, f"pads in mode {mode!r}")
    if torch_mode != "constant" and any(begin[:2] + end[:2]):
        b.refuse(node, f"pads the batch or channel axis in mode {mode!r}; torch pads only spatial axes so")
    first = next((i for i in range(rank) if begin[i] or end[i]), rank)
    if first == rank:
        return [b.tensor(node.input[0])]
    if torch_mode != "constant":  # torch pads all spatial axes of a 4-d input in these modes, never fewer
        first = min(first, max(rank - 2, 0))
    spec = tuple(v for i in reversed(range(first, rank)) for v in (begin[i], end[i]))
    kwargs = {"value": float(value)} if torch_mode == "constant" and value is not None else {}
    return [b.call(F.pad, b.tensor(node.input[0]), spec, torch_mode, **kwargs)]


def resize(b, node):
    a = b.attrs(node)
    mode = a.get("mode", "nearest")
    coord = a.get("coordinate_transformation_mode", "half_pixel")
    if int(a.get("antialias", 0)) or a.get("keep_aspect_ratio_policy", "stretch") != "stretch":
        b.refuse(node, "resizes with antialias or a kept aspect ratio")
    if b.rank(node.input[0]) != 4:
        b.refuse(node, "resizes a tensor that is not an image batch")
    axes = a.get("axes")
    scales = b.const(node, 2, "scales") if len(node.input) > 2 and node.input[2] else None
    sizes = b.value(node.input[3]) if len(node.input) > 3 and node.input[3] else None
    full = list(range(4)) if axes is None else [int(x) % 4 for x in axes]
    kwargs: dict = {}
    if scales is not None and scales.size:
        s = dict(zip(full, scales.reshape(-1).tolist()))
        if s.get(0, 1.0) != 1.0 or s.get(1, 1.0) != 1.0:
            b.refuse(node, "resizes the batch or channel axis")
        kwargs["scale_factor"] = (float(s.get(2, 1.0)), float(s.get(3, 1.0)))
    elif sizes is not None:
        entries = sizes.entries if isinstance(sizes, ShapeValue) else tuple(int(v) for v in np.asarray(sizes).ravel())
        d = dict(zip(full, entries))
        if not all(isinstance(d.get(i), int) for i in (2, 3)):
            b.refuse(node, f"needs constant sizes, but {node.input[3]!r} is computed at run time")
        kwargs["size"] = (d[2], d[3])
    else:
        b.refuse(node, "has neither constant scales nor constant sizes")
    half = coord in ("half_pixel", "pytorch_half_pixel")
    if mode == "nearest":
        nearest = a.get("nearest_mode", "round_prefer_floor")
        if coord == "asymmetric" and nearest == "floor":
            return [b.call(F.interpolate, b.tensor(node.input[0]), mode="nearest", **kwargs)]
        if half and nearest == "round_prefer_ceil":
            return [b.call(F.interpolate, b.tensor(node.input[0]), mode="nearest-exact", **kwargs)]
        b.refuse(node, f"resizes nearest with coordinates {coord!r} and rounding {nearest!r}, which torch has not")
    torch_mode = {"linear": "bilinear", "cubic": "bicubic"}.get(mode)
    if torch_mode == "bicubic" and (float(a.get("cubic_coeff_a", -0.75)) != -0.75 or int(a.get("exclude_outside", 0))):
        b.refuse(node, "resizes cubic with a coefficient other than torch's (-0.75, no exclusion)")
    if torch_mode is None or not (half or coord == "align_corners"):
        b.refuse(node, f"resizes {mode} with coordinates {coord!r}, which torch has not")
    return [b.call(F.interpolate, b.tensor(node.input[0]), mode=torch_mode, align_corners=coord == "align_corners",
                   **kwargs)]


def _reduce(fn, **fixed):
    """ONNX's Reduce* over ``axes`` (an attribute, or an input from opset 18) as ``fn(x, axes, keepdim=...)``."""
    def convert(b, node):
        a = b.attrs(node)
        axes = _axes(b, node)
        keep = bool(a.get("keepdims", 1))
        x = b.tensor(node.input[0])
        if not axes:
            if int(a.get("noop_with_empty_axes", 0)):
                return [x]
            axes = list(range(b.rank(node.input[0])))
        return [b.call(fn, x, *fixed.values(), tuple(axes), keepdim=keep)]
    return convert


reduce_mean = _reduce(torch.mean)
reduce_l2 = _reduce(torch.linalg.vector_norm, ord=2)  # F.normalize's norm (EdgeNeXt's cross-covariance attention)


def identity(b, node):
    return [b.tensor(node.input[0])]


def cast(b, node):
    if b.attrs(node).get("to") != TensorProto.FLOAT:
        b.refuse(node, "casts to a type other than float32 at run time; edgerev imports float32 graphs")
    return [b.tensor(node.input[0])]


def cast_like(b, node):
    """Cast to the second input's type (torch's dynamo exporter writes it with ``optimize=False``, the export that
    keeps batch norm): a float32 target, or a run-time tensor (the import's run-time tensors are float32), is
    the identity; any other type is refused as :func:`cast` refuses it."""
    target, x = b.value(node.input[1]), b.value(node.input[0])
    if isinstance(target, np.ndarray) and target.dtype != np.float32:
        b.refuse(node, f"casts to {target.dtype} at run time; edgerev imports float32 graphs")
    if isinstance(x, np.ndarray):  # a constant cast like the image (the exporter's zero biases): still a constant
        return [x.astype(np.float32)]
    return [b.tensor(node.input[0])]


#: op type -> converter; Constant and Shape are folded by the builder
OPS = {
    "Conv": conv, "ConvTranspose": conv_transpose, "BatchNormalization": batch_norm, "LayerNormalization": layer_norm,
    "Relu": _unary(F.relu), "Clip": clip, "LeakyRelu": leaky_relu, "PRelu": prelu, "Sigmoid": _unary(torch.sigmoid),
    "HardSigmoid": hard_sigmoid_op, "HardSwish": _unary(F.hardswish), "Tanh": _unary(torch.tanh),
    "Erf": _unary(torch.erf), "Gelu": gelu,
    "Softmax": softmax(torch.softmax), "LogSoftmax": softmax(torch.log_softmax),
    "Add": _binary(operator.add), "Sub": _binary(operator.sub), "Mul": _binary(operator.mul),
    "Div": _binary(operator.truediv),
    "Concat": concat, "Split": split, "Slice": slice_op, "Reshape": reshape, "Flatten": flatten,
    "Transpose": transpose, "Squeeze": squeeze, "Unsqueeze": unsqueeze, "Gather": gather,
    "GlobalAveragePool": _global(torch.mean), "GlobalMaxPool": _global(torch.amax),
    "AveragePool": average_pool, "MaxPool": max_pool, "ReduceMean": reduce_mean, "ReduceL2": reduce_l2,
    "Gemm": gemm, "MatMul": matmul, "Pad": pad, "Expand": expand, "Resize": resize, "Identity": identity,
    "Dropout": dropout, "Cast": cast, "CastLike": cast_like,
}

#: the ops whose weights train (their converters marked ``_layer``): a value computed from shapes alone that reaches
#: one is computed when the model runs, and the op is a layer of the model (EdgeNeXt's positional encoding reaches a
#: Conv)
LAYER_OPS = frozenset(op for op, convert in OPS.items() if getattr(convert, "makes_layer", False))

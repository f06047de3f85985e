"""The optimizer a run steps with: torch's SGD, its momentum buffer in the weights' float32 or in bfloat16; and the
unit-wise adaptive gradient clipping a model without normalization steps with (:func:`adaptive_clip_`).

``train.trainable: auto`` keeps the momentum in bfloat16 where the float32 buffer does not fit the budget beside
the weights that train (:func:`edgerev.train.trainable.choose_fit`): half the optimizer's bytes. torch's SGD
updates a buffer it finds in place and in the buffer's own dtype, so the buffer is made before the first step
(zeros: the first update is the gradient, as from none) and cast again after a checkpoint is loaded (torch casts
an optimizer's state to its weights' dtype). The arithmetic of each update stays in float32: the decayed
gradient, the Nesterov look-ahead and the weight's change; only the running average is rounded to bfloat16's
8 bits of mantissa when it is stored. torch's multi-tensor SGD takes one dtype per parameter group, so such a
run steps one tensor at a time.
"""

from __future__ import annotations

import torch
from torch import nn

from edgerev._torchapi import foreach

#: bytes per element of the momentum buffer -> its dtype
STATE_DTYPES = {4: torch.float32, 2: torch.bfloat16}


def sgd(params: list[nn.Parameter], *, lr: float, momentum: float, nesterov: bool, weight_decay: float,
        state_bytes: int = 4) -> torch.optim.SGD:
    """torch's SGD over ``params``, its momentum buffers held in ``state_bytes`` per element (4 or 2)."""
    low = momentum > 0 and state_bytes != 4
    optimizer = torch.optim.SGD([{"params": params}], lr=lr, momentum=momentum, nesterov=nesterov,
                                weight_decay=weight_decay, **({"foreach": False} if low else {}))
    keep_state_in(optimizer, STATE_DTYPES[state_bytes])
    return optimizer


def keep_state_in(optimizer: torch.optim.SGD, dtype: torch.dtype) -> None:
    """Hold every momentum buffer of ``optimizer`` in ``dtype`` (nothing for the weights' own dtype, or for an
    SGD without momentum): a zero buffer for a parameter without one, a buffer already there cast."""
    for group in optimizer.param_groups:
        if not group["momentum"]:
            continue
        for p in group["params"]:
            if p.dtype == dtype:
                continue
            state = optimizer.state[p]
            buf = state.get("momentum_buffer")
            state["momentum_buffer"] = (torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
                                        if buf is None else buf.to(dtype))


#: a unit's weight norm below this counts as this in :func:`adaptive_clip_` (NFNets' epsilon): a zero unit still moves
ADAPTIVE_CLIP_EPS = 1e-3


def adaptive_clip_(params: list[nn.Parameter], ratio: float, eps: float = ADAPTIVE_CLIP_EPS) -> None:
    """Unit-wise adaptive gradient clipping (AGC: Brock et al., "High-Performance Large-Scale Image Recognition
    Without Normalization", ICML 2021), in place: each unit's gradient is scaled down where its norm is above
    ``ratio`` times the unit's weight norm (at least ``eps``). A unit is one output of a weight of two or more
    dimensions (a convolution's output channel, a linear layer's row); a vector or a scalar (a bias) is one unit.

    A global norm clip bounds the whole step; this bounds each unit's step against its own size, which is what keeps
    a network without batch norm (a file whose batch norms were folded into its convolutions) from being thrown off
    by the few units whose gradients are large. It runs on the device, without reading the host. timm has it too
    (``timm.utils.agc``); timm is not a dependency of edgerev's runtime, and the function is these few lines.

    On a GPU a step of a small network is bound by its kernel launches, so the launches are few: two reductions per
    weight of two or more dimensions (its units' norms and its gradient's), two for all vectors and scalars
    together, five for the bounds of every unit at once, and one scaling per gradient: for MobileNetV2's 158 tensors
    271 launches, where its forward and backward at batch 8, 224x224, launch 523 (counted on the meta device); an op
    per tensor at each stage would take eight per parameter, 1,264.
    """
    with torch.no_grad():
        held = [p for p in params if p.grad is not None]
        units = [p for p in held if p.ndim > 1]
        whole = [p for p in held if p.ndim <= 1]
        # a parameter's gradient has its dtype (autograd's rule): each norm in the parameter's dtype
        limits = [torch.linalg.vector_norm(p, dim=tuple(range(1, p.ndim)), keepdim=True) for p in units]
        norms = [torch.linalg.vector_norm(p.grad, dim=tuple(range(1, p.ndim)), keepdim=True) for p in units]
        if whole:
            limits += foreach("norm", whole)
            norms += foreach("norm", [p.grad for p in whole])
        if not limits:
            return
        foreach("clamp_min_", limits, eps)
        foreach("mul_", limits, ratio)
        foreach("clamp_min_", norms, 1e-12)
        foreach("div_", limits, norms)
        foreach("clamp_max_", limits, 1.0)
        for p, scale in zip(units + whole, limits, strict=True):  # one broadcast product a tensor, as CUDA runs it
            p.grad.mul_(scale)

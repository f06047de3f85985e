"""The optimizer's momentum in bfloat16 (``train.trainable: auto`` where the float32 buffer does not fit): torch's
SGD with its buffer stored in bfloat16 and each update computed in float32, through a checkpoint and back."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edgerev.train.optim import ADAPTIVE_CLIP_EPS, adaptive_clip_, keep_state_in, sgd
from edgerev.train.state import load_checkpoint, save_checkpoint

SETTINGS = {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 5e-4}


def reference(w: torch.Tensor, grads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """SGD with Nesterov momentum written out, the buffer rounded to ``dtype`` at each of its two in-place updates
    as torch stores it (scaled, then the decayed gradient added)."""
    w, buf = w.clone(), torch.zeros_like(w)
    for g in grads:
        d = g + SETTINGS["weight_decay"] * w
        buf = ((buf * SETTINGS["momentum"]).to(dtype).float() + d).to(dtype).float()
        w = w - SETTINGS["lr"] * (d + SETTINGS["momentum"] * buf)
    return w


@pytest.mark.parametrize("state_bytes, dtype", [(4, torch.float32), (2, torch.bfloat16)])
def test_the_update_is_sgd_s_with_the_buffer_stored_in_its_dtype(state_bytes, dtype):
    torch.manual_seed(0)
    start = torch.randn(6, 5)
    grads = [torch.randn(6, 5) for _ in range(4)]
    w = torch.nn.Parameter(start.clone())
    opt = sgd([w], **SETTINGS, state_bytes=state_bytes)
    for g in grads:
        w.grad = g.clone()
        opt.step()
    assert opt.state[w]["momentum_buffer"].dtype == dtype
    torch.testing.assert_close(w.detach(), reference(start, grads, dtype), rtol=0, atol=1e-6)
    if dtype == torch.bfloat16:  # the rounding is seen: not float32's update
        assert not torch.allclose(w.detach(), reference(start, grads, torch.float32), rtol=0, atol=1e-4)


def test_a_checkpoint_brings_the_bfloat16_buffer_back_in_bfloat16(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    opt = sgd(list(model.parameters()), **SETTINGS, state_bytes=2)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    save_checkpoint(tmp_path, 1, 0, model, opt)
    again = sgd(list(model.parameters()), **SETTINGS, state_bytes=2)
    load_checkpoint(tmp_path, model, again)  # torch casts the state to the weights' dtype
    keep_state_in(again, torch.bfloat16)
    for p in model.parameters():
        assert again.state[p]["momentum_buffer"].dtype == torch.bfloat16
        assert torch.equal(again.state[p]["momentum_buffer"], opt.state[p]["momentum_buffer"])


def test_without_momentum_nothing_is_kept():
    w = torch.nn.Parameter(torch.ones(3))
    opt = sgd([w], lr=0.1, momentum=0.0, nesterov=False, weight_decay=0.0, state_bytes=2)
    assert not opt.state


@settings(max_examples=60, deadline=None)
@given(shapes=st.lists(st.sampled_from([(), (5,), (4, 3), (6, 2, 3, 3)]), min_size=1, max_size=4),
       ratio=st.floats(0.001, 2.0), scale=st.floats(1e-4, 1e3), seed=st.integers(0, 2**31 - 1))
def test_adaptive_clip_bounds_each_unit_against_its_weight_and_keeps_its_direction(shapes, ratio, scale, seed):
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:  # weights and vectors together: each clipped as if alone
        p = torch.nn.Parameter(torch.randn(shape, generator=g) * torch.rand((), generator=g))
        p.grad = torch.randn(shape, generator=g) * scale * torch.rand((), generator=g)
        params.append(p)
    befores = [p.grad.clone() for p in params]
    adaptive_clip_(params, ratio)
    for p, before in zip(params, befores, strict=True):
        dims = tuple(range(1, p.ndim)) if p.ndim > 1 else None
        limit = torch.linalg.vector_norm(p.detach(), dim=dims).clamp_min(ADAPTIVE_CLIP_EPS) * ratio
        norm, was = (torch.linalg.vector_norm(t, dim=dims) for t in (p.grad, before))
        assert torch.all(norm <= limit * (1 + 1e-5))  # every unit within its bound
        kept = was <= limit
        assert torch.equal(p.grad[kept], before[kept]) if p.ndim > 0 else (not kept or torch.equal(p.grad, before))
        factor = norm / was  # a unit scaled as a whole: the same direction
        assert torch.allclose(p.grad, before * (factor.reshape(-1, *[1] * (p.ndim - 1)) if p.ndim > 1 else factor),
                              rtol=1e-5, atol=0)


def test_adaptive_clip_launches_two_kernels_per_weight_and_one_per_gradient():
    """On a GPU the clipping's launches are what it costs: per weight of two or more dimensions its two norms, per
    parameter its scaling, and a fixed few for all vectors' norms and all the bounds (as a GPU runs them: counted
    on the meta device)."""
    from edgerev.memory.measure.profile import FlopCounter
    from edgerev.models.designs import mobilenet_v2

    params = list(mobilenet_v2(num_classes=10).to("meta").parameters())
    for p in params:
        p.grad = torch.empty_like(p)
    with FlopCounter() as counted:
        adaptive_clip_(params, 0.2)
    weights = sum(p.ndim > 1 for p in params)
    assert counted.kernels <= 2 * weights + len(params) + 7 < 2 * len(params)
    assert counted.syncs == 0


def test_adaptive_clip_leaves_parameters_without_a_gradient():
    p, q = torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.ones(2))
    q.grad = torch.full((2,), 100.0)
    adaptive_clip_([p, q], 0.1)
    assert p.grad is None and torch.allclose(torch.linalg.vector_norm(q.grad), 0.1 * torch.linalg.vector_norm(q))

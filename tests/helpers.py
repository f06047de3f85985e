"""Shared helpers of the test suite: block factories, gradient helpers, and an engine gradcheck wrapper."""

from __future__ import annotations

import copy

import torch
from torch import nn

from edgerev.engine import InvertibleSequence, Mode, plain, supported_modes
from edgerev.layers import (
    BatchPool,
    ChannelPool,
    Coupling,
    HybridBlock,
    InvBatchNorm2d,
    InvConv2d,
    InvLeakyReLU,
)

# The shapes here are tiny: one thread is faster than two, and does not spin against other work.
torch.set_num_threads(1)

MODES = ("invert", "floor", "recompute", "store")

#: every block kind the layer tests cover
BLOCKS = (
    "bn_train",
    "bn_eval",
    "leaky_0.2",
    "leaky_0.5",
    "conv",
    "channel_pool",
    "batch_pool",
    "coupling",
    "hybrid",
)

#: kinds that have a layer-wise ``backward_`` (the generic coupling has none)
LAYERWISE = tuple(k for k in BLOCKS if k != "coupling")


def residual_fn(channels: int) -> nn.Sequential:
    """A generic (non-invertible) residual function for :class:`Coupling`."""
    return nn.Sequential(nn.BatchNorm2d(channels), nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1))


def randomize_(module: nn.Module, seed: int = 0) -> nn.Module:
    """Give every batch norm non-trivial affine parameters (of both signs) and running statistics."""
    g = torch.Generator().manual_seed(seed)
    for m in module.modules():
        if isinstance(m, (InvBatchNorm2d, nn.modules.batchnorm._BatchNorm)):
            n = m.weight.shape[0]
            with torch.no_grad():
                sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
                m.weight.copy_(sign * (0.5 + torch.rand(n, generator=g)))
                m.bias.copy_(0.5 * torch.randn(n, generator=g))
                m.running_mean.copy_(0.5 * torch.randn(n, generator=g))
                m.running_var.copy_(0.5 + 1.5 * torch.rand(n, generator=g))
    return module


def make_block(kind: str, channels: int = 8, dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
    """One block of the given kind, randomized, in ``dtype``; ``bn_eval`` is in eval mode."""
    torch.manual_seed(seed)
    if kind in ("bn_train", "bn_eval"):
        block: nn.Module = InvBatchNorm2d(channels)
    elif kind.startswith("leaky_"):
        block = InvLeakyReLU(float(kind.split("_")[1]))
    elif kind == "conv":
        block = InvConv2d(channels)
    elif kind == "channel_pool":
        block = ChannelPool()
    elif kind == "batch_pool":
        block = BatchPool()
    elif kind == "coupling":
        block = Coupling(channels, residual_fn(channels // 2), residual_fn(channels // 2))
    elif kind == "hybrid":
        block = HybridBlock(channels)
    else:  # pragma: no cover - a typo in a test
        raise KeyError(kind)
    randomize_(block, seed)
    block = block.to(dtype)
    if kind == "bn_eval":
        block.eval()
    return block


def exact_modes(stage: nn.Module) -> tuple[str, ...]:
    """The exact engine modes (invert, floor, recompute, store) ``stage`` supports, default first."""
    return tuple(str(m) for m in supported_modes(stage) if str(m) in MODES)


def block_modes(kind: str) -> tuple[str, ...]:
    """The exact engine modes a block kind supports."""
    return exact_modes(make_block(kind, 4))


def params_of(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of ``a`` against the reference ``b`` (Frobenius norms)."""
    return ((a - b).norm() / b.norm().clamp_min(torch.finfo(b.dtype).tiny)).item()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def loss_grads(module: nn.Module, x: torch.Tensor, u: torch.Tensor, reference: bool,
               input_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """Output, input gradient and parameter gradients of ``(module(x) * u).sum()``.

    ``reference=True`` runs every :class:`InvertibleSequence` of ``module`` through plain autograd.
    """
    xx = x.detach().clone().requires_grad_(input_grad)
    params = params_of(module)
    with plain(module, enabled=reference):
        out = module(xx)
        value = out.detach().clone()  # taken before the backward runs
        inputs = ([xx] if input_grad else []) + params
        grads = list(torch.autograd.grad((out * u).sum(), inputs))
    gx = grads.pop(0) if input_grad else None
    return value, gx, grads


def assert_grads_close(engine, reference, tol: float, names=None) -> None:
    """Every tensor of ``engine`` within relative error ``tol`` of ``reference``.

    Some gradients are zero analytically (the bias of a convolution followed by a batch norm); their
    reference is rounding noise, so each norm is floored at 1e-6 of the largest reference norm.
    """
    assert len(engine) == len(reference)
    floor = 1e-6 * max(b.norm().item() for b in reference)
    for i, (a, b) in enumerate(zip(engine, reference)):
        name = names[i] if names else i
        assert a is not None, f"gradient {name} is None"
        assert a.shape == b.shape and a.dtype == b.dtype, name
        err = (a - b).norm().item() / max(b.norm().item(), floor)
        assert err <= tol, f"gradient {name}: relative error {err:.3e} > {tol:.0e}"


def random_modes(seq: InvertibleSequence, seed: int) -> list[str]:
    """One supported exact mode per stage, drawn at random (seeded)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for stage in seq.stages:
        ok = exact_modes(stage)
        out.append(ok[int(torch.randint(len(ok), (1,), generator=g))])
    return out


class FreshEngine(torch.autograd.Function):
    """``seq(x)`` through the engine, with a backward that runs a fresh engine step each time.

    The engine's own graph is single-use (its backward consumes the saved activation), while
    ``torch.autograd.gradcheck`` back-propagates many times through one graph. This wrapper keeps
    the function and its gradients those of the engine: its forward returns the engine's output
    and its backward returns the gradients the engine's backward computes for a fresh forward on
    the same inputs (batch norm in training mode is deterministic for a given input).
    """

    @staticmethod
    def forward(ctx, seq: InvertibleSequence, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.seq, ctx.params = seq, params
        ctx.save_for_backward(x)
        with torch.enable_grad():
            out = seq(x.detach().requires_grad_())
        assert type(out.grad_fn).__name__ == "_EngineBackward", "the engine did not run"
        return out.detach()

    @staticmethod
    def backward(ctx, gout: torch.Tensor):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            xx = x.detach().requires_grad_()
            out = ctx.seq(xx)
            assert type(out.grad_fn).__name__ == "_EngineBackward", "the engine did not run"
            grads = torch.autograd.grad(out, [xx, *ctx.params], gout, allow_unused=True)
        return (None, *grads)


def engine_fn(seq: InvertibleSequence):
    """A function of ``(x, *params)`` (the parameters are the module's own) for gradcheck."""

    def fn(x, *params):
        return FreshEngine.apply(seq, x, *params)

    return fn


def clone_model(module: nn.Module) -> nn.Module:
    return copy.deepcopy(module)


__all__ = [
    "BLOCKS",
    "LAYERWISE",
    "MODES",
    "FreshEngine",
    "Mode",
    "assert_grads_close",
    "block_modes",
    "clone_model",
    "cosine",
    "engine_fn",
    "exact_modes",
    "loss_grads",
    "make_block",
    "params_of",
    "random_modes",
    "randomize_",
    "rel_err",
    "residual_fn",
]


#: set in the process :func:`own_process` starts for a test: there the test itself runs
OWN_PROCESS = "EDGEREV_TEST_IN_ITS_OWN_PROCESS"


def own_process(test):
    """Run ``test`` in a Python process of its own (pytest on its node id alone), for a test that caps the
    process's CUDA allocator and reads its peaks: what earlier tests of the same process left allocated (some
    500 MiB after the GPU tests of the graphs and the fused quantizer on an H200) would count against its cap.
    Its fixtures are made in both processes; the test runs in the second, and its failure is this one's."""
    import functools
    import os
    import subprocess
    import sys

    @functools.wraps(test)
    def run(*args, **kwargs):
        if os.environ.get(OWN_PROCESS):
            return test(*args, **kwargs)
        node = os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0]
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node],
                              env={**os.environ, OWN_PROCESS: "1"}, capture_output=True, text=True)
        assert done.returncode == 0, f"{node} in its own process:\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}"

    return run

"""Analytic bytes per input pixel: what each stage keeps and what its backward needs, from its structure.

Volumes are counted in elements per input pixel (channels times the fraction of the input's
pixels the stage works at, times the batch multiplier of batch pooling); invertible stages preserve
volume. The peak of a step is taken as the largest, over the stages in backward order, of

    image + kept by earlier stored stages + activation + its gradient + the stage's own temporaries

Temporaries that the engine computes in batch slices (convolutions, element-wise gradient maps)
do not grow with the batch and so do not appear in a per-pixel figure. The rules for what autograd
saves (convolutions and batch norms their input, ReLU its output) follow PyTorch's derivatives.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from edgerev.engine import InvertibleSequence, Mode
from edgerev.layers import BatchPool, ChannelPool, Coupling, HybridBlock, InvSequential
from edgerev.models.resnet import BasicBlock
from edgerev.models.spec import model_spec


@dataclass
class _Vol:
    channels: int
    frac: float  # spatial size / input spatial size, times batch multiplier

    @property
    def units(self) -> float:
        return self.channels * self.frac


def _out_shape(m: nn.Module, v: _Vol) -> _Vol:
    if isinstance(m, (BatchPool,)):
        return v  # [4B, C, H/2, W/2]: same volume
    if isinstance(m, ChannelPool):
        return _Vol(4 * v.channels, v.frac / 4)
    if isinstance(m, nn.Conv2d):
        s = m.stride[0]
        return _Vol(m.out_channels, v.frac / (s * s))
    if isinstance(m, nn.Sequential):
        for sub in m:
            v = _out_shape(sub, v)
        return v
    if isinstance(m, BasicBlock):
        return _Vol(m.conv2.out_channels, v.frac / (m.conv1.stride[0] ** 2))
    return v


def _saves_input(m: nn.Module) -> bool:
    return isinstance(m, (nn.Conv2d, nn.BatchNorm2d, nn.Linear, BasicBlock))


def _chain_saved(layers: list[nn.Module], v: _Vol) -> tuple[float, _Vol]:
    """Units autograd keeps for the intermediates of a chain (not its input)."""
    saved = 0.0
    for i, m in enumerate(layers):
        out = _out_shape(m, v)
        nxt = layers[i + 1] if i + 1 < len(layers) else None
        if isinstance(m, nn.ReLU) or (nxt is not None and _saves_input(nxt)):
            saved += out.units
        if isinstance(m, BasicBlock):  # basic block: conv1 out, relu out, conv2 out (+ projection out)
            saved += 3 * out.units + (out.units if not isinstance(m.shortcut, nn.Identity) else 0)
        v = out
    return saved, v


def _stage_costs(stage: nn.Module, mode: Mode, v: _Vol) -> tuple[float, float, bool]:
    """(units kept from forward to backward, extra units during its backward, input kept?)."""
    out = _out_shape(stage, v)
    if mode is Mode.STORE:
        layers = list(stage) if isinstance(stage, nn.Sequential) else [stage]
        saved, _ = _chain_saved(layers, v)
        if isinstance(stage, Coupling):
            saved = _coupling_graph(stage, v)
        return saved, 0.0, _saves_input(layers[0]) or isinstance(stage, Coupling)
    if mode is Mode.INVERT:
        return 0.0, (0.5 * out.units if isinstance(stage, HybridBlock) else 0.0), False
    if mode is Mode.FLOOR:  # no copy of a gradient half: the activation and its gradient only
        return 0.0, 0.0, False
    # recompute (Coupling.recompute_backward_): one residual function's graph at a time, its output
    # (half a volume), and gradients in flight between its nodes: the input and output gradient of
    # one node plus the half-volume result (1.5 volumes; this term is read off PyTorch's backward of
    # BN/ReLU/conv chains, not derived from the structure)
    if isinstance(stage, Coupling):
        return 0.0, _function_graph(stage, v) + 0.5 * out.units + 1.5 * out.units, False
    return 0.0, 2 * out.units, False


def _residual_saved(stage: nn.Module, v: _Vol) -> list[float]:
    """Units autograd saves inside each of the coupling's ``F`` and ``G`` (at half the channels)."""
    half = _Vol(v.channels // 2, v.frac)
    out = []
    for fn in (stage.f, stage.g):
        layers = list(fn.layers) if isinstance(fn, InvSequential) else list(fn)
        out.append(_chain_saved(layers, half)[0])
    return out


def _function_graph(stage: nn.Module, v: _Vol) -> float:
    """Units the larger of the two residual functions saves (recompute runs them one at a time)."""
    return max(_residual_saved(stage, v))


def _coupling_graph(stage: nn.Module, v: _Vol) -> float:
    # y1 is kept as G's input; F's output and the sums are freed as the graph is built
    return sum(_residual_saved(stage, v)) + v.channels // 2 * v.frac


def model_bytes_per_pixel(model: nn.Module, element_size: int | None = None) -> float:
    """Predicted training-step bytes per input pixel of ``model`` (see the module docstring)."""
    seqs = [m for m in model.modules() if isinstance(m, InvertibleSequence)]
    if not seqs:
        raise ValueError(f"{type(model).__name__} has no InvertibleSequence to analyse")
    seq = seqs[0]
    e = element_size or next(model.parameters()).element_size()
    in_channels = model_spec(model).in_channels
    v = _Vol(in_channels, 1.0)
    rows = []
    for stage, mode in zip(seq.stages, seq.modes):
        kept, extra, keeps_input = _stage_costs(stage, mode, v)
        out = _out_shape(stage, v)
        rows.append((v, out, kept, extra, keeps_input))
        v = out
    peak, kept_before = 0.0, [0.0]
    for i, (vin, _, kept, _, keeps_input) in enumerate(rows):
        inp = vin.units if keeps_input and i > 0 else 0.0
        kept_before.append(kept_before[-1] + kept + inp)
    for i in reversed(range(len(rows))):
        vin, out, kept, extra, keeps_input = rows[i]
        grad_in = vin.units if i > 0 else 0.0
        live = kept_before[i + 1] + out.units + out.units + extra
        live = max(live, kept_before[i] + out.units + grad_in + (vin.units if keeps_input and i > 0 else 0.0))
        peak = max(peak, live)
    return e * (in_channels + peak)

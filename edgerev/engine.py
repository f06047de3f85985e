"""The engine: one autograd Function that trains a sequence of stages without storing activations.

Autograd never sees the inside of the sequence. The forward keeps only the sequence output (and
per-channel statistics on a :class:`~edgerev.layers.base.Tape`); the backward walks the stages in
reverse, each stage rebuilding its input from its output and producing its gradients, in the mode
the stage was given:

========== ======================================= =================================================
mode       forward keeps                           backward does
========== ======================================= =================================================
invert     nothing                                 block inverse, then layer-wise inverses (hybrid)
floor      nothing                                 block inverse and backward, no copy of a gradient half
recompute  nothing                                 block inverse, then autograd on the recomputed stage
store      the stage's autograd graph (its input)  ordinary backward of the stage
store8     an 8-bit copy of each layer's saved input autograd's backward, each layer from its own copy
store4     the same at 4 bits (two codes per byte) the same; approximate gradients
========== ======================================= =================================================

With ``store8``/``store4`` (Chakrabarti & Moseley, :mod:`edgerev.approximate`) the forward is exact and
runs once (batch-norm statistics move once); ReLU and leaky-ReLU masks are exact, and one layer's
approximation never reaches another layer's copy. Only the parameter gradients (and batch norm's
variance term) read the copies. When the stage before needs this stage's input to rebuild itself
(``invert``, ``recompute``), an invertible stage rebuilds it from its exact output with its inverse;
any other stage then also keeps its input in float32.

``floor`` keeps 2 activation volumes live (no copy of a gradient half), one of two ways
(:meth:`Coupling.floor_backward_`, :attr:`Execution.floor_restore`): on the CPU ``F`` and ``G`` run forward on
copies of batch slices, once per batch norm and once more, and the halves are only subtracted from (the
fewest FLOPs); on a GPU, where every kernel is a launch, the chains run over the whole batch and undo
their gradient maps to give the gradient half back (few kernels, two more walks of each chain).

A stored convolution's output, and that of the per-sample invertible layers right after it (RevNeXt's
stem), is computed again from the convolution's kept input before their backward instead of being rebuilt
through every block inverse above (:func:`_restorable`).

How a sequence runs besides its modes is one :class:`Execution` value, given whole (never four
flags set one by one from other modules): plain autograd (the reference for every gradient test and
the path used for ONNX export, see :func:`plain`), checkpoint segments for a plain model under a cap
(run by :mod:`edgerev.checkpointing`), a probe that sees each rebuilt activation, and whether the
engine may overwrite its input and output buffers. Stages are recognized as invertible by type
(:class:`~edgerev.layers.base.Invertible`), never by the names of their methods.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from edgerev import approximate
from edgerev._torchapi import storage_key
from edgerev.enums import TextEnum
from edgerev.errors import ModeError
from edgerev.finite import check_finite
from edgerev.layers import norm
from edgerev.layers.base import Grads, Invertible, Tape, add_grads, replaying
from edgerev.layers.coupling import Coupling, forward_per_sample
from edgerev.layers.norm import InvBatchNorm2d
from edgerev.layers.pooling import POOLS, global_pool, global_pool_grad


class Mode(TextEnum):
    """How a stage is trained (see the module docstring)."""

    INVERT = "invert"
    FLOOR = "floor"
    RECOMPUTE = "recompute"
    STORE = "store"
    STORE8 = "store8"
    STORE4 = "store4"

    @property
    def bits(self) -> int | None:
        """Bits of the kept copy for the approximate modes, None otherwise."""
        return {"store8": 8, "store4": 4}.get(self.value)


@dataclass(frozen=True)
class Execution:
    """How an :class:`InvertibleSequence` runs, apart from its per-stage modes.

    Attributes:
        plain: run the stages through plain autograd (stores everything; the reference and export path).
        segments: checkpoint segments (``start``, ``end``, ``mode``) for a plain model under a cap,
            instead of the engine (see :mod:`edgerev.checkpointing`); None: the engine.
        probe: called as ``probe(stage, activation)`` with every activation the backward rebuilds.
        owns_buffers: with ``pool=None``, let the engine overwrite its input, its output and the
            output's gradient instead of copying them (measurements that must see a stage as it runs
            inside a model).
        slices: per stage, the byte budget of the batch slices its per-sample temporaries are computed in
            (``0``: the whole batch at once), as the planner chose it under the cap; None: the default of
            :func:`edgerev.layers.chunk_budget` for every stage (the lean setting).
        watch: called as ``watch(i)`` when stage ``i``'s forward or backward starts and ``watch(None)`` when
            the engine hands back to autograd (the planner attributes a step's peak to stages this way).
        floor_restore: how ``floor`` stages keep the gradient half without a copy: by undoing their chains'
            gradient maps over the whole batch (True: few kernels) or from the chains run on batch slices (False:
            fewer FLOPs); None: as the device the step runs on wants it (:func:`floor_restores`). A plan sets it
            for the device it was made for, so that its fake-tensor accounting runs the same way.
    """

    plain: bool = False
    segments: tuple | None = None
    probe: Callable[[nn.Module, Tensor], None] | None = None
    owns_buffers: bool = False
    slices: tuple[int, ...] | None = None
    watch: Callable[[int | None], None] | None = None
    floor_restore: bool | None = None


def floor_restores(device: str | torch.device) -> bool:
    """Does ``floor`` mode undo its chains' gradient maps on ``device`` (:meth:`Coupling.floor_backward_`)? Yes
    wherever a kernel is a launch (a GPU, and the meta device, which dispatches CUDA's op sequence); not on the
    CPU, where the way by batch slices does fewer FLOPs and a slice costs no launch."""
    return torch.device(device).type != "cpu"


def engine_body(module: nn.Module) -> InvertibleSequence | None:
    """The engine sequence ``module`` runs as its body (its child ``body``), or None: a model the engine does not
    run (a model from outside, trained through plain autograd or cut into a chain first). A type check on a
    child, so a model says what it is by what it holds, not by an attribute stamped on it."""
    body = dict(module.named_children()).get("body")
    return body if isinstance(body, InvertibleSequence) else None


def _parse_mode(value: Mode | str) -> Mode:
    try:
        return Mode(value)
    except ValueError:
        raise ModeError(f"unknown mode {value!r}; choose from {', '.join(x.value for x in Mode)}") from None


def supported_modes(stage: nn.Module) -> tuple[Mode, ...]:
    """Modes a stage can run in: invertible layers declare theirs, anything else is ``store`` only.

    Every stage also runs in ``store8`` and ``store4``: its autograd forward keeps an 8- or 4-bit copy
    of each activation it saves (:mod:`edgerev.approximate`).
    """
    return (*(Mode(m) for m in getattr(stage, "modes", ("store",))), Mode.STORE8, Mode.STORE4)


class InvertibleSequence(nn.Module):
    """A sequence of stages trained by the engine, with a mode per stage.

    Args:
        stages: the stages, in order. Invertible stages (see :mod:`edgerev.layers`) support
            ``invert``/``recompute``/``store``; any other module (a stem convolution, a strided
            downsampling) is run in ``store`` mode.
        modes: one mode per stage, or one mode for all; by default the cheapest in memory that each
            stage supports (``invert``, else ``recompute``, else ``store``).
        pool: ``"mean"`` (``"max"``) makes the sequence return per-sample features averaged (the
            maximum) over space and over the sub-images of batch pooling (``[B, C]``); the activation
            itself then never leaves the engine, so its backward can work in place on its own buffers.
            ``None`` returns the last activation (its incoming gradient is then copied before being
            overwritten).
    """

    def __init__(self, stages: Sequence[nn.Module], modes: Sequence[Mode | str] | Mode | str | None = None,
                 pool: str | None = "mean") -> None:
        super().__init__()
        if pool is not None and pool not in POOLS:
            raise ValueError(f"pool must be one of {', '.join(POOLS)} or None, got {pool!r}")
        self.stages = nn.ModuleList(stages)
        self.pool = pool
        self._execution = Execution()
        self._modes: list[Mode] = [supported_modes(s)[0] for s in self.stages]
        if modes is not None:
            self.set_modes(modes)

    @property
    def modes(self) -> list[Mode]:
        return list(self._modes)

    def set_modes(self, modes: Sequence[Mode | str] | Mode | str) -> None:
        """Set the mode of every stage; a single mode applies where supported, else the stage's default."""
        if isinstance(modes, (str, Mode)):
            mode = _parse_mode(modes)
            self._modes = [mode if mode in supported_modes(s) else supported_modes(s)[0] for s in self.stages]
            return
        modes = list(modes)
        if len(modes) != len(self.stages):
            raise ModeError(f"got {len(modes)} modes for {len(self.stages)} stages")
        parsed = []
        for i, (stage, m) in enumerate(zip(self.stages, modes)):
            ok = ", ".join(x.value for x in supported_modes(stage))
            try:
                m = Mode(m)
            except ValueError:
                name = type(stage).__name__
                raise ModeError(f"stage {i} ({name}) cannot run in mode {m!r}; it supports {ok}") from None
            if m not in supported_modes(stage):
                raise ModeError(f"stage {i} ({type(stage).__name__}) cannot run in {m.value} mode; it supports {ok}")
            parsed.append(m)
        self._modes = parsed

    @property
    def execution(self) -> Execution:
        return self._execution

    def set_execution(self, execution: Execution) -> None:
        """Run from now on as ``execution`` says (see :class:`Execution`)."""
        if not isinstance(execution, Execution):
            raise TypeError(f"expected an Execution, got {type(execution).__name__}")
        if execution.slices is not None and (
                len(execution.slices) != len(self.stages)
                or any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in execution.slices)):
            raise ModeError(f"slices must be {len(self.stages)} byte budgets >= 0, one per stage "
                            f"(0: the whole batch), got {execution.slices!r}")
        self._execution = execution

    def slice_budget(self, i: int) -> int | None:
        """The batch-slice budget of stage ``i`` (None: the default, see :class:`Execution`)."""
        slices = self._execution.slices
        return None if slices is None else slices[i]

    def forward(self, x: Tensor, samples: int | None = None) -> Tensor:
        """Run the stages; ``samples`` is the original batch size (for ``pool="mean"``)."""
        samples = x.shape[0] if samples is None else samples
        params = [p for p in self.parameters() if p.requires_grad]
        run = self._execution
        use_engine = (
            not run.plain and torch.is_grad_enabled() and (x.requires_grad or bool(params)) and len(self.stages) > 0
        )
        if run.segments is not None and not run.plain and torch.is_grad_enabled():
            from edgerev.checkpointing import run_segments

            x = run_segments(self.stages, run.segments, x)
            return global_pool(x, samples, self.pool) if self.pool else x
        if not use_engine:
            for stage in self.stages:
                x = stage(x)
            return global_pool(x, samples, self.pool) if self.pool else x
        return _Engine.apply(x, self, samples, *params)


def _hands_back(seq: InvertibleSequence) -> list[bool]:
    """Per stage: must its backward hand its exact input to the stage before (which rebuilds from it)?

    ``invert`` and ``recompute`` rebuild a stage's input from its output; ``store`` keeps its input
    anyway. An approximate invertible stage that must hand its input back inverts its own output, so
    it needs its output handed to it in turn.
    """
    out, uses_output = [], False
    for stage, mode in zip(seq.stages, seq._modes):
        back = uses_output
        out.append(back)
        uses_output = mode in (Mode.INVERT, Mode.FLOOR, Mode.RECOMPUTE) or (
            mode.bits is not None and back and isinstance(stage, Invertible))
    return out


_REBUILDS = (Mode.INVERT, Mode.FLOOR, Mode.RECOMPUTE)
_AUTOGRAD_FORWARD = (Mode.STORE, Mode.STORE8, Mode.STORE4)  # the stage's forward runs through autograd


def _restorable(seq: InvertibleSequence) -> dict[int, int]:
    """Stage ``k`` -> stage ``j`` where ``k``'s output can be computed again from the input ``j`` keeps.

    ``j`` is a convolution in ``store`` mode (RevNeXt's stem: its input is the image) and ``j+1 .. k``
    are per-sample invertible layers that rebuild their inputs (its batch norm and leaky ReLU). Their
    output would otherwise be rebuilt by every block inverse above, with the largest error of the whole
    backward, and a leaky ReLU's mask read from a rebuilt value flips where the error crosses zero
    (2 of 131,072 at the paper's RevNeXt, batch 4, 32x32, float32: the stem's batch-norm shift then has a
    gradient cosine of 0.99980). The backward writes the output computed from the kept input over the
    rebuilt one, slice by slice, before ``k``'s backward (one small convolution more, no volume more).
    """
    out: dict[int, int] = {}
    for j, (stage, mode) in enumerate(zip(seq.stages, seq._modes)):
        if mode is not Mode.STORE or not isinstance(stage, nn.Conv2d):
            continue
        k = j
        while k + 1 < len(seq.stages) and forward_per_sample(seq.stages[k + 1]) and \
                seq._modes[k + 1] in _REBUILDS:
            k += 1
        if k > j:
            out[k] = j
    return out


def _restore_(y: Tensor, xin: Tensor, stages: Sequence[nn.Module], tape: Tape) -> None:
    """Overwrite ``y`` with ``stages`` run on ``xin`` (the first an ordinary module, the rest invertible
    layers replaying the forward's statistics), one batch slice at a time."""
    first, rest = stages[0], stages[1:]
    with torch.no_grad():
        for sl in tape.slices(y):
            h = first(xin[sl])
            for stage in rest:
                h = stage.forward_(h, tape)
            y[sl].copy_(h)
            del h  # one slice's output at a time


def _record_stats(stage: nn.Module, tape: Tape) -> None:
    """Put the batch statistics an autograd forward of ``stage`` measured on ``tape`` (for its inverse)."""
    for m in stage.modules():
        if isinstance(m, InvBatchNorm2d) and m.training and m._last_stats is not None:
            tape.stats[m] = m._last_stats


def _stage_params(stage: nn.Module) -> list[nn.Parameter]:
    return [p for p in stage.parameters() if p.requires_grad]


class _Engine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, seq: InvertibleSequence, samples: int, *params: nn.Parameter) -> Tensor:
        run = seq.execution
        tape = Tape(probe=run.probe)
        # the batch norms the engine runs itself (an autograd forward computes its own scales)
        norm.prepare((m for stage, mode in zip(seq.stages, seq._modes) if mode not in _AUTOGRAD_FORWARD
                      for m in stage.modules()), tape)
        default_slices = tape.slice_bytes
        stored: dict[int, object] = {}
        back = _hands_back(seq)
        h = x
        watch = run.watch or _unwatched
        for i, (stage, mode) in enumerate(zip(seq.stages, seq._modes)):
            budget = seq.slice_budget(i)
            tape.slice_bytes = default_slices if budget is None else budget
            watch(i)
            if mode is Mode.STORE:
                xin = h.detach().requires_grad_(i > 0 or ctx.needs_input_grad[0])
                saved: set[int] = set()

                def pack(t: Tensor, saved: set[int] = saved) -> Tensor:
                    saved.add(storage_key(t))
                    return t

                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = stage(xin)
                stored[i] = (xin, out)
                h = out.detach()
                key = storage_key(h)
                nxt = i + 1
                in_place_next = nxt < len(seq.stages) and seq._modes[nxt] is not Mode.STORE and isinstance(
                    seq.stages[nxt], Invertible)
                if in_place_next and (key in saved or key == storage_key(xin) or not h.is_contiguous()):
                    # the next stage overwrites h: never the stage's saved tensors or its input
                    h = h.clone(memory_format=torch.contiguous_format)
            elif mode.bits is not None:
                # the image (a first stage's input that needs no gradient) is held by the caller: kept exact
                exact = {storage_key(x)} if i == 0 and not x.requires_grad else set()
                out, kept = approximate.forward(stage, h, mode.bits, i > 0 or ctx.needs_input_grad[0], exact,
                                                tape.slice_bytes)
                if back[i] and isinstance(stage, Invertible):
                    _record_stats(stage, tape)  # the backward inverts the stage to hand its input back
                elif back[i]:
                    kept.input = h
                stored[i] = kept
                nxt = i + 1
                in_place_next = nxt < len(seq.stages) and seq._modes[nxt] is not Mode.STORE and isinstance(
                    seq.stages[nxt], Invertible)
                if in_place_next and (storage_key(out) in (storage_key(h), storage_key(x)) or not out.is_contiguous()):
                    out = out.clone(memory_format=torch.contiguous_format)  # never overwrite a kept input
                h = out
            else:
                if (h is x and not run.owns_buffers) or not h.is_contiguous():
                    h = h.clone(memory_format=torch.contiguous_format)  # never overwrite the caller's tensor
                h = stage.forward_(h, tape)
        watch(None)
        check_finite(h, "the output of the invertible sequence (diverged weights or a bad input)")
        ctx.seq, ctx.tape, ctx.stored, ctx.samples, ctx.params = seq, tape, stored, samples, params
        ctx.back = back
        ctx.default_slices = default_slices
        ctx.used = False
        if seq.pool:
            ctx.y = h  # never handed out, so the backward may overwrite it
            return global_pool(h, samples, seq.pool)
        ctx.save_for_backward(h)
        return h

    @staticmethod
    @once_differentiable
    def backward(ctx, gout: Tensor):
        if ctx.used:
            raise RuntimeError(
                "the engine's backward runs once per forward: it rebuilds activations in place. "
                "Run the forward again (retain_graph cannot keep them)."
            )
        ctx.used = True
        seq: InvertibleSequence = ctx.seq
        tape: Tape = ctx.tape
        last = seq.slice_budget(len(seq.stages) - 1)
        if seq.pool:
            y = ctx.y
            del ctx.y
            gy = global_pool_grad(y, gout, ctx.samples, seq.pool, ctx.default_slices if last is None else last)
        else:
            # the output and its incoming gradient belong to the caller: work on copies
            (y,) = ctx.saved_tensors
            if seq.execution.owns_buffers:
                gy = gout.contiguous()
            else:
                y = y.clone(memory_format=torch.contiguous_format)
                gy = gout.clone(memory_format=torch.contiguous_format)
        tape.replay = True
        grads: Grads = {}
        stored, back = ctx.stored, ctx.back
        restore = _restorable(seq)
        by_restoring = seq.execution.floor_restore
        if by_restoring is None:
            by_restoring = floor_restores(gy.device)
        watch = seq.execution.watch or _unwatched
        for i in reversed(range(len(seq.stages))):
            stage, mode = seq.stages[i], seq._modes[i]
            budget = seq.slice_budget(i)
            tape.slice_bytes = ctx.default_slices if budget is None else budget
            watch(i)
            if i in restore and y is not None:
                j = restore[i]
                _restore_(y, stored[j][0], seq.stages[j:i + 1], tape)
            with replaying(stage):
                if mode is Mode.STORE:
                    xin, out = stored.pop(i)
                    y, gy = _autograd_backward(stage, xin, out, gy, grads)
                elif mode.bits is not None:
                    kept = stored.pop(i)
                    gy = approximate.backward(kept, gy, grads)
                    if kept.input is not None:
                        y = kept.input
                    elif back[i]:
                        y = stage.inverse_(y, tape)
                    else:
                        y = None  # the stage before keeps what it needs
                    del kept
                elif mode is Mode.FLOOR:
                    y, gy = stage.floor_backward_(y, gy, tape, grads, by_restoring)
                elif mode is Mode.RECOMPUTE and isinstance(stage, Coupling):
                    y, gy = stage.recompute_backward_(y, gy, tape, grads)
                elif mode is Mode.RECOMPUTE:
                    x = stage.inverse_(y, tape)
                    xin = x.detach().requires_grad_()
                    with torch.enable_grad():
                        out = stage(xin)
                    _, gy = _autograd_backward(stage, xin, out, gy, grads)
                    y = x
                else:
                    y, gy = stage.backward_(y, gy, tape, grads)
            if tape.probe is not None and y is not None:
                tape.probe(stage, y)
            if gy is None:
                break
            if not gy.is_contiguous():
                gy = gy.contiguous()  # autograd may hand back a strided gradient; stages work in place
        del y
        watch(None)
        gx = gy if ctx.needs_input_grad[0] else None
        return (gx, None, None, *[grads.get(p) for p in ctx.params])


def _unwatched(stage: int | None) -> None:
    pass


def _autograd_backward(stage: nn.Module, xin: Tensor, out: Tensor, gy: Tensor,
                       grads: Grads) -> tuple[Tensor, Tensor | None]:
    params = _stage_params(stage)
    inputs = ([xin] if xin.requires_grad else []) + params
    if not inputs:  # a frozen or parameter-free first stage: nothing to differentiate
        return xin.detach(), None
    res = torch.autograd.grad(out, inputs, gy, allow_unused=True)
    if xin.requires_grad:
        gx, res = res[0], res[1:]
    else:
        gx = None
    add_grads(grads, params, res)
    return xin.detach(), gx


@contextlib.contextmanager
def executing(model: nn.Module, **changes) -> Iterator[nn.Module]:
    """Inside the block, every :class:`InvertibleSequence` of ``model`` runs with ``changes`` to its
    :class:`Execution` (e.g. ``probe=fn``); the previous execution comes back on exit."""
    seqs = [m for m in model.modules() if isinstance(m, InvertibleSequence)]
    old = [s.execution for s in seqs]
    for s in seqs:
        s.set_execution(dataclasses.replace(s.execution, **changes))
    try:
        yield model
    finally:
        for s, o in zip(seqs, old):
            s.set_execution(o)


def plain(model: nn.Module, enabled: bool = True) -> contextlib.AbstractContextManager[nn.Module]:
    """Run every :class:`InvertibleSequence` of ``model`` through plain autograd inside the block."""
    return executing(model, plain=enabled)

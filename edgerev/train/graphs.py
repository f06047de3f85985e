"""A training step of fixed shapes, captured once as a CUDA graph and replayed.

On a GPU a small step is bound by its kernel launches, not by its arithmetic: each of a step's few thousand
kernels costs the host some microseconds to launch whatever it computes. A CUDA graph records the kernels of
one step (``torch.cuda.graph``) and replays them all with one launch. On an H200, RevNeXt's step at batch 32,
32x32 ran 8-17 times faster replayed than launched op by op in every engine mode, with the same gradients to
rounding (at most 2.9e-6 of a parameter's largest gradient apart); at 240x240, where the kernels are large,
1.03-1.04 times (``benchmarks/cuda_graph.py``, docs/concepts/measurements.md). A replay runs the very kernels of
the capture on the very tensors: it applies only while nothing it was recorded with changes, which
:class:`StepGraphs` checks on every step.

What is captured is the micro-batch loop (:func:`edgerev.memory.measure.microbatch.accumulate`): each
micro-batch's forward, loss and backward, with the gradients summed into the parameters' ``.grad``. The
optimizer's update, gradient clipping and the one read of the host stay outside, as the trainer runs them.
The step's batch and targets are copied into the graph's own input tensors before each replay.

A step is replayed when
* it runs on CUDA;
* its key is the previous step's: input and target shapes and dtypes, micro-batches, the engine's modes and
  slices (or plain autograd), every parameter's and buffer's tensor (its address: a weight replaced by another
  tensor is not the one the graph reads), which parameters train, every module's training mode, the loss and the
  default slice budget; and
* its key was run eagerly ``warmup`` times before (cuDNN's choice of algorithm, the quantizer's compilation and
  the optimizer's first state happen there).

Otherwise it runs op by op. One graph is held at a time: its memory pool keeps the step's peak of temporaries
reserved between steps, so a new key releases the old graph before anything else runs, and the trainer
releases it (:meth:`StepGraphs.release`) before work of another shape (an evaluation). A step that cannot be
captured (an op that reads the host, a library kernel that refuses capture, memory that does not fit) runs
eagerly from then on, with the reason kept in :attr:`StepGraphs.refused`; its key is never tried again.

Not under a memory cap. The graph's pool lends none of its blocks to anything outside the step, and what the
step leaves to the allocator's other blocks (the optimizer's update, the batch) must fit beside it: under the
GTX 750 recipe's 400 MiB cap on an H200 a capture ran out of memory twice and one step's micro-batch was halved
(126 ms a step became 197 ms), and with expandable segments the optimizer's update ran out of memory beside a
pool of 153 MiB. So the trainer replays only a run without ``memory.budget``; a capped run launches its kernels.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from edgerev.errors import described
from edgerev.layers.base import chunk_bytes
from edgerev.memory.measure.microbatch import StepLoss, accumulate, step_signature


def step_key(model: nn.Module, x: Tensor, targets: tuple[Tensor, ...], micro_batches: int,
             loss_fn: Callable[..., Tensor]) -> tuple:
    """What a replayed step depends on: if any of it changes, the recorded kernels are not this step's. Beside the
    step's signature (shapes, micro-batches, plan, trainable set): the device, the targets' dtypes, the default
    slice budget, the loss, every parameter's and buffer's tensor (the graph reads and writes those addresses) and
    every module's training mode."""
    return (step_signature(model, x, targets, micro_batches), x.device, tuple(t.dtype for t in targets),
            chunk_bytes(), id(loss_fn), tuple(p.data_ptr() for p in model.parameters()),
            tuple(b.data_ptr() for b in model.buffers()), tuple(m.training for m in model.modules()))


@dataclass
class _Captured:
    key: tuple
    graph: torch.cuda.CUDAGraph
    x: Tensor
    targets: tuple[Tensor, ...]
    loss: StepLoss
    grads: list[tuple[nn.Parameter, Tensor]]


class StepGraphs:
    """The trainer's graphs: at most one held, replayed while its key repeats.

    Attributes:
        captures: graphs captured; replays: steps run by a replay.
        refused: why a key runs eagerly (the first error of its capture), by key; summarized by :meth:`report`.
    """

    def __init__(self, warmup: int = 1) -> None:
        self.warmup = warmup
        self.captures = self.replays = 0
        self.refused: dict[tuple, str] = {}
        self._held: _Captured | None = None
        self._last: tuple | None = None
        self._repeats = 0
        self._stream: torch.cuda.Stream | None = None

    def release(self) -> None:
        """Drop the held graph and give its memory pool back to the allocator."""
        if self._held is not None:
            self._held = None
            torch.cuda.empty_cache()
        self._last, self._repeats = None, 0

    def step(self, model: nn.Module, x: Tensor, targets: tuple[Tensor, ...], micro_batches: int,
             loss_fn: Callable[..., Tensor], parts: list[slice]) -> StepLoss | None:
        """The step's loss when it ran as a replay (its gradients in the parameters' ``.grad``); None when the
        caller must run it eagerly (after which it calls :meth:`ran_eagerly`)."""
        if not x.is_cuda:
            return None
        key = step_key(model, x, targets, micro_batches, loss_fn)
        if self._held is not None and self._held.key != key:
            self.release()
        if key in self.refused:
            return None
        if self._held is None:
            if key != self._last or self._repeats < self.warmup:
                return None
            self._held = self._capture(key, model, x, targets, loss_fn, parts)
            if self._held is None:
                return None
        held = self._held
        held.x.copy_(x)
        for static, t in zip(held.targets, targets, strict=True):
            static.copy_(t)
        for p, g in held.grads:  # the optimizer or a checkpoint may have let go of them: the replay writes these
            if p.grad is not g:
                p.grad = g
        held.graph.replay()
        self.replays += 1
        return held.loss

    def ran_eagerly(self, model: nn.Module, x: Tensor, targets: tuple[Tensor, ...], micro_batches: int,
                    loss_fn: Callable[..., Tensor]) -> None:
        """Count an eager step of this key towards its warm-up."""
        if not x.is_cuda:
            return
        key = step_key(model, x, targets, micro_batches, loss_fn)
        self._repeats = self._repeats + 1 if key == self._last else 1
        self._last = key

    def _capture(self, key: tuple, model: nn.Module, x: Tensor, targets: tuple[Tensor, ...],
                 loss_fn: Callable[..., Tensor], parts: list[slice]) -> _Captured | None:
        static_x = x.clone()
        static_t = tuple(t.clone() for t in targets)
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            p.grad = None  # the capture allocates them in its pool, and every replay writes them whole
        if self._stream is None:
            self._stream = torch.cuda.Stream(x.device)  # one capture stream: its library workspaces are made once
        graph = torch.cuda.CUDAGraph()
        refused = None
        try:
            # thread_local: a call of another thread (a service's, beside the trainer) neither breaks the capture
            # nor is refused because of it
            with torch.cuda.graph(graph, stream=self._stream, capture_error_mode="thread_local"):
                loss = accumulate(model, static_x, static_t, parts, loss_fn)
        except Exception as e:  # noqa: BLE001 (whatever refused the capture, the step runs eagerly)
            refused = described(e)
        if refused is not None:  # out of the except block: its traceback no longer holds the graph and its pool
            for p in params:
                p.grad = None
            del graph
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(x.device)
            torch.cuda.empty_cache()
            self.refused[key] = refused
            return None
        self.captures += 1
        return _Captured(key, graph, static_x, static_t, loss, [(p, p.grad) for p in params if p.grad is not None])

    def report(self) -> dict:
        """What the run's summary says of its graphs."""
        return {"captures": self.captures, "replays": self.replays,
                "refused": sorted(set(self.refused.values()))}


__all__ = ["StepGraphs", "step_key"]

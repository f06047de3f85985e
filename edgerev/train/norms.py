"""Batch-norm statistics a caller sets: frozen during training, measured over a set of images.

A model trained in the usual way normalizes each batch with that batch's statistics. A device of a
fleet that sees three of ten classes then learns weights that fit its classes' statistics only, and the
fleet's average of such weights fits no device (benchmarks/fleet_norm.py measures it). Training with
every batch norm *frozen* (eval mode: the running statistics normalize, and nothing updates them) at
statistics the fleet shares keeps the devices' weights comparable; :func:`calibrate` measures what each
device contributes to those statistics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import Tensor, nn


def norms(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The batch norms of ``model`` (modules with running statistics), in registration order."""
    return ((n, m) for n, m in model.named_modules()
            if isinstance(getattr(m, "running_mean", None), Tensor) and isinstance(getattr(m, "running_var", None),
                                                                                Tensor))


def freeze_norms(model: nn.Module) -> None:
    """Put every batch norm of ``model`` in eval mode (the rest stays as it is): it normalizes with its
    running statistics and leaves them as they are. ``model.train()`` undoes it, so a training loop calls
    this after each switch back to training mode."""
    for _, m in norms(model):
        m.eval()


class _Seen(Exception):
    """Raised by a hook once the one batch norm :func:`calibrate` measures has seen its input: the rest of
    the forward is not needed."""


def calibrate(model: nn.Module, batches: Callable[[], Iterable[Tensor]]) -> None:
    """Set every batch norm's statistics to those of its input over ``batches()`` (the model's float input),
    layer after layer: each layer's input is measured with the layers before it already at their new
    statistics, as a training-mode forward over all the images at once would normalize them. One pass over
    the images per batch norm, each cut short after the layer measured."""
    from edgerev.engine import plain

    was = model.training
    model.eval()
    try:
        for name, m in list(norms(model)):
            sums = [0.0, 0.0, 0]

            def record(_module, args, sums=sums) -> None:
                x = args[0].detach().double()
                sums[0] = sums[0] + x.sum(dim=(0, 2, 3))
                sums[1] = sums[1] + (x * x).sum(dim=(0, 2, 3))
                sums[2] += x.numel() // x.shape[1]
                raise _Seen

            handle = m.register_forward_pre_hook(record)
            try:
                with torch.no_grad(), plain(model):
                    for x in batches():
                        try:
                            model(x)
                        except _Seen:
                            pass
            finally:
                handle.remove()
            if sums[2]:
                set_statistics(model, {name: ((sums[0] / sums[2]).float(), (sums[1] / sums[2]).float())})
    finally:
        model.train(was)


def set_statistics(model: nn.Module, moments: dict[str, tuple[Tensor, Tensor]], least_var: float = 1e-5) -> None:
    """Set each batch norm's running mean and variance from its input's ``moments`` (mean, mean square);
    the variance is at least ``least_var``."""
    for name, m in norms(model):
        if name in moments:
            mean, square = moments[name]
            m.running_mean.copy_(mean)
            m.running_var.copy_((square - mean * mean).clamp_min(least_var))


def measure_running_statistics(model: nn.Module, batches: Iterable[Tensor]) -> int:
    """Replace the running statistics of every batch norm of ``model`` that trains (in training mode) by their
    average over ``batches`` (the model's float input), in one training-mode forward pass per batch, without
    gradient; returns how many batches were seen.

    A running average with momentum 0.1 trails weights that change fast: early in a run from scratch a model
    evaluated with it can sit at chance while the same weights, normalized by statistics of the current
    weights, are right most of the time (``docs/concepts/measurements.md``, ``benchmarks/bn_measure.py``).
    Each batch's mean and variance get the weight ``1/k`` (the k-th batch), so after the pass each statistic
    is the mean of the batches' own (Wu and Johnson's "precise BatchNorm"); give batches like training's
    (its batch size, its augmentation), whose statistics the weights learned to be normalized by. Batch
    norms in eval mode (frozen, ``train.bn_stats: frozen``) are left as they are, and the model comes back
    in the mode it was in.
    """
    from edgerev.engine import plain

    live = [m for _, m in norms(model) if m.training]
    if not live:
        return 0
    momenta = [m.momentum for m in live]
    seen = 0
    try:
        with torch.no_grad(), plain(model):
            for x in batches:
                seen += 1
                for m in live:
                    m.momentum = 1.0 / seen
                model(x)
    finally:
        for m, momentum in zip(live, momenta):
            m.momentum = momentum
    return seen

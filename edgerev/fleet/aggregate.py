"""The fleet's class registry and the averaging of what devices send (numpy only: no Flower, no torch).

Devices discover classes on their own and in any order. The server keeps one registry, class name ->
head row, that only grows (a class keeps its row for the life of the run); every device receives the rows
of all fleet classes and answers with the same rows. Averaging (FedAvg, McMahan et al. 2017) weights each
device by its sample count, and each head row by that device's count *of that class*: a device that never
saw a class does not pull its row towards its untrained initialization. A row no device had samples of in
a round keeps its previous value. Every other tensor is weighted by the device's total count.

Batch-norm statistics (when the fleet shares them) travel as *moments*: a ``running_var`` as the mean
square of the layer's input, ``running_var + running_mean ** 2`` (:func:`as_moments`; :func:`as_variances`
turns it back). Moments average exactly (the fleet's mean square is the count-weighted mean of the
devices'), a variance does not: averaged as such it misses the spread of the devices' means, which under
label skew is most of it. Every average above, and secure aggregation's sums of updates, stay linear.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

HEAD = "head."


def is_head(name: str) -> bool:
    return name.startswith(HEAD)


def head_rows(arrays: Mapping, default: int = 0) -> int:
    """The rows of the head's tensors in ``arrays`` (numpy arrays or Flower's Arrays), ``default`` if none."""
    return next((a.shape[0] for name, a in arrays.items() if is_head(name)), default)


class ClassRegistry:
    """Class name -> head row, in the order the fleet learned them (new names of one round: sorted)."""

    def __init__(self, classes: Iterable[str] = ()) -> None:
        self._rows: dict[str, int] = {}
        self.learn(classes)

    def learn(self, names: Iterable[str]) -> list[str]:
        """Add the names not known yet; returns them, in their new rows' order."""
        new = sorted({n for n in names if n not in self._rows})
        for n in new:
            self._rows[n] = len(self._rows)
        return new

    @property
    def classes(self) -> tuple[str, ...]:
        return tuple(self._rows)

    def row(self, name: str) -> int:
        return self._rows[name]

    def __len__(self) -> int:
        return len(self._rows)


VAR, MEAN = "running_var", "running_mean"


def _paired(arrays: Mapping) -> list[tuple[str, str]]:
    """(variance name, mean name) of each batch norm in ``arrays`` that carries both."""
    return [(n, n[:-len(VAR)] + MEAN) for n in arrays if n.endswith(VAR) and n[:-len(VAR)] + MEAN in arrays]


def as_moments(arrays: Mapping) -> dict:
    """``arrays`` (numpy arrays or torch tensors) with each batch norm's ``running_var`` replaced by its mean
    square, ``var + mean ** 2``: the form in which the fleet averages statistics (see the module docstring)."""
    out = dict(arrays)
    for var, mean in _paired(arrays):
        out[var] = arrays[var] + arrays[mean] * arrays[mean]
    return out


def as_variances(arrays: Mapping, least: float = 1e-5) -> dict:
    """The inverse of :func:`as_moments`: each mean square back to a variance, at least ``least`` (an
    average of rounded moments may dip below zero)."""
    out = dict(arrays)
    for var, mean in _paired(arrays):
        v = arrays[var] - arrays[mean] * arrays[mean]
        out[var] = v.clip(min=least) if isinstance(v, np.ndarray) else v.clamp_min(least)
    return out


def grow_rows(arrays: Mapping[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    """``arrays`` with each head tensor grown to ``rows`` rows; the new rows are zeros (a class the fleet
    has just learned starts from no preference, and the devices that have it train it this round)."""
    out = {}
    for name, a in arrays.items():
        if is_head(name) and a.shape[0] < rows:
            extra = np.zeros((rows - a.shape[0], *a.shape[1:]), dtype=a.dtype)
            a = np.concatenate([a, extra])
        out[name] = a
    return out


@dataclass(frozen=True)
class Contribution:
    """One device's answer: its tensors (fleet rows), its sample count, and its count per fleet class."""

    arrays: Mapping[str, np.ndarray]
    examples: int
    counts: Sequence[int]


def aggregate(contributions: Sequence[Contribution], previous: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The fleet's new tensors: count-weighted averages (see the module docstring).

    Args:
        previous: the tensors sent this round (rows nobody trained keep them).

    Raises:
        ValueError: no contribution, or one whose tensors or counts do not match ``previous``.
    """
    if not contributions:
        raise ValueError("nothing to aggregate")
    rows = head_rows(previous)
    for c in contributions:
        if set(c.arrays) != set(previous):
            raise ValueError("a contribution's tensors differ from the fleet's")
        if len(c.counts) != rows:
            raise ValueError(f"a contribution counts {len(c.counts)} classes, the fleet has {rows}")
    out: dict[str, np.ndarray] = {}
    total = sum(max(0, c.examples) for c in contributions)
    per_row = np.array([list(c.counts) for c in contributions], dtype=np.float64)  # devices x rows
    row_totals = per_row.sum(axis=0)
    for name, prev in previous.items():
        if is_head(name):
            acc = np.zeros(prev.shape, dtype=np.float64)
            for k, c in enumerate(contributions):
                w = per_row[k].reshape(-1, *([1] * (prev.ndim - 1)))
                acc += w * c.arrays[name].astype(np.float64)
            seen = row_totals > 0
            avg = prev.astype(np.float64).copy()
            avg[seen] = acc[seen] / row_totals[seen].reshape(-1, *([1] * (prev.ndim - 1)))
            out[name] = avg.astype(prev.dtype)
        elif total > 0:
            acc = sum(c.examples * c.arrays[name].astype(np.float64) for c in contributions)
            out[name] = (acc / total).astype(prev.dtype)
        else:
            out[name] = np.asarray(prev).copy()
    return out


def weighted_terms(delta: Mapping[str, np.ndarray], examples: int, counts: Sequence[int],
                   scales: Sequence[float]) -> list[np.ndarray]:
    """One device's part of :func:`aggregate` as terms whose plain *sum* over the devices is all the average
    needs, for an aggregation that only ever learns sums (secure aggregation).

    Every weighted average of :func:`aggregate` is ``sum_i w_i x_i / sum_i w_i``, so a device sends its
    weights and its weighted update, in this order: ``[examples]``, the counts per fleet row, then for
    each tensor in name order its update (trained minus received) times its weight (each head row times
    that row's count, any other tensor times ``examples``). Each weight is divided by its scale,
    ``scales[0]`` for ``examples`` and ``scales[1 + k]`` for row ``k`` (the round's largest such count:
    every weight is then at most 1, and the terms stay within the update's own range); a scale cancels in
    the average.
    """
    if len(scales) != 1 + len(counts) or not all(s > 0 for s in scales):
        raise ValueError(f"{len(scales)} scales for {len(counts)} rows, or a scale that is not positive")
    w = np.float64(examples) / scales[0]
    per_row = np.asarray(counts, dtype=np.float64) / np.asarray(scales[1:], dtype=np.float64)
    terms = [np.array([w]), per_row]
    for name in sorted(delta):
        d = np.asarray(delta[name], dtype=np.float64)
        terms.append(d * per_row.reshape(-1, *([1] * (d.ndim - 1))) if is_head(name) else d * w)
    return terms


def term_shapes(previous: Mapping[str, np.ndarray]) -> list[tuple[int, ...]]:
    """The shapes of :func:`weighted_terms` for the fleet's tensors ``previous``: the layout of their sums."""
    return [(1,), (head_rows(previous),), *(tuple(previous[name].shape) for name in sorted(previous))]


def term_scales(examples: Sequence[int], counts: Sequence[Sequence[int]]) -> list[float]:
    """The scales of :func:`weighted_terms` for a round: the largest sample count and each row's largest
    count over the devices (1 where all are 0)."""
    per_row = np.asarray(counts, dtype=np.float64).max(axis=0)
    return [float(max([1, *examples]))] + [float(max(1.0, c)) for c in per_row]


def average_from_sums(sums: Sequence[np.ndarray], previous: Mapping[str, np.ndarray],
                      least_weight: float = 1e-9) -> dict[str, np.ndarray]:
    """The fleet's new tensors from the devices' :func:`weighted_terms` summed: the same averages as
    :func:`aggregate` (a row no device counted, or every tensor when no device had a sample, keeps
    ``previous``).

    Args:
        least_weight: summed weights at or below this count as none (a dequantized sum of zeros may be
            off zero by a rounding).

    Raises:
        ValueError: ``sums`` does not have the layout of ``previous``.
    """
    names, layout = sorted(previous), term_shapes(previous)
    if len(sums) != len(layout) or any(np.shape(s) != want for s, want in zip(sums[:2], layout)):
        raise ValueError(f"{len(sums)} sums do not have the layout of the fleet's {len(names)} tensors")
    total, per_row = float(sums[0][0]), np.asarray(sums[1], dtype=np.float64)
    out: dict[str, np.ndarray] = {}
    for name, s, want in zip(names, sums[2:], layout[2:], strict=True):
        prev = previous[name]
        if np.shape(s) != want:
            raise ValueError(f"the sum of {name} has shape {np.shape(s)}, the fleet's is {want}")
        avg = prev.astype(np.float64)  # a copy
        if is_head(name):
            seen = per_row > least_weight
            avg[seen] += s[seen] / per_row[seen].reshape(-1, *([1] * (prev.ndim - 1)))
        elif total > least_weight:
            avg += s / total
        out[name] = avg.astype(prev.dtype)
    return {n: out[n] for n in previous}

"""The fleet's class registry and the averaging of what devices send (numpy only: no Flower, no torch).

Devices discover classes on their own and in any order. The server keeps one registry, class name ->
head row, that only grows (a class keeps its row for the life of the run); every device receives the rows
of all fleet classes and answers with the same rows. Averaging (FedAvg, McMahan et al. 2017) weights each
device by its sample count, and each head row by that device's count *of that class*: a device that never
saw a class does not pull its row towards its untrained initialization. A row no device had samples of in
a round keeps its previous value. Every other tensor is weighted by the device's total count.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

HEAD = "head."


def is_head(name: str) -> bool:
    return name.startswith(HEAD)


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
    rows = next((a.shape[0] for n, a in previous.items() if is_head(n)), 0)
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

"""How sure the gate may be: exact tests on paired outcomes of two models on the same held-out samples.

Each held-out sample is scored right or wrong under both models. Samples both get right, or both
wrong, say nothing about which is better; the *discordant* ones do: ``gained`` (the candidate right,
the current model wrong) and ``lost`` (the reverse). Under "the models are equally good" each
discordant sample is a fair coin, so ``gained`` out of ``gained + lost`` is Binomial(m, 1/2): McNemar's
exact test, one-sided in the direction asked.

The forgetting check allows a margin ``d`` (a loss of accuracy the owner accepts, e.g. for learning new
classes: a 10-way task is harder than a 5-way one). Given the ``m`` discordant samples among ``n``, the
loss is ``(lost - gained) / n = m (2 t - 1) / n`` where ``t`` is the chance that a discordant sample is a
loss; "the loss is at most d" is ``t <= t0 = (1 + d n / m) / 2``, and the p-value is the binomial tail
of ``lost`` at ``t0`` (conditional on ``m``, as McNemar's own test is). With ``d = 0`` this is McNemar's
test; when ``t0 >= 1`` even a loss of every discordant sample stays within the margin.

Plain Python (``math.lgamma``, exact integers at ``t = 1/2``) rather than scipy: the two tails are a few
lines, and the daemon's status and config paths must not import a numerical stack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def binomial_tail(k: int, n: int, p: float) -> float:
    """``P(X >= k)`` for ``X ~ Binomial(n, p)``, exact (summed in log space; exact integers at ``p = 1/2``)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    if p == 0.5:  # McNemar's case: an exact ratio of integers
        return sum(math.comb(n, j) for j in range(k, n + 1)) / 2**n
    lp, lq, lf = math.log(p), math.log1p(-p), math.lgamma(n + 1)
    terms = [lf - math.lgamma(j + 1) - math.lgamma(n - j + 1) + j * lp + (n - j) * lq for j in range(k, n + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


@dataclass(frozen=True)
class Paired:
    """Two models on the same ``n`` samples: ``gained`` (the candidate right, the current model wrong) and
    ``lost`` (the current model right, the candidate wrong)."""

    n: int
    gained: int
    lost: int

    def __post_init__(self) -> None:
        if min(self.n, self.gained, self.lost) < 0 or self.gained + self.lost > self.n:
            raise ValueError(f"impossible paired counts: {self}")

    @property
    def change(self) -> float:
        """The candidate's accuracy minus the current model's (0 for no sample)."""
        return (self.gained - self.lost) / self.n if self.n else 0.0

    def p_better(self) -> float:
        """One-sided exact McNemar p-value of "the candidate is better" (small: it is)."""
        return binomial_tail(self.gained, self.gained + self.lost, 0.5)

    def p_worse(self, margin: float = 0.0) -> float:
        """One-sided p-value of "the candidate is worse by more than ``margin``" (a fraction of accuracy; small:
        it is). ``margin = 0`` is McNemar's exact test (see the module docstring)."""
        m = self.gained + self.lost
        if m == 0 or self.lost == 0:
            return 1.0
        t0 = (1.0 + margin * self.n / m) / 2.0
        return 1.0 if t0 >= 1.0 else binomial_tail(self.lost, m, t0)


def paired(cand: list[bool] | tuple[bool, ...], cur: list[bool] | tuple[bool, ...]) -> Paired:
    """The paired counts of two models' right/wrong outcomes on the same samples."""
    if len(cand) != len(cur):
        raise ValueError(f"{len(cand)} candidate outcomes but {len(cur)} current ones")
    gained = sum(1 for a, b in zip(cand, cur) if a and not b)
    lost = sum(1 for a, b in zip(cand, cur) if b and not a)
    return Paired(len(cand), gained, lost)


def p_text(p: float) -> str:
    """A p-value as a reason prints it: three significant figures, scientific below 0.001."""
    return f"{p:.2g}" if p < 1e-3 else f"{p:.3g}"


def weighed(p: float, alpha: float, shown: str, chance: str) -> str:
    """What a one-sided test's p-value means for the owner first, the figure after: ``shown`` when ``p`` is at
    most ``alpha`` (the difference is real), else ``chance``; e.g. ``too many gains to be chance (p = 2.8e-14,
    promotion.alpha 0.05)``."""
    return f"{shown if p <= alpha else chance} (p = {p_text(p)}, promotion.alpha {alpha:g})"

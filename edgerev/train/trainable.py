"""Which parameters train, and whether batch norms move their statistics: the choices on-device fine-tuning makes.

TinyTL (Cai et al. 2020) and Lin et al. 2022 ("On-Device Training Under 256KB Memory") fine-tune a
pretrained network by training only part of it: a frozen weight needs no gradient and no optimizer
state, and a layer whose weight is frozen needs no saved input to compute it. The sets, by name:

- ``all``: every parameter;
- ``head``: the classifier only (the last linear layer: an ONNX file's last Gemm/MatMul);
- ``bias``: every bias (batch norms' shifts among them) and the head (TinyTL's bias-only update: a
  bias's gradient needs no saved input, so the activations behind frozen weights are not kept);
- ``last:N``: the parameters of the last ``N`` pieces of the chain that have parameters (a piece is
  what lies between two cut points of the model's graph, :mod:`edgerev.memory.graph`: a block, a
  layer); ``last:1`` is the head when the head stands alone;
- ``auto``: the most trainable parameters that fit the budget at the recipe's batch
  (:func:`choose_trainable`): the largest ``last:N``, or ``bias`` when it trains more; where the recipe's
  optimizer keeps a momentum buffer per weight and every parameter does not fit with it, the buffer is
  kept in bfloat16, or dropped, when that lets more parameters train (:func:`choose_fit`), and the run says so.

The leading pieces of the chain without a trainable parameter are its frozen prefix: they run under
``no_grad`` and keep no activation and no gradient (:class:`~edgerev.memory.graph.ChainModel`).

Batch-norm statistics (``bn_stats``): ``updated`` (batch norms in training mode normalize each batch by
its own statistics and move their running estimates) or ``frozen`` (every batch norm normalizes with
its running statistics and never moves them: small batches of a few classes then cannot pull the
pretrained statistics away).

The parsing here imports no torch (the recipe's config reads it); choosing and applying a set does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from edgerev.errors import EdgerevError
from edgerev.memory.solve.costs import BudgetTooSmall  # pure: no torch

if TYPE_CHECKING:
    from torch import Tensor, nn

    from edgerev.memory.measure.account import StepAccount, StepShape

BN_STATS = ("updated", "frozen")
FORMS = "all, head, bias, last:N (N >= 1) or auto"


class TrainableError(EdgerevError):
    """A trainable set that cannot be read or does not fit the model."""


@dataclass(frozen=True)
class Trainable:
    """A trainable set: ``kind`` one of all, head, bias, last, auto; ``n`` the pieces of ``last:N``."""

    kind: str
    n: int = 0

    def __str__(self) -> str:
        return f"last:{self.n}" if self.kind == "last" else self.kind


def parse_trainable(text: str | Trainable) -> Trainable:
    """``text`` as a :class:`Trainable`.

    Raises:
        TrainableError: not one of the forms (the message lists them).
    """
    if isinstance(text, Trainable):
        return text
    value = str(text).strip()
    if value in ("all", "head", "bias", "auto"):
        return Trainable(value)
    if value.startswith("last:"):
        count = value[len("last:"):]
        if count.isdigit() and int(count) >= 1:
            return Trainable("last", int(count))
    raise TrainableError(f"{text!r} is not a trainable set; use {FORMS}")


def check_bn_stats(value: str) -> str:
    if value not in BN_STATS:
        raise TrainableError(f"{value!r} is not a batch-norm choice; use {' or '.join(BN_STATS)}")
    return value


class NothingFits(BudgetTooSmall):
    """No trainable set fits the budget at the recipe's batch; ``smallest`` is the budget that trains the last piece
    with parameters alone (``last:1``, the head where it stands alone)."""

    def __init__(self, budget: int, smallest: int, batch: int) -> None:
        EdgerevError.__init__(self, f"a budget of {budget:,} bytes trains no set of parameters at batch {batch}; "
                                    f"the smallest budget that fits is {smallest:,} bytes (the last piece alone)")
        self.budget, self.smallest = budget, smallest


# ---- the model's side -----------------------------------------------------------------------------------------


def units(model: nn.Module) -> list[nn.Module]:
    """The pieces of ``model`` that ``last:N`` counts, in order: a chain's pieces with parameters, or an
    edgerev model's stages with parameters and its head."""
    from edgerev.engine import engine_body
    from edgerev.memory.graph import ChainModel
    from edgerev.models.handle import describe

    if isinstance(model, ChainModel):
        parts = model.chain
    else:
        head = describe(model).head
        parts = [*engine_body(model).stages, *([model.get_submodule(head)] if head is not None else [])]
    return [p for p in parts if any(True for _ in p.parameters())]


def head_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The classifier's parameters: the last linear layer in module order (a chain registers its modules in
    the graph's order), else the last piece with parameters."""
    from torch import nn

    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if linears:
        return list(linears[-1].parameters())
    found = units(model)
    if not found:
        raise TrainableError(f"{type(model).__name__} has no parameter to train")
    return list(found[-1].parameters())


def selected(model: nn.Module, trainable: str | Trainable) -> list[nn.Parameter]:
    """The parameters of ``model`` the set names (``auto`` is chosen by :func:`choose_trainable`, not here)."""
    t = parse_trainable(trainable)
    if t.kind == "all":
        return list(model.parameters())
    if t.kind == "head":
        return head_parameters(model)
    if t.kind == "bias":
        out = {id(p): p for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] == "bias"}
        out.update({id(p): p for p in head_parameters(model)})
        return list(out.values())
    if t.kind == "last":
        found = units(model)
        if t.n > len(found):
            raise TrainableError(f"last:{t.n} asks for more pieces than the model's {len(found)} with parameters")
        return list({id(p): p for u in found[len(found) - t.n:] for p in u.parameters()}.values())
    raise TrainableError("trainable auto is chosen under a budget (choose_trainable), not applied as it is")


def set_trainable(model: nn.Module, trainable: str | Trainable = "all", bn_stats: str = "updated",
                  size: int | None = None) -> nn.Module:
    """Train the parameters the set names and freeze the rest; set the batch norms' statistics.

    ``model`` may be any classifier: one without an engine body is captured as its chain (``size``: its
    input size, needed the first time), and the chain is returned: what the planner plans and the trainer
    runs. It shares ``model``'s parameters, whose ``requires_grad`` this sets.
    """
    from edgerev.memory.graph import ChainModel, planned
    from edgerev.train.norms import freeze_norms

    check_bn_stats(bn_stats)
    run = planned(model, size)
    keep = {id(p) for p in selected(run, trainable)}
    if not keep:
        raise TrainableError(f"trainable {trainable}: {type(model).__name__} has no such parameter")
    for p in run.parameters():
        p.requires_grad_(id(p) in keep)
    if isinstance(run, ChainModel):
        run.bn_stats = bn_stats
        run.resplit()
        run.train(run.training)
    elif bn_stats == "frozen":  # an edgerev model runs itself: its batch norms in eval mode (the trainer keeps them so)
        freeze_norms(run)
    return run


def trainable_count(model: nn.Module) -> int:
    """Trainable parameters (elements) of ``model``."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def least_account(run: nn.Module, trainable: Trainable, step: StepShape, bn_stats: str = "updated",
                  loss_fn: Callable[..., Tensor] | None = None) -> StepAccount:
    """The account of ``run`` (a planned model) training ``trainable`` with its whole batch ``step.batch`` in one
    micro-batch, in the least-memory plan the planner has for it (its floor candidates); the set is left applied."""
    from dataclasses import replace

    from edgerev.memory.plan.autoplan import _ModesSolver, _SegmentsSolver, accounted, is_plain

    set_trainable(run, trainable, bn_stats)
    solver = _SegmentsSolver(run, step.size, "cpu") if is_plain(run) else \
        _ModesSolver(run, step.size, "cpu", None, False)  # the planner's own least-memory candidates
    return min((accounted(run, step, replace(f, batch=step.batch or 1), loss_fn) for f in solver.floors()),
               key=lambda a: a.total)


def choose_trainable(model: nn.Module, step: StepShape, budget: int, bn_stats: str = "updated",
                     loss_fn: Callable[..., Tensor] | None = None) -> tuple[Trainable, StepAccount]:
    """``auto``: the set with the most trainable parameters whose step fits ``budget`` at the recipe's batch.

    A set fits when its least-memory plan (the planner's floor segmentations) runs the whole batch
    ``step.batch`` as one micro-batch within ``budget``, as the step's accounting counts it exactly. The
    sets ``last:N`` are nested, so the largest ``N`` that fits is found by bisection; ``bias`` is taken
    instead when it trains more parameters and fits. The model is left with the chosen set applied.

    Raises:
        NothingFits: not even the head fits at that batch (a :class:`~edgerev.memory.solve.costs.BudgetTooSmall`
            whose message names the budget that does).
    """
    from edgerev.memory.graph import planned

    run = planned(model, step.size)
    batch = step.batch or 1

    def least(t: Trainable) -> tuple[StepAccount, int]:
        return least_account(run, t, step, bn_stats, loss_fn), trainable_count(run)

    m = len(units(run))
    results: dict[Trainable, tuple[StepAccount, int]] = {}

    def fits(t: Trainable) -> bool:
        if t not in results:
            results[t] = least(t)
        return results[t][0].total <= budget

    best: Trainable | None = None
    if fits(Trainable("all")):
        best = Trainable("all")
    elif fits(Trainable("last", 1)):
        lo, hi = 1, m - 1  # last:lo fits; last:m is all, which does not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(Trainable("last", mid)) else (lo, mid - 1)
        best = Trainable("last", lo)
        if fits(Trainable("bias")) and results[Trainable("bias")][1] > results[best][1]:
            best = Trainable("bias")
    if best is None:
        smallest = min(results[Trainable("last", 1)][0].total, results[Trainable("all")][0].total)
        set_trainable(run, "all", bn_stats)
        raise NothingFits(budget, smallest, batch)
    set_trainable(run, best, bn_stats)
    return best, results[best][0]


#: what ``auto`` may keep of the recipe's momentum: its buffer as the weights' float32, in bfloat16, or none
STATES = ("kept", "bfloat16", "dropped", "none")


@dataclass(frozen=True)
class Fit:
    """What ``auto`` chose: the trainable set, the optimizer's state (of :data:`STATES`: ``kept`` in float32,
    ``bfloat16``, ``dropped``, or ``none`` where the recipe has no momentum), and the account of that step at its
    least-memory plan."""

    trainable: Trainable
    state: str
    account: StepAccount

    @property
    def momentum(self) -> bool:
        """Whether the optimizer keeps a momentum buffer."""
        return self.state in ("kept", "bfloat16")

    def step(self, step: StepShape) -> StepShape:
        """``step`` with the optimizer's state chosen."""
        from dataclasses import replace

        return replace(step, momentum=self.momentum, state_bytes=2 if self.state == "bfloat16" else 4)

    def summary(self) -> dict:
        """What to say of the choice: the set, and the optimizer's state."""
        return {"trainable": str(self.trainable), "optimizer_state": self.state}


def choose_fit(model: nn.Module, step: StepShape, budget: int, bn_stats: str = "updated",
               loss_fn: Callable[..., Tensor] | None = None) -> Fit:
    """``auto`` with the optimizer's state: the most trainable parameters whose step fits ``budget``.

    The set that trains the most parameters is chosen first (every parameter where that fits with the recipe's
    momentum in either precision, else :func:`choose_trainable`'s without momentum), then the most of its
    momentum that fits beside it: the buffer in float32, else in bfloat16 (half its bytes; the update is
    computed in float32, :func:`edgerev.train.optim.keep_state_in`), else none. Dropping the momentum only ever
    frees memory, so no set that fits with it trains more: SGD without momentum is what fine-tuning on a device
    under a few hundred kilobytes does (Lin et al. 2022), a frozen weight is what TinyTL does, and the first keeps
    more weights learning; 8-bit optimizers (Dettmers et al. 2022) keep the state in fewer bits for the same
    reason. The model is left with the chosen set.

    Raises:
        NothingFits: not even the last piece fits without momentum (its message names the budget that does).
    """
    from dataclasses import replace

    from edgerev.memory.graph import planned

    if not step.momentum:
        chosen, account = choose_trainable(model, step, budget, bn_stats, loss_fn)
        return Fit(chosen, "none", account)
    full = replace(step, state_bytes=4)

    def kept(chosen: Trainable) -> Fit | None:  # the most of the momentum that fits beside the set
        account = least_account(run, chosen, full, bn_stats, loss_fn)
        half = replace(account, optimizer=account.optimizer // 2)  # the state is held, not run: sizes alone
        return next((Fit(chosen, state, a) for state, a in (("kept", account), ("bfloat16", half))
                     if a.total <= budget), None)

    run = planned(model, step.size)
    found = kept(Trainable("all"))
    if found is not None:
        return found
    chosen, without = choose_trainable(model, replace(step, momentum=False), budget, bn_stats, loss_fn)
    return kept(chosen) or Fit(chosen, "dropped", without)

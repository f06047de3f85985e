"""edgerev from Python: :func:`plan` and :func:`fit`, what ``edgerev plan`` and ``edgerev train`` run.

``model`` is anything the resolver takes (:mod:`edgerev.models.resolve`): a registry name, a model
directory, an ONNX file, a factory ``package.module:callable``, or an ``nn.Module`` object::

    import edgerev

    p = edgerev.plan("edgerev.models.designs:mobilenet_v2", size=224, budget="400MiB", batch=32)
    print(p.batch, p.predicted_peak_bytes)

    net = MyNet()                       # trained in place
    out = edgerev.fit(net, "photos/", budget="400MiB", size=64, epochs=3, out="runs/mine")
    # out: the model directory (model.safetensors + model.json); `edgerev export --run out` for ONNX

The command line parses its flags into the same calls: there is one way a model is planned and one
way it is trained.

A model directory is data: the factory its ``model.json`` names is built only when the caller allows it
(``trust_factories``: ``package.module:callable`` names or the callables themselves; see
:mod:`edgerev.models.trust`). A run of one's own factory is reloaded so::

    edgerev.fit("runs/mine", "photos/", out="runs/more", trust_factories=[MyNet])
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from edgerev.config import ConfigError, byte_size, from_dict, load_yaml

if TYPE_CHECKING:
    from edgerev.memory.measure.account import StepShape
    from edgerev.memory.plan.progress import Progress
    from edgerev.train.config import RunConfig
    from edgerev.train.labeled import LabeledImages


@dataclass(frozen=True)
class PlanResult:
    """What :func:`plan` found: ``batch`` (the micro-batch), ``predicted_peak_bytes`` (the whole step as
    the trainer counts it), ``summary`` (``edgerev plan --json``'s object: planner, stages and modes,
    samples per second, measured figures with ``verify``), ``account`` (the step's terms:
    :class:`edgerev.memory.measure.account.StepAccount`, None where the planner gives none) and ``apply`` (sets
    the plan on the model)."""

    batch: int
    predicted_peak_bytes: int
    summary: dict
    account: object | None = None
    apply: Callable[[nn.Module], None] | None = field(default=None, repr=False)


def _with_trainable(cfg, trainable: str):
    """``cfg`` training ``trainable`` (the recipe's ``train.trainable``: the planner's trainable sets, checked
    there); an edgerev whose recipe has no such key trains ``all`` only."""
    if hasattr(cfg.train, "trainable"):
        return replace(cfg, train=replace(cfg.train, trainable=trainable))
    if trainable != "all":
        raise ConfigError(f"trainable: {trainable!r} is not supported by this edgerev; it trains all parameters")
    return cfg


def _trainable_set(net: nn.Module, trainable: str, size: int, step, budget: int, loss_fn
                   ) -> tuple[nn.Module, dict, StepShape]:
    """``net`` training only ``trainable`` (:mod:`edgerev.train.trainable`): what the planner then plans, what
    to say of it (for ``auto``: the set chosen and the optimizer's state,
    :meth:`~edgerev.train.trainable.Fit.summary`), and ``step`` with the optimizer's state it keeps."""
    try:
        from edgerev.train import trainable as sets
    except ImportError:
        raise ConfigError(f"trainable: {trainable!r} is not supported by this edgerev; it plans all parameters") \
            from None
    try:
        if trainable == "auto":  # leaves the chosen set applied
            from edgerev.memory.graph import planned

            fit = sets.choose_fit(net, step, budget, loss_fn=loss_fn)
            return planned(net, size), fit.summary(), fit.step(step)
        return sets.set_trainable(net, sets.parse_trainable(trainable), size=size), {"trainable": trainable}, step
    except sets.TrainableError as e:
        raise ConfigError(f"trainable: {e}") from None


def plan(model: str | Path | nn.Module, *, size: int, budget: int | str, batch: int | None = None,
         device: str = "cpu", momentum: bool = True, estimate: bool = False, verify: bool = False,
         trainable: str = "all", weights: str | Path | None = None, args: dict | None = None,
         trust_factories: Iterable[str | Callable] = (), progress: Callable[[str], None] | Progress | None = None
         ) -> PlanResult:
    """The micro-batch and per-stage modes (or checkpoint segments) that train ``model`` fastest under ``budget``.

    Args:
        model: a model source or an ``nn.Module`` (see the module docstring).
        size: input height and width.
        budget: bytes of the whole step (an int, or a size such as ``"400MiB"``).
        batch: samples per optimizer step, split into micro-batches as the budget needs (None: the
            planner picks the batch).
        device: ``cpu`` or ``cuda``.
        momentum: the recipe's SGD keeps one momentum buffer per weight (False: none).
        estimate: estimate stage costs (fake tensors, FLOPs) instead of measuring them.
        verify: run real steps with the plan and add the measured figures to ``summary``.
        trainable: which parameters train: ``all``, ``head``, ``bias``, ``last:N`` or ``auto`` (the most parameters
            that fit; where they do not all fit with ``momentum``, it is kept in bfloat16, or dropped, when that
            trains more, and ``summary["optimizer_state"]`` says ``bfloat16`` or ``dropped``).
        weights: pretrained weights for a registry name or a factory.
        args: a registry model's or factory's keyword arguments.
        trust_factories: the factories a model directory ``model`` may name (:mod:`edgerev.models.trust`).
        progress: takes a line per phase once planning has taken a few seconds (``edgerev plan`` writes them to
            stderr), or a :class:`~edgerev.memory.plan.progress.Progress` that says when to report.

    Raises:
        edgerev.memory.solve.costs.BudgetTooSmall: the budget is below the smallest step (named).
        edgerev.errors.EdgerevError: a source, size or value that cannot be used (one line).
    """
    from edgerev.memory.graph import planned
    from edgerev.memory.measure.account import account_step
    from edgerev.memory.plan.autoplan import plan_training
    from edgerev.memory.plan.autoplan import verify as verify_plan
    from edgerev.memory.plan.progress import Progress
    from edgerev.models.resolve import resolve_model
    from edgerev.models.trust import owner_factories
    from edgerev.train.config import DataConfig, OptimConfig, RunConfig, TrainConfig
    from edgerev.train.memory import loss_of, step_shape

    budget = byte_size(budget, "budget")
    trusted = owner_factories(trust_factories)  # a misspelt one is refused whatever the source
    handle = resolve_model(model, weights=weights, args=args, trust_factories=trusted)
    net = handle.module.to(device)
    handle.check_size(size)
    # the trainer's default recipe at this size and batch: the same step the trainer accounts and plans
    mom = OptimConfig().momentum if momentum else 0.0
    cfg = RunConfig(data=DataConfig(size=size), train=TrainConfig(batch=batch or TrainConfig().batch),
                    optim=OptimConfig(momentum=mom, nesterov=mom > 0))
    step = step_shape(cfg, net, None, batch)
    chosen: dict = {}
    if trainable != "all":
        net, chosen, step = _trainable_set(net, trainable, size, step, budget, loss_of(cfg))
    report = progress if isinstance(progress, Progress) else Progress(progress)
    tp = plan_training(net, size, budget, device, estimate=estimate, max_batch=batch, step=step, loss_fn=loss_of(cfg),
                       progress=report)
    arch = model if isinstance(model, (str, Path)) else handle.arch or type(net).__name__
    summary = {"arch": str(arch), "size": size, "device": device, "budget_bytes": budget, "step_batch": batch,
               **chosen, **tp.summary}
    if verify:
        report.phase("verifying: real training steps with the plan")
        # the steps run on what the plan is for: an edgerev model itself, any other as its chain (same weights)
        summary.update(verify_plan(planned(net, size), tp.modes, tp.batch, size, device, segments=tp.segments,
                                   slices=tp.slices))
        if device == "cpu":  # the whole step as the trainer holds it, measured on real tensors
            summary["measured_peak_bytes"] = account_step(net, step, tp.batch, tp.apply, loss_of(cfg), real=True).total
    return PlanResult(tp.batch, summary["predicted_peak_bytes"], summary, tp.account, tp.apply)


def fit(model: str | Path | nn.Module | None = None, data: str | Path | LabeledImages | tuple | None = None, *,
        out: str | Path, budget: int | str | None = None, trainable: str | None = None, **options: Any) -> Path:
    """Train (or fine-tune) ``model`` on ``data`` under ``budget``; returns the model directory (``out``).

    Args:
        model: a model source, or an ``nn.Module`` object, which is trained in place (None: the
            config's ``model``). Its model directory records what rebuilds it: its ``arch`` and ``model_args``
            attributes, if set; else for a timm or torchvision module the builder that makes it
            (``timm:create_model`` with its ``model_name``, ``torchvision.models:resnet18``...); else its class
            as ``package.module:Class``. One it would not rebuild is refused before anything is written.
        data: a folder of ``<class>/<image>`` files, a :class:`~edgerev.train.labeled.LabeledImages`,
            or a ``(train, val)`` pair of them (None: the config's sources).
        out: the run's folder; it becomes the model directory.
        budget: the memory cap of the whole step (bytes or ``"400MiB"``; None: none).
        trainable: which parameters train: ``all``, and where the planner offers them ``head``, ``bias``,
            ``last:N``, ``auto`` (the recipe's ``train.trainable``; None: the recipe's, by default ``all``).
        **options: ``size``, ``epochs``, ``batch``, ``lr``, ``device``, ``weights``, ``args``, ``config``
            (a recipe: a :class:`~edgerev.train.config.RunConfig` or a YAML file whose keys the others
            override), ``resume``, ``stop``, ``progress``: see :func:`fit_run`.
    """
    return fit_run(model, data, out=out, budget=budget, trainable=trainable, **options).out


def fit_run(model: str | Path | nn.Module | None = None, data: str | Path | LabeledImages | tuple | None = None, *,
            out: str | Path,
            budget: int | str | None = None, trainable: str | None = None, size: int | None = None,
            epochs: int | None = None, batch: int | None = None, lr: float | None = None, device: str | None = None,
            weights: str | Path | None = None, args: dict | None = None,
            config: RunConfig | dict | str | Path | None = None, resume: bool = False,
            stop: Callable[[], bool] | None = None, progress: bool | None = False,
            trust_factories: Iterable[str | Callable] = ()):
    """:func:`fit`, returning the trainer's :class:`~edgerev.train.trainer.RunResult` (status, steps, summary):
    what ``edgerev train`` prints.

    Args:
        size: input height and width (default: the model's own size when it has one, else the recipe's).
        epochs: the recipe's ``train.epochs``.
        batch: the recipe's ``train.batch``.
        lr: the recipe's ``optim.lr``.
        device: the recipe's ``device``.
        weights: pretrained weights of a registry name or factory (safetensors or a ``state_dict``).
        args: a registry model's or factory's keyword arguments.
        config: the base recipe (a RunConfig, a dict or a YAML file); None: the defaults.
        resume: continue the run in ``out`` (nothing else may change).
        stop: polled after every step; True stops at a step boundary with a checkpoint.
        progress: what stderr shows (None: a bar on a terminal, lines otherwise; False: nothing).
        trust_factories: factories a model directory (``model``, the recipe's ``model.init``) may name, added
            to the recipe's ``model.trust_factories`` (names or the callables; :mod:`edgerev.models.trust`).
    """
    from edgerev.train.config import RunConfig, SourceConfig
    from edgerev.train.labeled import LabeledImages
    from edgerev.train.trainer import train

    if resume and config is None and model is None and data is None:  # the saved recipe, its trust included
        return train(None, out, resume=True, stop=stop, progress=progress)
    if config is None:
        cfg = RunConfig()
    elif isinstance(config, RunConfig):
        cfg = config
    elif isinstance(config, dict):
        cfg = from_dict(RunConfig, config)
    else:
        cfg = from_dict(RunConfig, load_yaml(config))
    if trust_factories:
        from edgerev.models.trust import owner_factories

        named = tuple(dict.fromkeys([*cfg.model.trust_factories, *sorted(owner_factories(trust_factories))]))
        cfg = replace(cfg, model=replace(cfg.model, trust_factories=named))
    given = None
    if isinstance(model, nn.Module):
        from edgerev.models.resolve import ModelSourceError, resolve_model

        given = resolve_model(model, weights=weights)
        if given.arch is None:
            raise ModelSourceError(f"{type(model).__qualname__} is defined inside a function; define the class at a "
                                   "module's top level so its model directory can rebuild it")
        cfg = replace(cfg, model=replace(cfg.model, arch=given.arch, args=dict(given.args), weights=None))
    elif model is not None:
        from edgerev.models.resolve import resolve_model

        cfg = replace(cfg, model=replace(cfg.model, arch=str(model), args=dict(args or {}),
                                         weights=None if weights is None else str(weights)))
        if not resume:  # resolved once here: its own input size is the default size
            given = resolve_model(cfg.model.arch, weights=cfg.model.weights, args=cfg.model.args,
                                  trust_factories=cfg.model.factories)
    if size is None and given is not None:
        size = given.image_size
    if size is not None:
        cfg = replace(cfg, data=replace(cfg.data, size=size))
    if budget is not None:
        cfg = replace(cfg, memory=replace(cfg.memory, budget=budget, mode="auto"))
    if epochs is not None:
        cfg = replace(cfg, train=replace(cfg.train, epochs=epochs))
    if batch is not None:
        cfg = replace(cfg, train=replace(cfg.train, batch=batch))
    if lr is not None:
        cfg = replace(cfg, optim=replace(cfg.optim, lr=lr))
    if device is not None:
        cfg = replace(cfg, device=device)
    given_data = None
    if isinstance(data, (str, Path)):
        cfg = replace(cfg, data=replace(cfg.data, train=SourceConfig(kind="folder", path=str(data))))
    elif isinstance(data, LabeledImages):
        given_data = (data, None)
    elif isinstance(data, tuple) and len(data) == 2 and isinstance(data[0], LabeledImages):
        given_data = data
    elif data is not None:
        raise ConfigError(f"data: expected a folder, LabeledImages or a (train, val) pair, got {type(data).__name__}")
    if trainable is not None:
        cfg = _with_trainable(cfg, trainable)
    # the dataclasses' checks ran on the recipe given; the keys replaced above are checked again here
    cfg = from_dict(RunConfig, _plain(cfg))
    return train(cfg, out, resume=resume, stop=stop, progress=progress, data=given_data, model=given)


def _plain(cfg) -> dict:
    from edgerev.config import to_dict

    return to_dict(cfg)

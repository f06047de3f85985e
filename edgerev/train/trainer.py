"""The trainer: a recipe and an output folder in, a model directory and its curves out.

:func:`train` runs a :class:`~edgerev.train.config.RunConfig` into ``out``:

- ``config.yaml``: the resolved recipe (every default filled in);
- ``metrics.jsonl``: one JSON object per logged step (``"kind": "train"``) and per evaluation
  (``"kind": "eval"``);
- ``checkpoints/``: the latest step's weights and optimizer state (:mod:`edgerev.train.state`);
- ``progress.json``: the latest progress report (:mod:`edgerev.train.progress`), for status readers;
- at the end, ``model.safetensors`` + ``model.json`` (a model directory, see
  :mod:`edgerev.models.directory`), ``replay.safetensors`` when replay is on, ``summary.json`` (with the
  final per-class accuracy and confusion matrix), ``curves.png`` and ``classes.png`` (the same as a picture).

Given unlabelled images and ``semi.enabled``, each step also learns from some of them (FixMatch,
:mod:`edgerev.train.semi`); the held-out figures, the replay sample and the plateau see labelled samples
only. Each epoch's eval row, the progress reports and the summary's ``semi`` block say how many
unlabelled images the steps took and how many got a pseudo-label.

Everything random is a function of the seed and the step: the weights' initialization, each
epoch's order, each step's augmentation. A run resumed from a checkpoint therefore takes the same
steps as one that was never interrupted.

A stop (``stop()``) is asked after every step and between the batches of an evaluation (the starting
model's, each epoch's, the final one), so it waits for one step or one batch, never a whole evaluation
set. An epoch's evaluation cut short leaves a checkpoint that says it is due, and a resume runs it first.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from edgerev.config import ConfigError, dump_yaml, from_dict, load_yaml, to_dict
from edgerev.engine import plain
from edgerev.errors import EdgerevError, NonFiniteError
from edgerev.models.directory import ModelInfo, load_handle, normalize, read_info, save_model, write_json
from edgerev.models.handle import ModelHandle
from edgerev.train.augment import Augment, StrongAugment
from edgerev.train.cap import train_step
from edgerev.train.config import RunConfig, SourceConfig, default_threads
from edgerev.train.continual import grow_head, load_replay, save_replay
from edgerev.train.evaluate import EvaluationStopped, evaluate
from edgerev.train.graphs import StepGraphs
from edgerev.train.labeled import LabeledImages, load_source
from edgerev.train.memory import loss_of, plan_memory, training_model
from edgerev.train.norms import freeze_norms, measure_running_statistics
from edgerev.train.optim import STATE_DTYPES, keep_state_in, sgd
from edgerev.train.progress import Pacer, Plateau, Progress, write_progress
from edgerev.train.schedule import Tail, lr_at, tail_after
from edgerev.train.semi import UnlabeledOrder, per_step, pseudo_label, quotas, semi_summary, step_targets, weak_probs
from edgerev.train.state import has_checkpoint, load_checkpoint, save_checkpoint

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
log = logging.getLogger(__name__)


class RunError(EdgerevError):
    """The output folder or the run's inputs do not allow training to start."""


@dataclass
class RunResult:
    status: str  # "done" or "stopped" (at a step boundary, with a checkpoint)
    out: Path
    step: int
    total_steps: int  # the epoch maximum's steps (a run that stopped on a plateau took fewer)
    summary: dict = field(default_factory=dict)


def _diverged(step: int, lr: float, what: str) -> RunError:
    return RunError(f"training diverged at step {step + 1} ({what}); lower optim.lr ({lr:.4g} at that step) or set "
                    "optim.clip_grad_norm (or, for a network without batch norm, optim.adaptive_clip); the last "
                    "checkpoint holds the weights before it")


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: cuda asked for, but this machine has no usable CUDA device")
    return torch.device(name)


class MetricsLog:
    """``metrics.jsonl``: appended and flushed per line; on resume, lines past the checkpoint are dropped."""

    def __init__(self, path: Path, resume_step: int | None) -> None:
        self.path = path
        self.rows: list[dict] = []
        if resume_step is not None and path.exists():
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by the crash
                if row.get("step", 0) <= resume_step:
                    self.rows.append(row)
        path.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
        self._f = open(path, "a")

    def write(self, row: dict) -> None:
        self.rows.append(row)
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


@dataclass
class _Setup:
    model: ModelHandle
    info: ModelInfo
    train: LabeledImages
    val: LabeledImages
    old: tuple[str, ...]
    teacher: nn.Module | None
    start_eval: dict | None
    source_sha: str | None
    start: str  # how the run starts, a key of DEFAULT_LR: scratch, new, pretrained or folded
    fresh: int | None = None  # the head's first row without trained weights (grown or replaced), None: none


def _prepare(cfg: RunConfig, device: torch.device, data: tuple[LabeledImages, LabeledImages | None] | None,
             given: nn.Module | ModelHandle | None = None, stop: Callable[[], bool] | None = None) -> _Setup:
    """Data, the starting model (grown for new classes) and the teacher, from the recipe (or ``given``, a
    module object trained in place instead of ``model.arch``).

    Raises:
        EvaluationStopped: ``stop()`` said so during the starting model's evaluation.
    """
    size = cfg.data.size
    if data is not None:
        new, val = data[0].resized(size), data[1].resized(size) if data[1] is not None else None
    else:
        new = load_source(cfg.data.train, size)
        val = load_source(cfg.data.val, size) if cfg.data.val is not None else None
    if val is not None:
        train_new = new
    else:
        train_new, val = new.held_out(cfg.data.val_fraction)
    if len(train_new) == 0:
        raise RunError("no training sample is left after holding out the validation split")
    if cfg.train.patience is not None and len(val) == 0:
        raise RunError("train.patience stops on held-out figures, but no sample is held out: give data.val or "
                       "a data.val_fraction above 0, or set train.patience to null")
    torch.manual_seed(cfg.train.seed)
    teacher, start_eval, source_sha, replay = None, None, None, None
    if cfg.model.init is not None:
        start, info0, source_sha = load_handle(cfg.model.init, trust_factories=cfg.model.factories)
        if given is None and not _same_arch(info0.arch, cfg.model.arch):
            raise RunError(f"model.init {cfg.model.init} holds a {info0.arch} model, "
                           f"but model.arch is {cfg.model.arch}")
        if info0.input_size != size:
            raise RunError(f"model.init {cfg.model.init} was trained at {info0.input_size}x{info0.input_size}, "
                           f"but data.size is {size}")
        old = info0.classes
        classes = old + tuple(c for c in train_new.present() if c not in old)
        if cfg.continual.replay > 0:
            replay = load_replay(cfg.model.init, old, read_info(cfg.model.init)[1].get("replay_sha256"))
        model = start
        if cfg.continual.distill > 0:
            teacher = copy.deepcopy(start.module).to(device).eval()
            for p in teacher.parameters():
                p.requires_grad_(False)
        start_eval = evaluate(start.module.to(device), val.restrict(old), info0, device, cfg.train.eval_batch, old=old,
                              stop=stop)
        grow_head(model, old, classes)
        fresh = len(old) if len(classes) > len(old) else None
        info = replace(info0, classes=classes)
        if cfg.model.mean is not None:
            info = replace(info, mean=tuple(cfg.model.mean), std=tuple(cfg.model.std))
        pretrained = f"model.init {cfg.model.init}"
    else:
        from edgerev.models.names import SourceKind, source_kind
        from edgerev.models.resolve import resolve_model

        old, fresh = (), None
        own_head = (given is not None or cfg.model.weights is not None
                    or source_kind(cfg.model.arch) in (SourceKind.DIRECTORY, SourceKind.ONNX))
        classes = train_new.present()
        try:
            rows = None if own_head else len(classes)
            model = (resolve_model(cfg.model.arch, weights=cfg.model.weights, args=cfg.model.args,
                                   num_classes=rows, trust_factories=cfg.model.factories) if given is None
                     else resolve_model(given, num_classes=rows))
            if own_head:
                classes, fresh = _head_classes(model, train_new)
        except EdgerevError as e:
            raise RunError(f"model.arch: {e}") from None
        if given is not None:  # a module object: its model directory must rebuild it, or the run is refused now
            from edgerev.models.resolve import rebuild_error

            why = rebuild_error(model)
            if why is not None:
                raise RunError(f"model: the {type(model.module).__name__} given cannot be rebuilt from its model "
                               f"directory ({why}); name the function that builds it as a factory, e.g. "
                               'fit("torchvision.models:resnet18", data, args={...}), or set arch and model_args on '
                               "the module")
        pretrained = pretrained_source(cfg, model)
        mean, std = _normalization(cfg, model, train_new, pretrained)
        info = ModelInfo(model.arch or "", classes, size, tuple(round(float(v), 4) for v in mean),
                         tuple(round(float(v), 4) for v in std), dict(model.args))
    model.check_size(size)
    train = train_new.relabel(classes)
    if replay is not None:
        train = LabeledImages.concat([train, replay.relabel(classes)])
    model.module.to(device)
    return _Setup(model, info, train, val.restrict(classes), old, teacher, start_eval, source_sha,
                  run_start(model, pretrained is not None), fresh)


def _head_classes(model: ModelHandle, data: LabeledImages) -> tuple[tuple[str, ...], int | None]:
    """The classes of a run whose model came with its own head (a file, a model directory, a module object,
    ``model.weights``), one per row, and the head sized for them (in place); with them the first row the head
    was given without trained weights (None: it kept every row it had).

    A source that names its classes (a model directory, an ONNX file's metadata or sidecar) keeps them in its
    rows' order, each row with its weights, and grows a row per class of the data it does not name. A head
    whose rows number the classes the data declares keeps them as the data's (a class without a training
    sample keeps its row). Any other head is replaced by one with a row per class the data has samples of."""
    present = data.present()
    named = model.classes if len(model.classes) == model.num_classes else ()
    if named:
        new = tuple(c for c in present if c not in named)
        if new and len(new) == len(present):
            log.warning("none of the data's classes %s is among the %d the model names (%s ...): the head grows by "
                        "%d rows", list(present)[:5], len(named), ", ".join(named[:3]), len(new))
        classes = named + new
        grow_head(model, named, classes)
        return classes, len(named) if new else None
    if model.num_classes == len(data.classes):
        return data.classes, None
    model.set_head_rows(len(present))
    return present, 0


def run_start(model: ModelHandle, pretrained: bool) -> str:
    """How a run of ``model`` starts, a key of :data:`~edgerev.train.config.DEFAULT_LR` (its recipe's defaults,
    :meth:`~edgerev.train.config.OptimConfig.resolved`): from random weights one of edgerev's models (scratch) or
    any other (new); from trained weights a network of batch norms (pretrained) or one whose batch norms were folded
    into its convolutions (folded)."""
    if not pretrained:
        return "scratch" if _own(model) else "new"
    return "folded" if _folded(model.module) else "pretrained"


def pretrained_source(cfg: RunConfig, model: ModelHandle) -> str | None:
    """Why the run's starting model is a pretrained one (what it was resolved from), or None: random weights.

    A file (an ONNX file, a model directory) or ``model.weights`` carries trained weights; any other source (a
    registry name, a factory, a module object) does when its batch norms hold statistics other than their
    initial ones (a model without batch norm is then taken as new: nothing in it says otherwise)."""
    from edgerev.models.names import SourceKind, source_kind

    if cfg.model.weights is not None:
        return f"model.weights {cfg.model.weights}"
    if source_kind(cfg.model.arch) in (SourceKind.DIRECTORY, SourceKind.ONNX):
        return f"model.arch {cfg.model.arch}"
    moved = any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None
                and (bool(m.running_mean.ne(0).any()) or bool(m.running_var.ne(1).any()))
                for m in model.module.modules())
    return f"model.arch {cfg.model.arch} (its batch norms hold trained statistics)" if moved else None


def _own(model: ModelHandle) -> bool:
    """One of edgerev's models (its class is edgerev's: the registry's, built by name or given as a module)."""
    return type(model.module).__module__.partition(".")[0] == "edgerev"


def _folded(module: nn.Module) -> bool:
    """A network of convolutions most of which no batch norm follows: a pretrained file whose batch norms were
    folded (every one of them, or all but those no convolution precedes: MobileOne's identity branches keep 35
    batch norms beside 191 convolutions). A network of batch-norm layers has about one per convolution (edgerev's
    invertible layers counted as torch's: RevNeXt's 42 convolutions have 43)."""
    from edgerev.layers.conv import InvConv2d
    from edgerev.layers.norm import InvBatchNorm2d

    convs = sum(isinstance(m, (nn.modules.conv._ConvNd, InvConv2d)) for m in module.modules())
    norms = sum(isinstance(m, (nn.modules.batchnorm._BatchNorm, InvBatchNorm2d)) for m in module.modules())
    return convs > 0 and 2 * norms < convs


def _normalization(cfg: RunConfig, model: ModelHandle, images: LabeledImages, pretrained: str | None):
    """The run's mean and std: the recipe's ``model.mean``/``std``, else what the source carries, else computed
    from the training images, which for a pretrained model is said in one warning line."""
    if cfg.model.mean is not None:
        if len(cfg.model.mean) != model.in_channels:
            raise RunError(f"model.mean: {len(cfg.model.mean)} values for a model of {model.in_channels} input "
                           "channels")
        return cfg.model.mean, cfg.model.std
    if model.mean is not None and model.std is not None:  # the normalization the model was trained with
        return model.mean, model.std
    pixels = images.images.float() / 255
    mean = pixels.mean(dim=(0, 2, 3)).tolist()
    std = pixels.std(dim=(0, 2, 3)).clamp_min(1e-3).tolist()
    if pretrained is not None:
        log.warning("%s carries no normalization: its mean and std are computed from the %d training images (mean "
                    "%s, std %s); set model.mean and model.std in the recipe to the ones it was trained with",
                    pretrained, len(images), [round(v, 4) for v in mean], [round(v, 4) for v in std])
    return mean, std


def _same_arch(saved: str, arch: str) -> bool:
    """Whether a model directory's architecture ``saved`` is what the recipe's ``model.arch`` names."""
    from edgerev.models.names import SourceKind, source_kind

    kind = source_kind(arch)
    if kind is SourceKind.DIRECTORY:
        return read_info(arch)[0].arch == saved
    if kind is SourceKind.ONNX:
        return saved == "onnx"
    return saved == arch


def resolve_run(cfg: RunConfig | None, out: Path, resume: bool) -> RunConfig:
    """The recipe to run in ``out``: the given one for a fresh run, the saved one to resume."""
    saved = out / CONFIG
    if resume:
        if not has_checkpoint(out):
            raise RunError(f"{out} holds no checkpoint to resume from")
        resolved = from_dict(RunConfig, load_yaml(saved))
        if cfg is not None and to_dict(cfg) != to_dict(resolved):
            raise RunError(f"the config differs from the one the run in {out} started with ({saved}); "
                           "resume without --config, or start a new run in another folder")
        return resolved
    if cfg is None:
        raise RunError("a new run needs a config")
    if has_checkpoint(out) or (out / "model.json").exists():
        raise RunError(f"{out} already holds a run; pass --resume to continue it, or choose another folder")
    return cfg


@contextmanager
def training_threads(n: int | None) -> Iterator[int]:
    """torch's CPU threads for the block: ``n``, or one fewer than the cores (``train.threads``); the
    previous count is restored after, so a library caller's setting survives a run."""
    before = torch.get_num_threads()
    n = default_threads() if n is None else n
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)


def train(cfg: RunConfig | None, out: str | Path, resume: bool = False, stop: Callable[[], bool] | None = None,
          progress: bool | None = None, data: tuple[LabeledImages, LabeledImages | None] | None = None,
          report: Callable[[Progress], None] | None = None,
          clock: Callable[[], float] = time.monotonic, source: str | None = None,
          model: nn.Module | None = None, unlabeled: torch.Tensor | None = None) -> RunResult:
    """Run the recipe ``cfg`` into ``out`` (see the module docstring), with ``train.threads`` CPU threads.

    Args:
        resume: continue the run in ``out`` from its latest checkpoint (``cfg`` None or the same).
        stop: polled after every step and between the batches of an evaluation; when it returns True the run
            checkpoints and returns ``status="stopped"`` (a signal handler sets it).
        progress: what stderr shows: None (default) a bar on a terminal and otherwise one line per epoch
            and every ``train.progress_seconds`` within an epoch; True a bar; False nothing.
        data: ``(train, val)`` images held by the caller (a service's store) instead of the recipe's
            sources; ``val`` None holds out ``data.val_fraction`` of ``train``. A resumed run must be
            given the same data.
        report: called with each progress report (at the pace of the lines, whatever stderr shows).
        clock: the monotonic clock that paces reports and measures speed (tests inject one).
        source: what ``data`` is, for the saved recipe (whose ``data.train`` and ``data.val`` then say
            ``kind: provided``, their sample counts and this: the recipe saved is what was trained).
        model: a module object to train in place of building ``model.arch`` (:func:`edgerev.fit`);
            ``model.arch`` then names what rebuilds it (its class, see :mod:`edgerev.models.resolve`).
        unlabeled: ``uint8 [N, 3, H, W]`` images without labels, learnt from when ``semi.enabled`` (resized
            to ``data.size``); a resumed run must be given the same ones.
    """
    out = Path(out)
    cfg = resolve_run(cfg, out, resume)
    if data is not None and not resume:
        cfg = as_given(cfg, data, source)
    with training_threads(cfg.train.threads):
        return _train(cfg, out, resume, stop, progress, data, report, clock, model, unlabeled)


def as_given(cfg: RunConfig, data: tuple[LabeledImages, LabeledImages | None], source: str | None) -> RunConfig:
    """``cfg`` with its data sources replaced by what the caller gave (``kind: provided``)."""
    what = source or "images given by the program that ran the trainer"
    train_src = SourceConfig(kind="provided", samples=max(1, len(data[0])), description=f"training: {what}")
    val_src = None if data[1] is None else SourceConfig(kind="provided", samples=max(1, len(data[1])),
                                                         description=f"validation: {what}")
    return replace(cfg, data=replace(cfg.data, train=train_src, val=val_src))


class _Reporter:
    """Where each :class:`Progress` goes: ``progress.json``, stderr (bar or lines), the caller's hook."""

    def __init__(self, out: Path, total: int, initial: int, progress: bool | None,
                 report: Callable[[Progress], None] | None) -> None:
        tty = sys.stderr.isatty()
        self.bar = _progress(total, initial, tty if progress is None else progress)
        self.lines = progress is not False
        self.out, self.hook = out, report

    def __call__(self, p: Progress, epoch_end: bool) -> None:
        write_progress(self.out, p)
        if self.lines:
            if isinstance(self.bar, _NoBar):
                print(p.line(), file=sys.stderr, flush=True)
            elif epoch_end or p.state != "running":
                self.bar.write(p.line(), file=sys.stderr)  # above the bar, which shows the steps between
        if self.hook is not None:
            self.hook(p)


def step_graphs(cfg: RunConfig, device: torch.device, unlabeled: int, teacher: bool) -> StepGraphs | None:
    """The run's CUDA graphs (``train.cuda_graphs``), or None where its steps launch their kernels: off CUDA, under
    ``memory.budget``, and where other forwards run between the steps (FixMatch's weak views, a teacher's logits):
    the graph's memory pool lends nothing to what runs beside it (:mod:`edgerev.train.graphs`)."""
    if not cfg.train.cuda_graphs or device.type != "cuda" or cfg.memory.budget is not None or unlabeled or teacher:
        return None
    return StepGraphs()


def _train(cfg: RunConfig, out: Path, resume: bool, stop: Callable[[], bool] | None, progress: bool | None,
           data: tuple[LabeledImages, LabeledImages | None] | None, report: Callable[[Progress], None] | None,
           clock: Callable[[], float], given: nn.Module | ModelHandle | None = None,
           unlabeled: torch.Tensor | None = None) -> RunResult:
    device = _device(cfg.device)
    try:
        s = _prepare(cfg, device, data, given, stop)
    except EvaluationStopped:  # nothing written yet: a resume, or a new start, prepares again
        return RunResult("stopped", out, 0, 0, {"stopped_in": "the starting model's evaluation"})
    model, info = s.model.module, s.info
    probe = None if resume else _probe(cfg, s, device)  # a resumed run's checkpoint holds the fitted rows
    batch = min(cfg.train.batch, len(s.train))
    pool = _pool(unlabeled, cfg.data.size) if cfg.semi.enabled else None
    u = per_step(cfg.semi.ratio, batch, len(pool)) if pool is not None else 0  # unlabelled images per step
    run = training_model(cfg, model)  # the model itself, or a model from outside as its chain (sharing its weights)
    # the budget is checked (and the step planned) before anything is written: a refused run leaves nothing
    memory = plan_memory(cfg, run, s.teacher, batch, device, u)
    micro, cap, plan_summary = memory.micro_batches, memory.cap, memory.summary
    out.mkdir(parents=True, exist_ok=True)
    if not resume:
        dump_yaml(out / CONFIG, cfg)
    # a saved null is chosen again on resume
    cfg = replace(cfg, optim=cfg.optim.resolved(s.start, batch))
    params = [p for p in model.parameters() if p.requires_grad]
    if not memory.momentum:  # trainable auto dropped it to train more parameters (said in the plan)
        cfg = replace(cfg, optim=replace(cfg.optim, momentum=0.0, nesterov=False))
    optimizer = sgd(params, lr=cfg.optim.lr, momentum=cfg.optim.momentum, nesterov=cfg.optim.nesterov,
                    weight_decay=cfg.optim.weight_decay, state_bytes=memory.state_bytes)  # auto's bfloat16: 2

    per_epoch = max(1, len(s.train) // batch)
    if u:  # with FixMatch an epoch is one pass over the longer of the two: the labelled samples cycle meanwhile
        per_epoch = max(per_epoch, math.ceil(len(pool) / u))
    total = cfg.train.epochs * per_epoch
    step = 0
    semi_epochs: list[dict] = []  # per epoch: the unlabelled images the steps took, and those pseudo-labelled
    evaluation_due = False  # the evaluation of the epoch the checkpoint's step closed was cut short by a stop
    if resume:
        r = load_checkpoint(out, model, optimizer)
        keep_state_in(optimizer, STATE_DTYPES[memory.state_bytes])  # torch cast the state to the weights' dtype
        step, micro = r.step, max(micro, int(r.extra.get("micro_batches", micro)))
        semi_epochs = list(r.extra.get("semi", []))
        evaluation_due = bool(r.extra.get("evaluation_due", False))
        probe = r.extra.get("head_probe")
    metrics = MetricsLog(out / METRICS, step if resume else None)
    augment = Augment(cfg.augment.pad, cfg.augment.flip, cfg.augment.cutout)
    weak = Augment(cfg.augment.pad, cfg.augment.flip, 0)  # FixMatch's weak view: the recipe's shift and flip
    strong = StrongAugment(pad=max(1, cfg.augment.pad))
    quota = quotas(s.train.labels, len(info.classes), u, cfg.semi.class_cap) if u else None
    draw = UnlabeledOrder(len(pool), u, cfg.train.seed) if u else None
    loss_fn = loss_of(cfg, u)
    graphs = step_graphs(cfg, device, u, s.teacher is not None)
    reporter = _Reporter(out, total, step, progress, report)
    bar = reporter.bar
    plateau = Plateau(cfg.train.patience, (r for r in metrics.rows if r["kind"] == "eval"))
    pacer = Pacer(cfg.train.progress_seconds, clock)
    status, started, window = "done", time.perf_counter(), []
    since_report, first_step, t_start = [], step, clock()
    order, order_epoch = None, -1

    def tail() -> Tail | None:
        """Where the run anneals and ends once patience has run out (None before)."""
        if plateau.ran_out is None:
            return None
        return tail_after(plateau.ran_out, per_epoch, cfg.train.anneal_epochs, total)

    def end() -> int:
        t = tail()
        return total if t is None else t.end

    def semi_of(epoch: int) -> dict:
        """The counts of ``epoch`` (1-based), made when its first step takes unlabelled images."""
        while len(semi_epochs) < epoch:
            semi_epochs.append({"epoch": len(semi_epochs) + 1, "unlabeled": 0, "pseudo_labeled": 0})
        return semi_epochs[epoch - 1]

    def progress_of(state: str, epoch: int, lr: float) -> Progress:
        taken = step - first_step
        rate = taken / (clock() - t_start) if taken and clock() > t_start else None
        last = next((r for r in reversed(metrics.rows) if r["kind"] == "eval"), None)
        counts = semi_of(epoch) if u else {}
        return Progress(state, step, end(), epoch, cfg.train.epochs,
                        sum(since_report) / len(since_report) if since_report else None, lr, rate,
                        (end() - step) / rate if rate else None,
                        last and last.get("acc"), last and last.get("loss"), plateau.best_acc, plateau.best_epoch,
                        time.time(), counts.get("unlabeled"), counts.get("pseudo_labeled"))

    def evaluate_epoch() -> bool:
        """The held-out evaluation of the epoch ``step`` closes, logged and given to the plateau; False when a
        stop cut it short (nothing of it is kept)."""
        if graphs is not None:
            graphs.release()  # the evaluation's batches are another shape: its memory, not the graph's pool
        try:
            _measure_norms(cfg, s, model, info)
            ev = evaluate(model, s.val, info, device, cfg.train.eval_batch, old=s.old, stop=stop)
        except EvaluationStopped:
            return False
        metrics.write({"kind": "eval", "step": step, "epoch": step // per_epoch,
                       **{k: v for k, v in ev.items() if k not in ("per_class", "confusion")},
                       **({k: semi_of(step // per_epoch)[k] for k in ("unlabeled", "pseudo_labeled")} if u else {})})
        plateau.update(step // per_epoch, ev["acc"], ev["loss"])
        return True
    try:
        model.train()
        run.train()  # the chain a model from outside runs as has a mode of its own (the module's when it was captured)
        if evaluation_due and not evaluate_epoch():  # the checkpoint still says it is due
            status = "stopped"
        while status == "done" and step < end():  # a resumed run may have reached its plateau or its tail's end
            epoch, k = divmod(step, per_epoch)
            rounds = -(-(k + 1) * batch // len(s.train))  # passes over the labelled samples the epoch needs so far
            if epoch != order_epoch or len(order) < rounds * len(s.train):
                order = torch.cat([torch.randperm(len(s.train), generator=torch.Generator().manual_seed(
                    cfg.train.seed * 100_003 + epoch + 1_000_000_007 * r)) for r in range(rounds)])
                order_epoch = epoch
            idx = order[k * batch:(k + 1) * batch]
            g = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + step)
            x = normalize(augment(s.train.images[idx], g).to(device), info)
            y = s.train.labels[idx].to(device)
            target = (y,)
            if cfg.train.bn_stats == "frozen":  # each step: the evaluation at an epoch's end switched them back
                freeze_norms(model)
            if u:  # FixMatch: pseudo-labels from the weak views, the strong views join the batch
                images = pool[draw.at(step)]
                with plain(run, cfg.memory.mode == "plain"):
                    probs = weak_probs(run, normalize(weak(images, g).to(device), info), micro, cap)
                pseudo, mask = pseudo_label(probs, cfg.semi.threshold, quota)
                target = step_targets(y, pseudo, mask, cfg.semi.weight)
                x = torch.cat([x, normalize(strong(images, g).to(device), info)])
                counts = semi_of(epoch + 1)
                counts["unlabeled"] += u
                counts["pseudo_labeled"] += int(mask.sum())
            if s.teacher is not None:
                with torch.no_grad():
                    target = (*target, s.teacher(x))
            lr = lr_at(step, total, cfg.optim, tail())
            for group in optimizer.param_groups:
                group["lr"] = lr
            t0 = time.perf_counter()
            try:
                with plain(run, cfg.memory.mode == "plain"):
                    res = train_step(run, optimizer, x, target, micro_batches=micro, loss_fn=loss_fn,
                                     clip_grad_norm=cfg.optim.clip_grad_norm, adaptive_clip=cfg.optim.adaptive_clip,
                                     cap=cap, graphs=graphs)
            except NonFiniteError as e:
                raise _diverged(step, lr, str(e)) from None
            if not math.isfinite(res.loss):
                raise _diverged(step, lr, f"loss {res.loss}")
            window.append((res.loss, time.perf_counter() - t0))
            since_report.append(res.loss)
            micro = res.micro_batches
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{res.loss:.3f}", epoch=epoch + 1)
            if step % cfg.train.log_every == 0 or step == end():
                metrics.write({"kind": "train", "step": step, "epoch": epoch + 1, "lr": lr,
                               "loss": sum(w[0] for w in window) / len(window),
                               "step_seconds": sum(w[1] for w in window) / len(window), "micro_batches": micro})
                window = []
            end_of_epoch = step % per_epoch == 0
            evaluation_due = end_of_epoch and not evaluate_epoch()
            stopping = evaluation_due or (stop is not None and stop())
            if end_of_epoch or stopping or step % cfg.train.checkpoint_every == 0 or step == end():
                save_checkpoint(out, step, epoch, model, optimizer, {"micro_batches": micro, "semi": semi_epochs}
                                | ({"evaluation_due": True} if evaluation_due else {})
                                | ({"head_probe": probe} if probe is not None else {}))
            if not evaluation_due and pacer.due(end_of_epoch) and step < end():  # the last report follows the loop
                reporter(progress_of("running", epoch + 1, lr), end_of_epoch)
                since_report = []
            if stopping and (step < end() or evaluation_due):
                status = "stopped"
                break
    finally:
        if graphs is not None:
            graphs.release()
        bar.close()
        metrics.close()
    last_epoch = max(1, -(-step // per_epoch))
    if status == "done" and stop is not None and stop():  # asked in the last step: the rest waits for a resume
        status = "stopped"
    if status == "stopped":
        reporter(progress_of("stopped", last_epoch, lr_at(max(0, step - 1), total, cfg.optim, tail())), True)
        return RunResult(status, out, step, total)
    early = None
    if plateau.ran_out is not None and plateau.ran_out < cfg.train.epochs:
        annealed = (step - tail().start) // per_epoch
        early = {"epoch": plateau.ran_out, "annealed_epochs": annealed, "reason": plateau.reason()
                 + (f"; then annealed over {annealed} epochs to lr {lr_at(step - 1, total, cfg.optim, tail()):.2g}"
                    if annealed else "")}
    if cap is not None and cap.peak:  # what the tracker saw in this session's verified steps, against the plan's
        plan_summary = {**plan_summary, "measured_peak_bytes": cap.peak}
    if graphs is not None:
        plan_summary = {**plan_summary, "cuda_graphs": graphs.report()}
    semi = semi_summary(semi_epochs, len(pool), u) if u else None
    summary = _finish(cfg, out, s, model, info, metrics.rows, plan_summary, time.perf_counter() - started, step,
                      early, stop, semi, probe)
    if summary is None:
        reporter(progress_of("stopped", last_epoch, lr_at(max(0, step - 1), total, cfg.optim, tail())), True)
        return RunResult("stopped", out, step, total, {"stopped_in": "the final evaluation"})
    reporter(progress_of("plateau" if early else "done", last_epoch,
                         lr_at(max(0, step - 1), total, cfg.optim, tail())), True)
    return RunResult(status, out, step, total, summary)


#: images per class the new rows of a pretrained model's head are fitted on (:func:`_probe`)
PROBE_IMAGES = 64


def _probe(cfg: RunConfig, s: _Setup, device: torch.device) -> dict | None:
    """A pretrained model's new head rows fitted to its features (``continual.probe``,
    :func:`edgerev.train.continual.fit_new_rows`) on up to :data:`PROBE_IMAGES` unaugmented training images per
    class, in batches of ``train.eval_batch``; what was fitted (the summary's ``head_probe``), None: nothing to
    fit (no new row, a model from random weights, or ``continual.probe`` false)."""
    if not cfg.continual.probe or s.fresh is None or s.start not in ("pretrained", "folded"):
        return None
    from edgerev.train.continual import fit_new_rows, head_inputs

    sample = s.train.balanced_sample(PROBE_IMAGES * len(s.info.classes), cfg.train.seed)
    b = cfg.train.eval_batch
    features = head_inputs(s.model, (normalize(sample.images[k:k + b].to(device), s.info)
                                     for k in range(0, len(sample), b)))
    fit = fit_new_rows(s.model, features, sample.labels, s.fresh, cfg.optim.weight_decay)
    log.info("the head's %d new rows fitted to the pretrained features of %d images (accuracy on them %s)%s",
             fit["rows"], fit["images"], fit["accuracy"],
             f": kept as they were, {fit['kept']}" if "kept" in fit else "")
    return fit


def _measure_norms(cfg: RunConfig, s: _Setup, model: nn.Module, info: ModelInfo) -> None:
    """Before an evaluation: the running statistics of the batch norms that train, measured anew on
    ``train.bn_measure`` training images (a fixed draw, in whole batches of the training batch size, augmented
    as training augments; none with ``train.bn_stats: frozen``). Measured on unaugmented images in batches of
    ``eval_batch`` instead, a daemon's second job (two epochs, a new class) left that class at 0 %.

    It does not ask ``stop()``: a stop callable is polled once a step and between an evaluation's batches
    (callers count on it), and this is ``bn_measure / batch`` forward passes without gradient (8 of 64 images
    by default): about three training steps' work.
    """
    n = min(cfg.train.bn_measure, len(s.train))
    if n == 0 or cfg.train.bn_stats == "frozen":
        return
    device = next(model.parameters()).device
    pick = torch.randperm(len(s.train), generator=torch.Generator().manual_seed(cfg.train.seed * 7_919 + 1))[:n]
    b = min(cfg.train.batch, n)
    augment, g = Augment(cfg.augment.pad, cfg.augment.flip, cfg.augment.cutout), torch.Generator().manual_seed(7)
    measure_running_statistics(model, (normalize(augment(s.train.images[pick[k:k + b]], g).to(device), info)
                                       for k in range(0, n - b + 1, b)))


def _finish(cfg: RunConfig, out: Path, s: _Setup, model: nn.Module, info: ModelInfo, rows: list[dict],
            plan_summary: dict, seconds: float, step: int, early: dict | None,
            stop: Callable[[], bool] | None = None, semi: dict | None = None,
            probe: dict | None = None) -> dict | None:
    """Final evaluation, the model directory, the replay sample, the summary and the plot.

    ``early``: ``{"epoch", "annealed_epochs", "reason"}`` when patience ran out (at the end of ``epoch``)
    before the epoch maximum, and the run annealed for ``annealed_epochs`` before it stopped. ``stop`` is
    asked between the batches of the evaluation and once it is done: True returns None before anything is
    written (the last step's checkpoint holds the run, and a resume comes straight here). ``semi``: the
    unlabelled images used (the summary's ``semi``, None when none were). ``probe``: the new head rows fitted
    before training (the summary's ``head_probe``, :func:`_probe`)."""
    device = next(model.parameters()).device
    try:
        _measure_norms(cfg, s, model, info)
        final = evaluate(model, s.val, info, device, cfg.train.eval_batch, old=s.old, stop=stop)
    except EvaluationStopped:
        return None
    if stop is not None and stop():
        return None
    extra = {}
    if cfg.continual.replay > 0:
        extra["replay_sha256"] = save_replay(out, s.train.balanced_sample(cfg.continual.replay, cfg.train.seed))
    summary = {
        "arch": info.arch, "classes": list(info.classes), "old_classes": list(s.old), "steps": step,
        "train_samples": len(s.train), "val_samples": len(s.val),
        "seconds_this_session": round(seconds, 3), "final": final, "plan": plan_summary,
        "source_sha256": s.source_sha, "stopped_early": early, "semi": semi, "head_probe": probe,
    }
    if s.start_eval is not None:
        summary["start_old_acc"] = s.start_eval["acc"]
        if final["old_acc"] is not None and s.start_eval["acc"] is not None:
            summary["forgetting"] = s.start_eval["acc"] - final["old_acc"]
    model.cpu()
    summary["weights_sha256"] = save_model(out, s.model, info, extra)
    write_json(out / SUMMARY, summary)
    try:
        from edgerev.train.plots import plot_classes, plot_run

        plot_run(rows, plan_summary, out / "curves.png", title=f"{info.arch}: {out.name}")
        plot_classes(final, out / "classes.png", title=f"{info.arch}: {out.name}, per class")
    except ImportError as e:  # matplotlib is a dependency; a broken install must not lose the model
        print(f"edgerev: curves not plotted: {e}", file=sys.stderr)
    return summary


def _pool(images: torch.Tensor | None, size: int) -> torch.Tensor | None:
    """The unlabelled images as ``uint8 [N, 3, size, size]`` (None: none given, or none at all).

    Raises:
        RunError: they are not a batch of 3-channel ``uint8`` images.
    """
    if images is None or len(images) == 0:
        return None
    if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != 3:
        raise RunError(f"unlabelled images must be uint8 [N, 3, H, W], got {images.dtype} {list(images.shape)}")
    if images.shape[-2:] == (size, size):
        return images
    x = torch.nn.functional.interpolate(images.float(), size=(size, size), mode="bilinear", align_corners=False,
                                        antialias=True)
    return x.round().clamp(0, 255).to(torch.uint8)


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def set_postfix(self, **kw) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, initial: int, show: bool):
    if not show:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)

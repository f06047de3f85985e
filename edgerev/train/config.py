"""The training recipe: a YAML file read into frozen dataclasses (see :mod:`edgerev.config`).

Defaults are the recipe behind the RevNeXt paper's CIFAR-10 runs: SGD with Nesterov momentum 0.9,
a one-cycle schedule peaking at lr 0.4, weight decay 5e-4, pad-and-crop and flip. Every key is
optional; ``configs/`` holds presets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from edgerev.config import Pruned, byte_size, check
from edgerev.sizes import ByteSize

SCHEDULES = ("onecycle", "linear", "constant")
FORMAT = 1  # the saved recipe's format: a file of a later format is refused, not misread
MODES = ("auto", "plain", "invert", "floor", "recompute", "store", "store8", "store4")


@dataclass(frozen=True)
class ModelConfig:
    """``arch``: the model, one of a registry name, an edgerev model directory (a path with a ``/``), an
    ``.onnx`` file or a factory ``package.module:callable`` (see :mod:`edgerev.models.resolve`); ``args``:
    the registry model's or the factory's keyword arguments (``num_classes`` comes from the data);
    ``weights``: pretrained weights for a registry model or a factory, a safetensors file or a
    ``state_dict`` saved by ``torch.save`` (read with ``weights_only``); its classifier keeps its rows when
    they number the classes the data declares, else is re-made for the classes with samples (a model
    directory or an ONNX file that names its classes keeps them, each row with its weights, and grows a row
    per class of the data it does not name). ``init``: a model directory (a previous run's output) to continue from,
    keeping its classes and growing its head for new ones. ``trust_factories``: factories
    ``package.module:callable`` that a model directory (``arch``, ``init``, a daemon's versions) may name.
    A model directory is data and never names code to run unless its owner allows it here (or an installed
    package registers the factory as an ``edgerev.models`` entry point); a factory named in ``arch`` is
    allowed too. Naming a factory is trusting its module: importing it runs its code.

    ``mean``, ``std``: per channel, the normalization the model was trained with, on pixels scaled to 0..1
    (both or neither). They stand above what the source carries (a model directory's, an ONNX file's
    metadata or sidecar, a module's ``mean``/``std``); with neither here nor there, they are computed from
    the training images, which is right for a model trained from random weights and, for a pretrained one,
    said in one warning line: a model normalized otherwise than it was trained sees other inputs."""

    arch: str = "revnext"
    args: dict = field(default_factory=dict)
    weights: str | None = None
    init: str | None = None
    trust_factories: tuple[str, ...] = ()
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        from edgerev.errors import UnknownModelError
        from edgerev.models.names import SourceKind, source_kind  # no torch: the daemon's config stays light

        try:
            kind = source_kind(self.arch)
        except UnknownModelError as e:
            check(False, "arch", str(e))
        for i, name in enumerate(self.trust_factories):
            try:
                trusted = source_kind(name) is SourceKind.FACTORY
            except UnknownModelError:
                trusted = False
            check(trusted, f"trust_factories[{i}]", f"{name!r} is not a factory package.module:callable")
        check("num_classes" not in self.args, "args.num_classes", "set by the data's classes, not here")
        check((self.mean is None) == (self.std is None), "mean" if self.mean is None else "std",
              "the normalization needs both mean and std")
        if self.mean is not None:
            check(len(self.mean) == len(self.std), "std", f"has {len(self.std)} values, mean {len(self.mean)}")
            for i, v in enumerate(self.std):
                check(v > 0, f"std[{i}]", f"must be positive, got {v}")
        if kind in (SourceKind.DIRECTORY, SourceKind.ONNX):
            check(not self.args, "args", f"{self.arch} carries its own architecture; leave args out")
            check(self.weights is None, "weights", f"{self.arch} carries its own weights; leave weights out")

    @property
    def factories(self) -> tuple[str, ...]:
        """The factories a model directory of this recipe may name: ``trust_factories``, and ``arch`` when it
        is one (the owner named it)."""
        from edgerev.models.names import SourceKind, source_kind

        return tuple(dict.fromkeys([*([self.arch] if source_kind(self.arch) is SourceKind.FACTORY else []),
                                    *self.trust_factories]))


@dataclass(frozen=True)
class SourceConfig(Pruned):
    """Where images come from.

    ``synthetic``: the generated set (``samples`` from index ``start``, ``num_classes``, ``classes``
    subset, ``seed``: the classes' identity, ``noise``); the same seed at another ``start`` gives
    other samples of the same classes; ``folder``: ``path/<class>/<image>``; ``cifar10``: the binary version at ``path``
    (``split`` train or test); ``provided``: ``samples`` images a program gave the trainer (a daemon
    job's store), said in ``description``: written in a run's saved recipe, never read from a file.
    A saved recipe holds only the fields of its source's kind.
    """

    kind: Literal["synthetic", "folder", "cifar10", "provided"] = "synthetic"
    path: str | None = None
    samples: int = 2000
    num_classes: int = 10
    classes: tuple[int, ...] | None = None
    seed: int = 0
    start: int = 0
    noise: float = 40.0
    split: Literal["train", "test"] = "train"
    description: str | None = None

    def saved_fields(self) -> tuple[str, ...]:
        return {"synthetic": ("kind", "samples", "num_classes", "classes", "seed", "start", "noise"),
                "folder": ("kind", "path"), "cifar10": ("kind", "path", "split"),
                "provided": ("kind", "samples", "description")}[self.kind]

    def __post_init__(self) -> None:
        if self.kind in ("folder", "cifar10"):
            check(self.path is not None, "path", f"a {self.kind} source needs a local path")
        check(self.samples >= 1, "samples", f"must be at least 1, got {self.samples}")
        check(self.start >= 0, "start", f"must be >= 0, got {self.start}")
        check(self.num_classes >= 2, "num_classes", f"must be at least 2, got {self.num_classes}")


@dataclass(frozen=True)
class DataConfig:
    """``size``: input height and width; ``val``: a held-out source, or, when absent, a fraction
    ``val_fraction`` of the training source held out (fixed by sample index, so it never moves)."""

    train: SourceConfig = field(default_factory=SourceConfig)
    val: SourceConfig | None = None
    val_fraction: float = 0.1
    size: int = 32

    def __post_init__(self) -> None:
        check(self.size >= 1, "size", f"must be positive, got {self.size}")
        check(0.0 <= self.val_fraction < 1.0, "val_fraction", f"must lie in [0, 1), got {self.val_fraction}")


@dataclass(frozen=True)
class AugmentConfig:
    pad: int = 4
    flip: float = 0.5
    cutout: int = 0

    def __post_init__(self) -> None:
        check(self.pad >= 0, "pad", f"must be >= 0, got {self.pad}")
        check(0.0 <= self.flip <= 1.0, "flip", f"is a probability, got {self.flip}")
        check(self.cutout >= 0, "cutout", f"must be >= 0, got {self.cutout}")


#: ``optim.lr`` when the recipe leaves it null, by how a run starts (:class:`OptimConfig`); ``new``'s at a batch of
#: :data:`NEW_LR_BATCH`, scaled with the batch
DEFAULT_LR = {"scratch": 0.4, "new": 0.1, "pretrained": 0.01, "folded": 0.01}
NEW_LR_BATCH = 256
#: the gradient norm a run clips at when the recipe leaves ``optim.clip_grad_norm`` null, by how it starts
DEFAULT_CLIP = {"scratch": None, "new": None, "pretrained": None, "folded": None}
#: the unit-wise clipping ratio a run clips at when the recipe leaves ``optim.adaptive_clip`` null, by how it starts
DEFAULT_ADAPTIVE_CLIP = {"scratch": None, "new": None, "pretrained": None, "folded": 0.2}


@dataclass(frozen=True)
class OptimConfig:
    """SGD; ``lr`` is the peak of the schedule (reached after ``warmup`` of the steps); null: chosen by how the
    run starts (:data:`DEFAULT_LR`): 0.4 for one of edgerev's models from random weights (the RevNeXt paper's
    peak), 0.1 times the batch over 256 for a model from elsewhere from random weights (the linear scaling rule
    of Goyal et al. 2017, from ResNet's 0.1 at 256, as torchvision's recipes train: 0.003 at a batch of 8; at 0.4
    the zoo's SqueezeNet went to NaN and its ConvNeXts' losses to 70-200 within three steps), 0.01
    for fine-tuning a pretrained one (an ONNX file, a model directory, ``model.weights``, ``model.init``, a
    module object whose batch norms hold trained statistics), whose batch norms were folded into its
    convolutions or not (a folded one, with no batch norm after most of its convolutions, has its gradient
    clipped unit by unit: see ``adaptive_clip``).

    ``schedule``: ``onecycle`` (warm-up from ``lr/25``, cosine down), ``linear`` (the RevNeXt authors'
    cycle: from 0 up to ``lr``, then straight down to 0; their CIFAR-10 runs: ``warmup: 0.1``, i.e. 5 of
    50 epochs) or ``constant``.

    ``clip_grad_norm``: scale each step's gradient down to this norm; null: chosen by how the run starts
    (:data:`DEFAULT_CLIP`: never, whatever the start; ``.inf``: never). edgerev's earlier RevNeXt (a bare
    convolution as stem, a mean and a biased linear layer as head) diverged at the paper's peak lr 0.4 without it
    (batch 256: the stem's output, then every activation, grew without bound within 15 steps); the paper's stem and
    head remove the cause. The presets that use lr >= 0.1 still set it.

    ``adaptive_clip``: unit-wise adaptive gradient clipping (AGC, Brock et al. 2021, the NFNets' answer to training
    without batch norm): each unit's gradient (a convolution's output channel, a linear layer's row, a bias) is
    scaled down to at most this fraction of the unit's weight norm; null: chosen by how the run starts
    (:data:`DEFAULT_ADAPTIVE_CLIP`): 0.2 for a pretrained model whose batch norms were folded, never otherwise
    (``.inf``: never, whatever the model). Nothing renormalizes a folded network's activations, and a few units
    with large gradients throw it off where a global norm clip bounds only the whole step: in ``benchmarks/zoo.py``'s
    files at 64x64 (random weights exported folded, six steps at 0.01), LCNet's loss rose from 2.67 to 10.5 with the
    gradient clipped to a norm of 5 and fell to 0.72 at 0.2. Tighter ratios train those files more smoothly and
    fine-tune pretrained ones less (``benchmarks/byo_model.py``'s few-shot digits: MobileNetV2's new digits 0.81 at
    0.1, 0.87 at 0.2); looser ones let LCNet's and MNASNet's files diverge again (0.4). Applied before
    ``clip_grad_norm`` where both are set.
    """

    lr: float | None = None
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 5e-4
    label_smoothing: float = 0.0
    schedule: Literal["onecycle", "linear", "constant"] = "onecycle"
    warmup: float = 0.25
    clip_grad_norm: float | None = None
    adaptive_clip: float | None = None

    def peak(self, start: str, batch: int = NEW_LR_BATCH) -> float:
        """``lr``, or when null the default for a run that starts ``start`` (a key of :data:`DEFAULT_LR`) with
        steps of ``batch`` samples."""
        if self.lr is not None:
            return self.lr
        return DEFAULT_LR[start] * batch / NEW_LR_BATCH if start == "new" else DEFAULT_LR[start]

    def clip(self, start: str) -> float | None:
        """``clip_grad_norm``, or when null the default for a run that starts ``start`` (None: never)."""
        return self.clip_grad_norm if self.clip_grad_norm is not None else DEFAULT_CLIP[start]

    def adaptive(self, start: str) -> float | None:
        """``adaptive_clip``, or when null the default for a run that starts ``start`` (None: never, as ``.inf``)."""
        ratio = self.adaptive_clip if self.adaptive_clip is not None else DEFAULT_ADAPTIVE_CLIP[start]
        return None if ratio is None or math.isinf(ratio) else ratio

    def resolved(self, start: str, batch: int = NEW_LR_BATCH) -> OptimConfig:
        """This recipe with each null that how the run starts chooses set (:meth:`peak`, :meth:`clip`,
        :meth:`adaptive`): the optimizer and the step a run of ``start`` with steps of ``batch`` samples take (its
        clips as :func:`edgerev.train.cap.train_step` takes them, None: never; a recipe to run, not to save)."""
        return replace(self, lr=self.peak(start, batch), clip_grad_norm=self.clip(start),
                       adaptive_clip=self.adaptive(start))

    def __post_init__(self) -> None:
        check(self.clip_grad_norm is None or self.clip_grad_norm > 0, "clip_grad_norm",
              f"must be positive (or null), got {self.clip_grad_norm}")
        check(self.adaptive_clip is None or self.adaptive_clip > 0, "adaptive_clip",
              f"must be positive (or null), got {self.adaptive_clip}")
        check(self.lr is None or self.lr > 0, "lr", f"must be positive (or null), got {self.lr}")
        check(0.0 <= self.momentum < 1.0, "momentum", f"must lie in [0, 1), got {self.momentum}")
        check(not self.nesterov or self.momentum > 0, "nesterov", "needs momentum > 0")
        check(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        check(0.0 <= self.label_smoothing < 1.0, "label_smoothing", f"must lie in [0, 1), got {self.label_smoothing}")
        check(0.0 < self.warmup < 1.0, "warmup", f"must lie in (0, 1), got {self.warmup}")


@dataclass(frozen=True)
class TrainConfig:
    """``epochs``: the number of epochs, or with ``patience`` their maximum; ``patience``: stop once
    this many epochs in a row bring no held-out gain (null: run every epoch; see
    :class:`edgerev.train.progress.Plateau`); ``batch``: samples per optimizer step (split into
    micro-batches when the cap needs it); ``checkpoint_every``: steps between checkpoints (and at each
    epoch's end); ``progress_seconds``: within an epoch, seconds between progress lines (one is printed
    at every epoch's end). ``threads``: the CPU threads training uses (null: one fewer than the cores
    this process may run on, at least one: a device usually also serves predictions).

    ``anneal_epochs``: once patience runs out, the epochs over which the learning rate falls from where
    the schedule is to 0 before the run stops (a half cosine, see :mod:`edgerev.train.schedule`; within
    the ``epochs`` maximum; 0: stop at once, wherever the schedule is).

    ``trainable``: which parameters train (:mod:`edgerev.train.trainable`): ``all``, ``head`` (the classifier),
    ``bias`` (every bias and the head), ``last:N`` (the last N pieces of the model's graph that have parameters) or
    ``auto`` (the most parameters whose step fits ``memory.budget`` at ``batch``; where they do not all fit with
    ``optim.momentum``, the momentum buffers are kept in bfloat16, or dropped, when that trains more, and the
    run's plan says ``optimizer_state: bfloat16`` or ``dropped``); the frozen rest keeps no activation and no
    gradient. ``bn_stats``: ``updated`` (batch norms move their running statistics in training) or ``frozen``
    (every batch norm normalizes with the model's running statistics and leaves them as they are: a pretrained
    model's, or those a fleet measured for its rounds, :mod:`edgerev.train.norms`). ``bn_measure``: before each
    evaluation (every epoch's and the final one), the running statistics of the batch norms that train are measured
    anew on this many training images (a fixed draw, in batches as training takes them;
    :func:`edgerev.train.norms.measure_running_statistics`): the running average trails weights that change fast,
    so a run's first epochs were judged, and kept or stopped on, at statistics of weights it no longer has; 0 keeps
    the running average.

    ``cuda_graphs``: on CUDA, each step whose shapes, plan and weights repeat the previous step's is replayed as a
    CUDA graph instead of launching its kernels one by one (:mod:`edgerev.train.graphs`: the same gradients to
    rounding, several times faster where a step's kernels are small); not under ``memory.budget`` (the graph's
    memory pool lends nothing to the optimizer's update beside it) nor in a run with unlabelled views or a teacher
    (their forwards between steps); false: never."""

    epochs: int = 10
    patience: int | None = None
    anneal_epochs: int = 2
    batch: int = 128
    seed: int = 0
    checkpoint_every: int = 50
    log_every: int = 10
    progress_seconds: float = 60.0
    eval_batch: int = 256
    threads: int | None = None
    trainable: str = "all"
    bn_stats: str = "updated"
    bn_measure: int = 512
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        from edgerev.train.trainable import TrainableError, check_bn_stats, parse_trainable  # no torch

        for key, read in (("trainable", parse_trainable), ("bn_stats", check_bn_stats)):
            try:
                read(getattr(self, key))
            except TrainableError as e:
                check(False, key, str(e))
        for name in ("epochs", "batch", "checkpoint_every", "log_every", "eval_batch"):
            value = getattr(self, name)
            check(value >= 1, name, f"must be at least 1, got {value}")
        check(self.bn_measure >= 0, "bn_measure", f"must be at least 0 images, got {self.bn_measure}")
        check(self.patience is None or self.patience >= 1, "patience",
              f"must be at least 1 epoch (or null: no early stopping), got {self.patience}")
        check(self.anneal_epochs >= 0, "anneal_epochs", f"must be >= 0 (0: stop at once), got {self.anneal_epochs}")
        check(self.progress_seconds > 0, "progress_seconds", f"must be positive, got {self.progress_seconds}")
        if self.threads is not None:
            cores = available_cores()
            check(1 <= self.threads <= cores, "threads",
                  f"must lie in 1..{cores} (the cores this process may run on), got {self.threads}")


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and cpusets narrow)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_threads() -> int:
    """Training threads when the recipe says none: one fewer than the cores, at least one."""
    return max(1, available_cores() - 1)


@dataclass(frozen=True)
class MemoryConfig:
    """``budget``: the hard cap on training memory, bytes as an int or a size such as "400MiB" or "1.5GB"
    (read once into an int; null: none). It bounds the whole step as :mod:`edgerev.memory.measure.account`
    counts it: weights, gradients, optimizer state, the teacher, the batch and the planned micro-batch's
    activations. On CPU it bounds tensors, not the interpreter (see deploy/edgerev.service's
    ``MemoryMax=`` for the outer guard). ``mode``: ``auto``
    lets the planner choose per-stage modes (the model's default modes, ``invert`` where supported, when
    there is no budget);
    ``plain`` trains through plain autograd; a mode name runs every stage in it. ``profile``: the
    planner's per-stage costs, ``measure``d once per model and size (cached) or ``estimate``d."""

    budget: ByteSize | None = None
    mode: Literal["auto", "plain", "invert", "floor", "recompute", "store", "store8", "store4"] = "auto"
    profile: Literal["measure", "estimate"] = "measure"

    def __post_init__(self) -> None:
        if self.budget is not None:  # given in code, not read from a file: parsed here, once
            object.__setattr__(self, "budget", byte_size(self.budget, "budget"))
        check(self.budget is None or self.mode == "auto", "mode", "a budget needs mode auto (the planner picks)")


@dataclass(frozen=True)
class ContinualConfig:
    """Keeping old classes when fine-tuning from ``model.init``.

    ``replay``: size of the bounded, class-balanced sample of earlier training data kept beside the
    model and mixed into the next run's data (0: none). ``distill``: weight of the distillation
    loss (LwF) from the starting model on the old classes, at ``temperature`` (0: none).

    ``probe``: when a pretrained model's head grows rows for new classes (or is replaced), fit those rows to its
    features first (:func:`edgerev.train.continual.fit_new_rows`: a linear probe on up to 64 training images per
    class, the trained rows held), then train every weight as the recipe says (LP-FT). In
    ``benchmarks/byo_model.py``'s few-shot digits (five digits learned, five new ones from 20 images each), the
    imported MobileNetV2 learned the new digits to 0.65 from random rows and to 0.86 from fitted ones (0.82 from
    random weights; means of three seeds). A model from random weights has no features to fit to: never there.
    """

    replay: int = 0
    distill: float = 0.0
    temperature: float = 2.0
    probe: bool = True

    def __post_init__(self) -> None:
        check(self.replay >= 0, "replay", f"must be >= 0, got {self.replay}")
        check(self.distill >= 0, "distill", f"must be >= 0, got {self.distill}")
        check(self.temperature > 0, "temperature", f"must be positive, got {self.temperature}")


@dataclass(frozen=True)
class SemiConfig:
    """Learning from unlabelled images as well (FixMatch, Sohn et al., NeurIPS 2020), when a run is given some.

    Each step adds ``ratio`` unlabelled images per labelled one (mu). The model being trained labels each
    from a weak view (the recipe's own augmentation, without gradient); an image whose top probability is at
    least ``threshold`` gets that class as its pseudo-label, and the cross-entropy of a strong view
    (:class:`edgerev.train.augment.StrongAugment`: RandAugment-like colour, contrast, brightness, sharpness,
    blur, posterize and solarize, a shift, then Cutout) against it joins the loss with weight ``weight``
    (lambda_u), averaged over all the step's unlabelled images as in the paper. An epoch is then one pass over
    the longer of the two: the labelled samples, or the unlabelled images (the labelled ones cycling meanwhile).

    ``class_cap``: a class takes at most ``class_cap`` times its share of the labelled training samples of
    a step's unlabelled images as pseudo-labels (its most confident ones). The labelled distribution is the
    only class prior a device knows; a cap relative to it lets a common class stay common while a class the
    model over-predicts (its own mistakes confirmed, step after step) cannot take over the pseudo-labels.
    null: no cap. ``enabled`` false, or no unlabelled image given: the run is a labelled-only one.
    """

    enabled: bool = False
    threshold: float = 0.95
    weight: float = 1.0
    ratio: int = 2
    class_cap: float | None = 2.0

    def __post_init__(self) -> None:
        check(0.0 < self.threshold <= 1.0, "threshold", f"is a probability in (0, 1], got {self.threshold}")
        check(self.weight >= 0, "weight", f"must be >= 0, got {self.weight}")
        check(self.ratio >= 1, "ratio", f"must be at least 1 (unlabelled images per labelled one), got {self.ratio}")
        check(self.class_cap is None or self.class_cap >= 1.0, "class_cap",
              f"must be at least 1 (times a class's labelled share), or null, got {self.class_cap}")


@dataclass(frozen=True)
class RunConfig:
    """A whole training recipe; ``format``: the version of this layout (saved with every run)."""

    format: int = FORMAT
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    continual: ContinualConfig = field(default_factory=ContinualConfig)
    semi: SemiConfig = field(default_factory=SemiConfig)
    device: Literal["cpu", "cuda", "auto"] = "cpu"

    def __post_init__(self) -> None:
        check(self.format <= FORMAT, "format", f"{self.format} is newer than this edgerev reads ({FORMAT}): "
              "upgrade edgerev")
        check(self.format >= 1, "format", f"must be at least 1, got {self.format}")


def load_config(path) -> RunConfig:
    """Read and validate a recipe file."""
    from edgerev.config import from_dict, load_yaml

    return from_dict(RunConfig, load_yaml(path))

"""The fleet's model, and what travels between the fleet and a device.

A fleet (:mod:`edgerev.fleet`, on Flower) and each device's daemon speak in these terms and no others:

- :class:`FleetModel`, what the fleet sends: the model's description (a model source, its arguments, the input
  size), the fleet's classes (the head's rows, in the fleet registry's order), the shared tensors (which ones is
  the fleet's ``sharing`` setting: :func:`shared_names`), and the round's settings;
- :class:`RoundResult`, a device's answer to a round: its trained shared tensors and its training samples per
  fleet class; :class:`Consideration`, its gate's decision on the aggregated model;
- :class:`FleetError`, a request a device cannot carry out, in one line.

Every side builds the same model from a :class:`FleetModel` (:func:`fleet_model`: the source resolved, its
classifier sized to the fleet's classes, what the source does not bring drawn from the fleet's seed), names its
classifier's tensors ``head.*`` on the wire (:func:`to_wire`) whatever the model calls them, and checks what
arrives (:func:`check_shared`). A device composes its copy of the fleet model from the shared tensors and what it
keeps locally (:func:`device_model`); where that local state lives and how a round trains is the daemon's
(:mod:`edgerev_daemon.learning.fleet`). Nothing here imports Flower.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from edgerev.errors import EdgerevError
from edgerev.models.directory import ModelInfo
from edgerev.models.handle import ModelHandle, describe

SHARING = ("head", "head+last", "all")


class FleetError(EdgerevError):
    """A fleet request this device cannot carry out (the message says why, in one line)."""


@dataclass(frozen=True)
class FleetModel:
    """What the fleet sends: the model's description, the fleet's classes (head rows) and the shared tensors.

    ``round``: a name unique to the run and round (``"<run>/<round>"``); ``seed``: the fleet's
    initialization seed, so every device builds the same tensors for what is not sent. ``share_bn_stats``:
    the batch-norm statistics are the fleet's (``norms_measured``: the devices have measured them, from the
    second round on: a round job then trains with its batch norms frozen at them). ``lr``: the round job's
    peak learning rate (0: the device's); ``adopt_*``: the fine-tuning of the fleet model before the gate
    (:func:`consider`; ``edgerev.fleet.settings.FleetSettings`` says what each does). ``weights``: the base
    model's weights file for a registry ``arch`` or a factory (None: ``arch`` alone; :func:`fleet_model`).
    """

    round: str
    arch: str
    args: dict
    input_size: int
    classes: tuple[str, ...]
    shared: dict[str, torch.Tensor]
    sharing: str = "all"
    share_bn_stats: bool = False
    seed: int = 0
    epochs: int = 1
    lr: float = 0.0
    norms_measured: bool = False
    adopt_epochs: int = 0
    adopt_distill: float = 1.0
    adopt_lr: float = 0.0
    weights: str | None = None


@dataclass
class RoundResult:
    shared: dict[str, torch.Tensor]
    counts: list[int]            # training samples per fleet class, in ``classes`` order
    examples: int
    peak_bytes: int | None      # measured under the cap (:func:`peak_of`)
    cap_bytes: int | None
    job: int
    seconds: float = 0.0


@dataclass
class Consideration:
    promoted: bool
    reason: str
    version: str | None
    accuracy: float | None
    heldout: int
    metrics: dict = field(default_factory=dict)


def shared_names(state: Mapping[str, torch.Tensor], parameters: set[str], sharing: str,
                 share_bn_stats: bool = False) -> list[str]:
    """The names of ``state`` that the fleet shares, in ``state``'s order.

    ``head``: the classifier only; ``head+last``: and the last stage that has weights; ``all``: every
    trainable tensor. Batch-norm statistics (buffers) stay on the device unless ``share_bn_stats``.
    """
    if sharing not in SHARING:
        raise FleetError(f"sharing must be one of {', '.join(SHARING)}, got {sharing!r}")
    stages = sorted({int(n.split(".")[2]) for n in parameters if n.startswith("body.stages.")})
    last = f"body.stages.{stages[-1]}." if stages else None

    def scoped(name: str) -> bool:
        if name.startswith("head."):
            return True
        if sharing == "all":
            return True
        return sharing == "head+last" and last is not None and name.startswith(last)

    return [n for n, t in state.items() if scoped(n) and t.is_floating_point()
            and (n in parameters or share_bn_stats)]


def fleet_model(fm: FleetModel) -> ModelHandle:
    """The fleet's model before any round, the same tensors on the server and on every device: ``fm.arch``
    resolved as any model source (:func:`edgerev.models.resolve.resolve_model`) with ``fm.weights``, its
    classifier sized to the fleet's classes; what the source does not bring (a registry model without
    weights, a classifier re-made for another number of classes) is drawn from the fleet's seed. A base
    model's weights are thus the common start of the server's first parameters and of every device's first
    round.

    Raises:
        FleetError: the source cannot be built, or has no linear classifier (the fleet grows and averages
            its rows per class).
    """
    from edgerev.models.resolve import resolve_model

    torch.manual_seed(fm.seed)
    try:
        model = resolve_model(fm.arch, weights=fm.weights, args=fm.args, num_classes=len(fm.classes))
    except (ValueError, TypeError, KeyError) as e:  # EdgerevError is a ValueError
        raise FleetError(f"cannot build the fleet's model {fm.arch} {fm.args}: {e}") from None
    head_prefix(model)  # one that the fleet cannot name is refused here, before anything travels
    return model


WIRE_HEAD = "head."  # what the aggregation (edgerev.fleet.aggregate) takes for the classifier's tensors


def head_prefix(model: nn.Module | ModelHandle) -> str:
    """The prefix of ``model``'s classifier's tensor names (``head.`` for edgerev's models, ``fc.`` for a
    torchvision ResNet, an ONNX import's last Gemm's module).

    Raises:
        FleetError: no linear classifier, or tensors named ``head.*`` that are not the classifier's.
    """
    from edgerev.models.spec import head_name

    name = head_name(model)
    if name is None:
        raise FleetError(f"the fleet's model {type(describe(model).module).__name__} has no linear classifier to "
                         "grow per class")
    prefix = name + "."
    module = model.module if isinstance(model, ModelHandle) else model
    if prefix != WIRE_HEAD and any(n.startswith(WIRE_HEAD) for n in module.state_dict()):
        raise FleetError(f"the fleet's model has its classifier at {name!r} and other tensors named head.*: "
                         "the fleet sends the classifier's as head.*")
    return prefix


def to_wire(tensors: Mapping[str, torch.Tensor], head: str) -> dict[str, torch.Tensor]:
    """``tensors`` under the names the fleet sends: the classifier's (``head``, :func:`head_prefix`) as
    ``head.*`` whatever the model calls it, the rest as they are."""
    return {WIRE_HEAD + n[len(head):] if n.startswith(head) else n: t for n, t in tensors.items()}


def from_wire(tensors: Mapping[str, torch.Tensor], head: str) -> dict[str, torch.Tensor]:
    """The model's own names of tensors named as :func:`to_wire` sends them."""
    return {head + n[len(WIRE_HEAD):] if n.startswith(WIRE_HEAD) else n: t for n, t in tensors.items()}


def fleet_head(fm: FleetModel) -> str:
    """The prefix of the fleet's model's classifier (:func:`head_prefix`)."""
    return head_prefix(fleet_model(fm))


def model_names(fm: FleetModel) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The fleet's model before any round (:func:`fleet_model`) as tensors, and its shared names, as the fleet
    names them (:func:`to_wire`)."""
    model = fleet_model(fm).module
    head = head_prefix(model)
    state = to_wire(model.state_dict(), head)
    parameters = set(to_wire(dict(model.named_parameters()), head))
    names = shared_names(state, parameters, fm.sharing, fm.share_bn_stats)
    return state, names


def check_shared(fm: FleetModel) -> dict[str, torch.Tensor]:
    """The fleet's fresh state, after checking that ``fm.shared`` is exactly what it should hold.

    Raises:
        FleetError: a tensor missing, unknown, of the wrong shape, or not finite.
    """
    if len(fm.classes) < 1 or len(set(fm.classes)) != len(fm.classes):
        raise FleetError(f"the fleet's classes must be distinct and not empty, got {list(fm.classes)[:5]}")
    state, names = model_names(fm)
    missing = [n for n in names if n not in fm.shared]
    unknown = [n for n in fm.shared if n not in names]
    if missing or unknown:
        parts = ([f"missing {', '.join(missing[:3])}"] if missing else []) + \
                ([f"unknown {', '.join(unknown[:3])}"] if unknown else [])
        raise FleetError(f"the fleet's weights do not fit {fm.arch} with {len(fm.classes)} classes and sharing "
                         f"{fm.sharing!r}: {'; '.join(parts)}")
    shapes = [n for n in names if tuple(fm.shared[n].shape) != tuple(state[n].shape)]
    if shapes:
        n = shapes[0]
        raise FleetError(f"the fleet's weights do not fit: {n} has shape {tuple(fm.shared[n].shape)}, "
                         f"the model's is {tuple(state[n].shape)}" + (f" (and {len(shapes) - 1} more)"
                                                                       if len(shapes) > 1 else ""))
    bad = [n for n in names if not torch.isfinite(fm.shared[n]).all()]
    if bad:
        raise FleetError(f"the fleet's weights are not finite ({', '.join(bad[:3])}): refused")
    return state


def compose(fm: FleetModel, fresh: dict[str, torch.Tensor], local: tuple[dict, tuple] | None) -> dict:
    """The device's copy of the fleet model: shared tensors from the fleet, the rest from the local state
    (when it fits the fleet's model: same names and shapes), else from the fleet's fresh initialization."""
    state = dict(fresh)
    if local is not None:
        kept, _ = local
        for name, t in kept.items():
            if name in state and not name.startswith("head.") and tuple(t.shape) == tuple(state[name].shape):
                state[name] = t
    for name, t in fm.shared.items():
        state[name] = t.to(state[name].dtype)
    return state


def device_model(fm: FleetModel, fresh: dict[str, torch.Tensor], local: tuple[dict, tuple] | None) -> ModelHandle:
    """The device's copy of the fleet model (its handle): :func:`compose` of the fleet's tensors (``fresh``,
    as the fleet names them) and the device's last round (``local``, as the model names them)."""
    model = fleet_model(fm)
    head = head_prefix(model)
    local = (to_wire(local[0], head), local[1]) if local is not None else None
    model.module.load_state_dict(from_wire(compose(fm, fresh, local), head))
    return model


def fleet_info(fm: FleetModel, model: ModelHandle) -> ModelInfo:
    """The description of a model of the fleet: what rebuilds it (the source's own ``arch``: a model
    directory's architecture, ``onnx`` with the file's copy), the fleet's classes and input size."""
    return ModelInfo(model.arch, tuple(fm.classes), fm.input_size, model_args=dict(model.args))

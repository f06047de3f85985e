"""What an exported model carries besides its graph: classes, input size, normalization, provenance.

The values live in the ONNX model's ``metadata_props`` (string to string), so any ONNX Runtime can
read them (``session.get_modelmeta().custom_metadata_map``) without edgerev. Lists are JSON.

======================  ======================================================================
key                     value
======================  ======================================================================
``classes``             JSON list of class names, in logit order
``input_size``          height and width of the model input (an integer)
``mean``, ``std``       JSON lists, per channel: the input is ``(pixels / 255 - mean) / std``
``arch``                registry name of the architecture
``weights_sha256``      SHA-256 of the ``model.safetensors`` the export was made from
``edgerev_version``     the edgerev version that wrote the file
``fine_tuned``          JSON object, present after :mod:`edgerev.export.finetune` changed the head
======================  ======================================================================

No torch here: the ONNX Runtime side of edgerev reads this module on devices without PyTorch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from edgerev.errors import ExportError

REQUIRED = ("classes", "input_size", "mean", "std")


@dataclass(frozen=True)
class ModelMeta:
    """The edgerev metadata of an ONNX model (see the module docstring).

    Attributes:
        extra: every other key, kept as its raw string (``fine_tuned``, an exporter's own keys).
    """

    classes: tuple[str, ...]
    input_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    arch: str = ""
    weights_sha256: str = ""
    edgerev_version: str = ""
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.classes or len(set(self.classes)) != len(self.classes):
            raise ExportError(f"class names must be non-empty and distinct, got {list(self.classes)}")
        if self.input_size < 1:
            raise ExportError(f"input size must be positive, got {self.input_size}")
        if len(self.mean) != len(self.std) or not self.mean or any(s <= 0 for s in self.std):
            raise ExportError("normalization needs one mean and one positive std per channel")

    @property
    def fine_tuned(self) -> dict | None:
        """The record :mod:`edgerev.export.finetune` leaves, or None for a plain export."""
        text = self.extra.get("fine_tuned")
        return json.loads(text) if text else None

    def to_props(self) -> dict[str, str]:
        props = dict(self.extra)
        props.update({
            "classes": json.dumps(list(self.classes)),
            "input_size": str(self.input_size),
            "mean": json.dumps(list(self.mean)),
            "std": json.dumps(list(self.std)),
            "arch": self.arch,
            "weights_sha256": self.weights_sha256,
            "edgerev_version": self.edgerev_version,
        })
        return props

    @staticmethod
    def from_props(props: Mapping[str, str], where: str) -> ModelMeta:
        """Parse ``metadata_props``; ``where`` names the file in errors."""
        missing = [k for k in REQUIRED if k not in props]
        if missing:
            raise ExportError(f"{where} lacks edgerev metadata ({', '.join(missing)}): export it with 'edgerev export'")
        try:
            classes = json.loads(props["classes"])
            mean, std = json.loads(props["mean"]), json.loads(props["std"])
            if not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)):
                raise ValueError("classes is not a list of names")
            meta = ModelMeta(classes=tuple(classes), input_size=int(props["input_size"]),
                             mean=tuple(float(v) for v in mean), std=tuple(float(v) for v in std),
                             arch=props.get("arch", ""), weights_sha256=props.get("weights_sha256", ""),
                             edgerev_version=props.get("edgerev_version", ""),
                             extra={k: v for k, v in props.items() if k not in _OWN})
            if "fine_tuned" in props and not isinstance(json.loads(props["fine_tuned"]), dict):
                raise ValueError("fine_tuned is not a JSON object")
        except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
            raise ExportError(f"{where} has malformed edgerev metadata: {e}") from None
        return meta


_OWN = frozenset(("classes", "input_size", "mean", "std", "arch", "weights_sha256", "edgerev_version"))


def set_props(model, props: Mapping[str, str]) -> None:
    """Write ``props`` into an ``onnx.ModelProto``'s ``metadata_props``, replacing keys of the same name."""
    keep = [(p.key, p.value) for p in model.metadata_props if p.key not in props]
    del model.metadata_props[:]
    for key, value in [*keep, *props.items()]:
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value


def get_props(model) -> dict[str, str]:
    """The ``metadata_props`` of an ``onnx.ModelProto`` as a dict."""
    return {p.key: p.value for p in model.metadata_props}

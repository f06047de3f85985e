"""Export to ONNX (verified against PyTorch), inference with ONNX Runtime, head fine-tuning without PyTorch.

=========================  ===========================================================  ========
module                     does                                                         torch
=========================  ===========================================================  ========
:mod:`.onnx`               :func:`export_onnx`: model directory to a verified ``.onnx``  yes
:mod:`.imported`           :func:`export_imported`: an imported ONNX model back into      yes
                           its own file, verified
:mod:`.predict`            :class:`Predictor`: images to labels with ONNX Runtime        no
:mod:`.finetune`           :func:`finetune_head`: train the head on a frozen backbone    no
:mod:`.head_numpy`         its default backend: softmax regression in numpy              no
:mod:`.ort_training`       its optional backend: ONNX Runtime training                   no
:mod:`.metadata`           classes, input size, normalization inside the file            no
:mod:`.graph`              cut an exported graph at its head, swap the head's weights    no
:mod:`.images`             Pillow + numpy decoding, the same as the trainer's            no
:mod:`.runtime`            ONNX Runtime imported on demand, sessions                     no
=========================  ===========================================================  ========

The names below load on first use, so importing this package never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgerev.lazy import lazy_attributes

_LAZY = {
    "ExportResult": "edgerev.export.onnx",
    "export_onnx": "edgerev.export.onnx",
    "verify_onnx": "edgerev.export.onnx",
    "Prediction": "edgerev.export.predict",
    "Predictor": "edgerev.export.predict",
    "FinetuneResult": "edgerev.export.finetune",
    "finetune_head": "edgerev.export.finetune",
    "ModelMeta": "edgerev.export.metadata",
    "ImportedExport": "edgerev.export.imported",
    "export_imported": "edgerev.export.imported",
}

if TYPE_CHECKING:
    from edgerev.export.finetune import FinetuneResult, finetune_head
    from edgerev.export.imported import ImportedExport, export_imported
    from edgerev.export.metadata import ModelMeta
    from edgerev.export.onnx import ExportResult, export_onnx, verify_onnx
    from edgerev.export.predict import Prediction, Predictor

__all__ = [
    "ExportResult",
    "FinetuneResult",
    "ImportedExport",
    "ModelMeta",
    "Prediction",
    "Predictor",
    "export_onnx",
    "export_imported",
    "finetune_head",
    "verify_onnx",
]

__getattr__, __dir__ = lazy_attributes("edgerev.export", _LAZY, globals())

"""The imported model: a ``torch.fx.GraphModule`` built from the ONNX graph, and what it keeps of the file."""

from __future__ import annotations

import copy

import torch.fx as fx

from edgerev.models.handle import Exporter, describes
from edgerev.models.onnx_import.signature import OnnxIO

#: attributes an ImportedModel carries besides its graph, modules and buffers
_EXTRA = ("io", "onnx_links", "onnx_source", "head_name")


class ImportedModel(fx.GraphModule):
    """A trainable model imported from ONNX (:func:`edgerev.models.onnx_import.load_onnx` builds it).

    Weights are parameters of real modules (``nn.Conv2d``, ``nn.BatchNorm2d`` with running statistics,
    ``nn.Linear``...), every other op a ``call_function`` node, so ``torch.fx`` and ``torch.export`` see one clean
    graph. It outputs logits: a final Softmax of the file is left out for training and put back by the export.

    Attributes:
        io: the original's interface (input and output names, shapes, layout, classes, normalization).
        onnx_links: state-dict key -> ``(node index, input index, how)``: where each weight goes back in the file.
        onnx_source: the original model, serialized (external data inlined); the export writes weights into it.
        head_name: the module name of the last linear layer (the classifier head), or None.
    """

    io: OnnxIO
    onnx_links: dict[str, tuple[int, int, str]]
    onnx_source: bytes
    head_name: str | None

    @property
    def in_channels(self) -> int:
        return self.io.in_channels

    @property
    def image_size(self) -> int | None:
        return self.io.image_size

    @property
    def num_classes(self) -> int:
        """Outputs of the head (after growth too), else of the file's output."""
        if self.head_name is not None:
            return int(self.get_submodule(self.head_name).out_features)
        return int(self.io.output_shape[-1] or 0)

    def __deepcopy__(self, memo):
        # GraphModule's deepcopy rebuilds the module from its graph and drops plain attributes
        res = super().__deepcopy__(memo)
        for key in _EXTRA:
            object.__setattr__(res, key, copy.deepcopy(getattr(self, key), memo))
        return res


def _imported_fields(model: ImportedModel) -> dict:
    io = model.io
    return {"arch": "onnx", "in_channels": io.in_channels, "image_size": io.image_size, "head": model.head_name,
            "mean": tuple(io.mean) or None, "std": tuple(io.std) or None, "input_name": io.input_name,
            "output_name": io.output_names[0], "onnx_source": model.onnx_source, "exporter": Exporter.IMPORTED,
            "fixed_classes": int(io.output_shape[-1] or 0) or None, "classes": tuple(io.classes)}


describes(ImportedModel, _imported_fields)

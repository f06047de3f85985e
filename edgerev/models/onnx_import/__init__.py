"""ONNX import that trains, and the export back that loads where the original did.

``load_onnx(path)`` builds a :class:`ImportedModel` (a ``torch.fx.GraphModule`` with real ``nn.Conv2d``,
``nn.BatchNorm2d``, ``nn.Linear`` submodules) from an ONNX classifier; ``check_onnx(path)`` refuses what it
cannot train in one line; ``export_imported(model, path)`` writes the trained weights back into the original
graph (same input and output names, shapes, opset and metadata), verified with ONNX Runtime.
docs/reference/onnx-ops.md lists the ops and opsets.
"""

from edgerev.models.onnx_import.build import check_onnx, load_onnx
from edgerev.models.onnx_import.export import ImportedExport, export_imported
from edgerev.models.onnx_import.model import ImportedModel
from edgerev.models.onnx_import.read import MAX_OPSET, MIN_OPSET, sidecar_path
from edgerev.models.onnx_import.signature import OnnxIO

__all__ = ["MAX_OPSET", "MIN_OPSET", "ImportedExport", "ImportedModel", "OnnxIO", "check_onnx", "export_imported",
           "load_onnx", "sidecar_path"]

"""ONNX import that trains.

``load_onnx(path)`` builds a :class:`ImportedModel` (a ``torch.fx.GraphModule`` with real ``nn.Conv2d``,
``nn.BatchNorm2d``, ``nn.Linear`` submodules) from an ONNX classifier; ``check_onnx(path)`` refuses what it
cannot train in one line. The export back, which writes the trained weights into the original graph (same input
and output names, shapes, opset and metadata), is export's: :func:`edgerev.export.imported.export_imported`.
docs/reference/onnx-ops.md lists the ops and opsets.
"""

from edgerev.models.onnx_import.build import check_onnx, load_onnx
from edgerev.models.onnx_import.model import ImportedModel
from edgerev.models.onnx_import.read import MAX_OPSET, MIN_OPSET, sidecar_path
from edgerev.models.onnx_import.signature import OnnxIO

__all__ = ["MAX_OPSET", "MIN_OPSET", "ImportedModel", "OnnxIO", "check_onnx", "load_onnx", "sidecar_path"]

"""The input size a model source carries, read without torch: what a daemon's ``image_size`` defaults to.

A model directory records its input size (``model.json``); an ONNX file may fix its input's height and width.
A registry name or a factory carries none (their models take many sizes). Nothing here raises: a source that
cannot be read carries nothing, and the model's own check refuses it later with the reason.
"""

from __future__ import annotations

from pathlib import Path

from edgerev.errors import EdgerevError, TrustError
from edgerev.models.directory import CheckpointError, read_info
from edgerev.models.names import SourceKind, source_kind


def carried_image_size(arch: str) -> int | None:
    """The one image size ``arch`` was made for (square, fixed), or None."""
    try:
        kind = source_kind(arch)
    except EdgerevError:
        return None
    path = Path(arch).expanduser()
    if kind is SourceKind.DIRECTORY:
        try:
            size = read_info(path)[0].input_size  # as the directory's loader reads it (no torch)
        except (CheckpointError, TrustError, OSError):  # the start check refuses it, in one line
            return None
        return size if size > 0 else None
    if kind is SourceKind.ONNX:
        return _onnx_size(path)
    return None


def _onnx_size(path: Path) -> int | None:
    try:
        import onnx

        graph = onnx.load(str(path), load_external_data=False).graph
    except Exception:  # noqa: BLE001 (onnx's decode errors have no common base; the import refuses them later)
        return None
    inits = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in inits]
    if len(inputs) != 1:
        return None
    dims = inputs[0].type.tensor_type.shape.dim
    if len(dims) != 4:
        return None
    sizes = [d.dim_value if d.HasField("dim_value") else 0 for d in dims]
    # NCHW (the usual export) or NHWC (channels last: 1 or 3 channels at the end)
    h, w = (sizes[2], sizes[3]) if sizes[1] in (1, 3) or sizes[3] not in (1, 3) else (sizes[1], sizes[2])
    return h if h == w and h > 0 else None

"""Model directories for the trainer and the daemon: the format (:mod:`edgerev.models.directory`) and the
rebuild of the model one holds (:func:`edgerev.models.resolve.load_model`), under the names they have
always had here.

A *model directory* (a training run's output folder, or a daemon's version directory) holds
``model.safetensors`` (the weights and buffers, no pickle), ``model.json`` (:class:`ModelInfo` and the
SHA-256 of the weights, written last) and, for an imported ONNX model, ``source.onnx`` (its graph).
"""

from edgerev.models.directory import (
    INFO,
    ONNX_SOURCE,
    WEIGHTS,
    CheckpointError,
    ModelInfo,
    load_state,
    load_tensors,
    normalize,
    read_info,
    read_json,
    save_model,
    save_tensors,
    sha256_file,
    write_json,
)
from edgerev.models.resolve import build_model, load_model

__all__ = ["INFO", "ONNX_SOURCE", "WEIGHTS", "CheckpointError", "ModelInfo", "build_model", "load_model", "load_state",
           "load_tensors", "normalize", "read_info", "read_json", "save_model", "save_tensors", "sha256_file",
           "write_json"]

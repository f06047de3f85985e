"""Head training with ONNX Runtime training: the optional backend of :func:`edgerev.export.finetune.finetune_head`.

``onnxruntime-training-cpu`` 1.19.2 (``pip install 'edgerev[ort-training]'``) is the last release of a
deprecated line (Python <= 3.11); the default backend, :mod:`edgerev.export.head_numpy`, trains the
same head with numpy alone. This one builds training artifacts for the head
(``generate_artifacts``: cross-entropy loss, AdamW or SGD), lowering their IR to 10 (onnx >= 1.18
stamps the optimizer graph IR 14, which ORT 1.19 refuses), and trains them with ``CheckpointState``,
``Module`` and ``Optimizer`` on shuffled mini-batches. Nothing here imports torch.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from edgerev.errors import ExportError
from edgerev.export import graph
from edgerev.export.head_numpy import run_epochs
from edgerev.export.runtime import first_line, onnxruntime, quiet_artifact_generation, training_modules


def build_artifacts(head_proto, head: graph.Head, folder: Path, optimizer: str = "adamw") -> None:
    """Write the head's training artifacts into ``folder``, every ONNX file at IR <= 10.

    ``checkpoint`` (parameters), ``training_model.onnx`` (cross-entropy loss and gradients),
    ``eval_model.onnx`` and ``optimizer_model.onnx`` (AdamW or SGD).
    """
    import onnx

    _, artifacts = training_modules()
    optim = {"adamw": artifacts.OptimType.AdamW, "sgd": artifacts.OptimType.SGD}[optimizer]
    try:
        with quiet_artifact_generation():
            artifacts.generate_artifacts(head_proto, requires_grad=[head.weight, head.bias], frozen_params=[],
                                         loss=artifacts.LossType.CrossEntropyLoss, optimizer=optim,
                                         artifact_directory=str(folder))
    except Exception as e:
        raise ExportError(f"ONNX Runtime could not build the head's training graphs: {first_line(e)}") from None
    for path in folder.glob("*.onnx"):
        model = onnx.load(str(path))
        if model.ir_version > graph.MAX_IR:
            onnx.save(graph.lower_ir(model), str(path))


def train_head(feats: np.ndarray, labels: np.ndarray, w: np.ndarray, b: np.ndarray, head: graph.Head, *,
               epochs: int, lr: float, batch: int, optimizer: str, seed: int
               ) -> tuple[np.ndarray, np.ndarray, list[float]]:
    """Train the head ``(w, b)`` on ``feats`` with ONNX Runtime training; returns the new ``(w, b)`` and
    the mean training loss of each epoch (the signature of :func:`edgerev.export.head_numpy.train_head`
    plus the head's names in the graph)."""
    with tempfile.TemporaryDirectory(prefix="edgerev-ort-") as tmp:
        state, losses = _train(graph.head_model(w, b, head), head, feats, labels, Path(tmp), epochs=epochs, lr=lr,
                               batch=batch, optimizer=optimizer, seed=seed)
        w1 = np.array(state.parameters[head.weight].data, dtype=np.float32)
        b1 = np.array(state.parameters[head.bias].data, dtype=np.float32)
    return w1, b1, losses


def _train(head_proto, head: graph.Head, feats: np.ndarray, labels: np.ndarray, folder: Path, *,
           epochs: int, lr: float, batch: int, optimizer: str, seed: int):
    """Train the head on ``feats`` with artifacts built in ``folder``; returns ``(state, losses per epoch)``."""
    api, _ = training_modules()
    build_artifacts(head_proto, head, folder, optimizer)
    state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    options = onnxruntime().SessionOptions()
    options.log_severity_level = 3  # ORT warns on every SGD step that its own optimizer graph's shapes disagree
    module = api.Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"), device="cpu",
                        session_options=options)
    opt = api.Optimizer(str(folder / "optimizer_model.onnx"), module)
    opt.set_learning_rate(lr)
    module.train()

    def step(idx: np.ndarray) -> float:
        loss = module(feats[idx], labels[idx])
        opt.step()
        module.lazy_reset_grad()
        return float(loss)

    losses = run_epochs(step, len(labels), epochs=epochs, batch=batch, seed=seed)
    return state, losses



def version() -> str:
    import onnxruntime

    return onnxruntime.__version__

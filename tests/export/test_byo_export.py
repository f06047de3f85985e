"""A model imported from ONNX, grown for a new class, exported by 'edgerev export', then predicted and head-tuned
with ONNX Runtime alone: the owner's application loads the update as it loaded the original."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from edgerev.export.finetune import finetune_head
from edgerev.export.onnx import export_onnx
from edgerev.export.predict import Predictor
from edgerev.models.designs import resnet18
from edgerev.models.directory import ModelInfo, save_model
from edgerev.models.onnx_import import load_onnx
from edgerev.train.continual import grow_head

SIZE = 32


def original(path) -> None:
    """A user's file: a tiny ResNet-18 exported by torch's TorchScript exporter (batch norm folded in eval mode)
    with its own input and output names and a dynamic batch."""
    torch.manual_seed(0)
    model = resnet18(num_classes=3, width=0.125).eval()
    torch.onnx.export(model, (torch.zeros(1, 3, SIZE, SIZE),), str(path), dynamo=False, input_names=["image"],
                      output_names=["scores"], dynamic_axes={"image": {0: "n"}, "scores": {0: "n"}})


@pytest.mark.slow  # 4 s of CPU: an export, two ONNX Runtime sessions, a head fine-tuning
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the TorchScript exporter, as a user's file was written
def test_imported_model_exports_under_its_own_names_and_serves(tmp_path):
    original(tmp_path / "original.onnx")
    model = load_onnx(tmp_path / "original.onnx")
    old, new = ("cat", "dog", "owl"), ("cat", "dog", "owl", "fox")
    x = np.random.default_rng(0).standard_normal((2, 3, SIZE, SIZE)).astype(np.float32)
    before = ort.InferenceSession(str(tmp_path / "original.onnx")).run(None, {"image": x})[0]
    grow_head(model, old, new)
    info = ModelInfo(arch="onnx", classes=new, input_size=SIZE, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    save_model(tmp_path / "run", model, info)

    result = export_onnx(tmp_path / "run", tmp_path / "updated.onnx")
    assert result.exporter == "imported"
    session = ort.InferenceSession(str(tmp_path / "updated.onnx"))
    (inp,), (out,) = session.get_inputs(), session.get_outputs()
    assert (inp.name, inp.shape, out.name, out.shape) == ("image", ["n", 3, SIZE, SIZE], "scores", ["n", 4])
    after = session.run(None, {"image": x})[0]
    np.testing.assert_allclose(after[:, :3], before, atol=1e-5)  # the old classes' scores are the original's

    pixels = np.random.default_rng(1).integers(0, 256, (8, 3, SIZE, SIZE), dtype=np.uint8)
    predictions = Predictor(tmp_path / "updated.onnx").classify(pixels, top=2)
    assert len(predictions) == 8 and all(p.label in new for p in predictions)
    tuned = finetune_head(tmp_path / "updated.onnx", (pixels, np.arange(8) % 4), tmp_path / "tuned.onnx", epochs=2)
    assert tuned.samples == 8 and tuned.max_abs_diff < 1e-4
    session = ort.InferenceSession(str(tmp_path / "tuned.onnx"))
    assert [o.name for o in session.get_outputs()] == ["scores"] and session.get_inputs()[0].name == "image"


@pytest.mark.slow  # 4 s of CPU, as above
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_file_that_outputs_probabilities_keeps_doing_so(tmp_path):
    """The import trains on logits (it leaves a final Softmax out); the export, prediction and head fine-tuning
    keep the original's probabilities: no second softmax, and the head tuned under the Softmax."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(resnet18(num_classes=3, width=0.125), torch.nn.Softmax(dim=1)).eval()
    torch.onnx.export(net, (torch.zeros(1, 3, SIZE, SIZE),), str(tmp_path / "original.onnx"), dynamo=False,
                      input_names=["image"], output_names=["probs"],
                      dynamic_axes={"image": {0: "n"}, "probs": {0: "n"}})
    model = load_onnx(tmp_path / "original.onnx")
    info = ModelInfo(arch="onnx", classes=("a", "b", "c"), input_size=SIZE)
    save_model(tmp_path / "run", model, info)
    export_onnx(tmp_path / "run", tmp_path / "updated.onnx")
    pixels = np.random.default_rng(1).integers(0, 256, (6, 3, SIZE, SIZE), dtype=np.uint8)
    predictor = Predictor(tmp_path / "updated.onnx")
    assert predictor.outputs_probabilities
    scores = predictor.logits(pixels)
    np.testing.assert_allclose(scores.sum(axis=1), 1.0, rtol=1e-5)
    best = predictor.classify(pixels, top=1)
    np.testing.assert_allclose([p.probability for p in best], scores.max(axis=1), rtol=1e-5)  # no second softmax
    tuned = finetune_head(tmp_path / "updated.onnx", (pixels, np.arange(6) % 3), tmp_path / "tuned.onnx", epochs=2)
    assert tuned.max_abs_diff < 1e-4
    out = ort.InferenceSession(str(tmp_path / "tuned.onnx")).run(None, {"image": pixels.astype(np.float32)})[0]
    np.testing.assert_allclose(out.sum(axis=1), 1.0, rtol=1e-5)

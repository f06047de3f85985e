"""A user's model that ends in a Softmax: imported, exported by 'edgerev export', predicted. The file outputs
probabilities as the original did, and edgerev predict reads them as probabilities (no second softmax)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

from edgerev.export.onnx import export_onnx
from edgerev.export.predict import Predictor, softmax
from edgerev.models.designs import mobilenet_v2
from edgerev.models.directory import ModelInfo, save_model
from edgerev.models.onnx_import import load_onnx

SIZE = 32


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the TorchScript exporter, as a user's file was written
@pytest.mark.parametrize("ends_in_softmax", [True, False])
def test_predict_reads_what_the_file_outputs(tmp_path, ends_in_softmax):
    torch.manual_seed(0)
    net = mobilenet_v2(num_classes=3, width=0.25)
    net = (nn.Sequential(net, nn.Softmax(dim=1)) if ends_in_softmax else net).eval()
    torch.onnx.export(net, (torch.zeros(1, 3, SIZE, SIZE),), str(tmp_path / "original.onnx"), dynamo=False,
                      input_names=["image"], output_names=["scores"],
                      dynamic_axes={"image": {0: "n"}, "scores": {0: "n"}})
    model = load_onnx(tmp_path / "original.onnx")
    info = ModelInfo(arch="onnx", classes=("a", "b", "c"), input_size=SIZE, mean=(0.5,) * 3, std=(0.25,) * 3)
    save_model(tmp_path / "run", model, info)
    export_onnx(tmp_path / "run", tmp_path / "updated.onnx")

    predictor = Predictor(tmp_path / "updated.onnx")
    assert predictor.outputs_probabilities is ends_in_softmax
    pixels = np.random.default_rng(0).integers(0, 256, (4, 3, SIZE, SIZE), dtype=np.uint8)
    x = ((pixels / 255.0 - 0.5) / 0.25).astype(np.float32)
    out = ort.InferenceSession(str(tmp_path / "updated.onnx")).run(None, {"image": x})[0]
    expected = out if ends_in_softmax else softmax(out)
    got = np.array([[dict(p.top)[c] for c in ("a", "b", "c")] for p in predictor.classify(pixels, top=3)])
    np.testing.assert_allclose(got, expected, atol=1e-6)
    np.testing.assert_allclose(got.sum(axis=1), 1.0, atol=1e-5)

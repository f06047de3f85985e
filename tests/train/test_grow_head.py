"""Head growth on models from outside: the designs' heads, a captured graph's last linear layer, clear refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edgerev.models.designs import DESIGNS
from edgerev.models.directory import CheckpointError
from edgerev.train.continual import ContinualLoss, grow_head, head_name

HEADS = {"mobilenet_v2": "classifier.1", "resnet18": "fc", "efficientnet_b0": "classifier.1"}


@pytest.mark.parametrize("name", sorted(DESIGNS))
def test_design_head_grows_and_keeps_old_logits(name):
    torch.manual_seed(0)
    model = DESIGNS[name](num_classes=3, width=0.25).double().eval()
    with torch.no_grad():
        model.get_submodule(HEADS[name]).bias.uniform_(-1, 1)  # a bias that is not zero must be kept too
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        before = model(x)
    assert head_name(model) == HEADS[name]
    grow_head(model, ("a", "b", "c"), ("a", "b", "c", "d", "e"))
    head = model.get_submodule(HEADS[name])
    assert head.out_features == 5 and head.weight.dtype == torch.float64 and not head.training
    assert model.num_classes == 5
    with torch.no_grad():
        after = model(x)
    torch.testing.assert_close(after[:, :3], before)
    assert after.shape == (2, 5)


class Ordered(nn.Module):
    """The classifier is defined before a linear layer that runs earlier: module order and graph order differ."""

    def __init__(self) -> None:
        super().__init__()
        self.classes = nn.Linear(6, 3)
        self.conv = nn.Conv2d(3, 4, 3)
        self.project = nn.Linear(4, 6)

    def forward(self, x):
        return self.classes(torch.relu(self.project(self.conv(x).mean((2, 3)))))


def test_graph_head_is_the_last_linear_the_graph_runs():
    torch.manual_seed(0)
    graph = torch.fx.symbolic_trace(Ordered().eval())
    x = torch.randn(2, 3, 8, 8)
    before = graph(x).detach()
    assert head_name(graph) == "classes"
    grow_head(graph, ("a", "b", "c"), ("a", "b", "c", "d"))
    after = graph(x)
    assert after.shape == (2, 4)
    torch.testing.assert_close(after[:, :3], before)
    # the grown model trains with distillation from the old logits, the new rows included
    loss = ContinualLoss(distill=1.0)(after, torch.tensor([3, 0]), before)
    loss.backward()
    assert graph.classes.weight.grad[3].abs().sum() > 0


def test_a_model_without_a_classifier_is_refused():
    with pytest.raises(CheckpointError, match="no linear layer"):
        grow_head(nn.Sequential(nn.Conv2d(3, 3, 1), nn.Flatten()), ("a",), ("a", "b"))
    # the last linear layer is not the classifier: its rows are not the old classes
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 5), nn.Softmax(dim=1), nn.Linear(5, 7))
    with pytest.raises(CheckpointError, match="7 rows, not one per old class"):
        grow_head(model, ("a", "b"), ("a", "b", "c"))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the TorchScript exporter, as many users' files were written
def test_imported_head_grows(tmp_path):
    """An ONNX file's last Gemm, imported as the graph's last linear layer, grows like any head."""
    from edgerev.models.onnx_import import load_onnx

    torch.manual_seed(0)
    torch.onnx.export(DESIGNS["resnet18"](num_classes=3, width=0.125).eval(), (torch.zeros(1, 3, 32, 32),),
                      str(tmp_path / "m.onnx"), dynamo=False, input_names=["image"], output_names=["scores"],
                      dynamic_axes={"image": {0: "n"}, "scores": {0: "n"}})
    model = load_onnx(tmp_path / "m.onnx")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        before = model(x)
    assert head_name(model) == model.head_name
    grow_head(model, ("a", "b", "c"), ("a", "b", "c", "d"))
    assert model.num_classes == 4  # the import counts its head's rows
    with torch.no_grad():
        torch.testing.assert_close(model(x)[:, :3], before)


def test_designs_are_factory_sources():
    from edgerev.models.resolve import resolve_model

    model = resolve_model("edgerev.models.designs:mobilenet_v2", args={"width": 0.25}, num_classes=4)
    assert head_name(model) == "classifier.1" and model.num_classes == 4

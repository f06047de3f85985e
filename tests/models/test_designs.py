"""The reference designs (edgerev/models/designs.py): published sizes, and tiny variants that train and trace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edgerev.models import list_models
from edgerev.models.designs import DESIGNS, efficientnet_b0, make_divisible, mobilenet_v2, resnet18

# torchvision's counts at 1000 classes (MobileNet_V2_Weights, ResNet18_Weights, EfficientNet_B0_Weights)
PUBLISHED = {"mobilenet_v2": 3_504_872, "resnet18": 11_689_512, "efficientnet_b0": 5_288_548}


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(DESIGNS))
def test_published_parameter_count(name):
    with torch.device("meta"):  # the full-size model's shapes without its 12 M floats or any forward
        model = DESIGNS[name]()
    assert count(model) == PUBLISHED[name]
    assert model.num_classes == 1000 and model.in_channels == 3
    assert getattr(model, "image_size", None) is None  # global pooling: any size, not only the 224 of the paper


def test_published_layers():
    """The designs' distinctive layers are where the papers put them."""
    with torch.device("meta"):
        m, r, e = mobilenet_v2(), resnet18(), efficientnet_b0()
    assert sum(isinstance(x, nn.ReLU6) for x in m.modules()) == 35  # stem, 17 blocks (16 expand), last 1x1
    depthwise = [c for c in m.modules() if isinstance(c, nn.Conv2d) and c.groups > 1]
    assert len(depthwise) == 17 and all(c.groups == c.in_channels == c.out_channels for c in depthwise)
    assert (r.conv1.kernel_size, r.conv1.stride, r.maxpool.kernel_size) == ((7, 7), (2, 2), 3)
    assert sum(isinstance(x, nn.Sigmoid) for x in e.modules()) == 16  # one squeeze-and-excitation per MBConv
    assert not any(isinstance(x, (nn.ReLU, nn.ReLU6)) for x in e.modules())
    kernels = sorted({c.kernel_size[0] for c in e.modules() if isinstance(c, nn.Conv2d) and c.groups > 1})
    assert kernels == [3, 5]


def test_not_in_the_registry():
    assert not set(DESIGNS) - {"resnet18"} & set(list_models())
    from edgerev.models import create_model

    # the registry's resnet18 is the CIFAR-style engine model, not this one
    assert type(create_model("resnet18", num_classes=3)) is not type(resnet18(num_classes=3))


@pytest.mark.parametrize("name", sorted(DESIGNS))
def test_tiny_variant_trains_and_traces(name):
    torch.manual_seed(0)
    model = DESIGNS[name](num_classes=5, width=0.25)
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 4])
    logits = model(x)
    assert logits.shape == (4, 5) and torch.isfinite(logits).all()
    F.cross_entropy(logits, y).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert all(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if not n.endswith("bias")), name
    model.eval()
    traced = torch.fx.symbolic_trace(model)  # no data-dependent control flow: the planner can capture the graph
    torch.testing.assert_close(traced(x), model(x))


def test_width_rounds_to_multiples_of_eight():
    assert [make_divisible(v) for v in (3, 8, 12, 16 * 0.25, 32 * 0.35, 1280)] == [8, 8, 16, 8, 16, 1280]
    model = mobilenet_v2(num_classes=2, width=0.5)
    assert all(c.out_channels % 8 == 0 for c in model.modules() if isinstance(c, nn.Conv2d))
    assert model.classifier[1].in_features == 1280  # the last 1x1 never narrows below the paper's 1280


@pytest.mark.parametrize("bad", [{"num_classes": 0}, {"num_classes": 2.5}, {"width": 0}, {"width": -1.0}])
def test_bad_arguments_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        resnet18(**bad)

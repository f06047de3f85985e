"""Three standard CNNs to their published designs, for bring-your-own-model tests and benchmarks.

Not in the registry (``edgerev memory --table`` and :func:`list_models` stay edgerev's own models): they
stand for the models users bring, built here because no package edgerev depends on ships them
(torchvision is not a dependency). Each is a factory ``name(num_classes=1000, width=1.0)``, usable as the
model source ``edgerev.models.designs:mobilenet_v2``; at width 1.0 and 1000 classes each has its published
parameter count:

- :func:`mobilenet_v2`, 3,504,872: Sandler et al. 2018, inverted residuals, linear bottlenecks, ReLU6;
- :func:`resnet18`, 11,689,512: He et al. 2016, 7x7 stride-2 stem, max pool, basic blocks [2, 2, 2, 2];
- :func:`efficientnet_b0`, 5,288,548: Tan and Le 2019, MBConv with squeeze-and-excitation, SiLU.

The layer names follow torchvision's implementations, so that a torchvision ``state_dict`` of the same
design should load as ``model.weights`` (not checked here: torchvision is no dependency). ``width``
multiplies every channel count (rounded to a multiple of 8, as the papers' reference code does), so tests
build tiny ones; it does not change the depth. Everything is a plain ``nn.Module`` without data-dependent
control flow, so ``torch.fx``, ``torch.export`` and ONNX export see the whole graph. Stochastic depth
(EfficientNet's drop-connect) is left out: it is the identity in evaluation and a choice of the training
recipe, not of the design.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from edgerev.models.handle import describes


def make_divisible(value: float, divisor: int = 8) -> int:
    """``value`` rounded to the nearest multiple of ``divisor``, never below ``divisor`` and never more than
    10 % under ``value`` (the rule of the MobileNet and EfficientNet reference code)."""
    out = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return out + divisor if out < 0.9 * value else out


def _check(num_classes: int, width: float) -> None:
    if not (isinstance(num_classes, int) and num_classes >= 1):
        raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}")
    if not width > 0:
        raise ValueError(f"width must be positive, got {width!r}")


def conv_bn_act(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1,
                act: Callable[[], nn.Module] | None = nn.ReLU6) -> nn.Sequential:
    """Convolution (no bias, "same" padding), batch norm, activation (none when ``act`` is None)."""
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
                               nn.BatchNorm2d(cout)]
    if act is not None:
        layers.append(act())
    return nn.Sequential(*layers)


def _init(model: nn.Module) -> None:
    """The reference implementations' initialization: He (fan-out) for convolutions, unit batch norm."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0, 0.01)
            nn.init.zeros_(m.bias)


class Classifier(nn.Module):
    """What the three designs share: ``features`` (image to feature map), global average pooling, then
    ``classifier`` (dropout and the linear head, whose rows are the classes).

    Attributes ``in_channels`` and ``num_classes`` say what the model takes and gives. It has no ``image_size``:
    it was designed at 224x224, but global pooling lets it take any size of at least 32 (see
    :func:`edgerev.models.spec.model_spec`).
    """

    def __init__(self, features: nn.Module, channels: int, num_classes: int, dropout: float) -> None:
        super().__init__()
        self.features = features
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(channels, num_classes))
        self.in_channels, self.num_classes = 3, num_classes
        _init(self)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.pool(self.features(x)).flatten(1))


# ---- MobileNetV2 -------------------------------------------------------------------------------------------


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expansion (ReLU6), depthwise 3x3 (ReLU6), linear 1x1 projection; the input
    is added when the block keeps the shape (stride 1, same channels)."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = round(cin * expand)
        layers: list[nn.Module] = [conv_bn_act(cin, hidden, 1)] if expand != 1 else []
        # the projection's convolution and batch norm sit in ``conv`` itself, as in torchvision's layer names
        layers += [conv_bn_act(hidden, hidden, 3, stride, groups=hidden), *conv_bn_act(hidden, cout, 1, act=None)]
        self.conv = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv(x) if self.residual else self.conv(x)


# (expansion t, channels c, repeats n, first stride s): the paper's Table 2
MOBILENET_V2 = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                (6, 320, 1, 1))


def mobilenet_v2(num_classes: int = 1000, width: float = 1.0) -> Classifier:
    """MobileNetV2 (Sandler et al. 2018): 3.50 M parameters at width 1.0 and 1000 classes."""
    _check(num_classes, width)
    cin = make_divisible(32 * width)
    last = make_divisible(1280 * max(1.0, width))
    layers: list[nn.Module] = [conv_bn_act(3, cin, 3, 2)]
    for t, c, n, s in MOBILENET_V2:
        cout = make_divisible(c * width)
        for i in range(n):
            layers.append(InvertedResidual(cin, cout, s if i == 0 else 1, t))
            cin = cout
    layers.append(conv_bn_act(cin, last, 1))
    return Classifier(nn.Sequential(*layers), last, num_classes, dropout=0.2)


# ---- ResNet-18 ---------------------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with batch norm, the input added (through a strided 1x1
    convolution and batch norm when the shape changes), then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: Tensor) -> Tensor:
        y = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu(y + self.downsample(x))


class ResNet(nn.Module):
    """ResNet for ImageNet (He et al. 2016): 7x7 stride-2 stem, 3x3 stride-2 max pool, four stages of basic
    blocks, global average pooling and a linear head ``fc``; torchvision's layer names. Designed at 224x224,
    it takes any size of at least 32."""

    def __init__(self, blocks: tuple[int, ...], num_classes: int, width: float) -> None:
        super().__init__()
        widths = [make_divisible(c * width) for c in (64, 128, 256, 512)]
        self.conv1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = widths[0]
        for i, (n, cout) in enumerate(zip(blocks, widths)):
            stage = []
            for j in range(n):
                stage.append(BasicBlock(cin, cout, 2 if (i > 0 and j == 0) else 1))
                cin = cout
            setattr(self, f"layer{i + 1}", nn.Sequential(*stage))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)
        self.in_channels, self.num_classes = 3, num_classes
        _init(self)
        # the fc layer keeps PyTorch's default initialization, as in torchvision
        self.fc.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))


def resnet18(num_classes: int = 1000, width: float = 1.0) -> ResNet:
    """ResNet-18 for ImageNet (He et al. 2016): 11.69 M parameters at width 1.0 and 1000 classes.

    Not the registry's ``resnet18`` (a CIFAR-style 3x3 stem without max pool, run by edgerev's engine).
    """
    _check(num_classes, width)
    return ResNet((2, 2, 2, 2), num_classes, width)


# ---- EfficientNet-B0 ---------------------------------------------------------------------------------------


class SqueezeExcitation(nn.Module):
    """Squeeze-and-excitation (Hu et al. 2018): per-channel gates ``sigmoid(W2 silu(W1 mean(x)))``."""

    def __init__(self, channels: int, squeeze: int) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.activation = nn.SiLU()
        self.scale_activation = nn.Sigmoid()

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))


class MBConv(nn.Module):
    """EfficientNet's block: 1x1 expansion (SiLU), depthwise kxk (SiLU), squeeze-and-excitation on a
    quarter of the block's input channels, linear 1x1 projection; the input is added when the shape stays."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = make_divisible(cin * expand)
        layers: list[nn.Module] = [conv_bn_act(cin, hidden, 1, act=nn.SiLU)] if hidden != cin else []
        layers += [conv_bn_act(hidden, hidden, kernel, stride, groups=hidden, act=nn.SiLU),
                   SqueezeExcitation(hidden, max(1, cin // 4)), conv_bn_act(hidden, cout, 1, act=None)]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: Tensor) -> Tensor:
        return x + self.block(x) if self.residual else self.block(x)


# (expansion, kernel, first stride, channels, repeats): the paper's Table 1
EFFICIENTNET_B0 = ((1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3), (6, 5, 1, 112, 3),
                   (6, 5, 2, 192, 4), (6, 3, 1, 320, 1))


def efficientnet_b0(num_classes: int = 1000, width: float = 1.0) -> Classifier:
    """EfficientNet-B0 (Tan and Le 2019) with SiLU: 5.29 M parameters at width 1.0 and 1000 classes."""
    _check(num_classes, width)
    cin = make_divisible(32 * width)
    layers: list[nn.Module] = [conv_bn_act(3, cin, 3, 2, act=nn.SiLU)]
    for t, k, s, c, n in EFFICIENTNET_B0:
        cout = make_divisible(c * width)
        layers.append(nn.Sequential(*[MBConv(cin if i == 0 else cout, cout, k, s if i == 0 else 1, t)
                                      for i in range(n)]))
        cin = cout
    last = make_divisible(4 * cin)
    layers.append(conv_bn_act(cin, last, 1, act=nn.SiLU))
    return Classifier(nn.Sequential(*layers), last, num_classes, dropout=0.2)


DESIGNS: dict[str, Callable[..., nn.Module]] = {
    "mobilenet_v2": mobilenet_v2, "resnet18": resnet18, "efficientnet_b0": efficientnet_b0}


def _classes_follow(model: Classifier | ResNet, rows: int) -> None:
    model.num_classes = rows


describes(Classifier, lambda model: {}, head_grown=_classes_follow)
describes(ResNet, lambda model: {}, head_grown=_classes_follow)

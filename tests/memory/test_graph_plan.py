"""The planner on an arbitrary classifier's graph, and trainable sets, over a grid of three architectures.

Built here, small (32x32) and outside the registry: a residual CNN with batch norm and in-place ReLUs,
a MobileNetV2-like net (inverted residuals, ReLU6, depthwise convolutions, dropout before the head) and
a squeeze-and-excitation net with HardSwish. For each:

- the chain of pieces between the graph's cut points computes the model's forward exactly, and no cut
  falls inside a residual or gated block;
- gradients under every plan (stored, checkpointed, one segment, 8- and 4-bit copies, a mix) equal
  plain autograd's (the copies approximately), and batch-norm statistics move once;
- the step's accounting on fake tensors equals the tracker's count of the real step, byte for byte,
  for every plan and trainable set;
- the cap's invariants: below the floor is refused before anything is profiled, naming the floor; the
  floor trains; an accepted budget never needs a retry;
- each trainable set trains exactly the parameters it names, a frozen prefix keeps nothing, frozen
  batch-norm statistics do not move, and ``auto`` picks the most parameters that fit.
"""

from __future__ import annotations

import copy
import json
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgerev.config import ConfigError
from edgerev.memory.graph import ChainModel, GraphError, chain, planned
from edgerev.memory.measure import profile as profile_mod
from edgerev.memory.measure.account import StepShape, account_step
from edgerev.memory.measure.peak import apply_plan
from edgerev.memory.plan.autoplan import _SegmentsSolver, batch_statistics, floor_plan, plan_training
from edgerev.memory.solve.costs import BudgetTooSmall, Segment
from edgerev.memory.solve.segments import EXACT_SEGMENT_MODES, plan_segments
from edgerev.train.cap import CpuCap, train_step
from edgerev.train.config import TrainConfig
from edgerev.train.trainable import (
    NothingFits,
    Trainable,
    TrainableError,
    choose_fit,
    choose_trainable,
    parse_trainable,
    selected,
    set_trainable,
    trainable_count,
)

SIZE, CLASSES = 32, 5


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)  # used twice, in place: the capture rewrites both out of place
        self.short = nn.Sequential() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.b2(self.c2(self.relu(self.b1(self.c1(x)))))
        out += self.short(x)
        return self.relu(out)


class ResCNN(nn.Module):
    def __init__(self, w: int = 8) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU(inplace=True))
        self.layer1 = ResBlock(w, w, 1)
        self.layer2 = ResBlock(w, 2 * w, 2)
        self.fc = nn.Linear(2 * w, CLASSES)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def cba(cin, cout, k, stride=1, groups=1, act=nn.ReLU6):
    layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, *([act()] if act else []))


class Inverted(nn.Module):
    def __init__(self, cin, cout, stride, expand=4):
        super().__init__()
        hidden = cin * expand
        self.conv = nn.Sequential(cba(cin, hidden, 1), cba(hidden, hidden, 3, stride, groups=hidden),
                                  cba(hidden, cout, 1, act=None))
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        return x + self.conv(x) if self.residual else self.conv(x)


class MobileLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(cba(3, 8, 3, 2), Inverted(8, 8, 1), Inverted(8, 16, 2), Inverted(16, 16, 1))
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(16, CLASSES))

    def forward(self, x):
        return self.classifier(self.features(x).mean((2, 3)))


class SE(nn.Module):
    def __init__(self, c, r=4):
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(c, c // r, 1), nn.Conv2d(c // r, c, 1)

    def forward(self, x):
        s = F.adaptive_avg_pool2d(x, 1)
        return x * F.hardsigmoid(self.fc2(F.relu(self.fc1(s))))


class SENet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = cba(3, 8, 3, act=nn.Hardswish)
        self.block1 = nn.Sequential(cba(8, 16, 3, 2, act=nn.Hardswish), SE(16))
        self.block2 = nn.Sequential(cba(16, 16, 3, groups=16, act=nn.Hardswish), SE(16), cba(16, 16, 1, act=None))
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x):
        x = self.stem(x)
        x = self.block1(x)
        x = x + self.block2(x)
        return self.head(x.mean(dim=(2, 3)))


NETS = {"rescnn": ResCNN, "mobile": MobileLike, "senet": SENet}


def grid(sets, fast) -> list:
    """Every net with every one of ``sets``; the pairs in ``fast`` run always, the rest only with the slow tests
    (each pair takes seconds: a fake and a real step per plan)."""
    return [pytest.param(n, t, marks=() if (n, t) in fast else pytest.mark.slow) for n in sorted(NETS) for t in sets]


def by_net(fast) -> list:
    return [pytest.param(n, marks=() if n in fast else pytest.mark.slow) for n in sorted(NETS)]


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return NETS[name]()


def batch(n: int = 6, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, SIZE, SIZE, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


# ---- cut points: the chain computes the forward -----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(NETS))
def test_the_chain_computes_the_models_forward_exactly(name):
    model = build(name)
    reference = copy.deepcopy(model)
    cm = chain(model, SIZE)
    x, _ = batch()
    for mode in (False, True):  # eval, then train: batch norm statistics move the same way
        model.train(mode), reference.train(mode), cm.train(mode)
        with torch.no_grad():
            torch.manual_seed(3)
            got = cm(x)
            torch.manual_seed(3)
            want = reference(x)
        assert torch.equal(got, want), f"{name}: the chain differs from the forward (train={mode})"
    for (k, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), f"{name}: {k} moved differently through the chain"
    # the chain shares the model's weights: nothing was copied
    assert {id(p) for p in cm.parameters()} == {id(p) for p in model.parameters()}


EXPECTED_PIECES = {
    "rescnn": ["stem.0", "stem.1", "stem.2", "layer1", "layer1.relu", "layer2", "layer2.relu", "adaptive_avg_pool2d",
               "flatten", "fc"],
    "mobile": ["features.0.0", "features.0.1", "features.0.2", "features.1.conv", "features.2.conv.0.0",
               "features.2.conv.0.1", "features.2.conv.0.2", "features.2.conv.1.0", "features.2.conv.1.1",
               "features.2.conv.1.2", "features.2.conv.2.0", "features.2.conv.2.1", "features.3.conv", "mean",
               "classifier.0", "classifier.1"],
    "senet": ["stem.0", "stem.1", "stem.2", "block1.0.0", "block1.0.1", "block1.0.2", "block1.1", "block2", "mean",
              "head"],
}


@pytest.mark.parametrize("name", sorted(NETS))
def test_cut_points_fall_between_blocks_never_inside_one(name):
    """A residual or gated block has two tensors alive inside it: it is one piece; a chain is cut at every op."""
    assert [p.name for p in chain(build(name), SIZE).chain] == EXPECTED_PIECES[name]


def test_a_long_chain_keeps_the_cuts_at_its_smallest_tensors():
    """Past ``max_pieces`` the cuts at the largest tensors go (the solver's time grows with the chain's square)."""
    model = build("mobile")
    full, short = chain(model, SIZE), chain(model, SIZE, max_pieces=6)
    assert len(full.chain) == len(EXPECTED_PIECES["mobile"]) and len(short.chain) == 6
    x, _ = batch()
    model.eval()
    with torch.no_grad():
        sizes = []
        h = x
        for piece in full.chain:
            h = piece(h)
            sizes.append(h.numel())
        assert torch.equal(short(x), model(x))
    kept = set()
    h = x
    with torch.no_grad():
        for piece in short.chain[:-1]:
            h = piece(h)
            kept.add(h.numel())
    dropped = sorted(sizes[:-1], reverse=True)[:len(sizes) - 6]
    assert max(kept) <= min(dropped), (kept, dropped)


def test_a_model_fx_cannot_follow_is_captured_with_torch_export():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Linear(4, CLASSES)

        def forward(self, x):
            if x.shape[-1] > 8:  # control flow on a shape: torch.fx cannot trace it, torch.export specializes it
                x = F.max_pool2d(x, 2)
            return self.fc(F.relu(self.bn(self.conv(x))).mean((2, 3)))

    with pytest.raises(torch.fx.proxy.TraceError):
        torch.fx.symbolic_trace(Branchy())
    torch.manual_seed(0)
    model = Branchy()
    reference = copy.deepcopy(model)
    cm = chain(model, SIZE)
    x, y = batch()
    assert torch.equal(cm(x), reference(x))  # training mode: batch statistics, running ones moved once
    assert torch.equal(model.bn.running_mean, reference.bn.running_mean)
    assert {id(p) for p in cm.parameters()} == {id(p) for p in model.parameters()}
    # a checkpointed re-run leaves the running statistics where the forward put them
    apply_plan(cm, None, (Segment(0, len(cm.body.stages), "checkpoint"),))
    F.cross_entropy(cm(x), y).backward()
    F.cross_entropy(reference(x), y).backward()
    assert torch.equal(model.bn.running_mean, reference.bn.running_mean)
    assert torch.allclose(model.conv.weight.grad, reference.conv.weight.grad, atol=1e-6)


class AsksTraining(nn.Module):
    """Normalizes by the batch's statistics or the running ones as its Python asks ``self.training`` (timm's
    ``BatchNormAct2d`` does so); ``exported``: with control flow on a shape too, which only torch.export follows."""

    def __init__(self, exported: bool = False):
        super().__init__()
        self.exported = exported
        self.conv, self.bn, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Linear(4, CLASSES)

    def forward(self, x):
        if self.exported and x.shape[-1] > 8:
            x = x * 1.0
        h = self.conv(x)
        if self.training:
            h = self.bn(h)
        else:
            h = F.batch_norm(h, self.bn.running_mean, self.bn.running_var, self.bn.weight, self.bn.bias)
        return self.fc(F.relu(h).mean((2, 3)))


@pytest.mark.parametrize("exported", [False, True])
def test_a_module_in_eval_mode_is_captured_as_it_trains(exported):
    """The chain is what a training step runs: traced in training mode whatever the module's (a graph fixes the
    branch its Python takes); the module is left in eval mode."""
    torch.manual_seed(0)
    model = AsksTraining(exported)
    with torch.no_grad():
        model.bn.running_var.fill_(25.0)  # running statistics far from any batch's
    model.eval()
    model.bn.train()  # a module in eval mode holding a batch norm in training mode, as a calibration leaves it
    cm = chain(model, SIZE)
    assert not model.training
    x, _ = batch()
    cm.train()
    with torch.no_grad():
        torch.testing.assert_close(cm(x), copy.deepcopy(model).train()(x))


def test_a_module_given_in_eval_mode_trains_as_in_training_mode(tmp_path):
    """The trainer puts the chain in training mode too: torch.export's batch norms are the chain's own modules,
    which the module's ``train()`` does not reach."""
    from edgerev.api import fit_run
    from edgerev.train.config import SourceConfig
    from edgerev.train.labeled import load_source

    images = load_source(SourceConfig(kind="synthetic", samples=16, num_classes=CLASSES, seed=1), SIZE)
    losses = []
    for mode in (True, False):
        torch.manual_seed(0)
        model = AsksTraining(exported=True).train(mode)
        out = fit_run(model, images, out=tmp_path / f"run-{mode}", size=SIZE, epochs=2, batch=8, lr=0.05,
                      config={"train": {"log_every": 1, "patience": None}})
        rows = [json.loads(line) for line in (out.out / "metrics.jsonl").read_text().splitlines()]
        losses.append([r["loss"] for r in rows if r["kind"] == "train"])
    assert losses[0] == losses[1]


def test_in_place_writes_are_rewritten_and_writes_into_views_refused():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4, CLASSES)

        def forward(self, x):
            h = self.conv(x)
            h.add_(1.0)  # written in place, read again through its old name
            h = torch.relu_(h)
            return self.fc(h.mean((2, 3)))

    class IntoView(InPlace):
        def forward(self, x):
            h = self.conv(x)
            h[:, :2].mul_(2.0)
            return self.fc(h.mean((2, 3)))

    torch.manual_seed(0)
    model = InPlace()
    x, _ = batch()
    assert torch.equal(chain(model, SIZE)(x), model(x))
    with pytest.raises(GraphError, match=r"writes in place into a view"):
        chain(IntoView(), SIZE)


def test_an_in_place_dropout_into_a_view_nothing_reads_again_trains_out_of_place():
    class Classifier(nn.Module):  # torchvision's EfficientNet: Dropout(inplace=True) on the flattened features
        def __init__(self):
            super().__init__()
            self.conv, self.drop = nn.Conv2d(3, 4, 3, padding=1), nn.Dropout(0.2, inplace=True)
            self.fc = nn.Linear(4, CLASSES)

        def forward(self, x):
            return self.fc(self.drop(torch.flatten(F.adaptive_avg_pool2d(F.relu(self.conv(x)), 1), 1)))

    class ReadAgain(Classifier):
        def forward(self, x):
            h = F.adaptive_avg_pool2d(F.relu(self.conv(x)), 1)
            return self.fc(self.drop(torch.flatten(h, 1))) + h.mean()  # the viewed tensor is read after the write

    torch.manual_seed(0)
    model = Classifier()
    reference = copy.deepcopy(model)
    cm = chain(model, SIZE)
    x, y = batch()
    apply_plan(cm, None, tuple(Segment(i, i + 1, "checkpoint") for i in range(len(cm.body.stages))))
    got, want = grads(model, cm, x, y), grads(reference, reference, x, y)
    assert got.keys() == want.keys() and all(torch.allclose(got[k], want[k], atol=1e-6) for k in want)
    with pytest.raises(GraphError, match=r"writes in place into a view"):
        chain(ReadAgain(), SIZE)


def test_torch_exports_in_place_ops_run_out_of_place_under_checkpoints():
    class ExportOnly(nn.Module):  # timm's MobileViT: traced by torch.export, its SiLU in place on a cut's tensor
        def __init__(self):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
            self.conv2, self.fc = nn.Conv2d(4, 4, 3, padding=1), nn.Linear(4, CLASSES)

        def forward(self, x):
            if x.shape[-1] > 2:  # torch.fx cannot follow it
                x = self.conv1(x)
            h = F.silu(self.bn1(x), inplace=True)
            h = F.silu(self.conv2(h), inplace=True)
            return self.fc(h.mean((2, 3)))

    torch.manual_seed(0)
    model = ExportOnly()
    reference = copy.deepcopy(model)
    cm = chain(model, SIZE)
    names = {getattr(n.target, "__name__", "") for m in cm.modules() if isinstance(m, torch.fx.GraphModule)
             for n in m.graph.nodes}
    assert "silu.default" in names and "silu_.default" not in names
    x, y = batch()
    apply_plan(cm, None, tuple(Segment(i, i + 1, "checkpoint") for i in range(len(cm.body.stages))))
    got, want = grads(model, cm, x, y), grads(reference, reference, x, y)
    assert got.keys() == want.keys() and all(torch.allclose(got[k], want[k], atol=1e-6) for k in want)


def test_a_forward_that_returns_no_single_tensor_is_refused_in_one_line():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(4, CLASSES)

        def forward(self, x):
            y = self.fc(self.conv(x).mean((2, 3)))
            return y, y

    with pytest.raises(GraphError) as info:
        chain(Two(), SIZE)
    assert "\n" not in str(info.value)


# ---- gradients under every plan ---------------------------------------------------------------------------------


def plans(n: int) -> dict[str, tuple[Segment, ...]]:
    return {
        "store": (Segment(0, n, "store"),),
        "checkpoint-each": tuple(Segment(i, i + 1, "checkpoint") for i in range(n)),
        "checkpoint-one": (Segment(0, n, "checkpoint"),),
        "mixed": (Segment(0, n // 3, "checkpoint"), Segment(n // 3, 2 * n // 3, "store8"),
                  Segment(2 * n // 3, n, "store")),
        "store8": tuple(Segment(i, i + 1, "store8") for i in range(n)),
        "store4": (Segment(0, n, "store4"),),
    }


def grads(model: nn.Module, run: nn.Module, x, y, seed: int = 5) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout mask in the forward (and in a checkpointed re-run)
    F.cross_entropy(run(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("plan", list(plans(3)))
@pytest.mark.parametrize("name", sorted(NETS))
def test_gradients_under_every_plan_equal_plain_autograds(name, plan):
    model = build(name).double()
    reference = copy.deepcopy(model)
    cm = chain(model, SIZE)
    x, y = batch()
    x = x.double()
    apply_plan(cm, None, plans(len(cm.body.stages))[plan])
    got, want = grads(model, cm, x, y), grads(reference, reference, x, y)
    assert got.keys() == want.keys() == {n for n, _ in model.named_parameters()}
    whole = torch.cat([g.flatten() for g in want.values()])
    if plan in ("store8", "store4", "mixed"):  # approximate: the whole gradient's direction, each part's error
        cos = F.cosine_similarity(torch.cat([got[k].flatten() for k in want]), whole, dim=0)
        assert cos > (0.99 if plan == "store4" else 0.999), f"{name} {plan}: cosine {cos:.5f}"
    for k in want:
        if plan in ("store8", "store4", "mixed"):
            # against the whole gradient's norm: a batch norm's scale before another batch norm has a true
            # gradient near zero (the second one normalizes it away), whose direction is noise
            err = (got[k] - want[k]).norm() / whole.norm()
            assert err < (0.2 if plan == "store4" else 0.05), f"{name} {plan}: {k} off by {err:.4f} of the whole"
        else:
            assert torch.allclose(got[k], want[k], rtol=1e-9, atol=1e-12), f"{name} {plan}: {k}"
    for (k, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), f"{name} {plan}: {k} moved other than once"


# ---- one accounting: the prediction is the tracker's count ------------------------------------------------------


@pytest.mark.parametrize("name,trainable", grid(["all", "head", "bias", "last:2"],
                                                 {("rescnn", "all"), ("senet", "bias"), ("mobile", "last:2")}))
def test_the_accounting_predicts_the_tracked_step_exactly(name, trainable):
    model = build(name)
    cm = set_trainable(model, trainable, size=SIZE)
    step = StepShape(SIZE, 6, momentum=True)
    for plan in ("store", "checkpoint-each", "mixed", "store4"):
        segs = plans(len(cm.body.stages))[plan]

        def apply(m, segs=segs):
            apply_plan(m, None, segs)

        fake = account_step(cm, step, 3, apply)
        real = account_step(cm, step, 3, apply, real=True)
        assert fake == real, f"{name} {trainable} {plan}: predicted {fake.total}, tracked {real.total}"


@pytest.mark.parametrize("name,trainable", grid(["all", "last:2"], {("senet", "all"), ("mobile", "last:2")}))
def test_estimated_piece_statistics_have_the_measured_bytes_and_planning_runs_nothing(name, trainable, monkeypatch):
    """An estimate prices a chain's pieces on copies without data: the bytes of every piece are the ones a real run
    saves, its seconds grow with the batch, and a plan from estimates never runs a piece on real tensors."""
    model = build(name)
    cm = set_trainable(model, trainable, size=SIZE)
    x = torch.randn(8, 3, SIZE, SIZE)
    if hasattr(cm, "body_input"):
        x = cm.body_input(x)
    est = profile_mod.estimate_stage_stats(cm.body.stages, x)
    real = profile_mod.stage_stats(cm.body.stages, x, repeats=0)
    assert len(est) == len(real)
    for e, r in zip(est, real):
        assert (e.input_bytes, e.input_elements, e.graph_bytes, e.output_bytes) == \
            (r.input_bytes, r.input_elements, r.graph_bytes, r.output_bytes)
        assert e.forward_seconds.at(2) >= e.forward_seconds.at(1) >= 0
        assert e.backward_seconds.at(2) >= e.backward_seconds.at(1) >= 0

    def no_timing(*a, **k):
        raise AssertionError("a plan from estimates ran a piece")

    monkeypatch.setattr(profile_mod, "stage_stats", no_timing)
    monkeypatch.setattr(profile_mod, "_time_stage", no_timing)
    step = StepShape(SIZE, 6, momentum=True)
    p = plan_training(model, SIZE, 1 << 30, estimate=True, max_batch=6, step=step)
    assert p.predicted_peak_bytes <= 1 << 30 and p.batch >= 1

class FunctionalNorm(nn.Module):
    """A batch norm called as a function (timm's ``BatchNormAct2d`` traced into a chain is one): no module of it
    is a torch batch norm."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(channels)), nn.Parameter(torch.zeros(channels))
        self.register_buffer("mean", torch.zeros(channels))
        self.register_buffer("var", torch.ones(channels))

    def forward(self, x: Tensor) -> Tensor:
        return F.batch_norm(x, self.mean, self.var, self.weight, self.bias, self.training, 0.1, 1e-5)


class BatchNormAct(nn.BatchNorm2d):
    """A batch norm of another package whose forward calls the function with its own training flag and momentum
    (timm's ``BatchNormAct2d``), then an activation."""

    def forward(self, x: Tensor) -> Tensor:
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        return F.relu(F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training,
                                   momentum, self.eps))


def act_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), BatchNormAct(4), nn.Conv2d(4, 4, 3, padding=1),
                         BatchNormAct(4), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, CLASSES))


@pytest.mark.parametrize("plan", ["store", "checkpoint-each", "checkpoint-one"])
def test_a_batch_norm_of_another_package_moves_its_statistics_once_a_step_and_freezes(plan):
    """A batch norm stays a module of the chain: a checkpointed re-run leaves its running statistics where plain
    autograd's step puts them (traced through, its fixed momentum moved them twice), and a frozen set freezes it."""
    model, reference = act_net(), act_net()
    x, y = batch()
    F.cross_entropy(reference(x), y).backward()
    cm = planned(model, SIZE)
    apply_plan(cm, None, plans(len(cm.body.stages))[plan])
    F.cross_entropy(cm(x), y).backward()
    for (name, got), want in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(got, want), f"{plan}: {name}"
    frozen = set_trainable(act_net(), "all", "frozen", size=SIZE)
    before = [b.clone() for b in frozen.buffers()]
    F.cross_entropy(frozen(x), y).backward()
    assert all(torch.equal(a, b) for a, b in zip(before, frozen.buffers()))
    assert not batch_statistics(frozen, SIZE) and batch_statistics(planned(act_net(), SIZE), SIZE)


def test_batch_statistics_is_a_batch_norm_in_training_mode_module_or_function():
    def net(norm):
        return nn.Sequential(nn.Conv2d(3, 4, 3), norm, nn.Flatten(), nn.Linear(4 * (SIZE - 2) ** 2, CLASSES))

    assert batch_statistics(planned(build("rescnn"), SIZE), SIZE)
    assert batch_statistics(net(FunctionalNorm(4)), SIZE)
    assert not batch_statistics(net(FunctionalNorm(4)).eval(), SIZE)
    assert not batch_statistics(net(nn.GroupNorm(2, 4)), SIZE)
    frozen = set_trainable(build("rescnn"), "all", "frozen", size=SIZE)
    assert not batch_statistics(frozen, SIZE)


def test_a_model_that_normalizes_by_the_batch_trains_at_the_largest_micro_batch_an_exact_plan_fits():
    """Under the least budget that trains the whole batch of 6 (every piece checkpointed), a smaller micro-batch
    that stores more is faster; a batch norm sees the micro-batch, so the planner takes the whole batch, and the
    fastest where the batch norms are frozen."""
    cm = planned(build("rescnn"), SIZE)
    stats = profile_mod.estimate_stage_stats(cm.body.stages, torch.randn(8, 3, SIZE, SIZE))
    fixed = profile_mod.fixed_bytes(cm)
    with pytest.raises(BudgetTooSmall) as info:
        plan_segments(stats, 1, fixed, batches=[6], modes=EXACT_SEGMENT_MODES)
    target, batches = info.value.smallest, [1, 2, 3, 6]
    while True:  # the least budget whose exact plan at 6 the solver finds (its granules round)
        try:
            plan_segments(stats, target, fixed, batches=[6], modes=EXACT_SEGMENT_MODES)
            break
        except BudgetTooSmall:
            target += max(1, target // 200)
    fastest = plan_segments(stats, target, fixed, batches=batches, modes=EXACT_SEGMENT_MODES)
    assert fastest.batch < 6, "the budget must make a smaller micro-batch the faster one"
    assert _SegmentsSolver(cm, SIZE, "cpu", stats).solve(target, batches, 6).batch == 6
    assert _SegmentsSolver(cm, SIZE, "cpu", stats).solve(target, batches, 3).batch == 3
    assert _SegmentsSolver(cm, SIZE, "cpu", stats).solve(target, [1, 2, 4, 5], 6).batch == 2  # 4s, 5s: 3s
    cm.bn_stats = "frozen"
    cm.train()
    assert _SegmentsSolver(cm, SIZE, "cpu", stats).solve(target, batches, 6).batch == fastest.batch


# ---- the cap's invariants ---------------------------------------------------------------------------------------

FLOOR = re.compile(r"the smallest budget that fits is ([0-9,]+) bytes")


def capped_steps(model: nn.Module, run: nn.Module, micro: int, cap: CpuCap, n: int = 6, steps: int = 2) -> None:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01, momentum=0.9)
    for s in range(steps):
        x, y = batch(n, seed=10 + s)
        result = train_step(run, optimizer, x, y, micro_batches=micro, cap=cap)
        assert result.retries == 0, "a budget accepted at start needed a smaller micro-batch"
    assert cap.verified_steps >= 1 and cap.peak <= cap.budget


@pytest.mark.parametrize("name,trainable", grid(["all", "bias"], {("rescnn", "all"), ("senet", "bias")}))
def test_below_the_floor_is_refused_at_once_and_the_floor_trains(name, trainable, monkeypatch):
    model = build(name)
    cm = set_trainable(model, trainable, size=SIZE)
    step = StepShape(SIZE, 6, momentum=True)

    def no_profiling(*a, **k):
        raise AssertionError("a budget below the floor must be refused before anything is profiled")

    with monkeypatch.context() as m:
        m.setattr(profile_mod, "stage_stats", no_profiling)
        with pytest.raises(BudgetTooSmall) as info:
            plan_training(model, SIZE, 1, max_batch=6, step=step)
        floor = int(FLOOR.search(str(info.value)).group(1).replace(",", ""))
        with pytest.raises(BudgetTooSmall, match=f"smallest budget that fits is {floor:,} bytes"):
            plan_training(model, SIZE, floor - 1, max_batch=6, step=step)
    proposal, account = floor_plan(model, step)
    assert account.total == floor and account.micro_batch == 1
    proposal.apply(cm)
    capped_steps(model, cm, 6, CpuCap(floor, account.baseline))


def test_a_plan_is_accounted_for_a_model_from_outside_as_its_chain():
    """The planner's account takes the module a user gave (the doctor's fallback once handed it one and torch
    raised that it has no engine body): the account of its chain, which the plan applies to."""
    from edgerev.memory.plan.autoplan import accounted

    model = build("rescnn")
    step = StepShape(SIZE, 6, momentum=True)
    proposal, floor = floor_plan(model, step)
    chained = accounted(planned(model, SIZE), step, proposal)
    assert accounted(model, step, proposal).total == chained.total == floor.total


@pytest.mark.parametrize("name", ["rescnn", "tiny"])
def test_the_floor_is_never_above_plain_autograds_step(name):
    """Plain autograd's step is one of the least-memory candidates: where weights, gradients and momentum are most
    of a step (``tiny``: 580 bytes of weights, whose every segmentation holds more than plain autograd), the floor
    is that step, not a segmentation above it."""
    from tests.resolve_factories import tiny

    model = tiny() if name == "tiny" else build(name)
    cm = planned(model, SIZE)
    plain = (Segment(0, len(cm.body.stages), "store"),)
    for momentum in (False, True):
        step = StepShape(SIZE, 6, momentum=momentum)
        autograd = account_step(cm, step, 6, lambda m: apply_plan(m, None, plain)).total
        _, floor = floor_plan(model, step)
        assert floor.total <= autograd, (name, momentum)
        if name == "tiny":
            assert floor.total == min(autograd, account_step(cm, step, 1, lambda m: apply_plan(m, None, plain)).total)


def test_chain_segments_keep_exact_gradients_wherever_an_exact_plan_fits():
    """A 4-bit copy is priced at memory speed, cheaper than any re-run: the segments' solver takes one only where no
    segmentation of stored and checkpointed pieces fits (issue 33: approximate modes only where nothing exact
    fits the cap). Stats of known bytes per sample, at micro-batch 8."""
    from edgerev.memory.measure.profile import fixed_bytes
    from edgerev.memory.plan.autoplan import _SegmentsSolver
    from edgerev.memory.solve.costs import Linear, StageStats
    from edgerev.memory.solve.segments import predicted_peak

    cm = planned(build("rescnn"), SIZE)
    n = len(cm.body.stages)
    stats = [StageStats(1e3, 250, 1e4, 1e3, Linear(0.0, 1e-3), Linear(0.0, 2e-3))] * n
    solver = _SegmentsSolver(cm, SIZE, "cpu", stats=stats)
    checkpointed = predicted_peak(stats, [Segment(i, i + 1, "checkpoint") for i in range(n)])
    copied = predicted_peak(stats, [Segment(0, n, "store4")])
    assert copied < checkpointed
    exact = solver.solve(int(fixed_bytes(cm) + 8 * checkpointed * 1.02), [8])
    assert exact.batch == 8 and {seg.mode for seg in exact.segments} <= {"store", "checkpoint"}, exact.segments
    below = solver.solve(int(fixed_bytes(cm) + 8 * (copied + checkpointed) / 2), [8])
    assert below.batch == 8 and {seg.mode for seg in below.segments} & {"store8", "store4"}, below.segments


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(NETS))
def test_an_accepted_budget_never_fails_later(name):
    """The whole planner (profile, solve, check, shrink) at budgets from the floor up; the trainer's steps fit."""
    model = build(name)
    cm = planned(model, SIZE)
    step = StepShape(SIZE, 6, momentum=True)
    floor = floor_plan(model, step)[1].total
    for factor in (1.0, 1.3, 2.0, 4.0):
        budget = int(floor * factor)
        tp = plan_training(model, SIZE, budget, max_batch=6, step=step)
        assert tp.predicted_peak_bytes <= budget
        tp.apply(model)
        capped_steps(model, cm, -(-6 // tp.batch), CpuCap(budget, tp.account.baseline))


def test_the_planner_plans_a_model_without_an_engine_body():
    """The registry's attributes are not needed: plan_training takes the module and plans its chain."""
    model = build("rescnn")
    step = StepShape(SIZE, 4)
    floor = floor_plan(model, step)[1].total
    tp = plan_training(model, SIZE, 3 * floor, max_batch=4, step=step)
    assert tp.summary["planner"] == "checkpoint segments"
    assert [s["name"] for s in tp.summary["stages"]] == EXPECTED_PIECES["rescnn"]
    assert tp.account.total == tp.predicted_peak_bytes <= 3 * floor


# ---- trainable sets ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("trainable", ["all", "head", "bias", "last:1", "last:3"])
@pytest.mark.parametrize("name", sorted(NETS))
def test_a_trainable_set_trains_exactly_what_it_names(name, trainable):
    model = build(name)
    cm = set_trainable(model, trainable, size=SIZE)
    named = {id(p) for p in selected(cm, trainable)}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = batch()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    F.cross_entropy(cm(x), y).backward()
    optimizer.step()
    for n, p in model.named_parameters():
        if id(p) in named:
            assert p.grad is not None and not torch.equal(p, before[n]), f"{trainable}: {n} did not train"
        else:
            assert p.grad is None and torch.equal(p, before[n]), f"{trainable}: {n} trained"
    if trainable == "head":
        assert {id(p) for p in named} == {id(p) for p in list(model.modules())[-1].parameters()} or \
            len(named) == 2  # the last linear layer: weight and bias
    if trainable.startswith("last") or trainable == "head":
        assert len(cm.prefix) > 0 and not any(p.requires_grad for p in cm.prefix.parameters())


@pytest.mark.parametrize("name", sorted(NETS))
def test_a_frozen_prefix_keeps_no_activation_and_no_gradient(name):
    """Head only: the step holds the head's input, its gradients and little else."""
    model = build(name)
    step = StepShape(SIZE, 6)
    full = account_step(set_trainable(model, "all", size=SIZE), step, 6, lambda m: None)
    head = account_step(set_trainable(model, "head"), step, 6, lambda m: None)
    params = sum(p.numel() * 4 for p in selected(planned(model), "head"))
    assert head.gradients == params
    # logits, their gradient, the head's input and the prefix's largest activation (freed as it goes)
    assert head.step_bytes < full.step_bytes / 3, (head.step_bytes, full.step_bytes)


@pytest.mark.parametrize("name", sorted(NETS))
def test_frozen_batch_norm_statistics_do_not_move_and_updated_ones_do(name):
    model = build(name)
    x, y = batch()
    for bn_stats, moves in (("frozen", False), ("updated", True)):
        cm = set_trainable(model, "all", bn_stats, size=SIZE)
        cm.train()
        before = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
        F.cross_entropy(cm(x), y).backward()
        after = {k: v for k, v in model.state_dict().items() if "running" in k}
        assert before and all(torch.equal(before[k], after[k]) != moves for k in before), bn_stats


@pytest.mark.parametrize("name", by_net({"rescnn"}))
def test_auto_trains_the_most_parameters_that_fit(name):
    model = build(name)
    cm = planned(model, SIZE)
    step = StepShape(SIZE, 6, momentum=True)
    totals = {}
    for t in ("all", "last:1", "last:2"):
        set_trainable(cm, t)
        totals[t] = min(account_step(cm, step, 6, lambda m, s=s: apply_plan(m, None, s)).total
                        for s in _floors(cm))
    chosen, account = choose_trainable(model, step, totals["all"])
    assert str(chosen) == "all" and account.total == totals["all"]
    chosen, account = choose_trainable(model, step, totals["last:2"])
    assert chosen.kind in ("last", "bias") and account.total <= totals["last:2"]
    assert trainable_count(cm) >= sum(p.numel() for p in selected(cm, "last:2"))
    with pytest.raises(NothingFits) as info:
        choose_trainable(model, step, totals["last:1"] - 1)
    assert info.value.smallest == totals["last:1"] and isinstance(info.value, BudgetTooSmall)


def _least(cm: ChainModel, trainable: str, step: StepShape, loss_fn=None) -> int:
    """The least total of ``cm``'s step training ``trainable`` over the floor plans, the whole batch at once."""
    set_trainable(cm, trainable)
    return min(account_step(cm, step, step.batch, lambda m, s=s: apply_plan(m, None, s), loss_fn).total
               for s in _floors(cm))


def test_auto_drops_the_momentum_only_where_that_trains_more():
    """With momentum, ``auto`` takes every parameter while it fits; then the largest set that fits without the
    momentum, with it where that set fits with it (no set that fits with it trains more): in float32, else in
    bfloat16, else none, and says which."""
    model = build("rescnn")
    cm = planned(model, SIZE)
    kept, dropped = StepShape(SIZE, 6, momentum=True), StepShape(SIZE, 6, momentum=False)
    half = StepShape(SIZE, 6, momentum=True, state_bytes=2)
    every = sum(p.numel() for p in cm.parameters())
    all_kept, all_half, all_dropped = (_least(cm, "all", s) for s in (kept, half, dropped))
    assert all_dropped < all_half < all_kept and all_kept - all_half == all_half - all_dropped == every * 2
    for budget, state, state_bytes in ((all_kept, "kept", 4), (all_kept - 1, "bfloat16", 2), (all_half, "bfloat16", 2),
                                       (all_half - 1, "dropped", 0), (all_dropped, "dropped", 0)):
        fit = choose_fit(model, kept, budget)
        assert (str(fit.trainable), fit.state, trainable_count(cm)) == ("all", state, every), budget
        assert fit.account.total <= budget and fit.account.optimizer == every * state_bytes
        assert fit.summary() == {"trainable": "all", "optimizer_state": state}
        assert fit.step(kept).momentum == (state != "dropped") and fit.step(kept).state_bytes == (state_bytes or 4)
    steps = {"kept": kept, "bfloat16": half, "dropped": dropped}
    for budget in (_least(cm, "last:2", kept), _least(cm, "last:2", half), _least(cm, "last:1", dropped)):
        counts = {}
        for state, step in steps.items():
            try:
                choose_trainable(model, step, budget)
                counts[state] = trainable_count(cm)
            except NothingFits:
                counts[state] = -1
        fit = choose_fit(model, kept, budget)
        most = max(counts.values())
        assert trainable_count(cm) == most and fit.state == next(s for s in steps if counts[s] == most), counts
        assert fit.account.total <= budget
    with pytest.raises(NothingFits) as info:
        choose_fit(model, kept, _least(cm, "last:1", dropped) - 1)
    assert info.value.smallest == _least(cm, "last:1", dropped)
    fit = choose_fit(model, dropped, all_dropped)  # a recipe without momentum: nothing to drop
    assert (str(fit.trainable), fit.momentum, fit.summary()["optimizer_state"]) == ("all", False, "none")


def _floors(cm: ChainModel):
    n = len(cm.body.stages)
    return [tuple(Segment(i, i + 1, "store4") for i in range(n)), (Segment(0, n, "store4"),),
            tuple(Segment(i, i + 1, "checkpoint") for i in range(n))]


def test_changing_the_trainable_set_after_planning_is_refused():
    model = build("rescnn")
    cm = planned(model, SIZE)
    apply_plan(cm, None, plans(len(cm.body.stages))["checkpoint-each"])
    model.stem[0].weight.requires_grad_(False)
    x, y = batch()
    with pytest.raises(Exception, match="plan it again"):
        cm(x)


@pytest.mark.parametrize("text,expected", [("all", Trainable("all")), ("head", Trainable("head")),
                                           ("bias", Trainable("bias")), ("last:3", Trainable("last", 3)),
                                           ("auto", Trainable("auto"))])
def test_parse_trainable(text, expected):
    assert parse_trainable(text) == expected and str(expected) == text


@pytest.mark.parametrize("text", ["last:0", "last:", "last:x", "some", "", "Head"])
def test_parse_trainable_refuses(text):
    with pytest.raises(TrainableError, match="is not a trainable set; use all, head, bias, last:N"):
        parse_trainable(text)


def test_the_recipe_validates_trainable_and_bn_stats():
    assert TrainConfig(trainable="last:2", bn_stats="frozen").trainable == "last:2"
    with pytest.raises(ConfigError, match=r"^trainable: 'last:0' is not a trainable set"):
        TrainConfig(trainable="last:0")
    with pytest.raises(ConfigError, match=r"^bn_stats: 'moving' is not a batch-norm choice"):
        TrainConfig(bn_stats="moving")


# ---- the trainer: a recipe's trainable set and batch-norm choice on a model from outside -------------------------


def test_the_trainer_trains_a_models_head_under_a_budget_with_frozen_statistics(tmp_path):
    from edgerev.api import fit_run
    from edgerev.train.config import SourceConfig
    from edgerev.train.labeled import load_source

    images = load_source(SourceConfig(kind="synthetic", samples=24, num_classes=CLASSES, seed=1), SIZE)
    model = build("rescnn")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = {"train": {"trainable": "head", "bn_stats": "frozen"}}
    result = fit_run(model, images, out=tmp_path / "run", size=SIZE, epochs=1, batch=8, lr=0.1, budget=4 * 2**20,
                     config=cfg)
    moved = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert moved == {"fc.weight", "fc.bias"}, moved
    plan = result.summary["plan"]
    assert plan["mode"] == "planned" and plan["account"]["total"] <= plan["budget_bytes"]
    assert plan["account"]["optimizer"] == sum(p.numel() * 4 for p in model.fc.parameters())


@pytest.mark.parametrize("state", ["bfloat16", "dropped"])
def test_the_trainer_keeps_the_momentum_auto_chose_to_keep(tmp_path, state):
    """Under a budget just below every parameter's step with momentum, ``auto`` trains every parameter with the
    momentum in bfloat16; below that step too, with plain SGD: the run says so, accounts the optimizer state it
    keeps, its buffers are of that dtype (a resumed run's too) and its steps stay under the budget."""
    from edgerev.api import fit_run
    from edgerev.train.config import RunConfig, SourceConfig
    from edgerev.train.labeled import load_source
    from edgerev.train.memory import loss_of

    images = load_source(SourceConfig(kind="synthetic", samples=24, num_classes=CLASSES, seed=1), SIZE)
    model = build("rescnn")
    every = sum(p.numel() for p in model.parameters())
    # every parameter, with momentum, the batch of 8 at once, as the trainer's recipe makes the step
    floor = _least(planned(model, SIZE), "all", StepShape(SIZE, 8, momentum=True), loss_of(RunConfig()))
    budget = floor - 1 if state == "bfloat16" else floor - every * 2 - 1
    before = {k: v.clone() for k, v in model.named_parameters()}
    result = fit_run(model, images, out=tmp_path / "run", budget=budget, trainable="auto", size=SIZE, epochs=2,
                     batch=8, lr=0.05)
    plan = result.summary["plan"]
    assert (plan["trainable"], plan["optimizer_state"]) == ("all", state)
    assert plan["account"]["optimizer"] == (every * 2 if state == "bfloat16" else 0)
    assert plan["measured_peak_bytes"] <= plan["budget_bytes"] == budget
    assert all(not torch.equal(v, before[k]) for k, v in model.named_parameters())
    from safetensors.torch import load_file

    from edgerev.train.state import FOLDER

    saved = load_file(str(next((tmp_path / "run" / FOLDER).glob("*.safetensors"))))
    buffers = {v.dtype for k, v in saved.items() if k.endswith("momentum_buffer")}
    assert buffers == ({torch.bfloat16} if state == "bfloat16" else set()), buffers


# ---- imported: the same nets through ONNX (edgerev.models.onnx_import) -----------------------------------------


@pytest.mark.parametrize("name", by_net({"senet"}))
def test_an_imported_onnx_model_is_cut_planned_and_accounted_exactly(name, tmp_path):
    """The nets exported by torch with batch norm kept, imported: the chain computes the import's forward,
    its gradients under checkpoint segments are plain autograd's and its step is accounted to the byte."""
    from edgerev.models.onnx_import import load_onnx

    model = build(name).eval()
    path = tmp_path / f"{name}.onnx"
    torch.onnx.export(model, torch.randn(2, 3, SIZE, SIZE), str(path), input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "batch"}}, dynamo=False, do_constant_folding=False,
                      training=torch.onnx.TrainingMode.PRESERVE)
    imported = load_onnx(path).train()
    reference = copy.deepcopy(imported)
    cm = chain(imported, SIZE)
    x, y = batch()
    with torch.no_grad():
        assert torch.equal(cm(x), reference(x))
    apply_plan(cm, None, plans(len(cm.body.stages))["checkpoint-each"])
    got, want = grads(imported, cm, x, y), grads(reference, reference, x, y)
    assert got.keys() == want.keys() and len(got) > 0
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=1e-4, atol=1e-6), k
    step = StepShape(SIZE, 4, momentum=True)

    def apply(m):
        apply_plan(m, None, plans(len(cm.body.stages))["mixed"])

    assert account_step(cm, step, 2, apply) == account_step(cm, step, 2, apply, real=True)


@pytest.mark.parametrize("arch,args", [("resnet18", {"width": 8, "blocks": (1, 1, 1, 1)}),
                                       ("revnext", {"width": 8, "blocks": (1, 1, 1, 1, 1)})])
def test_an_edgerev_model_trains_its_head_alone(arch, args):
    """The sets apply to the registry's models too (by requires_grad: their engine runs them as they are)."""
    from edgerev.models import create_model

    torch.manual_seed(0)
    model = create_model(arch, **args, num_classes=CLASSES)
    assert set_trainable(model, "head") is model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = batch()
    F.cross_entropy(model(x), y).backward()
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1).step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    head = {n for n, p in model.named_parameters() if p.requires_grad}
    assert moved == head and head <= {"head.weight", "head.bias"} and "head.weight" in head, moved
    stats = {n: b.clone() for n, b in model.named_buffers() if "running" in n}
    assert stats and set_trainable(model, "all", "frozen") is model  # frozen: batch norms in eval mode
    model(x).sum().backward()
    assert all(torch.equal(b, stats[n]) for n, b in model.named_buffers() if n in stats)


@pytest.mark.slow  # a reversible model's fake steps: ~50 s on a loaded machine
def test_auto_on_an_edgerev_model_keeps_its_stage_modes():
    from edgerev.memory.plan.autoplan import floor_plan
    from edgerev.models import create_model

    torch.manual_seed(0)
    model = create_model("revnext", width=8, blocks=(1, 1, 1, 1, 1), num_classes=CLASSES)
    step = StepShape(SIZE, 4, momentum=True)
    chosen, account = choose_trainable(model, step, 10**9)
    assert str(chosen) == "all" and account.micro_batch == 4
    floor = floor_plan(model, StepShape(SIZE, 4, momentum=True))[1]
    assert account.total >= floor.total


class PooledNorm(nn.Module):
    """A batch norm after a global pool, over one value per channel of a sample (RexNet's squeeze-excitation, RepViT's
    classifier): torch refuses to train it at a batch of 1."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm1d(8)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(self.norm(F.adaptive_avg_pool2d(self.conv(x), 1).flatten(1)))


def test_a_batch_norm_over_one_value_per_channel_is_planned_at_micro_batches_of_two():
    """The planner's floor ran it at micro-batch 1 and failed with torch's raw error (RexNet, RepViT); now its least
    micro-batch is 2, no plan splits a step into a micro-batch of 1, and a step of batch 1 is refused in one line."""
    from edgerev.errors import UnsupportedModel
    from edgerev.memory.measure.microbatch import split_batch
    from edgerev.memory.plan.autoplan import least_micro_batch, trains_at

    size = 16
    assert least_micro_batch(planned(PooledNorm(), size), size) == 2
    assert least_micro_batch(planned(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(),
                                                   nn.LazyLinear(10)), size), size) == 1
    with pytest.raises(UnsupportedModel, match="^PooledNorm trains at .* use a batch of 2 or more") as e:
        plan_training(PooledNorm(), size, 10**8, max_batch=1, step=StepShape(size, batch=1))
    assert "\n" not in str(e.value)
    plans = {}
    for batch in (2, 5, 8, 33):
        step = StepShape(size, batch=batch, momentum=True)
        roomy = plan_training(PooledNorm(), size, 10**8, max_batch=batch, step=step)
        floor = floor_plan(PooledNorm(), step)[1].total
        plans[batch] = plan_training(PooledNorm(), size, floor + (roomy.predicted_peak_bytes - floor) // 4,
                                     max_batch=batch, step=step)
        for p in (roomy, plans[batch]):
            parts = split_batch(batch, -(-batch // p.batch))
            assert trains_at(batch, p.batch, 2) and min(s.stop - s.start for s in parts) >= 2, (batch, p.batch)
    assert plans[8].batch < 8  # the tight plan accumulates micro-batches, of two samples or more
    model = planned(PooledNorm(), size)
    plans[8].apply(model)
    x, y = torch.randn(8, 3, size, size), torch.randint(0, 10, (8,))
    micro = -(-8 // plans[8].batch)
    res = train_step(model, torch.optim.SGD(model.parameters(), lr=0.01), x, (y,), micro_batches=micro)
    assert res.micro_batches == micro > 1 and math.isfinite(res.loss)

"""Accounting on tensors without data: the meta device, with fake tensors where an op has no meta kernel.

The planner accounts every candidate step on copies of the model that hold no data (:func:`edgerev._torchapi.shadowed`).
The meta device and ``FakeTensorMode`` must give the same bytes, stage by stage, for every mode of the engine and
for plain models; a step that needs an op with no meta kernel is accounted on fake tensors instead.
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import edgerev._torchapi as torchapi
from edgerev.engine import supported_modes
from edgerev.memory.measure.account import StepShape, account_step
from edgerev.memory.measure.profile import _fit_bytes, stage_inputs
from edgerev.models import create_model
from tests.profiles import SMALL_REVNEXT, small_model


def _on_fake_tensors(monkeypatch) -> None:
    """Make :func:`edgerev._torchapi.shadowed` take its fake-tensor path (as for an op without a meta kernel)."""
    def no_meta_kernel(module):
        raise NotImplementedError("Could not run 'aten::something' with arguments from the 'Meta' backend")

    monkeypatch.setattr(torchapi, "meta_copy", no_meta_kernel)


CASES = [
    ("revnext", {"width": 8, "blocks": (1, 1, 1, 1, 1)}, mode)
    for mode in ("invert", "floor", "recompute", "store", "store8", "store4")
] + [
    ("revnet", {"width": 8}, "recompute"),
    ("resnet18", {"width": 8}, None),  # plain autograd
]


@pytest.mark.parametrize("arch, overrides, mode", CASES, ids=[f"{a}-{m or 'plain'}" for a, _, m in CASES])
def test_meta_and_fake_tensors_account_a_step_alike(monkeypatch, arch, overrides, mode):
    model = create_model(arch, **overrides)
    step = StepShape(16, batch=6, momentum=True)

    def apply(m: nn.Module) -> None:
        if mode is not None:
            m.body.set_modes(mode)

    def account() -> tuple:
        peaks: dict[int, int] = {}
        acc = account_step(model, step, 4, apply, stage_peaks=peaks)
        return acc, peaks

    on_meta = account()
    with monkeypatch.context() as m:
        _on_fake_tensors(m)
        on_fake = account()
    assert on_meta == on_fake
    assert on_meta[0].step_bytes > 0 and (mode is None or len(on_meta[1]) == len(model.body.stages))


def test_meta_and_fake_tensors_profile_a_stage_alike(monkeypatch):
    model = small_model(SMALL_REVNEXT)
    shapes = stage_inputs(model, 16)
    stage = model.body.stages[3]
    ways = (False, True)  # floor by slices and by restoring (Execution.floor_restore)
    curves = {(m, r): _fit_bytes(stage, m, shapes[3], False, r) for m in supported_modes(stage) for r in ways}
    _on_fake_tensors(monkeypatch)
    assert stage_inputs(model, 16) == shapes
    assert {(m, r): _fit_bytes(stage, m, shapes[3], False, r) for m in supported_modes(stage) for r in ways} == curves


def test_a_meta_copy_holds_no_data_and_keeps_what_trains():
    model = create_model("revnext", width=8, blocks=(1, 1, 1, 1, 1))
    model.head.weight.requires_grad_(False)
    copy = torchapi.meta_copy(model)
    assert all(t.device.type == "meta" for t in [*copy.parameters(), *copy.buffers()])
    assert [p.requires_grad for p in copy.parameters()] == [p.requires_grad for p in model.parameters()]
    assert all(t.device.type == "cpu" for t in model.parameters())  # the original is untouched
    assert copy.head.weight.shape == model.head.weight.shape


def test_a_model_with_tensor_attributes_is_copied_whole_onto_meta():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.scale = torch.full((1, 4, 1, 1), 2.0)  # neither a parameter nor a buffer (as traced graphs keep them)

        def forward(self, x):
            return self.conv(x) * self.scale

    copy = torchapi.meta_copy(Scaled())
    assert copy.scale.device.type == "meta"
    with torch.device("meta"):
        assert copy(torch.zeros(2, 3, 8, 8)).shape == (2, 4, 6, 6)


# ---- the meta memo: an op answered from what the same call returned before (edgerev._torchapi.MetaMemo) ----

def _layout(t: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "channels_last" and t.dim() == 4:
        return t.contiguous(memory_format=torch.channels_last)
    if kind == "transposed" and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)  # dense, not contiguous
    if kind == "expanded":
        return t[..., :1].expand(t.shape)  # strides of 0: several elements on one
    return t


MEMO_OPS = {
    "leaky_relu": lambda x, y: torch.nn.functional.leaky_relu(x, 0.1),
    "leaky_relu_": lambda x, y: torch.nn.functional.leaky_relu_(x.clone(), 0.2),
    "add": lambda x, y: x + y,
    "add_out": lambda x, y: torch.add(x, y, out=torch.empty(x.shape)),
    "add_out_resized": lambda x, y: torch.add(x, y, out=torch.empty(0)),
    "add_": lambda x, y: x.clone().add_(y, alpha=2.0),
    "addcmul": lambda x, y: torch.addcmul(x, x, y, value=0.5),
    "mul_scalar": lambda x, y: x * 3,
    "clone": lambda x, y: x.clone(),
    "std_mean": lambda x, y: torch.std_mean(x, dim=0, keepdim=True),
    "sum": lambda x, y: x.sum(dim=-1),
    "where": lambda x, y: torch.where(x > 0, x, y),
    "half": lambda x, y: x.to(torch.float16),
    "cat": lambda x, y: torch.cat([x, y], dim=0),
    "foreach_mul": lambda x, y: torch._foreach_mul([x, y], [y, x]),
    "transpose": lambda x, y: x.transpose(0, -1),  # a view: never recorded
    "batch_norm": lambda x, y: torch.nn.functional.batch_norm(  # two samples at least: statistics to compute
        torch.cat([x, x]), torch.zeros(x.shape[1]), torch.ones(x.shape[1]), training=True) if x.dim() > 1 else x.neg(),
    "conv": lambda x, y: torch.nn.functional.conv2d(x, torch.zeros(2, x.shape[1], 1, 1)) if x.dim() == 4 else x.abs(),
}


def _signature(out, args: list[torch.Tensor]) -> list:
    """Everything the tracker and the engine read of an op's results: shapes, strides, dtypes, storage bytes, and
    which argument each result is or shares its storage with."""
    from torch.utils._pytree import tree_leaves

    keys = [torchapi.storage_key(a) for a in args]
    results = [(tuple(t.shape), t.stride(), t.dtype, t.storage_offset(), t.untyped_storage().nbytes(),
                next((i for i, a in enumerate(args) if t is a), -1),
                keys.index(torchapi.storage_key(t)) if torchapi.storage_key(t) in keys else -1)
               if isinstance(t, torch.Tensor) else t for t in tree_leaves(out)]
    return results + [(tuple(a.shape), a.stride()) for a in args]  # an out= argument resized


@pytest.mark.parametrize("op", sorted(MEMO_OPS))
@settings(max_examples=12, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=4),
       layouts=st.tuples(*[st.sampled_from(["contiguous", "channels_last", "transposed", "expanded"])] * 2))
def test_the_meta_memo_replays_exactly_what_the_op_returns(op, shape, layouts):
    fn = MEMO_OPS[op]

    def call(memo: bool) -> list:
        with torch.device("meta"), (torchapi.MetaMemo() if memo else contextlib.nullcontext()):
            x, y = (_layout(torch.randn(shape), kind) for kind in layouts)
            return _signature(fn(x, y), [x, y])

    torchapi.MetaMemo._calls.clear()
    plain = call(False)
    assert call(True) == plain  # recorded
    assert call(True) == plain  # replayed


def test_a_replayed_op_keeps_no_tensor_alive():
    gc.disable()  # what the tracker sees freed is what reference counts free, not the garbage collector
    try:
        with torch.device("meta"), torchapi.MetaMemo():
            for _ in range(2):  # record, then replay
                x = torch.randn(4, 3)
                out = torch.std_mean(x, dim=0)
                seen = [weakref.ref(t.untyped_storage()) for t in (x, *out)]
                del x, out
                assert all(ref() is None for ref in seen)
    finally:
        gc.enable()

"""Accounting on tensors without data: the meta device, with fake tensors where an op has no meta kernel.

The planner accounts every candidate step on copies of the model that hold no data (:func:`edgerev._torchapi.shadowed`).
The meta device and ``FakeTensorMode`` must give the same bytes, stage by stage, for every mode of the engine and
for plain models; a step that needs an op with no meta kernel is accounted on fake tensors instead.
"""

from __future__ import annotations

import pytest
import torch
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

"""Fake-tensor accounting of a model that is not on the CPU: the same bytes as on the CPU.

The planner accounts and profiles a CUDA model on fake tensors; its fake copy must sit where the fake inputs
are made. No CUDA here: a model on the ``meta`` device stands in for one on another device (it failed the
same way, on mixed devices)."""

from __future__ import annotations

from edgerev.engine import supported_modes
from edgerev.memory.measure.account import StepShape, account_step
from edgerev.memory.measure.profile import _bytes_curves, stage_inputs
from edgerev.models import create_model


def small():
    return create_model("revnext", width=8, blocks=(1, 1, 1, 1, 1))


def test_a_step_is_accounted_alike_wherever_the_model_is():
    model = small()
    step = StepShape(16, batch=4, momentum=True)
    on_cpu = account_step(model, step, 2, lambda m: m.body.set_modes("invert"))
    elsewhere = account_step(model.to("meta"), step, 2, lambda m: m.body.set_modes("invert"))
    assert elsewhere == on_cpu


def test_a_stage_profile_counts_the_same_bytes_wherever_the_model_is():
    model = small()
    shapes = stage_inputs(model, 16)
    i = 3
    stage = model.body.stages[i]
    modes = [m for m in supported_modes(stage) if m.value in ("invert", "store")]
    curves = {m: _bytes_curves(stage, m, shapes[i], False, "cpu") for m in modes}
    model.to("meta")
    assert {m: _bytes_curves(stage, m, shapes[i], False, "cpu") for m in modes} == curves

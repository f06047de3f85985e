"""What the math libraries take beside the tensors (edgerev.memory.measure.workspaces): counted in the accounting
while each operator runs, probed once per signature, on the device where a CUDA step is planned. The probe itself
needs CUDA (marked gpu); how its figures enter an account is tested on the CPU with a probe given in its place."""

import pytest
import torch
import torch.nn.functional as F

from edgerev import create_model
from edgerev.memory.measure.account import StepShape, account_step
from edgerev.memory.measure.tracker import MemoryBudgetExceeded, MemoryTracker
from edgerev.memory.measure.workspaces import LibraryMemory, counting, signature
from edgerev.memory.plan.autoplan import plan_training

BACKWARD = torch.ops.aten.convolution_backward.default
FORWARD = torch.ops.aten.convolution.default
MiB = 2**20


def _model():
    torch.manual_seed(0)
    return create_model("revnext", width=8, blocks=(1, 1, 1, 1, 1), num_classes=4)


def _account(lib=None):
    with counting(lib):
        return account_step(_model(), StepShape(32), 8, lambda m: m.body.set_modes("invert"))


class Probe:
    """A convolution backward takes ``inside`` bytes, a forward a tenth of it; every call is recorded."""

    def __init__(self, inside: int) -> None:
        self.inside, self.calls = inside, []

    def __call__(self, func, args, kwargs) -> int:
        self.calls.append(signature(func, args, kwargs))
        return self.inside if func is BACKWARD else self.inside // 10


def test_what_a_convolution_takes_inside_itself_is_live_while_it_runs():
    bare = _account()
    inside = 512 * MiB  # more than the whole step holds: the peak is where a backward runs, plus this
    counted = _account(LibraryMemory(persistent=3 * MiB, probe=Probe(inside)))
    assert counted.libraries == 3 * MiB and counted.baseline == bare.baseline + 3 * MiB
    # the step's tensors are what they were; the peak is the tensors live at some backward, plus its workspace
    assert counted.gradients == bare.gradients
    assert bare.baseline + 3 * MiB + inside < counted.total <= bare.total + 3 * MiB + inside


def test_a_signature_is_probed_once():
    probe = Probe(MiB)
    lib = LibraryMemory(0, probe=probe)
    _account(lib)
    first = len(probe.calls)
    assert first == len(set(probe.calls)) > 0
    assert {c[0] for c in probe.calls} == {str(FORWARD), str(BACKWARD)}
    _account(lib)
    assert len(probe.calls) == first
    assert lib.summary() == {"counted": True, "persistent_bytes": 0, "probed": first,
                             "largest_transient_bytes": MiB}


def test_a_remembered_account_is_the_one_of_the_libraries_counted():
    """The planner remembers accounts for the process: one made without the libraries' memory is not the one
    with it, nor one with another device's."""
    from edgerev.memory.plan.autoplan import Proposal, accounted

    model, step = _model(), StepShape(32)
    p = Proposal(8, tuple("store" if i == 0 else "invert" for i in range(len(model.body.stages))), None, 0, 0.0)
    bare = accounted(model, step, p)
    with counting(LibraryMemory(5 * MiB, probe=Probe(0))):
        assert accounted(model, step, p).total == bare.total + 5 * MiB
    with counting(LibraryMemory(7 * MiB, probe=Probe(0))):
        assert accounted(model, step, p).total == bare.total + 7 * MiB
    assert accounted(model, step, p) is bare


def test_a_signature_is_shapes_strides_and_arguments_not_values():
    x, w = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    args = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    key = signature(FORWARD, args, {})
    assert signature(FORWARD, (x + 1, w * 2, *args[2:]), {}) == key
    assert signature(FORWARD, (x.contiguous(memory_format=torch.channels_last), *args[1:]), {}) != key
    assert signature(FORWARD, (x, w, None, [2, 2], *args[4:]), {}) != key
    assert signature(FORWARD, (x.double(), w.double(), *args[2:]), {}) != key


def test_other_operators_take_nothing_and_are_not_probed():
    probe = Probe(MiB)
    lib = LibraryMemory(0, probe=probe)
    assert lib.transient(torch.ops.aten.mm.default, (torch.ones(2, 2), torch.ones(2, 2)), {}) == 0
    assert probe.calls == []


def test_a_workspace_over_the_budget_is_refused_like_a_tensor():
    model, x = _model(), torch.randn(2, 3, 16, 16)
    with counting(LibraryMemory(0, probe=Probe(10**12))), MemoryTracker(budget=10**11), \
            pytest.raises(MemoryBudgetExceeded, match="with its workspace"):
        F.cross_entropy(model(x), torch.tensor([0, 1])).backward()


@pytest.mark.parametrize("error", [torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                   RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED")])
def test_a_probe_that_fails_counts_nothing_and_says_so(error):
    def probe(func, args, kwargs):
        raise error

    lib = LibraryMemory(0, probe=probe)
    assert lib.transient(FORWARD, (torch.ones(1, 1, 2, 2), torch.ones(1, 1, 1, 1)), {}) == 0
    assert lib.transient(FORWARD, (torch.ones(1, 1, 2, 2), torch.ones(1, 1, 1, 1)), {}) == 0  # not tried again
    assert lib.summary()["unprobed"] == 1
    assert str(error).split(".")[0].split(": ")[-1] in next(iter(lib.failures.values()))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has the device: the plan counts them")
def test_a_cuda_plan_made_without_the_device_says_they_are_not_counted():
    tp = plan_training(_model(), 16, 50 * MiB, "cuda", estimate=True, check=True, batches=[4], widen=False)
    assert tp.summary["libraries"]["counted"] is False and "not in the prediction" in tp.summary["libraries"]["why"]
    assert tp.account.libraries == 0


@pytest.mark.gpu
def test_on_cuda_a_planned_step_allocates_what_was_predicted():
    """The paper's step (RevNeXt, batch 32, 240x240) planned under 711 MB on the device: the allocator's peak
    within 5 % of the prediction, the convolutions' workspaces and cuBLAS's counted in it."""
    from edgerev.memory.measure.microbatch import accumulate, split_batch

    if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):  # the step makes them again, as in a process of its own
        torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    model = create_model("revnext").cuda().train()
    tp = plan_training(model, 240, 711_000_000, "cuda", estimate=True, max_batch=32, check=True, batches=[32])
    libraries = tp.summary["libraries"]
    assert libraries["counted"] and libraries["persistent_bytes"] > 0 and libraries["largest_transient_bytes"] > 0
    tp.apply(model)
    x = torch.randn(32, 3, 240, 240, device="cuda")
    y = torch.randint(0, model.num_classes, (32,), device="cuda")
    parts = split_batch(32, 32 // tp.batch)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        accumulate(model, x, (y,), parts, F.cross_entropy).read()
        torch.cuda.synchronize()
    allocated = torch.cuda.max_memory_allocated() - start
    assert allocated == pytest.approx(tp.predicted_peak_bytes, rel=0.05), (allocated, tp.predicted_peak_bytes)

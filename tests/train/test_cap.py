"""The hard memory cap on CPU: training steps that split their batch when they run into it, and lose nothing."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from edgerev.errors import EdgerevError
from edgerev.memory.measure.microbatch import accumulate, split_batch
from edgerev.memory.measure.tracker import MemoryBudgetExceeded, MemoryTracker
from edgerev.models import create_model
from edgerev.train.cap import CpuCap, StepFailed, cpu_cap, train_step
from tests.helpers import own_process

# Small enough to run in float64, large enough that activations outweigh the weights: splitting the
# batch must lower the peak, or no split can rescue a budget one byte short.
SMALL = dict(width=4, blocks=(1, 1, 1, 1, 1))
BATCH = 8
SIZE = 32


def make(train: bool = True, seed: int = 0):
    """A small float64 RevNeXt (eval mode: batch norm on running statistics) and one batch."""
    torch.manual_seed(seed)
    model = create_model("revnext", **SMALL).double().train(train)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(BATCH, 3, SIZE, SIZE, dtype=torch.float64, generator=g)
    y = torch.randint(0, 10, (BATCH,), generator=g)
    return model, x, y


def step_bytes(model, x, y, parts: int) -> int:
    """Peak live bytes of forward+backward over ``parts`` micro-batches, as ``train_step`` runs them (its loop)."""
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    with MemoryTracker() as tr:
        summed = accumulate(model, x, (y,), split_batch(x.shape[0], parts), F.cross_entropy)
    summed.read()  # after the update, outside the cap, as train_step reads it
    return tr.peak


def before_step(model, x, y, optimizer=None) -> int:
    """Bytes alive before the capped block: weights, buffers, the batch (and optimizer state)."""
    tensors = [*model.parameters(), *model.buffers(), x, y]
    if optimizer is not None:
        tensors += [s for st in optimizer.state.values() for s in st.values() if isinstance(s, torch.Tensor)]
    return sum(t.untyped_storage().nbytes() for t in tensors)


class CountingSGD(torch.optim.SGD):
    steps = 0

    def step(self, closure=None):
        self.steps += 1
        return super().step(closure)


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_state(a: dict, b: dict, **tol) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=lambda m, k=k: f"{k}: {m}", **tol)


def needs_of(train: bool) -> dict[int, int]:
    model, x, y = make(train=train)
    base = before_step(model, x, y)
    return {k: base + step_bytes(model, x, y, k) for k in (1, 2, 4, 8)}


@pytest.fixture(scope="module")
def needs():
    """Bytes one step of the eval-mode model needs with 1, 2, 4 and 8 micro-batches."""
    return needs_of(train=False)


@pytest.fixture(scope="module")
def needs_train():
    """The same for the model in training mode (batch statistics)."""
    return needs_of(train=True)


def test_a_budget_that_fits_the_batch_changes_nothing(needs):
    model, x, y = make(train=False)
    free = copy.deepcopy(model)
    opt = CountingSGD(model.parameters(), lr=0.1)
    r = train_step(model, opt, x, y, cap=CpuCap.over_alive(needs[1], model, opt, x, y))  # exactly enough
    assert (r.micro_batches, r.retries) == (1, 0)
    assert opt.steps == 1
    ref_opt = torch.optim.SGD(free.parameters(), lr=0.1)
    ref = train_step(free, ref_opt, x, y, cap=None)
    assert r.loss == ref.loss
    assert_same_state(state(model), state(free), rtol=0, atol=0)


def test_one_byte_less_retries(needs):
    model, x, y = make(train=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    r = train_step(model, opt, x, y, cap=CpuCap.over_alive(needs[1] - 1, model, opt, x, y))
    assert r.retries >= 1 and r.micro_batches > 1


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_split_step_equals_the_full_batch_step(needs, momentum):
    fits = min(needs[k] for k in (2, 4, 8))
    assert fits < needs[1], "the test needs a budget that only smaller micro-batches fit"
    budget = (fits + needs[1]) // 2
    model, x, y = make(train=False)
    free = copy.deepcopy(model)
    before = state(model)
    opt = CountingSGD(model.parameters(), lr=0.5, momentum=momentum)
    r = train_step(model, opt, x, y, cap=CpuCap.over_alive(budget, model, opt, x, y))
    assert r.retries >= 1 and r.micro_batches > 1
    assert needs[r.micro_batches] <= budget  # stopped at the first split that fits
    assert all(needs[k] > budget for k in (1, 2, 4, 8) if k < r.micro_batches)
    assert opt.steps == 1
    ref_opt = torch.optim.SGD(free.parameters(), lr=0.5, momentum=momentum)
    ref = train_step(free, ref_opt, x, y)
    assert r.loss == pytest.approx(ref.loss, rel=1e-12)
    after, expected = state(model), state(free)
    assert any(not torch.equal(after[k], before[k]) for k in after)  # the step did something
    assert_same_state(after, expected, rtol=1e-10, atol=1e-12)
    if momentum:
        for p, q in zip(model.parameters(), free.parameters()):
            torch.testing.assert_close(opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"],
                                       rtol=1e-10, atol=1e-12)


def test_adam_steps_once(needs):
    budget = (min(needs[k] for k in (2, 4, 8)) + needs[1]) // 2
    model, x, y = make(train=False)
    free = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    r = train_step(model, opt, x, y, cap=CpuCap.over_alive(budget, model, opt, x, y))
    assert r.retries >= 1
    assert {int(s["step"]) for s in opt.state.values()} == {1}
    ref_opt = torch.optim.Adam(free.parameters(), lr=1e-2)
    train_step(free, ref_opt, x, y)
    assert_same_state(state(model), state(free), rtol=1e-9, atol=1e-12)


def test_batch_norm_statistics_of_a_retried_step(needs_train):
    """The failed attempts' running-statistics updates are undone: the result is that of the final split alone."""
    needs = needs_train
    model, x, y = make(train=True)
    budget = (min(needs[k] for k in (2, 4, 8)) + needs[1]) // 2
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    r = train_step(model, opt, x, y, cap=CpuCap.over_alive(budget, model, opt, x, y))
    assert r.retries >= 1
    ref = train_step(twin, torch.optim.SGD(twin.parameters(), lr=0.1), x, y, micro_batches=r.micro_batches)
    assert (ref.micro_batches, ref.retries) == (r.micro_batches, 0)
    a, b = state(model), state(twin)
    stats = [k for k in a if "running" in k]
    assert stats
    for k in stats:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    assert_same_state(a, b, rtol=1e-10, atol=1e-12)
    assert r.loss == pytest.approx(ref.loss, rel=1e-12)


def test_a_budget_too_small_for_one_sample(needs_train):
    needs = needs_train
    model, x, y = make(train=True)
    before = state(model)
    opt = CountingSGD(model.parameters(), lr=0.1, momentum=0.9)
    budget = needs[8] - 1  # micro-batches of one sample need needs[8]
    with pytest.raises(StepFailed) as info:
        train_step(model, opt, x, y, cap=CpuCap.over_alive(budget, model, opt, x, y))
    assert isinstance(info.value, EdgerevError)
    assert "one sample" in str(info.value)
    assert opt.steps == 0 and not opt.state
    assert all(p.grad is None for p in model.parameters())
    assert_same_state(state(model), before, rtol=0, atol=0)  # weights and running statistics
    # the same call with enough memory works afterwards
    r = train_step(model, opt, x, y, cap=CpuCap.over_alive(needs[8], model, opt, x, y))
    assert r.micro_batches == BATCH and opt.steps == 1


def test_the_budget_counts_what_was_alive_before(needs):
    """The tracker starts from the weights, buffers and batch: a budget below them fails at once."""
    model, x, y = make(train=False)
    with pytest.raises(StepFailed):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        train_step(model, opt, x, y, cap=CpuCap.over_alive(before_step(model, x, y), model, opt, x, y))


def test_budget_exceeded_in_the_engine_backward_propagates():
    model, x, y = make(train=True)
    model.body.set_modes("invert")
    with MemoryTracker() as tr:
        loss = F.cross_entropy(model(x), y)
        after_forward = tr.peak
        loss.backward()
    assert tr.peak > after_forward
    model.zero_grad(set_to_none=True)
    budget = (after_forward + tr.peak) // 2
    with MemoryTracker(budget=budget):
        loss = F.cross_entropy(model(x), y)  # the forward fits
        with pytest.raises(MemoryBudgetExceeded) as info:
            loss.backward()
    assert isinstance(info.value, MemoryError) and isinstance(info.value, EdgerevError)
    assert f"budget of {budget} bytes" in str(info.value)
    assert any(entry.path.name == "engine.py" for entry in info.traceback), "not raised inside the engine"


def test_cpu_cap_without_budget_is_a_no_op():
    with cpu_cap(None) as tracker:
        assert tracker is None
    with cpu_cap(10_000, baseline=100) as tracker, pytest.raises(MemoryBudgetExceeded):
        assert tracker.current == 100
        torch.empty(10_000)


@pytest.mark.gpu
@own_process
def test_cuda_cap_recovers_from_out_of_memory():
    """Under a 400 MiB CUDA cap a batch too large for it is split, not crashed on."""
    from edgerev.train.cap import apply_cuda_cap

    torch.manual_seed(0)
    model = create_model("revnext").cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    apply_cuda_cap(400 * 2**20)
    try:
        x = torch.randn(256, 3, 240, 240, device="cuda")
        y = torch.randint(0, 10, (256,), device="cuda")
        result = train_step(model, opt, x, y)
        assert result.micro_batches > 1
        assert torch.cuda.max_memory_allocated() <= 400 * 2**20
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def test_gradient_clipping_scales_the_step():
    """Plain SGD at lr 1: the step is the gradient, clipped to the given norm when it is larger."""
    torch.manual_seed(0)
    model = create_model("revnext", width=8, blocks=(1, 1, 1, 1, 1), num_classes=3)
    x, y = torch.randn(4, 3, 16, 16) * 50, torch.randint(0, 3, (4,))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    train_step(model, optimizer, x, y, clip_grad_norm=0.01)
    step = torch.sqrt(sum(((p.detach() - b) ** 2).sum() for p, b in zip(model.parameters(), before)))
    assert float(step) == pytest.approx(0.01, rel=1e-3)


def test_a_cap_over_what_is_alive_counts_the_optimizer_state(needs):
    """``CpuCap.over_alive``: its baseline is the weights, buffers and batch, and the optimizer state once made."""
    model, x, y = make(train=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert CpuCap.over_alive(needs[1], model, opt, x, y).baseline == before_step(model, x, y)
    train_step(model, opt, x, y)
    with_state = CpuCap.over_alive(needs[1], model, opt, x, y).baseline
    assert with_state == before_step(model, x, y, opt) > before_step(model, x, y)

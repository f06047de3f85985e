"""Training steps replayed as CUDA graphs (edgerev.train.graphs): the same weights as steps launched op by op,
and no replay of a step whose shapes, plan, weights or modes changed. The replays need CUDA (marked gpu); what
decides a replay is tested on the CPU."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from edgerev import create_model
from edgerev.config import from_dict
from edgerev.engine import InvertibleSequence
from edgerev.train.cap import train_step
from edgerev.train.config import RunConfig
from edgerev.train.graphs import StepGraphs, step_key


def _small(device="cpu"):
    torch.manual_seed(0)
    return create_model("revnext", width=8, blocks=(1, 1, 1, 1, 1), num_classes=4).to(device).train()


def _batch(device="cpu", n=8, size=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 3, size, size, generator=g).to(device), torch.randint(0, 4, (n,), generator=g).to(device))


def test_the_key_changes_with_everything_a_replay_was_recorded_with():
    model = _small()
    x, y = _batch()
    key = step_key(model, x, (y,), 1, F.cross_entropy)
    assert step_key(model, x, (y,), 1, F.cross_entropy) == key  # the same step again
    assert step_key(model, x.clone(), (y.clone(),), 1, F.cross_entropy) == key  # other values, same shapes
    changed = {
        "shape": lambda: step_key(model, x[:4], (y[:4],), 1, F.cross_entropy),
        "dtype": lambda: step_key(model, x.double(), (y,), 1, F.cross_entropy),
        "micro-batches": lambda: step_key(model, x, (y,), 2, F.cross_entropy),
        "loss": lambda: step_key(model, x, (y,), 1, lambda a, b: F.cross_entropy(a, b)),
    }
    for what, k in changed.items():
        assert k() != key, what
    model.set_modes("floor")
    assert step_key(model, x, (y,), 1, F.cross_entropy) != key, "modes"
    model.set_modes("invert")
    assert step_key(model, x, (y,), 1, F.cross_entropy) == key
    p = next(model.parameters())
    p.data = p.data.clone()  # a weight the graph would not read
    assert step_key(model, x, (y,), 1, F.cross_entropy) != key, "a replaced weight"
    key = step_key(model, x, (y,), 1, F.cross_entropy)
    model.head.eval()
    assert step_key(model, x, (y,), 1, F.cross_entropy) != key, "a module's mode"
    model.head.train()
    p.requires_grad_(False)
    assert step_key(model, x, (y,), 1, F.cross_entropy) != key, "the trainable set"


def test_on_the_cpu_graphs_change_nothing():
    """A step given graphs on the CPU runs as without them, every time."""
    results = []
    for graphs in (None, StepGraphs()):
        model = _small()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x, y = _batch()
        losses = [train_step(model, opt, x, y, graphs=graphs).loss for _ in range(3)]
        results.append((losses, [p.detach().clone() for p in model.parameters()]))
        if graphs is not None:
            assert graphs.captures == graphs.replays == 0
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)


def _lockstep(batches, configure=lambda m: None, micro=1, clip=None, between=None, loss_fn=F.cross_entropy):
    """Each step twice from the same weights, statistics and momentum: with graphs on one model, eagerly on a
    second one copied from the first just before. Their losses, gradients and updated weights must agree to
    rounding (a whole run is not compared: a GPU's rounding grows over steps); returns the graphs."""
    graphs = StepGraphs()
    a, b = _small("cuda"), _small("cuda")
    configure(a)
    configure(b)
    oa = torch.optim.SGD(a.parameters(), lr=0.05, momentum=0.9)
    ob = torch.optim.SGD(b.parameters(), lr=0.05, momentum=0.9)
    for i, (x, y) in enumerate(batches):
        if between is not None:
            between(i, a, oa)
        b.load_state_dict(a.state_dict())
        # a deep copy: load_state_dict keeps the very momentum tensors it is given (same device and dtype), which
        # the first optimizer's step would then move under the second's feet
        ob.load_state_dict(copy.deepcopy(oa.state_dict()))
        ra = train_step(a, oa, x, y, micro_batches=micro, clip_grad_norm=clip, loss_fn=loss_fn, graphs=graphs)
        rb = train_step(b, ob, x, y, micro_batches=micro, clip_grad_norm=clip, loss_fn=loss_fn)
        assert ra.loss == pytest.approx(rb.loss, rel=1e-5, abs=1e-6), i
        for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
            # a capture's library kernels may round apart from an eager step's: 0.8e-6 to 2.9e-6 of a parameter's
            # largest gradient on an H200 (benchmarks/cuda_graph.py); the update moves a weight by lr times that
            scale = float(q.grad.abs().max()) if q.grad is not None else 0.0
            assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-5 * scale + 1e-12), (i, name)
            assert torch.allclose(p, q, rtol=1e-6, atol=2 * 0.05 * (1e-5 * scale) + 1e-9), (i, name)
        for p, q in zip(a.buffers(), b.buffers(), strict=True):
            assert torch.allclose(p.float(), q.float(), rtol=1e-5, atol=1e-6), i
    return graphs


def _configure(mode):
    def configure(model):
        if mode == "plain":  # every invertible sequence through plain autograd, for the model's whole life
            for seq in model.modules():
                if isinstance(seq, InvertibleSequence):
                    seq.set_execution(dataclasses.replace(seq.execution, plain=True))
        else:
            model.set_modes(mode)
    return configure


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["invert", "floor", "store8", "plain"])
def test_replayed_steps_are_the_eager_steps(mode):
    """SGD with momentum and clipping, two micro-batches: one eager step warms the key up, then one capture and
    five replays, each step's loss, gradients, weights and statistics those of the eager step."""
    graphs = _lockstep([_batch("cuda", n=16, seed=s) for s in range(6)], _configure(mode), micro=2, clip=1.0)
    assert (graphs.captures, graphs.replays, graphs.refused) == (1, 5, {})


@pytest.mark.gpu
def test_a_changed_step_is_not_replayed():
    """A step of another shape, gradients let go of between steps, a replaced weight: each step is still the eager
    one (a replay of a graph that reads the old weight, or whose gradients nobody holds, would not be)."""
    batches = [_batch("cuda", n=16, seed=s) for s in range(8)]
    batches[4] = _batch("cuda", n=8, seed=4)  # another shape: the held graph is released, the step runs eagerly

    def between(i, model, opt):
        if i == 3:
            opt.zero_grad(set_to_none=True)  # as a user's loop might: the replay puts its gradients back
        if i == 7:
            p = model.head.weight
            p.data = p.data.clone().mul_(1.5)  # a new tensor, other values: the graph read the old one

    graphs = _lockstep(batches, between=between)
    # steps 0-3: eager, capture and replay, replay, replay (its gradients let go of); 4: eager (another shape);
    # 5: eager (a new warm-up); 6: capture and replay; 7: eager (a new weight)
    assert (graphs.captures, graphs.replays) == (2, 4)


@pytest.mark.gpu
def test_a_step_that_cannot_be_captured_runs_eagerly():
    """A loss that reads the host cannot be captured: the step runs eagerly, the reason is kept, nothing is lost."""

    def host_reading(logits, y):
        loss = F.cross_entropy(logits, y)
        if loss.item() > 1e9:  # a read of the host inside the step
            raise AssertionError
        return loss

    graphs = _lockstep([_batch("cuda", seed=s) for s in range(4)], loss_fn=host_reading)
    assert graphs.captures == 0 and graphs.replays == 0 and len(graphs.refused) == 1
    assert graphs.report()["refused"][0]


def test_which_runs_replay_their_steps():
    """Graphs on CUDA only, and not under a budget, with unlabelled views or a teacher, or when switched off."""
    from edgerev.train.trainer import step_graphs

    def cfg(**train_and_memory):
        d = {"model": {"arch": "revnext"}, "data": {"size": 16}}
        for key, value in train_and_memory.items():
            section, name = key.split("__")
            d.setdefault(section, {})[name] = value
        return from_dict(RunConfig, d)

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert isinstance(step_graphs(cfg(), cuda, 0, False), StepGraphs)
    assert step_graphs(cfg(), cpu, 0, False) is None
    assert step_graphs(cfg(memory__budget="400MiB"), cuda, 0, False) is None
    assert step_graphs(cfg(train__cuda_graphs=False), cuda, 0, False) is None
    assert step_graphs(cfg(), cuda, 16, False) is None
    assert step_graphs(cfg(), cuda, 0, True) is None


@pytest.mark.gpu
def test_the_trainer_replays_its_steps(tmp_path):
    """A run on CUDA replays its steps, says so, and learns as the same run launched op by op."""
    from edgerev.train.trainer import train

    def recipe(graphs):
        return {"model": {"arch": "revnext", "args": {"width": 8, "blocks": [1, 1, 1, 1, 1]}}, "device": "cuda",
                "data": {"size": 16, "train": {"samples": 256, "num_classes": 4, "noise": 20.0},
                         "val": {"samples": 128, "num_classes": 4, "noise": 20.0, "start": 100_000}},
                "augment": {"pad": 1, "flip": 0.0}, "optim": {"lr": 0.05},
                "train": {"epochs": 3, "batch": 32, "log_every": 2, "cuda_graphs": graphs}}

    results = [train(from_dict(RunConfig, recipe(g)), tmp_path / str(g), progress=False) for g in (False, True)]
    off, on = (r.summary for r in results)
    assert "cuda_graphs" not in off["plan"]
    # one eager step per epoch after its evaluation, then a capture: 3 captures, 24 steps
    assert on["plan"]["cuda_graphs"] == {"captures": 3, "replays": 21, "refused": []}
    assert on["final"]["acc"] > 0.6  # four classes: chance is 0.25 (the CPU's run of this recipe passes 0.6)
    assert on["final"]["acc"] == pytest.approx(off["final"]["acc"], abs=0.1)  # a GPU's rounding grows over a run

"""Training steps replayed as CUDA graphs (edgerev.train.graphs): the same weights as steps launched op by op,
and no replay of a step whose shapes, plan, weights or modes changed. The replays need CUDA (marked gpu); what
decides a replay is tested on the CPU."""

import pytest
import torch
import torch.nn.functional as F

from edgerev import create_model
from edgerev.config import from_dict
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


def _steps(model, graphs, batches, micro=1, clip=None, between=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for i, (x, y) in enumerate(batches):
        if between is not None:
            between(i, model, opt)
        losses.append(train_step(model, opt, x, y, micro_batches=micro, clip_grad_norm=clip, graphs=graphs).loss)
    return losses, [p.detach().clone() for p in model.parameters()], [b.clone() for b in model.buffers()]


def _same(a, b):
    la, wa, ba = a
    lb, wb, bb = b
    assert la == pytest.approx(lb, rel=1e-5, abs=1e-6)
    for p, q in zip(wa + ba, wb + bb, strict=True):
        assert torch.allclose(p.float(), q.float(), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["invert", "floor", "store8", "plain"])
def test_replayed_steps_train_as_eager_steps(mode):
    """Six steps of SGD with momentum and clipping, two micro-batches: one eager step warms the key up, then one
    capture and five replays; weights, batch-norm statistics and losses as six eager steps give."""
    from edgerev import plain

    batches = [_batch("cuda", n=16, seed=s) for s in range(6)]
    runs = []
    for graphs in (None, StepGraphs()):
        model = _small("cuda")
        if mode != "plain":
            model.set_modes(mode)
        with plain(model, mode == "plain"):
            runs.append(_steps(model, graphs, batches, micro=2, clip=1.0))
        if graphs is not None:
            assert (graphs.captures, graphs.replays, graphs.refused) == (1, 5, {})
    _same(*runs)


@pytest.mark.gpu
def test_a_changed_step_is_not_replayed():
    """A step of another shape, a replaced weight or gradients let go of between steps: never the old replay."""
    batches = [_batch("cuda", n=16, seed=s) for s in range(8)]
    batches[4] = _batch("cuda", n=8, seed=4)  # another shape: the held graph is released, the step runs eagerly

    def between(i, model, opt):
        if i == 3:
            opt.zero_grad(set_to_none=True)  # as a user's loop might: the replay puts its gradients back
        if i == 7:
            p = model.head.weight
            p.data = p.data.clone()  # the graph reads the old tensor: this step must not replay it

    runs = []
    for graphs in (None, StepGraphs()):
        runs.append(_steps(_small("cuda"), graphs, batches, between=between))
        if graphs is not None:
            # steps 0-3: eager, capture and replay, replay, replay (its gradients let go of); 4: eager (another
            # shape); 5: eager (a new warm-up); 6: capture and replay; 7: eager (a new weight)
            assert graphs.captures == 2 and graphs.replays == 4
    _same(*runs)


@pytest.mark.gpu
def test_a_step_that_cannot_be_captured_runs_eagerly():
    """A loss that reads the host cannot be captured: the step runs eagerly, the reason is kept, nothing is lost."""

    def host_reading(logits, y):
        loss = F.cross_entropy(logits, y)
        if loss.item() > 1e9:  # a read of the host inside the step
            raise AssertionError
        return loss

    batches = [_batch("cuda", seed=s) for s in range(4)]
    runs = []
    for graphs in (None, StepGraphs()):
        model = _small("cuda")
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = [train_step(model, opt, x, y, loss_fn=host_reading, graphs=graphs).loss for x, y in batches]
        runs.append((losses, [p.detach().clone() for p in model.parameters()], [b.clone() for b in model.buffers()]))
        if graphs is not None:
            assert graphs.captures == 0 and graphs.replays == 0 and len(graphs.refused) == 1
            assert graphs.report()["refused"][0]
    _same(*runs)


@pytest.mark.gpu
def test_the_trainer_replays_its_steps(tmp_path):
    """A run on CUDA with graphs ends with the weights and metrics of the same run without them, and says so."""
    from edgerev.train.trainer import train

    def recipe(graphs):
        return {"model": {"arch": "revnext", "args": {"width": 8, "blocks": [1, 1, 1, 1, 1]}}, "device": "cuda",
                "data": {"size": 16, "train": {"samples": 128, "num_classes": 4, "noise": 20.0},
                         "val": {"samples": 64, "num_classes": 4, "noise": 20.0, "start": 100_000}},
                "augment": {"pad": 1, "flip": 0.0}, "optim": {"lr": 0.05},
                "train": {"epochs": 2, "batch": 32, "log_every": 2, "cuda_graphs": graphs}}

    results = [train(from_dict(RunConfig, recipe(g)), tmp_path / str(g), progress=False) for g in (False, True)]
    off, on = (r.summary for r in results)
    assert "cuda_graphs" not in off["plan"]
    assert on["plan"]["cuda_graphs"]["replays"] > 0 and on["plan"]["cuda_graphs"]["refused"] == []
    # the same kernels on the same values; a GPU's reductions may still round apart over a run's steps
    assert on["final"]["acc"] == pytest.approx(off["final"]["acc"], abs=2 / 64 + 1e-9)
    assert on["final"]["loss"] == pytest.approx(off["final"]["loss"], rel=1e-3)

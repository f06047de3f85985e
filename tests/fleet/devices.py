"""A fleet of stand-in devices for the fleet tests that look at what travels, not at training.

Import it after ``pytest.importorskip("flwr")``: it imports Flower.
"""

from flwr.app import Context, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID

from edgerev.fleet.client import make_client_app
from edgerev.fleet.grid import InProcessGrid
from edgerev.fleet.model import Consideration, RoundResult
from edgerev.fleet.server import make_server_app
from edgerev.fleet.settings import FleetSettings

#: node id -> the classes of that device
CLASSES = {2: ["class0", "class1"], 3: ["class1", "class2"]}


class FakeDevice:
    """A device whose round sends back every shared float it received plus ``step``, with ``per_class``
    samples of each of its classes, and no held-out sample (nothing to judge the fleet model on)."""

    def __init__(self, classes, step: float = 0.0, per_class: int = 10):
        self.counts = {c: per_class for c in classes}
        self.step = step
        self.refusals: list[str] = []

    def classes(self):
        return dict(self.counts)

    def train_round(self, fm):
        counts = [self.counts.get(c, 0) for c in fm.classes]
        return RoundResult({k: v + self.step for k, v in fm.shared.items()}, counts, sum(counts), None, None, 0)

    def consider(self, fm):
        return Consideration(False, "", None, 0.0, 0)

    def refused(self, what, error):
        self.refusals.append(error)


def run_fleet(settings: FleetSettings, step: float = 0.0, on_round=None, devices=None,
              deliver=lambda node, msg: True) -> InProcessGrid:
    """Run ``settings.rounds`` rounds of the fleet's ServerApp over ``devices`` (node id -> FakeDevice;
    default: the :data:`CLASSES` devices, each adding ``step``) through an in-process Grid; returns the
    Grid (its ``traffic``). ``on_round`` is the ServerApp's round callback."""
    links = devices if devices is not None else {n: FakeDevice(c, step) for n, c in CLASSES.items()}
    app = make_client_app(lambda ctx: links[ctx.node_id])
    grid = InProcessGrid({n: (app, Context(1, n, {}, RecordDict(), {})) for n in links}, deliver=deliver)
    make_server_app(on_round)(grid, Context(1, SUPERLINK_NODE_ID, {}, RecordDict(), settings.to_run_config()))
    return grid

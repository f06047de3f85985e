"""What travels per round for each sharing setting, counted on the wire by the in-process Grid.

The devices answer without training (the weights they received back, their class counts, no held-out
sample): what travels depends on the shared tensors, not their values. Each round a device receives the
weights twice (train, evaluate) and sends them once (its train reply).
"""

import pytest

pytest.importorskip("flwr")

from edgerev.fleet.server import initial_arrays  # noqa: E402
from edgerev.fleet.settings import FleetSettings  # noqa: E402
from tests.fleet.devices import run_fleet  # noqa: E402


def _round(sharing, identity):
    settings = FleetSettings(rounds=1, sharing=sharing, arch="revnext", image_size=16, min_devices=2,
                             model_args={"width": 8, "blocks": [1, 1, 1, 1, 1]})
    grid = run_fleet(settings)
    arrays = initial_arrays(settings, ("class0", "class1", "class2"))
    return 4 * sum(a.numpy().size for a in arrays.values()), len(arrays), grid.traffic[2].by_round["1"]


def test_bytes_per_round_follow_what_is_shared(identity):
    rows = {s: _round(s, identity) for s in ("head", "head+last", "all")}
    for shared, tensors, t in rows.values():
        # the weights once up (train reply), twice down (train, evaluate); on top, per tensor its name, shape,
        # type and object id (about 210 B measured), per message its metadata, config and metrics (query, train,
        # evaluate: about 500 B each)
        assert shared <= t["sent"] <= shared + 256 * tensors + 1_000
        assert 2 * shared <= t["received"] <= 2 * (shared + 256 * tensors) + 3 * 1_000
    assert rows["head"][2]["sent"] < rows["head+last"][2]["sent"] < rows["all"][2]["sent"]
    assert rows["head"][0] == 4 * 3 * 128  # three fleet classes x 128 features (the head has no bias)

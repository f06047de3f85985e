"""Differential privacy as a fleet setting: each device's update is clipped on the device (Flower's
``fixedclipping_mod``) and the server adds Gaussian noise to the aggregate (Flower's
``DifferentialPrivacyClientSideFixedClipping``), through the fleet's own ServerApp and ClientApp, with the
updates averaged in clear or by secure aggregation.

The devices do not train: each sends back what it received plus 1.0 on every float, an update far above
the clipping norm, the same on every device (so the aggregate of the clipped updates is the clipped
update itself, whatever the per-class weighting).
"""

import numpy as np
import pytest

pytest.importorskip("flwr")

from edgerev.fleet.server import initial_arrays  # noqa: E402
from edgerev.fleet.settings import FleetSettings  # noqa: E402
from tests.fleet.devices import run_fleet  # noqa: E402

FLEET = ("class0", "class1", "class2")


def _update(clip: float, noise: float, secagg: bool = False) -> np.ndarray:
    """The fleet's first-round update (aggregate minus the initial weights), flattened."""
    settings = FleetSettings(rounds=1, sharing="head+last", arch="revnext", image_size=16, min_devices=2,
                             model_args={"width": 8, "blocks": [1, 1, 1, 1, 1]}, dp_clipping_norm=clip,
                             dp_noise_multiplier=noise, secagg=secagg)
    seen = {}
    run_fleet(settings, step=1.0, on_round=lambda r, arrays, classes: seen.update(arrays=arrays, classes=classes))
    assert seen["classes"] == FLEET
    start = initial_arrays(settings, FLEET)
    return np.concatenate([(seen["arrays"][k].numpy() - start[k].numpy()).ravel() for k in start.keys()])


def test_without_dp_the_update_is_the_devices(identity):
    u = _update(0.0, 0.0)
    np.testing.assert_allclose(u, 1.0, rtol=1e-5)


@pytest.mark.parametrize("secagg", [False, True], ids=["clear", "secagg"])
def test_each_update_is_clipped_on_the_device(identity, secagg):
    u = _update(0.5, 0.0, secagg)  # under secure aggregation the clipped update is what the device masks
    assert np.linalg.norm(u) == pytest.approx(0.5, rel=1e-4)
    # clipping scales the update, it keeps its direction (secure aggregation: up to one quantization level,
    # 2 x 8 / 2^22 for the default range of +-8)
    np.testing.assert_allclose(u, u[0], rtol=1e-4, atol=16 / 2**22 if secagg else 0.0)


@pytest.mark.parametrize("secagg", [False, True], ids=["clear", "secagg"])
def test_the_server_adds_noise_scaled_to_the_norm_over_the_devices(identity, secagg):
    u = _update(0.5, 2.0, secagg)
    clipped = 0.5 / np.sqrt(u.size)  # every coordinate of the clipped update (all equal)
    noise = u - clipped
    # Flower's wrapper: standard deviation noise_multiplier x clipping_norm / devices sampled = 2 x 0.5 / 2
    assert noise.std() == pytest.approx(0.5, rel=0.05)
    assert abs(noise.mean()) < 5 * 0.5 / np.sqrt(u.size)

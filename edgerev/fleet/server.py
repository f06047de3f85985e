"""The fleet's ServerApp: the class registry, FedAvg over the devices' rounds, DP and SecAgg+ as settings.

``app`` is what a SuperLink runs (``flwr run``; ``[tool.flwr.app.components] serverapp =
"edgerev.fleet.server:app"``); :func:`make_server_app` builds one that reports each round to a callback
(the simulation measures accuracy there).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping

from edgerev.fleet.aggregate import ClassRegistry, as_moments, head_rows
from edgerev.fleet.secagg import SecAggPlus
from edgerev.fleet.settings import FleetSettings
from edgerev.fleet.strategy import FleetAvg, to_record

log = logging.getLogger("edgerev.fleet.server")

RoundHook = Callable[[int, ArrayRecord, tuple[str, ...]], None]  # round, fleet weights, their classes


def initial_arrays(settings: FleetSettings, classes: tuple[str, ...]) -> ArrayRecord:
    """The shared tensors of the fleet's model before any round: the base model's when the fleet names one, else
    fresh from the fleet's seed (every device builds the rest the same way:
    :func:`edgerev.fleet.model.fleet_model`)."""
    from edgerev.fleet.model import FleetModel, model_names

    fm = FleetModel("init", settings.arch, dict(settings.model_args), settings.image_size, classes, {},
                    settings.sharing, settings.share_bn_stats, settings.seed, weights=settings.weights or None)
    state, names = model_names(fm)
    return to_record(as_moments({n: state[n].numpy() for n in names}))


def run_fleet(grid: Grid, settings: FleetSettings, on_round: RoundHook | None = None):
    """Run ``settings.rounds`` rounds on ``grid``; returns Flower's strategy result."""
    registry = ClassRegistry()
    fleet = FleetAvg(registry, settings.min_devices, settings.timeout,
                     SecAggPlus(settings) if settings.secagg else None, settings.judge_from)
    fleet.learn_classes(grid)
    if not len(registry):
        raise RuntimeError("no device listed a class: nothing to train")
    strategy = fleet
    if settings.dp:
        strategy = DifferentialPrivacyClientSideFixedClipping(
            fleet, noise_multiplier=settings.dp_noise_multiplier, clipping_norm=settings.dp_clipping_norm,
            num_sampled_clients=settings.min_devices)
    config = ConfigRecord(settings.to_run_config())

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if on_round is not None and server_round > 0:
            rows = head_rows(arrays, len(registry))
            on_round(server_round, arrays, registry.classes[:rows])
        return None

    return strategy.start(grid, initial_arrays(settings, registry.classes), num_rounds=settings.rounds,
                          timeout=settings.timeout, train_config=config, evaluate_config=ConfigRecord(dict(config)),
                          evaluate_fn=evaluate_fn)


def make_server_app(on_round: RoundHook | None = None) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        settings = FleetSettings.from_run_config(dict(context.run_config))
        run_fleet(grid, settings, on_round)

    return app


app = make_server_app()

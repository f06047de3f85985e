"""The fleet's ClientApp: a device's side of each round goes through its daemon.

The ClientApp trains nothing itself. For a ``train`` message it hands the received weights to the
device's daemon (a :class:`DeviceLink`) as a federated round (the daemon's ``train_round``: a job with the device's
own samples, distillation, under its memory cap, checkpointed) and answers with the trained shared
tensors, the device's sample count and its count per fleet class. For an ``evaluate`` message it hands
the aggregated model to the daemon's gate (its ``consider``) and answers with the
held-out accuracy and whether it was promoted. For a ``query`` it answers the names and counts of the
classes it has. Nothing else leaves the device: no image, no feature, no per-sample label.

A message that does not fit (unknown keys, wrong shapes, weights that are not finite) is refused with
one line in the device's log and an event in its store; the ClientApp raises, and Flower returns the
error to the server, which leaves the device out of that round.

Differential privacy (Flower's ``fixedclipping_mod``) applies to a train message when the server's
strategy wrapper put a clipping norm in its config, so one ClientApp serves every setting. With secure
aggregation (``secagg`` in the config) the train reply carries the counts only: the (clipped) update is
held in the ClientApp's context and leaves the device masked, in the steps of SecAgg+
(:mod:`edgerev.fleet.secagg`), which Flower's ``secaggplus_mod`` answers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import fixedclipping_mod

from edgerev.fleet import secagg
from edgerev.fleet.aggregate import as_moments, as_variances
from edgerev.fleet.model import Consideration, FleetError, FleetModel, RoundResult
from edgerev.fleet.settings import FleetSettings
from edgerev.fleet.strategy import ARRAYS, CONFIG, METRICS

log = logging.getLogger("edgerev.fleet.client")

CLIPPING_NORM = "clipping_norm"  # flwr.supercore.differential_privacy.KEY_CLIPPING_NORM
KNOWN_CONFIG = {*FleetSettings().to_run_config(), "classes", "server-round", CLIPPING_NORM, secagg.SCALE_KEY}


class DeviceLink(Protocol):
    """The way to a device's daemon: the ClientApp needs these of it, and the daemon's side implements them
    (:class:`edgerev_daemon.service.fleet.DaemonLink`, one held in this process, and
    :class:`edgerev_daemon.service.fleet.DataDirLink`, a SuperNode's)."""

    def classes(self) -> dict[str, int]: ...

    def train_round(self, fm: FleetModel) -> RoundResult: ...

    def consider(self, fm: FleetModel) -> Consideration: ...

    def refused(self, what: str, error: str) -> None: ...


def fleet_model(content: RecordDict, run_id: int, link: DeviceLink, what: str) -> FleetModel:
    """The fleet model a message carries, its keys and types checked.

    Raises:
        FleetError: a record missing, a config key unknown, a value of the wrong type (recorded on the device).
    """
    try:
        if ARRAYS not in content.array_records or CONFIG not in content.config_records:
            raise FleetError(f"the message lacks its {ARRAYS!r} or {CONFIG!r} record")
        config = dict(content.config_records[CONFIG])
        unknown = sorted(k for k in config if k not in KNOWN_CONFIG)
        if unknown:
            raise FleetError(f"unknown keys in the fleet's config: {', '.join(unknown[:5])}")
        classes = config.get("classes")
        if not isinstance(classes, list) or not all(isinstance(c, str) and c for c in classes):
            raise FleetError("the fleet's config lacks its class list")
        try:
            settings = FleetSettings.from_run_config(config)
        except ValueError as e:
            raise FleetError(f"the fleet's settings: {e}") from None
        # batch-norm statistics travel as moments (edgerev.fleet.aggregate): the device keeps variances
        shared = as_variances({k: torch.from_numpy(np.array(v.numpy(), copy=True)) for k, v in
                               content.array_records[ARRAYS].items()})
    except FleetError as e:
        link.refused(what, str(e))
        raise
    server_round = config.get("server-round", 0)
    # the first round's statistics are the fresh model's; the devices measure them from its job on, and a
    # model to judge comes after a round
    measured = what == "model" or (isinstance(server_round, int) and server_round > 1)
    return FleetModel(f"{run_id}/{server_round}", settings.arch, dict(settings.model_args),
                      settings.image_size, tuple(classes), shared, settings.sharing, settings.share_bn_stats,
                      settings.seed, settings.local_epochs, settings.lr, measured, settings.adopt_epochs,
                      settings.adopt_distill, settings.adopt_lr, settings.weights or None)


def _when_clipping(msg: Message, context: Context, call_next) -> Message:
    """Flower's ``fixedclipping_mod`` on a train message whose config carries a clipping norm (the DP
    strategy wrapper's); any other message passes untouched."""
    configs = msg.content.config_records if msg.has_content() else {}
    if any(CLIPPING_NORM in c for c in configs.values()):
        return fixedclipping_mod(msg, context, call_next)
    return call_next(msg, context)


def _holding(link_for: Callable[[Context], DeviceLink]):
    """A mod that, under secure aggregation, keeps the train reply's update (trained minus received, after
    any clipping) in the context and sends the counts without it."""

    def mod(msg: Message, context: Context, call_next) -> Message:
        reply = call_next(msg, context)
        config = msg.content.config_records.get(CONFIG)
        if reply.has_error() or config is None or not config.get("secagg"):
            return reply
        received = msg.content.array_records[ARRAYS]
        trained = reply.content.array_records.pop(ARRAYS)
        delta = {k: trained[k].numpy().astype(np.float64) - received[k].numpy() for k in received.keys()}
        bad = next((k for k, d in delta.items() if not np.isfinite(d).all()), None)
        if bad is not None:
            error = f"the round's update of {bad} is not finite; not sent"
            link_for(context).refused("round", error)
            raise FleetError(error)
        metrics = reply.content.metric_records[METRICS]
        secagg.hold(context, int(config.get("server-round", 0)), delta, int(metrics["num-examples"]),
                    list(metrics["class-counts"]))
        return reply

    return mod


def make_client_app(link_for: Callable[[Context], DeviceLink]) -> ClientApp:
    """A ClientApp whose device is ``link_for(context)``."""
    app = ClientApp()
    protocol = secagg.device_mod(CONFIG, lambda context, error: link_for(context).refused("round", error))

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        counts = link_for(context).classes()
        names = sorted(counts)
        return Message(RecordDict({CONFIG: ConfigRecord({"classes": names}),
                                   METRICS: MetricRecord({"num-examples": sum(counts.values()),
                                                          "class-counts": [counts[n] for n in names]})}),
                       reply_to=msg)

    @app.train(mods=[protocol, _holding(link_for), _when_clipping])
    def train(msg: Message, context: Context) -> Message:
        link = link_for(context)
        fm = fleet_model(msg.content, context.run_id, link, "round")
        result = link.train_round(fm)
        shared = as_moments(result.shared)
        arrays = ArrayRecord({k: Array(np.ascontiguousarray(shared[k].numpy()))
                              for k in msg.content.array_records[ARRAYS].keys()})
        metrics = {"num-examples": result.examples, "class-counts": list(result.counts),
                   "peak-bytes": int(result.peak_bytes or 0), "cap-bytes": int(result.cap_bytes or 0)}
        return Message(RecordDict({ARRAYS: arrays, METRICS: MetricRecord(metrics)}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        link = link_for(context)
        fm = fleet_model(msg.content, context.run_id, link, "model")
        c = link.consider(fm)
        metrics = {"num-examples": c.heldout, "accuracy": float(c.accuracy if c.accuracy is not None else 0.0),
                   "promoted": int(c.promoted)}
        return Message(RecordDict({METRICS: MetricRecord(metrics)}), reply_to=msg)

    return app

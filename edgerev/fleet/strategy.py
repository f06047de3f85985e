"""FedAvg on ArrayRecords with the fleet's class registry (:mod:`edgerev.fleet.aggregate`).

Before each round (the first: before its initial weights are made) the strategy asks every device
which classes it has (a ``query`` message; the answer is class names and counts, never samples), grows
the registry and the head's rows, and sends the fleet's class list with the weights. Replies are
averaged with each head row weighted by the devices' counts of that class. A reply whose tensors or
counts do not match what was sent, or that is not finite, is left out of the average and logged; a
round with no usable reply keeps the fleet's weights.

With secure aggregation (``secure``) the train replies carry counts only, and the averages come from the
sums that :class:`edgerev.fleet.secagg.SecAggPlus` unmasks (:func:`edgerev.fleet.aggregate.weighted_terms`);
a round whose protocol cannot finish keeps the fleet's weights.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from edgerev.fleet.aggregate import (
    ClassRegistry,
    Contribution,
    aggregate,
    average_from_sums,
    grow_rows,
    head_rows,
    term_scales,
    term_shapes,
)
from edgerev.fleet.secagg import SCALE_KEY, SecAggError, SecAggPlus

log = logging.getLogger("edgerev.fleet.server")

ARRAYS, CONFIG, METRICS = "arrays", "config", "metrics"


def to_numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in record.items()}


def to_record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})


class FleetAvg(FedAvg):
    """FedAvg whose head rows follow a fleet-wide class registry.

    Args:
        registry: the fleet's classes (grown by the devices' answers).
        min_devices: devices a round waits for (Flower's ``min_available_nodes`` and sample sizes).
        timeout: seconds to wait for the class query's answers.
        secure: sum the updates by secure aggregation (the replies carry counts only).
        judge_from: the first round whose fleet model the devices judge (``evaluate`` messages).
    """

    def __init__(self, registry: ClassRegistry, min_devices: int = 2, timeout: float = 3600.0,
                 secure: SecAggPlus | None = None, judge_from: int = 1) -> None:
        super().__init__(min_train_nodes=min_devices, min_evaluate_nodes=min_devices,
                         min_available_nodes=min_devices, arrayrecord_key=ARRAYS, configrecord_key=CONFIG)
        self.registry = registry
        self.timeout = timeout
        self._sent: dict[str, np.ndarray] = {}
        self._grid: Grid | None = None
        self.secure = secure
        self.judge_from = judge_from
        self.last_counts: dict[int, list[int]] = {}

    def learn_classes(self, grid: Grid, server_round: int = 0) -> list[str]:
        """Ask every reachable device for its classes; returns the names new to the registry."""
        messages = [Message(RecordDict({CONFIG: ConfigRecord({"server-round": server_round})}), node,
                            MessageType.QUERY) for node in grid.get_node_ids()]
        names: list[str] = []
        for reply in grid.send_and_receive(messages, timeout=self.timeout):
            if reply.has_error():
                log.warning("device %d did not list its classes: %s", reply.metadata.src_node_id, reply.error.reason)
                continue
            cfg = reply.content.config_records.get(CONFIG)
            listed = cfg.get("classes") if cfg is not None else None
            if not isinstance(listed, list) or not all(isinstance(c, str) and c for c in listed):
                log.warning("device %d listed its classes in a form not understood; ignored",
                            reply.metadata.src_node_id)
                continue
            names.extend(listed)
        new = self.registry.learn(names)
        if new:
            log.info("fleet classes: %d (new: %s)", len(self.registry), ", ".join(new))
        return new

    def _with_classes(self, arrays: ArrayRecord, config: ConfigRecord) -> tuple[ArrayRecord, ConfigRecord]:
        grown = grow_rows(to_numpy(arrays), len(self.registry))
        rows = head_rows(grown, len(self.registry))
        config = ConfigRecord({**config, "classes": list(self.registry.classes[:rows])})
        return to_record(grown), config

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        if server_round > 1:  # the first round's classes were asked for just before it (the initial weights)
            self.learn_classes(grid, server_round)
        arrays, config = self._with_classes(arrays, config)
        self._sent, self._grid = to_numpy(arrays), grid
        return super().configure_train(server_round, arrays, config, grid)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        if server_round < self.judge_from:  # the fleet model goes to the devices' gates from this round on
            return []
        arrays, config = self._with_classes(arrays, config)
        return super().configure_evaluate(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        contributions = {}
        rows = head_rows(self._sent)
        self.last_counts = {}
        for msg in replies:
            node = msg.metadata.src_node_id
            if msg.has_error():
                log.warning("round %d: device %d failed: %s", server_round, node, msg.error.reason)
                continue
            try:
                contributions[node] = _contribution(msg, self._sent, rows, clear=self.secure is None)
            except ValueError as e:
                log.warning("round %d: device %d's reply left out: %s", server_round, node, e)
        merged = None
        if contributions and self.secure is None:
            merged = aggregate(list(contributions.values()), self._sent)
        elif contributions:
            contributions, merged = self._sum_securely(server_round, contributions)
        if merged is None:
            log.warning("round %d: no usable reply; the fleet's weights stay", server_round)
            return None, None
        self.last_counts = {node: list(c.counts) for node, c in contributions.items()}
        total = sum(c.examples for c in contributions.values())
        return to_record(merged), MetricRecord({"num-examples": total, "devices": len(contributions)})

    def _sum_securely(self, server_round: int, counted: dict[int, Contribution]
                      ) -> tuple[dict[int, Contribution], dict[str, np.ndarray] | None]:
        """Run SecAgg+ over the devices that answered with their counts: those whose updates the sum holds,
        and the fleet's new tensors (None when the protocol could not finish)."""
        scales = term_scales([c.examples for c in counted.values()], [c.counts for c in counted.values()])
        collect = RecordDict({CONFIG: ConfigRecord({"server-round": server_round, SCALE_KEY: scales})})
        try:
            sums, summed = self.secure.sum(self._grid, counted, server_round, collect, term_shapes(self._sent))
        except SecAggError as e:
            log.warning("round %d: secure aggregation did not finish: %s", server_round, e)
            return {}, None
        return {node: c for node, c in counted.items() if node in summed}, average_from_sums(sums, self._sent)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The devices' held-out accuracies weighted by their held-out counts; a device with no held-out
        sample (nothing to judge on) counts for nothing, and a round where none had any reports nothing
        (Flower's weighting divides by the total)."""
        judged = [m for m in replies if not m.has_error() and METRICS in m.content.metric_records
                  and int(m.content.metric_records[METRICS].get("num-examples", 0) or 0) > 0]
        if not judged:
            log.info("round %d: no device had a held-out sample to judge the fleet model on", server_round)
            return None
        return super().aggregate_evaluate(server_round, judged)


def _contribution(msg: Message, sent: dict[str, np.ndarray], rows: int, clear: bool = True) -> Contribution:
    """A reply's counts, and its tensors when they travel in ``clear`` (not under secure aggregation)."""
    content = msg.content
    if METRICS not in content.metric_records:
        raise ValueError("no counts")
    arrays: dict[str, np.ndarray] = {}
    if clear:
        if ARRAYS not in content.array_records:
            raise ValueError("no weights")
        arrays = to_numpy(content.array_records[ARRAYS])
        if set(arrays) != set(sent):
            raise ValueError(f"tensors {sorted(set(arrays) ^ set(sent))[:3]} differ from those sent")
        for name, a in arrays.items():
            if a.shape != sent[name].shape:
                raise ValueError(f"{name} has shape {a.shape}, {sent[name].shape} was sent")
            if not np.isfinite(a).all():
                raise ValueError(f"{name} is not finite")
    elif content.array_records:
        raise ValueError("it sent its update in clear under secure aggregation")
    metrics = content.metric_records[METRICS]
    counts = metrics.get("class-counts")
    examples = metrics.get("num-examples")
    if not isinstance(counts, list) or len(counts) != rows or any(not isinstance(n, int) or n < 0 for n in counts):
        raise ValueError(f"class counts {counts!r} do not match the {rows} fleet classes")
    if not isinstance(examples, int) or examples < 0:
        raise ValueError(f"num-examples {examples!r} is not a count")
    return Contribution(arrays, examples, counts)

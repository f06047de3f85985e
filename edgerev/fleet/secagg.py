"""Secure aggregation (SecAgg+, Bell et al. 2020) on Flower's message API: the server learns only the sum of
the devices' updates.

Flower 1.41 ships the protocol's device side as a mod (``flwr.client.mod.secaggplus_mod``) and its server
side only as a workflow of its legacy API (``SecAggPlusWorkflow``, which needs a ``LegacyContext`` and a
legacy strategy). :class:`SecAggPlus` is that server side on the message API, speaking to Flower's own mod,
message for message, through the same Grid as the rest of the fleet:

1. **setup**: each device makes two key pairs and sends the public keys;
2. **share keys**: each device receives its neighbours' public keys, splits its mask seed and its first
   private key into Shamir shares (``threshold`` of them rebuild a secret) and sends one share of each to
   every neighbour, encrypted for it; the server only forwards them;
3. **collect masked vectors**: each device quantizes its vector (``clipping_range``, 2^22 levels), adds a
   mask from its own seed and, for each neighbour, one from the key it agreed with it (added by one of
   the two, subtracted by the other), and sends the sum modulo 2^32;
4. **unmask**: each device that is still there sends, for every neighbour, the share of its seed if that
   neighbour sent its vector, or the share of its first private key if it did not (never both); the
   server rebuilds the seeds to remove the devices' own masks and the dropped devices' keys to remove
   the pairwise masks that no longer cancel.

What differs from Flower's workflow, on purpose: a device is asked only for the shares it holds (those
of the neighbours whose encrypted shares reached it), so a device that drops before step 3 no longer
halts the round; a masked vector of the wrong layout counts as a dropped device (its masks are removed
with its key); and the unmasked sum is checked: its weight term must equal the number of vectors summed.

The fleet's averages are weighted (each head row by per-class counts), while the protocol sums. Each
device therefore sends :func:`edgerev.fleet.aggregate.weighted_terms`: its weights and its weighted
update (trained minus received), whose sums give every average. The counts themselves travel in clear in
the train reply, as they do without secure aggregation (the server uses them only to scale the weights:
:func:`edgerev.fleet.aggregate.term_scales`); the update never does.

The device side (:func:`device_mod`): the train message is answered with the counts only and the
weighted update is held in the ClientApp's context until the protocol's step 3 asks for it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.common import bytes_to_ndarray
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
from flwr.common.secure_aggregation.ndarrays_arithmetic import (
    factor_extract,
    parameters_addition,
    parameters_mod,
    parameters_subtraction,
)
from flwr.common.secure_aggregation.quantization import dequantize
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, RECORD_KEY_STATE, Key, Stage
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
from flwr.serverapp import Grid
from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

from edgerev.fleet.settings import FleetSettings

log = logging.getLogger("edgerev.fleet.secagg")

QUANTIZATION_RANGE = 1 << 22  # Flower's defaults: 2^22 levels over [-clipping_range, clipping_range] ...
MODULUS_RANGE = 1 << 32  # ... summed modulo 2^32 (room for 1024 devices)
SCALE_KEY = "secagg-scales"  # aggregate.term_scales of the train round, sent with step 3 (weights <= 1)
HELD, HELD_COUNTS = "edgerev.secagg.update", "edgerev.secagg.counts"  # the device's context, between the steps


class SecAggError(RuntimeError):
    """The protocol could not finish: too few devices, or too few shares to remove a mask."""


@dataclass
class _Round:
    """What the server knows of one run of the protocol."""

    server_round: int
    threshold: int
    neighbours: dict[int, set[int]]
    public_keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    forwarded: dict[int, list[tuple[int, bytes]]] = field(default_factory=dict)  # dst -> (src, ciphertext)


class SecAggPlus:
    """The server side of SecAgg+ (see the module docstring), as ``settings`` (checked there) set it:
    ``secagg_shares``, each device's neighbourhood, itself included (0: every device of the round, SecAgg
    proper); ``secagg_threshold``, the fraction of a neighbourhood whose shares rebuild a secret (at least 2
    shares: the server learns nothing of a device unless that many of its neighbours collude with it, and
    a round survives as long as that many neighbours of every device answer); ``secagg_range``, each term
    of a device's vector clipped to +- it before quantization; ``timeout``, seconds each step waits.
    """

    def __init__(self, settings: FleetSettings) -> None:
        self.shares, self.threshold = settings.secagg_shares, settings.secagg_threshold
        self.clipping_range, self.timeout = settings.secagg_range, settings.timeout

    def sum(self, grid: Grid, nodes: Iterable[int], server_round: int, collect: RecordDict,
            shapes: Sequence[tuple[int, ...]]) -> tuple[list[np.ndarray], set[int]]:
        """The sum of the vectors of ``nodes`` (each of ``shapes``), and the devices whose vectors it holds.

        Args:
            collect: what step 3's message carries besides the protocol's own record.

        Raises:
            SecAggError: fewer than 2 devices, or not enough of them answered to remove the masks.
        """
        order = sorted(set(nodes))
        if len(order) < 2:
            raise SecAggError(f"secure aggregation needs at least 2 devices, {len(order)} answered")
        r = self._setup(grid, order, server_round)
        active = self._share_keys(grid, r)
        masked, contributors = self._collect(grid, r, active, collect, shapes)
        return self._unmask(grid, r, masked, contributors, active - contributors), contributors

    def _send(self, grid: Grid, r: _Round, stage: str, contents: dict[int, RecordDict]) -> dict[int, ConfigRecord]:
        """Send each node its content; the protocol record of each good answer, by node."""
        messages = [Message(content, node, MessageType.TRAIN, group_id=str(r.server_round))
                    for node, content in contents.items()]
        answers = {}
        for reply in grid.send_and_receive(messages, timeout=self.timeout):
            node = reply.metadata.src_node_id
            if reply.has_error():
                log.warning("round %d, secure aggregation (%s): device %d failed: %s", r.server_round, stage,
                            node, reply.error.reason)
            elif node in contents and RECORD_KEY_CONFIGS in reply.content.config_records:
                answers[node] = reply.content.config_records[RECORD_KEY_CONFIGS]
        return answers

    @staticmethod
    def _protocol(stage: str, **values) -> RecordDict:
        return RecordDict({RECORD_KEY_CONFIGS: ConfigRecord({Key.STAGE: stage, **values})})

    def _enough(self, r: _Round, active: set[int], stage: str) -> None:
        short = [n for n in active if len(r.neighbours[n] & active) < r.threshold]
        if short:
            raise SecAggError(f"after {stage}, devices {short} have fewer than {r.threshold} neighbours left")

    def _setup(self, grid: Grid, order: list[int], server_round: int) -> _Round:
        n = len(order)
        k = n if self.shares == 0 or self.shares >= n else self.shares
        threshold = min(k, max(2, math.ceil(self.threshold * k)))
        half = k // 2
        neighbours = {node: set(order) if k == n else {order[(i + d) % n] for d in range(-half, half + 1)}
                      for i, node in enumerate(order)}
        r = _Round(server_round, threshold, neighbours)
        setup = self._protocol(Stage.SETUP, **{
            Key.SAMPLE_NUMBER: n, Key.SHARE_NUMBER: k, Key.THRESHOLD: threshold,
            Key.CLIPPING_RANGE: float(self.clipping_range), Key.TARGET_RANGE: QUANTIZATION_RANGE,
            Key.MOD_RANGE: MODULUS_RANGE, Key.MAX_WEIGHT: 1.0})
        for node, cfg in self._send(grid, r, Stage.SETUP, {node: setup for node in order}).items():
            pk1, pk2 = cfg.get(Key.PUBLIC_KEY_1), cfg.get(Key.PUBLIC_KEY_2)
            if isinstance(pk1, bytes) and isinstance(pk2, bytes):
                r.public_keys[node] = (pk1, pk2)
        self._enough(r, set(r.public_keys), Stage.SETUP)
        return r

    def _share_keys(self, grid: Grid, r: _Round) -> set[int]:
        keyed = set(r.public_keys)
        contents = {node: self._protocol(Stage.SHARE_KEYS, **{str(m): list(r.public_keys[m])
                                                              for m in r.neighbours[node] & keyed})
                    for node in keyed}
        sent: list[tuple[int, int, bytes]] = []
        for node, cfg in self._send(grid, r, Stage.SHARE_KEYS, contents).items():
            dsts, ciphertexts = cfg.get(Key.DESTINATION_LIST), cfg.get(Key.CIPHERTEXT_LIST)
            if (isinstance(dsts, list) and isinstance(ciphertexts, list) and len(dsts) == len(ciphertexts)
                    and all(isinstance(d, int) for d in dsts) and all(isinstance(c, bytes) for c in ciphertexts)):
                sent.extend((node, d, c) for d, c in zip(dsts, ciphertexts, strict=True))
        active = {src for src, _, _ in sent}
        r.forwarded = {node: [] for node in active}
        for src, dst, ciphertext in sent:
            if dst in active and dst in r.neighbours[src]:
                r.forwarded[dst].append((src, ciphertext))
        self._enough(r, active, Stage.SHARE_KEYS)
        return active

    def _collect(self, grid: Grid, r: _Round, active: set[int], collect: RecordDict,
                 shapes: Sequence[tuple[int, ...]]) -> tuple[list[np.ndarray], set[int]]:
        contents = {}
        for node in active:
            content = RecordDict(dict(collect))
            content[RECORD_KEY_CONFIGS] = ConfigRecord({
                Key.STAGE: Stage.COLLECT_MASKED_VECTORS,
                Key.CIPHERTEXT_LIST: [c for _, c in r.forwarded[node]],
                Key.SOURCE_LIST: [s for s, _ in r.forwarded[node]]})
            contents[node] = content
        layout = [(1,), *shapes]  # the mod puts the sum of the weights' quantized ratio first
        total, contributors = None, set()
        for node, cfg in self._send(grid, r, Stage.COLLECT_MASKED_VECTORS, contents).items():
            vector = _masked_vector(cfg.get(Key.MASKED_PARAMETERS), layout)
            if vector is None:
                log.warning("round %d, secure aggregation: device %d sent a masked vector of another layout; "
                            "left out", r.server_round, node)
                continue
            total = vector if total is None else parameters_addition(total, vector)
            contributors.add(node)
        if total is None or len(contributors) < 2:
            raise SecAggError(f"{len(contributors)} masked vectors arrived: a sum of fewer than 2 is no secret")
        return parameters_mod(total, MODULUS_RANGE), contributors

    def _unmask(self, grid: Grid, r: _Round, masked: list[np.ndarray], contributors: set[int],
                dropped: set[int]) -> list[np.ndarray]:
        held = {node: {src for src, _ in r.forwarded[node]} for node in contributors}  # whose shares each holds
        asked = {node: ((held[node] | {node}) & contributors, held[node] & dropped) for node in contributors}
        contents = {node: self._protocol(Stage.UNMASK, **{Key.ACTIVE_NODE_ID_LIST: sorted(alive),
                                                          Key.DEAD_NODE_ID_LIST: sorted(dead)})
                    for node, (alive, dead) in asked.items()}
        shares: dict[int, dict[int, bytes]] = {node: {} for node in contributors | dropped}  # owner -> holder -> share
        for node, cfg in self._send(grid, r, Stage.UNMASK, contents).items():
            owners, values = cfg.get(Key.NODE_ID_LIST), cfg.get(Key.SHARE_LIST)
            if not (isinstance(owners, list) and isinstance(values, list) and len(owners) == len(values)):
                continue
            for owner, share in zip(owners, values, strict=True):
                if owner in asked[node][0] | asked[node][1] and isinstance(share, bytes):
                    shares[owner][node] = share  # only the shares it was asked for, one of each
        shapes = [a.shape for a in masked]
        for owner, got in shares.items():
            partners = [c for c in contributors if owner in held[c]] if owner in dropped else []
            if owner in dropped and not partners:
                continue  # nobody masked with it: nothing of it is in the sum
            if len(got) < r.threshold:
                raise SecAggError(f"{len(got)} shares of device {owner}'s secret came back, "
                                  f"{r.threshold} are needed to remove its masks")
            secret = combine_shares(list(got.values()))
            if owner in contributors:  # its own mask, from its seed
                masked = parameters_subtraction(masked, pseudo_rand_gen(secret, MODULUS_RANGE, shapes))
                continue
            for partner in partners:  # the masks it agreed with those that sent their vectors
                key = generate_shared_key(bytes_to_private_key(secret), bytes_to_public_key(r.public_keys[partner][0]))
                mask = pseudo_rand_gen(key, MODULUS_RANGE, shapes)
                # the partner added the mask if its id is the larger one, else subtracted it
                masked = (parameters_subtraction if partner > owner else parameters_addition)(masked, mask)
        q_ratio, summed = factor_extract(parameters_mod(masked, MODULUS_RANGE))
        if q_ratio != len(contributors) * QUANTIZATION_RANGE:
            raise SecAggError(f"the unmasked sum does not hold {len(contributors)} vectors (its weight term is "
                              f"{q_ratio / QUANTIZATION_RANGE:.3f}): a mask was not removed")
        sums = dequantize(summed, self.clipping_range, QUANTIZATION_RANGE)
        offset = -(len(contributors) - 1) * self.clipping_range  # each vector was shifted by +clipping_range
        return [s + offset for s in sums]


def _masked_vector(payload, layout: Sequence[tuple[int, ...]]) -> list[np.ndarray] | None:
    if not isinstance(payload, list) or len(payload) != len(layout) or not all(isinstance(b, bytes) for b in payload):
        return None
    try:
        vector = [bytes_to_ndarray(b) for b in payload]
    except ValueError:
        return None
    if any(a.shape != tuple(s) or a.dtype.kind not in "iu" for a, s in zip(vector, layout, strict=True)):
        return None
    return [a.astype(np.int64) for a in vector]


# -- the device side --------------------------------------------------------------------------------------

def hold(context: Context, server_round: int, delta: dict[str, np.ndarray], examples: int,
         counts: Sequence[int]) -> None:
    """Keep a round's update in the ClientApp's context until the protocol's step 3 asks for it."""
    context.state.array_records[HELD] = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in delta.items()})
    context.state.config_records[HELD_COUNTS] = ConfigRecord({"round": server_round, "examples": int(examples),
                                                       "counts": [int(c) for c in counts]})


def held_terms(context: Context, server_round: int, scales: list[float], clipping_range: float) -> list[np.ndarray]:
    """The held update of ``server_round`` as :func:`edgerev.fleet.aggregate.weighted_terms`, and forget it.

    Raises:
        ValueError: nothing held for that round, or a term beyond ``clipping_range`` (it would be clipped,
            and the fleet's average silently wrong).
    """
    from edgerev.fleet.aggregate import weighted_terms

    info = context.state.config_records.get(HELD_COUNTS)
    arrays = context.state.array_records.get(HELD)
    if info is None or arrays is None or info.get("round") != server_round:
        raise ValueError(f"no update of round {server_round} is held (was the device restarted?)")
    del context.state.config_records[HELD_COUNTS], context.state.array_records[HELD]
    terms = weighted_terms({k: v.numpy() for k, v in arrays.items()}, int(info["examples"]), list(info["counts"]),
                           scales)
    names = ["examples", "counts", *sorted(arrays.keys())]
    for name, t in zip(names, terms, strict=True):
        peak = float(np.abs(t).max(initial=0.0))
        if not peak <= clipping_range:
            raise ValueError(f"the update of {name} reaches {peak:.3g}, beyond the secure aggregation's range "
                             f"+-{clipping_range:g} (raise secagg-range)")
    return terms


def device_mod(config: str, on_error: Callable[[Context, str], None]) -> Callable:
    """The device's mod for a train message: Flower's ``secaggplus_mod`` for a step of the protocol, which
    takes the held update as the device's vector (the round and :data:`SCALE_KEY` come in the ``config``
    record of step 3; ``on_error(context, reason)`` is told when it cannot be sent); any other train
    message passes untouched."""
    from flwr.client.mod import secaggplus_mod
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    from flwr.compat.common import recorddict_compat as compat

    def vector(msg: Message, context: Context) -> Message:
        cfg = msg.content.config_records.get(config, ConfigRecord())
        protocol = msg.content.config_records.get(RECORD_KEY_CONFIGS)
        try:
            scales = cfg.get(SCALE_KEY)
            if not isinstance(scales, list) or not all(isinstance(s, float) for s in scales) or protocol is None:
                raise ValueError(f"step 3 of secure aggregation came without its {SCALE_KEY!r}")
            clipping = context.state.config_records[RECORD_KEY_STATE]["clipping_range"]
            terms = held_terms(context, cfg.get("server-round"), scales, float(clipping))
        except (KeyError, ValueError) as e:
            on_error(context, f"secure aggregation: {e}")
            raise
        fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(terms), 1, {})  # weight 1: the terms carry theirs
        return Message(compat.fitres_to_recorddict(fitres, keep_input=False), reply_to=msg)

    def mod(msg: Message, context: Context, call_next) -> Message:
        if msg.has_content() and RECORD_KEY_CONFIGS in msg.content.config_records:
            return secaggplus_mod(msg, context, vector)
        return call_next(msg, context)

    return mod

"""A Flower Grid that delivers messages to ClientApps in this process: simulation without Ray.

A ServerApp talks to its devices through a :class:`flwr.serverapp.Grid`: it pushes messages addressed to
node ids and pulls the replies. On a real deployment the SuperLink stores them and each SuperNode pulls
its own, runs its ClientApp and pushes the reply back. Here each node is a ClientApp and its Context in
the same process, and a push runs the ClientApp at once. Every message and reply is serialized to
Flower's wire format and parsed back on the way (as the SuperLink does), so a device never shares an
object with the server, and the bytes each device sends and receives are counted as they would travel.

An exception in a ClientApp becomes an error reply, as a SuperNode reports it. A node can be made
unreachable (``reachable(node_id)`` False: it is not listed and receives nothing) or made to lose its
replies (``deliver(node_id, message)`` False: it works on the message, the reply never arrives, as a
device that drops out mid-round).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.serverapp import Grid
from flwr.supercore.run import Run

log = logging.getLogger("edgerev.fleet.grid")

@dataclass
class Traffic:
    """Bytes on the wire for one node, by round (``group_id`` or the server round in the config)."""

    sent: int = 0
    received: int = 0
    by_round: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, key: str, round_id: str, n: int) -> None:
        setattr(self, key, getattr(self, key) + n)
        r = self.by_round.setdefault(round_id, {"sent": 0, "received": 0})
        r[key] += n


def _wire(message: Message) -> tuple[Message, int]:
    proto = message_to_proto(message)
    return message_from_proto(proto), proto.ByteSize()


def _round_of(message: Message) -> str:
    if message.has_content():
        for cfg in message.content.config_records.values():
            if "server-round" in cfg:
                return str(cfg["server-round"])
    return message.metadata.group_id or "0"


class InProcessGrid(Grid):
    """Nodes ``{node_id: (client_app, context)}`` in this process, under one run.

    Args:
        reachable: whether a node can be reached now (default: always).
        deliver: whether a node's reply to ``message`` arrives (default: always).
    """

    def __init__(self, nodes: dict[int, tuple[ClientApp, Context]], run_id: int = 1,
                 reachable: Callable[[int], bool] = lambda node: True,
                 deliver: Callable[[int, Message], bool] = lambda node, msg: True) -> None:
        self.nodes = nodes
        self._run = Run.create_empty(run_id)
        self.reachable, self.deliver = reachable, deliver
        self.traffic: dict[int, Traffic] = {n: Traffic() for n in nodes}
        self._replies: dict[str, Message] = {}

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return [n for n in self.nodes if self.reachable(n)]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            # what the SuperLink fills in on receipt (Flower's own in-memory grid does the same)
            msg.metadata.__dict__["_message_id"] = str(uuid4())
            msg.metadata.__dict__["_src_node_id"] = SUPERLINK_NODE_ID
            msg.metadata.__dict__["_run_id"] = self._run.run_id
            ids.append(msg.metadata.message_id)
            if node not in self.nodes or not self.reachable(node):
                continue
            round_id = _round_of(msg)
            received, n = _wire(msg)
            self.traffic[node].add("received", round_id, n)
            app, context = self.nodes[node]
            try:
                reply = app(received, context)
            except Exception as e:  # noqa: BLE001 - a SuperNode turns any ClientApp exception into an error reply
                log.warning("node %d: %s", node, e)
                error = Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=f"{type(e).__name__}: {e}")
                reply = Message(error, reply_to=received)
            if not self.deliver(node, received):
                continue
            reply.metadata.__dict__["_message_id"] = str(uuid4())
            back, n = _wire(reply)
            self.traffic[node].add("sent", round_id, n)
            self._replies[msg.metadata.message_id] = back
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in list(message_ids) if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        # every reply that will ever come has come when the push returns: nothing to wait for
        return self.pull_messages(self.push_messages(messages))

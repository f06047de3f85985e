"""Invertible building blocks: each knows its ``forward`` and ``inverse``; the engine decides what is kept."""

from edgerev.layers.activation import InvLeakyReLU
from edgerev.layers.base import Invertible, InvSequential, Tape, chunk_budget, replaying
from edgerev.layers.conv import InvConv2d
from edgerev.layers.coupling import Coupling, HybridBlock
from edgerev.layers.norm import InvBatchNorm2d
from edgerev.layers.pooling import BatchPool, ChannelPool, unpool_batch

__all__ = [
    "BatchPool",
    "ChannelPool",
    "Coupling",
    "HybridBlock",
    "InvBatchNorm2d",
    "InvConv2d",
    "InvLeakyReLU",
    "InvSequential",
    "Invertible",
    "Tape",
    "chunk_budget",
    "replaying",
    "unpool_batch",
]

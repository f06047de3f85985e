"""Invertible building blocks: each knows its ``forward`` and ``inverse``; the engine decides what is kept."""

from edgerev.layers.activation import InvLeakyReLU
from edgerev.layers.base import Invertible, InvSequential, Tape, chunk_budget, replaying
from edgerev.layers.conv import InvConv2d
from edgerev.layers.coupling import Coupling, HybridBlock
from edgerev.layers.norm import InvBatchNorm2d
from edgerev.layers.pooling import POOLS, BatchPool, ChannelPool, global_pool, global_pool_grad, unpool_batch
from edgerev.torch_range import warn_if_unsupported

# every model, the engine and the trainer build on these layers: the one place where edgerev's torch code loads
warn_if_unsupported()

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
    "POOLS",
    "Tape",
    "chunk_budget",
    "global_pool",
    "global_pool_grad",
    "replaying",
    "unpool_batch",
]

"""RevNeXt (Hascoet et al. 2023): hybrid reversible blocks, batch and channel pooling.

Built as the paper and its authors' code (``TristHas/reversibility_paper``: ``models.py``,
``layers.py``) build it: a stem of convolution, invertible batch norm and invertible leaky ReLU; hybrid
blocks whose ``F`` and ``G`` hold two (conv, BN, leaky ReLU) triples (one in the block right after the
stem); batch-norm scales ``|gamma| + eps_i`` starting at ``gamma = 1``; a head that takes the maximum
over space and over the batch-pooled sub-images, then a linear layer without bias whose logits are
scaled by 0.125.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from edgerev.errors import ArchitectureError
from edgerev.layers import BatchPool, ChannelPool, HybridBlock, InvBatchNorm2d, InvConv2d, InvLeakyReLU
from edgerev.models._registry import register_model
from edgerev.models.base import EngineModel, stem
from edgerev.models.head import ScaledLinear

LEVELS = 5
#: the authors' logit scale (``IResXD.w``)
LOGIT_SCALE = 0.125


class RevNeXt(EngineModel):
    """Stem, then five levels of hybrid blocks separated by alternating batch and channel pooling.

    Channels per level: ``w, w, 4w, 4w, 16w`` (``w`` the stem width); resolution halves at each
    pooling, so the activation volume is the same at every stage and the peak does not grow with
    depth. Input sizes must be multiples of 16.

    Where this model still departs from the authors' code, and why:

    * The level plan (``w, w, 4w, 4w, 16w``, blocks ``(2, 2, 2, 2, 3)``) is edgerev's reading of the
      paper's Table 1 (lost from its extracted text); the authors' notebooks vary it per experiment.
    * Batch pooling moves the sub-images to the batch axis (``[4B, C, h, w]``) where the authors stack
      them on an extra axis of a 5-d tensor (``[B, C, 4, h, w]``, 3-d convolutions of depth 1): the same
      values meet the same kernels, and batch norm groups the same elements, so the function is the same.
    * Batch norm keeps running statistics for evaluation; the authors' invertible batch norm always
      normalizes with the statistics of the batch at hand, which a predictor serving one image at a
      time cannot do (batch norm over one image normalizes away what its statistics carry).
    * ``eps_i = 0.1`` everywhere: the paper's text introduces ``eps_i`` and its notebooks set 0.1,
      though their ``ibatch_norm_xd`` never passes it on (its own default, 0, applies). Without the
      bound a scale that reaches 0 makes the layer's inverse divide by zero.
    * Slope 0.2: the value of the paper's experiments (their code's default is 0.01, whose inverse
      multiplies reconstruction noise by 100 per layer).

    Reconstruction SNR is not flat with depth at this initialization (``benchmarks/snr_depth.py``; batch
    8, 32x32, min over stages against a float64 forward, depth 1/2/4/8 blocks per level): 116/103/90/77 dB in
    ``floor`` mode, 104/90/75/59 in ``invert``. Rounding the top activation to float32 alone, every inverse
    exact, gives 116/104/91/78 dB: each branch ends in a leaky ReLU of a ``gamma = 1`` batch norm whose
    mean (0.32) adds up block after block, so the stream outgrows the stem's output (RMS 0.57 -> 26 at
    depth 8). ``floor`` reaches that bound; ``invert``'s further 12 to 19 dB come from recovering ``y1`` and
    ``x2`` through layer inverses (``Coupling.backward_``), where the authors' ``RevBlock`` restores copies,
    the price of holding 2.5 activation volumes instead of 3. The paper's flat curve is its metric's: the
    authors' batch-norm inverse has a depth-independent floor of ``20 log10(2 N)`` dB (90.3 dB at batch 256,
    8x8).

    Args:
        width: stem width, a multiple of 4 (32 in the paper: 352 bytes per input pixel).
        blocks: hybrid blocks per level, five integers >= 1.
        depth: (conv, BN, leaky ReLU) triples inside each of ``F`` and ``G`` (the block right after the
            stem has one, as in the authors' code).
        slope: leaky ReLU slope.
        eps_i: bound on the batch-norm scale.
        num_classes: classifier outputs.
    """

    def __init__(self, width: int = 32, blocks: Sequence[int] = (2, 2, 2, 2, 3), depth: int = 2,
                 slope: float = 0.2, eps_i: float = 0.1, num_classes: int = 10) -> None:
        blocks = _check_levels("revnext", width, blocks, "blocks")
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ArchitectureError(f"revnext: depth must be an integer >= 1 (triples in F and G), got {depth!r}")

        def block(c: int, index: int) -> list[nn.Module]:
            return [HybridBlock(c, 1 if index == 0 else depth, slope, eps_i)]

        stages = _pooled_levels(width, blocks, block, slope, eps_i)
        super().__init__(stages, 16 * width, num_classes, divisor=16, pool="max",
                         head=ScaledLinear(16 * width, num_classes, bias=False, scale=LOGIT_SCALE))


def _check_levels(name: str, width: int, counts: Sequence[int], key: str) -> tuple[int, ...]:
    """One clear error for a width or a level list the RevNeXt plan cannot take."""
    if isinstance(width, bool) or not isinstance(width, int) or width < 4 or width % 4:
        raise ArchitectureError(f"{name}: width must be a positive multiple of 4 (the hybrid blocks split each "
                                f"channel half again), got {width!r}")
    try:
        counts = tuple(counts)
    except TypeError:
        counts = ()
    if len(counts) != LEVELS or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts):
        raise ArchitectureError(f"{name}: {key} must be {LEVELS} integers >= 1, one per level (channels w, w, 4w, "
                                f"4w, 16w), got {list(counts) if counts else counts!r}")
    return counts


def _stem(width: int, slope: float, eps_i: float) -> list[nn.Module]:
    """The authors' stem: a stored convolution, then invertible batch norm and leaky ReLU.

    The convolution's input, the image, is kept anyway; the batch norm and leaky ReLU run as
    invertible stages, so the stem adds no activation volume to the peak.
    """
    return [stem(width), InvBatchNorm2d(width, eps_i), InvLeakyReLU(slope)]


def _pooled_levels(width: int, counts: Sequence[int], unit: Callable[[int, int], list[nn.Module]], slope: float,
                   eps_i: float) -> list[nn.Module]:
    """Stem, then five levels of ``counts[k]`` units at ``w, w, 4w, 4w, 16w`` channels, with batch and
    channel pooling alternating between levels (the RevNeXt plan: every stage keeps the same volume).
    ``unit(channels, index)`` builds the ``index``-th unit of the network."""
    stages: list[nn.Module] = _stem(width, slope, eps_i)
    channels = [width, width, 4 * width, 4 * width, 16 * width]
    pools = [BatchPool, ChannelPool, BatchPool, ChannelPool, None]
    index = 0
    for c, n, pool in zip(channels, counts, pools):
        for _ in range(n):
            stages += unit(c, index)
            index += 1
        if pool is not None:
            stages.append(pool())
    return stages


@register_model
def revnext(**kw) -> RevNeXt:
    """RevNeXt, stem width 32, hybrid blocks (2, 2, 2, 2, 3) per level."""
    return RevNeXt(**kw)


@register_model
def layerwise(width: int = 32, layers: Sequence[int] = (2, 2, 2, 2, 2), slope: float = 0.2, eps_i: float = 0.1,
              num_classes: int = 10) -> EngineModel:
    """A flat chain of invertible layers (conv, BN, leaky ReLU), with RevNeXt's stem, pooling and head.

    Every layer is its own stage, so the backward inverts layer after layer across the whole
    network: the design whose reconstruction error grows with depth.
    """
    layers = _check_levels("layerwise", width, layers, "layers")

    def triple(c: int, index: int) -> list[nn.Module]:
        return [InvConv2d(c), InvBatchNorm2d(c, eps_i), InvLeakyReLU(slope)]

    stages = _pooled_levels(width, layers, triple, slope, eps_i)
    return EngineModel(stages, 16 * width, num_classes, divisor=16, pool="max",
                       head=ScaledLinear(16 * width, num_classes, bias=False, scale=LOGIT_SCALE))

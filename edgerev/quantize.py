"""Approximate activation storage (Chakrabarti & Moseley): a sign-preserving 8- or 4-bit copy.

The forward stays exact; only the copy kept for the backward pass is quantized. The ``2**bits`` codes
of a channel are split between the two signs in proportion to their ranges (at least one code each):
``P`` codes for ``(0, hi]`` and ``N`` for ``[-lo, 0]``, each value reconstructed at the middle of its
bin and never at zero, so ``x > 0`` holds for the copy exactly when it holds for the original: ReLU
and leaky-ReLU gradients computed from the copy are exact (the sign is one bit of information the
code carries). A ReLU output (``lo = 0``) thus gets ``2**bits - 1`` levels for its positive values
and one code for its zeros; a centred batch-norm output about half the codes per sign, as the
paper's uniform grid aligned on zero. Ranges are per channel: the batch's largest value of each sign,
or a given range (values beyond it are clipped to its end bins). Four-bit codes are packed two per
byte, so the kept copy is an eighth of the float32 tensor.

Two paths give the same codes, bit for bit. The eager one runs a few ATen kernels per batch slice (ten to
quantize, five to read back) and per channel; on a GPU those launches, not the arithmetic, are what
``store8``/``store4`` cost. The fused one (:func:`fusing`; on by default for float32 CUDA tensors) is two
operators, ``edgerev::encode`` and ``edgerev::decode``, whose bodies ``torch.compile`` turns into a range
reduction and one element-wise kernel, and one kernel to read back: the whole tensor at once, with no float
temporary, so it needs no slices. Where the compiler is missing or fails (a device without Triton), the first
call says so in one warning and the eager path takes over for the rest of the process.
"""

from __future__ import annotations

import contextlib
import contextvars
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from edgerev._torchapi import exact_division_options
from edgerev.layers.base import batch_slices


@dataclass
class Quantized:
    """A quantized copy: ``codes`` (uint8, packed two per byte for 4 bits) and one small per-channel table.

    ``table`` rows: the positive range, the negative range (magnitude), the bin width of each sign, and
    ``zero``, the code boundary between the signs less a half: codes ``> zero`` are positive values.
    """

    codes: Tensor
    table: Tensor  # [5, C]: pos, neg, step of positives, step of the others, zero
    bits: int
    shape: torch.Size
    dtype: torch.dtype
    slice_bytes: int | None = None  # the batch-slice budget of its temporaries, for dequantize too (None: the default)

    @property
    def pos(self) -> Tensor:
        """[C] upper end of the positive range."""
        return self.table[0]

    @property
    def neg(self) -> Tensor:
        """[C] upper end of the negative magnitudes."""
        return self.table[1]

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size()


def channel_range(x: Tensor) -> tuple[Tensor, Tensor]:
    """Largest positive value and largest negative magnitude per channel (dim 1), over the batch."""
    dims = [d for d in range(x.dim()) if d != 1]
    hi = x.amax(dim=dims).clamp_min(0)
    lo = (-x.amin(dim=dims)).clamp_min(0)
    return hi, lo


def bn_range(scale: Tensor, shift: Tensor, k: float = 4.0) -> tuple[Tensor, Tensor]:
    """Range of ``s * xhat + beta`` for ``|xhat| <= k``: the paper's clipping after batch norm."""
    hi = (shift + k * scale.abs()).clamp_min(0)
    lo = (-(shift - k * scale.abs())).clamp_min(0)
    return hi, lo


def _view(v: Tensor, dim: int) -> Tensor:
    return v.view(1, -1, *([1] * (dim - 2)))


def split_codes(hi: Tensor, lo: Tensor, bits: int) -> Tensor:
    """Codes per channel ``[2, C]``: for positive values and for the others, in proportion to the two ranges."""
    total = 2**bits
    counts = hi.new_empty(2, *hi.shape)
    torch.mul(hi, total, out=counts[0]).div_(hi + lo).round_().clamp_(1, total - 1)
    torch.neg(counts[0], out=counts[1]).add_(total)
    return counts


# Codes run in the order of the values: ``0 .. N-1`` for values <= 0 (the largest magnitude first), ``N ..
# 2**bits - 1`` for positive values. With ``t = x / step`` (the step of x's sign), a value's code is
# ``ceil(t) + N - 1``: a positive ``t`` lands at ``N`` or above, zero and negative ``t`` at ``N - 1`` or below,
# and a bin is ``(k, k+1]`` in ``t``, whose middle is ``code - (N - 0.5)``. The few kernels this takes per
# batch slice (ten to quantize, five to dequantize, all element-wise) and per channel are what
# ``store8``/``store4`` launch on a GPU beside autograd's own.


def quantize(x: Tensor, bits: int, rng: tuple[Tensor, Tensor] | None = None,
             slice_bytes: int | None = None) -> Quantized:
    """Sign-preserving ``bits``-bit copy of ``x`` (``bits`` is 8 or 4); ``x`` is left untouched. Its element-wise
    temporaries are made in batch slices of ``slice_bytes`` (the stage's planned budget; None: the default of
    :func:`edgerev.layers.chunk_budget`; 0: the whole batch at once), and so are :func:`dequantize`'s."""
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    if x.dim() < 2:
        raise ValueError(f"quantize needs a [batch, channels, ...] tensor, got shape {tuple(x.shape)}")
    if _fused(x):
        fused = _fused_encode(x, bits, rng, slice_bytes)
        if fused is not None:
            return fused
    total, dim = 2**bits, x.dim()
    table = x.new_empty(5, x.shape[1])
    ranges = table[:2]
    if rng is None:
        dims = [d for d in range(dim) if d != 1]
        torch.amax(x, dims, out=table[0])
        torch.amin(x, dims, out=table[1]).neg_()
    else:
        table[0].copy_(rng[0])
        table[1].copy_(rng[1])
    # a range of 0 would put a whole sign at zero on the way back: keep every range positive
    ranges.clamp_min_(torch.finfo(x.dtype).eps)
    counts = split_codes(table[0], table[1], bits)
    torch.div(ranges, counts, out=table[2:4])
    torch.sub(counts[1], 0.5, out=table[4])
    step_pos, step_neg = _view(table[2], dim), _view(table[3], dim)
    below = _view(counts[1] - 1, dim)  # the code of the smallest magnitude <= 0
    tiny = torch.finfo(x.dtype).tiny
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    for sl in batch_slices(x, budget=slice_bytes):
        xs = x[sl]
        # t = x / step of x's sign, from the two signed parts (a select by the sign is several times slower on
        # a CPU than these element-wise ops)
        t = xs.clamp_max(0).div_(step_neg).addcdiv_(xs.clamp_min(0), step_pos)
        # a positive value too small for its step (a subnormal over a step above 1) comes out of the divide at
        # zero: the smallest normal float, signed as x is, puts it among the positive codes (and moves no
        # other quotient across an integer)
        t.add_(torch.sign(xs), alpha=tiny).ceil_().add_(below).clamp_(0, total - 1)
        codes[sl].copy_(t)
    if bits == 4:
        flat = codes.view(-1)
        if flat.numel() % 2:
            flat = torch.cat([flat, flat.new_zeros(1)])
        codes = flat[0::2] | (flat[1::2] << 4)
    return Quantized(codes, table, bits, x.shape, x.dtype, slice_bytes)


def dequantize(q: Quantized) -> Tensor:
    """Float tensor of the original shape: each code at the middle of its bin, with its sign."""
    if _fused(q.codes, q.dtype):
        out = _fused_decode(q)
        if out is not None:
            return out
    codes = q.codes
    if q.bits == 4:
        pairs = codes.new_empty(codes.numel(), 2)
        torch.bitwise_and(codes, 0x0F, out=pairs[:, 0])
        torch.bitwise_right_shift(codes, 4, out=pairs[:, 1])
        codes = pairs.view(-1)[:q.shape.numel()]
    codes = codes.view(q.shape)
    out = torch.empty(q.shape, dtype=q.dtype, device=codes.device)
    dim = len(q.shape)
    step_pos, step_neg, zero = (_view(q.table[i], dim) for i in (2, 3, 4))
    for sl in batch_slices(out, budget=q.slice_bytes):
        v = torch.sub(codes[sl], zero, out=out[sl])  # bins from the boundary: positive for positive values
        positive = v.clamp_min(0)
        v.clamp_max_(0).mul_(step_neg).addcmul_(positive, step_pos)
    return out


# ---- the fused path ------------------------------------------------------------------------------------------------

# Kernels one call of each fused operator launches on a GPU, as inductor schedules its body: the range reduction
# (which it splits in two over a large batch) with the per-channel table as its epilogue, then the codes, packed in
# the same kernel; reading back is one element-wise kernel. :class:`edgerev.memory.measure.profile.FlopCounter`
# counts a fused operator as this many launches (an upper bound; the CUDA campaign times the real ones).
LAUNCHES = {"encode": 3, "decode": 1}

_fusion: contextvars.ContextVar[bool | None] = contextvars.ContextVar("edgerev_fusion", default=None)
_broken: list[str] = []  # why the compiler failed, once it has: the eager path for the rest of the process


@contextlib.contextmanager
def fusing(on: bool | None) -> Iterator[None]:
    """Inside the block, :func:`quantize` and :func:`dequantize` run the fused operators (True: on any device,
    the meta device included, where the kernel counter sees them), the eager kernels (False), or choose by the
    tensor (None, the default: fused for float32 tensors on CUDA, where launches are dear). Other dtypes always
    run eagerly."""
    token = _fusion.set(on)
    try:
        yield
    finally:
        _fusion.reset(token)


def _fused(x: Tensor, dtype: torch.dtype | None = None) -> bool:
    if (dtype or x.dtype) != torch.float32 or _broken:
        return False
    on = _fusion.get()
    return x.is_cuda if on is None else on


def _encode_body(x: Tensor, rng: Tensor | None, bits: int, pack: bool) -> tuple[Tensor, Tensor]:
    """Codes and table of ``x`` seen as ``[N, C, L]``: the eager path's arithmetic, operation for operation, on the
    whole tensor (each sum below has one zero term, so a fused multiply-add rounds it alike)."""
    total = 256 if bits == 8 else 16  # a constant of the compiled body (``2**bits`` of a traced int is symbolic)
    eps, tiny = torch.finfo(x.dtype).eps, torch.finfo(x.dtype).tiny
    if rng is None:
        hi, lo = x.amax((0, 2)), x.amin((0, 2)).neg()
    else:
        hi, lo = rng[0], rng[1]
    hi, lo = hi.clamp_min(eps), lo.clamp_min(eps)
    npos = (hi * total).div(hi + lo).round().clamp(1, total - 1)
    nneg = total - npos
    step_pos, step_neg = hi / npos, lo / nneg
    table = torch.stack([hi, lo, step_pos, step_neg, nneg - 0.5])
    t = x.clamp_max(0).div(step_neg[:, None]) + x.clamp_min(0).div(step_pos[:, None])
    t = (t + torch.sign(x) * tiny).ceil().add((nneg - 1)[:, None]).clamp(0, total - 1)
    codes = t.to(torch.uint8)
    if pack:
        flat = codes.reshape(-1)
        codes = flat[0::2] | (flat[1::2] << 4)
    return codes, table


def _decode_body(codes: Tensor, table: Tensor, shape: list[int], bits: int) -> Tensor:
    """The float ``[N, C, L]`` tensor of ``codes``: each at the middle of its bin, as the eager path computes it."""
    if bits == 4:
        codes = torch.stack([codes & 0x0F, codes >> 4], 1).reshape(-1)[:shape[0] * shape[1] * shape[2]]
    v = codes.view(shape).to(table.dtype) - table[4][:, None]
    return v.clamp_max(0) * table[3][:, None] + v.clamp_min(0) * table[2][:, None]


_compiled: dict[tuple, object] = {}


def _compile(body, *variant):
    """``body`` compiled for one variant of its arguments (the flags, and which sizes are 1: the compiler
    specializes those, so that one compiled function would recompile for each and stop at its limit): a copy of
    its code object per variant, each of which compiles once, with symbolic sizes. Its divisions round as the
    eager kernels' do (:func:`~edgerev._torchapi.exact_division_options`): the same codes and table, bit for bit."""
    key = (body.__name__, *variant)
    if key not in _compiled:
        code = body.__code__.replace(co_name=f"{body.__name__}_{len(_compiled)}")
        fn = types.FunctionType(code, body.__globals__, code.co_name, body.__defaults__, body.__closure__)
        _compiled[key] = torch.compile(fn, dynamic=True, fullgraph=True, options=exact_division_options() or None)
    return _compiled[key]


def _ones(shape) -> tuple[bool, ...]:
    return tuple(n == 1 for n in shape)


@torch.library.custom_op("edgerev::encode", mutates_args=(),
                         schema="(Tensor x, Tensor? rng, int bits, bool pack) -> (Tensor, Tensor)")
def _encode_op(x: Tensor, rng: Tensor | None, bits: int, pack: bool) -> tuple[Tensor, Tensor]:
    return _compile(_encode_body, x.device.type, rng is None, bits, pack, _ones(x.shape))(x, rng, bits, pack)


@_encode_op.register_fake
def _(x: Tensor, rng: Tensor | None, bits: int, pack: bool) -> tuple[Tensor, Tensor]:
    codes = x.new_empty((x.numel() // 2,) if pack else x.shape, dtype=torch.uint8)
    return codes, x.new_empty(5, x.shape[1])


@torch.library.custom_op("edgerev::decode", mutates_args=(),
                         schema="(Tensor codes, Tensor table, SymInt[] shape, int bits) -> Tensor")
def _decode_op(codes: Tensor, table: Tensor, shape: list[int], bits: int) -> Tensor:
    return _compile(_decode_body, codes.device.type, bits, _ones(shape))(codes, table, shape, bits)


@_decode_op.register_fake
def _(codes: Tensor, table: Tensor, shape: list[int], bits: int) -> Tensor:
    return table.new_empty(shape)


def _give_up(error: Exception) -> None:
    if not _broken:
        _broken.append(f"{type(error).__name__}: {error}".splitlines()[0])
        warnings.warn(f"edgerev: the fused quantizer did not compile ({_broken[0]}); store8/store4 run the eager "
                      "kernels from now on (same codes, more launches)", RuntimeWarning, stacklevel=3)


def _as_3d(shape: torch.Size) -> list[int]:
    return [shape[0], shape[1], shape[2:].numel()]


def _fused_encode(x: Tensor, bits: int, rng: tuple[Tensor, Tensor] | None, slice_bytes: int | None) -> Quantized | None:
    """:func:`quantize` by the fused operator; None where it failed to compile (the caller runs the eager path)."""
    pack = bits == 4 and x.numel() % 2 == 0
    try:
        codes, table = _encode_op(x.reshape(_as_3d(x.shape)), None if rng is None else torch.stack(rng), bits, pack)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # a device without a working compiler (no Triton, no C++ compiler): eager from now on
        _give_up(e)
        return None
    if bits == 4 and not pack:  # an odd count: pad the codes to whole bytes as the eager path does
        flat = torch.cat([codes.view(-1), codes.new_zeros(1)])
        codes = flat[0::2] | (flat[1::2] << 4)
    elif not pack:
        codes = codes.view(x.shape)
    return Quantized(codes, table, bits, x.shape, x.dtype, slice_bytes)


def _fused_decode(q: Quantized) -> Tensor | None:
    """:func:`dequantize` by the fused operator; None where it failed to compile."""
    try:
        return _decode_op(q.codes, q.table, _as_3d(q.shape), q.bits).view(q.shape)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:
        _give_up(e)
        return None

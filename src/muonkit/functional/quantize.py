"""Low-precision storage of optimizer states: blockwise 8-bit codes and bf16 with stochastic rounding.

Pure functions on local tensors. A state is computed in fp32 and stored in one of these forms
(:mod:`muonkit.state_precision` chooses per group):

- **8-bit, blockwise.** The tensor is cut along its last dimension into blocks of at most
  :data:`BLOCK` consecutive values (each row from its start; a row's last block may be shorter).
  Each block keeps one fp32 scale, ``absmax / 448``, and its values as ``float8_e4m3fn`` codes of
  ``x / scale`` (round to nearest). That is a *non-linear* 8-bit code: three mantissa bits at
  every magnitude from 448 down to 2^-6 of the scale (relative error <= 2^-4 of a value), then
  subnormals to 2^-9; a value below ``absmax * 2^-10 / 448`` of its block is stored as zero.
  The **signed** form (momentum, AdamW's ``exp_avg``) stores ``x``; the **unsigned** form
  (AdamW's ``exp_avg_sq``, NorMuon's row moments: values >= 0) stores ``sqrt(x)`` and squares it
  back, so the code's range covers 2 * 18 binary orders of magnitude of ``x`` per block and a
  second moment's relative error is at most about 2^-3; a positive value too small for the code
  is stored as the smallest positive code, never as zero (a zero second moment would make Adam's
  update ``m / eps``: it errs towards smaller updates instead, as bitsandbytes' code). Blocks are the local tensor's: on a
  shard they never straddle the shard's edge. Decoding is one cast and one multiply;
  encoding one reduction, one multiply and one cast (no table lookups: a ``bucketize`` into a
  256-entry table costs 30-40x more on a CPU).
- **bf16, stochastically rounded.** Round to nearest stalls an EMA whose step is below half a
  bf16 ulp (a momentum buffer of 1.0 never moves to 1.001). :func:`round_bf16` rounds up with
  probability proportional to the distance (unbiased), with random bits made by hashing each
  value's fp32 bits with a per-step ``salt``: the same value rounds the same way on every rank
  and layout (bit-exact states across layouts), and differently from one step to the next.

Example::

    >>> x = torch.tensor([[1.0, -0.5, 0.25, 0.0]])
    >>> codes, scales = quantize_blockwise(x, signed=True)
    >>> dequantize_blockwise(codes, scales, signed=True)
    tensor([[ 1.0000, -0.5000,  0.2500,  0.0000]])
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = [
    "BLOCK",
    "CODE_DTYPE",
    "SCALE_SUFFIX",
    "STATE_DTYPES",
    "block_count",
    "block_shape",
    "blocks_consistent",
    "dequantize_blockwise",
    "quantize_blockwise",
    "quantize_into",
    "round_bf16",
    "salt_of",
    "work_dtype",
]

STATE_DTYPES = ("fp32", "bf16", "8bit")
"""How optimizer states may be kept at rest (``state_dtype``; :mod:`muonkit.state_precision`)."""
SCALE_SUFFIX = "_scale"
"""An 8-bit state ``K`` keeps its block scales in the state entry ``K + SCALE_SUFFIX``."""
BLOCK = 256
"""The most values one scale covers (along the last dimension), as bitsandbytes' and torchao's 8-bit optimizers."""
CODE_DTYPE = torch.float8_e4m3fn
"""The 8-bit code: e4m3, finite range +-448."""
_TOP = 448.0  # the largest e4m3fn value: a block's absmax maps to it
_FLOOR = 2.0**-9  # the smallest positive e4m3fn value: where an unsigned code's non-zero values end up at least


@functools.cache
def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a param's update is computed in (and its fp32-precision states are kept in): fp32
    for bf16 and fp16 params, else the param's."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def block_count(cols: int) -> int:
    """Scales per row of ``cols`` values (``ceil(cols / BLOCK)``; a zero-size row has none)."""
    return -(-cols // BLOCK)


def block_shape(shape: tuple[int, ...], blocks: int = BLOCK) -> tuple[int, ...]:
    """The shape of one value per block of at most ``blocks`` along the last dim of a ``shape`` tensor
    (a 0-dim tensor: one block)."""
    return (*shape[:-1], -(-shape[-1] // blocks)) if shape else (1,)


def _blocks(x: Tensor) -> tuple[Tensor, int]:
    """``x`` (fp32) as ``(*lead, blocks, BLOCK)``, zero-padded at each row's end; and the pad."""
    x = x if x.dim() else x.reshape(1)
    cols = x.shape[-1]
    blocks = block_count(cols)
    pad = blocks * BLOCK - cols
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], blocks, BLOCK), pad


def _check_finite(x: Tensor, *, signed: bool) -> None:
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError("Cannot quantize a state holding NaN or inf: a checked step never stores one")
    if not signed and x.numel() and bool((x < 0).any()):
        raise ValueError("Cannot quantize a negative value in the unsigned (second-moment) code: values must be >= 0")


def quantize_blockwise(x: Tensor, *, signed: bool, check: bool = True) -> tuple[Tensor, Tensor]:
    """``x``'s 8-bit codes (``float8_e4m3fn``, ``x``'s shape) and scales (fp32, ``(*lead, blocks)``;
    a 0-dim ``x`` counts as one value). ``signed=False`` codes ``sqrt(x)`` of values >= 0.
    ``check``: refuse non-finite values (and negative ones, unsigned) with a ``ValueError``;
    a caller that checked already passes False (no host read)."""
    codes = torch.empty(x.shape, dtype=CODE_DTYPE, device=x.device)
    scales = torch.empty((*x.shape[:-1], block_count(x.shape[-1])) if x.dim() else (1,), device=x.device)
    quantize_into(codes, scales, x, signed=signed, check=check)
    return codes, scales


def quantize_into(codes: Tensor, scales: Tensor, x: Tensor, *, signed: bool, check: bool = True) -> None:
    """:func:`quantize_blockwise` into existing ``codes`` and ``scales`` (the stored state, in place)."""
    if check:
        _check_finite(x, signed=signed)
    work = x.float() if x.dtype != torch.float32 else x
    if not signed:
        work = work.sqrt()
    blocks, pad = _blocks(work)
    absmax = blocks.abs().amax(dim=-1) if blocks.numel() else blocks.new_zeros(blocks.shape[:-1])
    scale = absmax / _TOP
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    # x / scale, not x * (1 / scale): the block's largest value lands on 448 exactly
    scaled = (blocks / safe.unsqueeze(-1)).clamp_(-_TOP, _TOP)
    if not signed:  # a second moment never decodes to 0 unless it is 0: the update would be m / eps
        scaled.clamp_(min=_FLOOR).mul_(blocks > 0)  # (values are >= 0: a zero one is coded 0)
    if not pad and codes.is_contiguous():
        codes.view(scaled.shape).copy_(scaled)  # cast and store in one pass
    else:
        coded = scaled.to(CODE_DTYPE)
        coded = coded.reshape(*coded.shape[:-2], coded.shape[-2] * BLOCK)
        if pad:
            coded = coded[..., : coded.shape[-1] - pad]
        codes.copy_(coded.reshape(codes.shape))
    scales.copy_(scale.reshape(scales.shape))


def dequantize_blockwise(codes: Tensor, scales: Tensor, *, signed: bool) -> Tensor:
    """The fp32 values ``codes`` and ``scales`` stand for (a new tensor, ``codes``' shape)."""
    values = codes.float()
    blocks, pad = _blocks(values)
    out = (blocks * scales.reshape(blocks.shape[:-1]).unsqueeze(-1)).reshape(
        *blocks.shape[:-2], blocks.shape[-2] * BLOCK
    )
    if pad:
        out = out[..., : out.shape[-1] - pad]
    out = out.reshape(codes.shape)
    return out if signed else out.square_()


def blocks_consistent(codes: Tensor, scales: Tensor) -> Tensor:
    """Per block (``scales``' shape): whether the codes are what a write leaves. A block whose scale
    is a normal float holds its largest value as the code +-448 (``absmax / scale`` lands on 448 at
    most one fp32 rounding away, and e4m3 rounds it to 448); a block whose scale is 0 holds only
    zeros (a scale below fp32's normal range loses the relation, and is not checked; nor is a
    block holding a NaN code, which the callers refuse as non-finite). Codes and
    scales from two different cuts of the same values (another layout's blocks) almost never pass."""
    peak, _ = _blocks(codes.float().abs())
    peak = peak.amax(dim=-1).reshape(scales.shape)
    normal = scales >= torch.finfo(torch.float32).tiny
    fits = torch.where(normal, peak == _TOP, torch.where(scales == 0, peak == 0, True))
    return fits | peak.isnan()  # a NaN code: refused as a non-finite value, by the value checks


_MIX = (0x7FEB352D, 0x846CA68B - (1 << 32))  # odd multipliers of a 32-bit integer hash (lowbias32), as int32


def round_bf16(x: Tensor, salt: int | Tensor) -> Tensor:
    """``x`` (fp32) rounded to bf16 stochastically: down or up to the neighbouring bf16 values with
    probabilities proportional to the distance to the other one, so ``E[round_bf16(x)] = x``.

    The random 16 bits added below the kept mantissa are a hash of ``x``'s own bits and ``salt``
    (one per step; int32 arithmetic, wrapping): deterministic given the value and the step, so
    equal values round alike. NaN and inf stay as they are; a finite value never rounds to inf
    (it is clamped to bf16's largest)."""
    if x.dtype != torch.float32:
        x = x.float()
    bits = x.contiguous().view(torch.int32)
    if isinstance(salt, Tensor):
        salt = salt.to(device=x.device, dtype=torch.int32)
    else:
        salt = salt & 0xFFFFFFFF
        salt = salt - (1 << 32) if salt >= 1 << 31 else salt
    # One new tensor, the rest in place (half the time of a new tensor per operation, the same bits).
    h = torch.bitwise_xor(bits, salt)
    h.mul_(_MIX[0])
    h.bitwise_xor_(torch.bitwise_right_shift(h, 15).bitwise_and_(0x1FFFF))
    h.mul_(_MIX[1])
    # adding to the magnitude bits rounds away from zero for either sign; & -65536 clears the low 16
    rounded = h.bitwise_right_shift_(16).bitwise_and_(0xFFFF).add_(bits).bitwise_and_(-65536).view(torch.float32)
    big = torch.finfo(torch.bfloat16).max
    finite = torch.bitwise_and(bits, 0x7F800000) != 0x7F800000  # exponent not all ones: isfinite(x), in 2 passes
    rounded = torch.where(finite, rounded.clamp_(-big, big), x)
    return rounded.to(torch.bfloat16)  # exact: the low 16 bits are zero


def salt_of(step: float | Tensor, key: str = "") -> int | Tensor:
    """A salt for :func:`round_bf16` from a step count (a number, or a 0-dim tensor: then a 0-dim int32
    tensor on its device, no host read) and the state's key: a new one each step and state."""
    offset = sum(key.encode()) * 0x632BE5AB
    if isinstance(step, Tensor):
        mixed = (step.to(torch.int64) * 0x9E3779B1 + offset) & 0xFFFFFFFF
        return torch.where(mixed >= 1 << 31, mixed - (1 << 32), mixed).to(torch.int32)
    return (int(step) * 0x9E3779B1 + offset) & 0xFFFFFFFF

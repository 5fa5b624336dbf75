"""QK-Clip math (Kimi K2's MuonClip, arXiv 2507.20534): attention-logit maxima and per-head row factors.

For every head h the largest attention logit of a step is ``S_h = max_{i, j unmasked} q_i . k_j * scale``.
A head whose ``S_h`` exceeds the threshold tau gets ``gamma_h = tau / S_h``; its query rows are
multiplied by ``gamma_h ** alpha`` and its key rows by ``gamma_h ** (1 - alpha)``, so its logits
(bilinear in the two projections) shrink by exactly ``gamma_h`` and its new maximum is tau.

Grouped-query attention shares one key head among several query heads. The key rows of a group
take the factor of the group's hottest head, ``gamma_g = min_{h in g} gamma_h``; each query head
keeps its own ``gamma_h ** alpha``. Every head then ends at or below tau (``gamma_h ** alpha *
gamma_g ** (1 - alpha) <= gamma_h``), the hottest one exactly at tau, and cool heads of the group
only lose ``gamma_g ** (1 - alpha)`` (nothing with ``alpha = 1``).

Multi-head latent attention (DeepSeek-V3, Kimi K2): the per-head non-rotary query and key parts
take ``gamma_h ** alpha`` and ``gamma_h ** (1 - alpha)``, the per-head rotary query part takes the
whole ``gamma_h``, the rotary key shared by all heads is left alone (the K2 paper's rule).

A maximum that is not a finite number above tau (``<= tau``, ``nan``, ``+-inf``) gives ``gamma = 1``:
such a head is never rescaled, so no factor is ever 0, ``inf`` or ``nan``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "HeadRows",
    "QKLayout",
    "flat_scale",
    "max_attention_logits",
    "qk_clip_factors",
    "qk_row_scale",
    "scale_rows_",
]

Part = Literal["query", "key", "query_rope"]
PARTS: tuple[Part, ...] = ("query", "key", "query_rope")

LOGIT_BLOCK_ELEMENTS = 1 << 24
"""Logits materialized at once by :func:`max_attention_logits` (64 MiB in fp32): the query-row block size."""


@dataclass(frozen=True)
class HeadRows:
    """Where one part of every head lives along one dimension of one parameter.

    Head ``i`` owns the indices ``[offset + i * stride, offset + i * stride + width)`` along
    ``dim`` of the parameter ``param`` (a dotted name relative to the attention module).

    Examples (``H`` query heads, ``K`` key heads, head size ``d``):

    * ``q_proj.weight`` of Llama: ``HeadRows("q_proj.weight", "query", count=H, width=d)``.
    * GPT-2's fused ``c_attn`` (a ``Conv1D``, weight stored ``(in, 3 * H * d)``): the key is
      ``HeadRows("c_attn.weight", "key", count=H, width=d, offset=H * d, dim=1)``.
    * GPT-NeoX's interleaved ``query_key_value`` (per head ``[q | k | v]``): the key is
      ``HeadRows("query_key_value.weight", "key", count=H, width=d, offset=d, stride=3 * d)``.

    ``part``: ``"query"`` (scaled by ``gamma_h ** alpha``), ``"key"`` (one entry per key head,
    scaled by ``gamma_g ** (1 - alpha)``) or ``"query_rope"`` (MLA's rotary query, ``gamma_h``).
    """

    param: str
    part: Part
    count: int
    width: int
    offset: int = 0
    stride: int | None = None
    dim: int = 0

    def __post_init__(self) -> None:
        if self.part not in PARTS:
            raise ValueError(f"Invalid part={self.part!r}: must be one of {PARTS}")
        for name in ("count", "width"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Invalid {name}={getattr(self, name)}: must be positive")
        if self.offset < 0 or self.step < self.width:
            raise ValueError(
                f"Invalid HeadRows offset={self.offset}, stride={self.stride}: need offset >= 0 and stride >= width={self.width}"
            )

    @property
    def step(self) -> int:
        return self.width if self.stride is None else self.stride

    @property
    def end(self) -> int:
        """One past the last index this block touches."""
        return self.offset + (self.count - 1) * self.step + self.width

    def indices(self, device: torch.device | None = None) -> Tensor:
        """The indices along ``dim``, head-major: ``(count * width,)``."""
        heads = torch.arange(self.count, device=device).unsqueeze(1) * self.step
        return (self.offset + heads + torch.arange(self.width, device=device)).reshape(-1)


@dataclass(frozen=True)
class QKLayout:
    """The query/key rows of one attention layer: what a module returns from ``qk_clip_layout()``.

    ``num_heads`` query heads and ``num_kv_heads`` key heads (``num_heads % num_kv_heads == 0``;
    query head ``h`` reads key head ``h // (num_heads // num_kv_heads)``, as ``repeat_kv`` and
    ``enable_gqa`` do). ``rows`` lists every weight and bias block that produces queries or keys.
    """

    num_heads: int
    num_kv_heads: int
    rows: tuple[HeadRows, ...]

    def __post_init__(self) -> None:
        if self.num_heads <= 0 or self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"Invalid QKLayout num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}: "
                "both positive, num_heads a multiple of num_kv_heads"
            )
        for block in self.rows:
            want = self.num_kv_heads if block.part == "key" else self.num_heads
            if block.count != want:
                raise ValueError(f"Invalid {block}: a {block.part} block covers {want} heads")
        if not {b.part for b in self.rows} >= {"query", "key"}:
            raise ValueError(f"Invalid QKLayout rows={self.rows}: need at least one query and one key block")


def max_attention_logits(
    query: Tensor,
    key: Tensor,
    *,
    scale: float,
    mask: Tensor | None = None,
    causal: bool = False,
    block_elements: int = LOGIT_BLOCK_ELEMENTS,
) -> Tensor:
    """Per query head, the largest ``q . k * scale`` over the positions the mask lets through.

    ``query`` ``(B, H, Tq, d)``, ``key`` ``(B, K, Tk, d)`` with ``H % K == 0`` (grouped keys are
    not repeated). ``mask``: broadcastable to ``(B, H, Tq, Tk)``, boolean (True = attend) or
    additive float (a position is masked where it is ``-inf`` or below half the dtype's minimum,
    as transformers writes it). ``causal``: key ``j`` visible to query ``i`` iff ``j <= i``
    (``scaled_dot_product_attention``'s ``is_causal``). Computed in fp32 under ``no_grad``, a
    block of query rows at a time, so at most ``~block_elements`` logits exist at once.
    Returns ``(H,)`` float32; ``-inf`` for a head that saw no unmasked position.
    """
    batch, heads, rows, dim = query.shape
    kv_heads, cols = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    with torch.no_grad():
        q = query.detach().reshape(batch, kv_heads, groups, rows, dim)
        kt = key.detach().to(torch.float32).unsqueeze(2).transpose(-1, -2)  # (B, K, 1, d, Tk)
        best = torch.full((kv_heads, groups), float("-inf"), device=query.device)
        step = max(1, min(rows, block_elements // max(1, batch * heads * cols)))
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            logits = torch.matmul(q[..., start:stop, :].to(torch.float32), kt).mul_(scale)
            allowed = _allowed(mask, causal, start, stop, cols, kv_heads, groups, query.device)
            if allowed is not None:
                logits.masked_fill_(~allowed, float("-inf"))
            best = torch.maximum(best, logits.amax(dim=(0, 3, 4)))
        return best.reshape(heads)


def _allowed(
    mask: Tensor | None,
    causal: bool,
    start: int,
    stop: int,
    cols: int,
    kv_heads: int,
    groups: int,
    device: torch.device,
) -> Tensor | None:
    """The visible positions of query rows ``[start, stop)``, shaped to broadcast over ``(B, K, G, rows, Tk)``."""
    allowed: Tensor | None = None
    if mask is not None:
        while mask.ndim < 4:
            mask = mask.unsqueeze(0)
        block = mask[..., start:stop, :cols] if mask.shape[-2] > 1 else mask[..., :cols]
        if block.dtype != torch.bool:
            block = block > torch.finfo(block.dtype).min / 2
        if block.shape[1] == kv_heads * groups and kv_heads * groups > 1:
            allowed = block.reshape(block.shape[0], kv_heads, groups, *block.shape[2:])
        else:
            allowed = block.unsqueeze(2)
    if causal:
        tri = torch.arange(cols, device=device) <= torch.arange(start, stop, device=device).unsqueeze(1)
        allowed = tri if allowed is None else allowed & tri
    return allowed


def qk_clip_factors(max_logits: Tensor, *, threshold: float, num_kv_heads: int) -> tuple[Tensor, Tensor]:
    """``(gamma per query head, gamma per key head)`` for per-head maxima ``max_logits`` ``(H,)``.

    ``gamma_h = threshold / S_h`` where ``S_h`` is finite and above ``threshold``, else 1; a key
    head takes the smallest ``gamma_h`` of its query heads. Both float32, in ``(0, 1]``.
    """
    if threshold <= 0:
        raise ValueError(f"Invalid threshold={threshold!r}: must be > 0")
    logits = max_logits.to(torch.float32)
    hot = torch.isfinite(logits) & (logits > threshold)
    gamma = torch.where(hot, threshold / torch.where(hot, logits, 1.0), 1.0)
    return gamma, gamma.reshape(num_kv_heads, -1).amin(dim=1)


def qk_row_scale(
    blocks: Sequence[HeadRows], size: int, query_gamma: Tensor, key_gamma: Tensor, *, alpha: float
) -> Tensor:
    """The factor of every index ``0..size`` along one dimension of one parameter (1 outside ``blocks``).

    ``query`` blocks take ``gamma_h ** alpha``, ``key`` blocks ``gamma_g ** (1 - alpha)``,
    ``query_rope`` blocks ``gamma_h``. Float32, ``(size,)``.
    """
    scale = torch.ones(size, device=query_gamma.device)
    for block in blocks:
        if block.end > size:
            raise ValueError(
                f"Invalid {block}: reaches index {block.end}, the parameter has {size} along dim {block.dim}"
            )
        gamma = key_gamma if block.part == "key" else query_gamma
        power = {"query": alpha, "key": 1.0 - alpha, "query_rope": 1.0}[block.part]
        index = block.indices(scale.device)
        scale[index] *= gamma.pow(power).repeat_interleave(block.width)
    return scale


def scale_rows_(tensor: Tensor, scale: Tensor, *, dim: int) -> None:
    """``tensor *= scale`` broadcast along ``dim`` (in fp32, written back in ``tensor``'s dtype)."""
    shape = [1] * tensor.ndim
    shape[dim] = -1
    factor = scale.to(tensor.device).reshape(shape)
    if tensor.dtype == torch.float32 or tensor.dtype == torch.float64:
        tensor.mul_(factor.to(tensor.dtype))
    else:
        tensor.copy_(tensor.to(torch.float32) * factor)


def flat_scale(scale: Tensor, shape: Sequence[int], *, dim: int, start: int, length: int) -> Tensor:
    """The factor of each element ``start .. start + length`` of a tensor of ``shape`` flattened row-major,
    for per-index factors ``scale`` along ``dim`` (a ZeRO flat partition holds such element ranges)."""
    inner = 1
    for n in shape[dim + 1 :]:
        inner *= int(n)
    elements = torch.arange(start, start + length, device=scale.device)
    return scale[(elements // inner) % int(shape[dim])]

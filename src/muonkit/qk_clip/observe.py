"""What QK-Clip sees during the forward passes: each observed layer's running per-head logit maxima.

An observed attention module carries a :class:`Slot` in its ``__dict__`` under :data:`SLOT` (so
pickling and ``deepcopy`` of the model follow it). Attention that reports to it: hand-written
modules call :func:`observed_attention` instead of ``F.scaled_dot_product_attention``;
transformers models go through :mod:`muonkit.qk_clip.transformers_attention`. Both compute
``max_attention_logits`` (:mod:`muonkit.functional.qk_clip`) on the queries and keys the
attention uses, and keep the maximum over every micro-batch since the last clip. Only modules in
training mode are observed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from muonkit.functional.qk_clip import HeadRows, QKLayout, max_attention_logits

__all__ = ["SLOT", "Slot", "observed_attention", "slot_of"]

SLOT = "_muonkit_qk_clip"
"""The attribute an observed attention module carries: its :class:`Slot`."""


class Slot:
    """One attention layer: its name, layout, params and the running per-head maxima.

    Raises ``ValueError`` when the layout names a param the module lacks, or rows beyond its size.
    """

    def __init__(self, name: str, module: nn.Module, layout: QKLayout) -> None:
        self.name = name
        self.layout = layout
        self.module = module  # a plain reference: the slot lives in module.__dict__, so pickle and deepcopy follow
        self.maxima: Tensor | None = None
        self.params: list[tuple[str, int, list[HeadRows]]] = []
        """(param name in the module, dim, its blocks): looked up at each clip, so wrapping or sharding the
        model after the QKClip was built (``fully_shard`` swaps in DTensor params) is fine."""
        by_key: dict[tuple[str, int], list[HeadRows]] = {}
        for block in layout.rows:
            by_key.setdefault((block.param, block.dim), []).append(block)
        for (param_name, dim), blocks in by_key.items():
            try:
                param = module.get_parameter(param_name)
            except AttributeError as e:
                raise ValueError(f"QKClip: {name} declares rows of {param_name!r}, which it does not have") from e
            shape = tuple(getattr(param, "ds_shape", param.shape))  # a ZeRO-3 param is empty outside forward
            if not 0 <= dim < len(shape):
                raise ValueError(f"QKClip: {name}.{param_name} has {len(shape)} dims, a row block names dim {dim}")
            for block in blocks:
                if block.end > shape[dim]:
                    raise ValueError(
                        f"QKClip: {name}.{param_name} has {shape[dim]} entries along dim {dim}, "
                        f"{block} reaches {block.end}"
                    )
            self.params.append((param_name, dim, blocks))

    def param(self, name: str) -> Tensor:
        return self.module.get_parameter(name)

    def observe(self, query: Tensor, key: Tensor, *, scale: float, mask: Tensor | None, causal: bool) -> None:
        heads, kv = self.layout.num_heads, self.layout.num_kv_heads
        if query.shape[1] != heads or key.shape[1] != kv:
            raise RuntimeError(
                f"QKClip: {self.name} ran attention with {query.shape[1]} query and {key.shape[1]} key heads, "
                f"its layout declares {heads} and {kv} (tensor-parallel attention is not supported)"
            )
        found = max_attention_logits(query, key, scale=scale, mask=mask, causal=causal)
        self.maxima = found if self.maxima is None else torch.maximum(self.maxima, found)


def slot_of(module: nn.Module) -> Slot | None:
    """The :class:`Slot` of ``module`` while it is observed and in training mode, else None."""
    slot = module.__dict__.get(SLOT)
    return slot if slot is not None and module.training else None


def observed_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """``scaled_dot_product_attention`` that reports its logit maxima to the QKClip attached to ``module``.

    ``query`` ``(B, H, T, d)``, ``key``/``value`` ``(B, K, T, d)`` (``K`` divides ``H``: grouped
    keys are used as they are). Without a QKClip on ``module`` (or in eval mode) it is plain sdpa.
    ``module`` declares its rows with ``qk_clip_layout() -> QKLayout``.

    Example (in a hand-written attention's ``forward``)::

        y = muonkit.qk_clip.observed_attention(self, q, k, v, causal=True)
    """
    slot = slot_of(module)
    if slot is not None:
        scaling = query.shape[-1] ** -0.5 if scale is None else scale
        slot.observe(query, key, scale=scaling, mask=attn_mask, causal=causal and attn_mask is None)
    return F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=causal and attn_mask is None,
        scale=scale,
        enable_gqa=key.shape[1] != query.shape[1],
    )

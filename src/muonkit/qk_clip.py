"""QK-Clip (MuonClip, Kimi K2, arXiv 2507.20534): keep attention logits below a threshold.

Muon's updates have a large spectral norm; on long runs some heads' query and key weights grow
until their attention logits explode (Kimi K2 saw logits above 1000 and loss spikes). QK-Clip
watches every head's largest logit ``S_h = max q . k * scale`` during the forward passes of a step
and, right after the optimizer step, shrinks the query and key rows of each head above the
threshold tau by ``gamma_h = tau / S_h`` (queries ``gamma_h ** alpha``, keys ``gamma_h ** (1 - alpha)``),
so that head's largest logit would now be exactly tau. Heads below tau are never touched; with
grouped keys see :mod:`muonkit.functional.qk_clip`.

Example::

    clip = muonkit.QKClip(model, optimizer, threshold=100.0)   # hooks optimizer.step()
    for batch in data:
        model(**batch).loss.backward()
        optimizer.step()          # QK-Clip runs right after, on every rank
        optimizer.zero_grad()
    clip.last_max_logit            # the largest logit the last step saw (for logging)

What is observed: transformers models through their attention interface (``eager`` and ``sdpa``;
the model's attention implementation is switched to a wrapper that computes the maxima and then
calls the original), and hand-written attention that calls :func:`observed_attention` and
declares its rows with a ``qk_clip_layout() -> QKLayout`` method. Only modules in training mode
are observed.
"""

from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from muonkit.distributed.qk_clip import all_reduce_max_, local_index_runs, local_tensor, reduction_device
from muonkit.functional.qk_clip import (
    HeadRows,
    QKLayout,
    max_attention_logits,
    qk_clip_factors,
    qk_row_scale,
    scale_rows_,
)
from muonkit.qk_layouts import transformers_layout

__all__ = ["HeadRows", "QKClip", "QKLayout", "observed_attention"]

logger = logging.getLogger(__name__)

SLOT = "_muonkit_qk_clip"
"""The attribute an observed attention module carries: its :class:`_Slot`."""


class _Slot:
    """One attention layer: its name, layout, params and the running per-head maxima."""

    def __init__(self, name: str, module: nn.Module, layout: QKLayout) -> None:
        self.name = name
        self.layout = layout
        self.module = weakref.ref(module)
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
            if not 0 <= dim < param.ndim:
                raise ValueError(f"QKClip: {name}.{param_name} has {param.ndim} dims, a row block names dim {dim}")
            for block in blocks:
                if block.end > param.shape[dim]:
                    raise ValueError(
                        f"QKClip: {name}.{param_name} has {param.shape[dim]} entries along dim {dim}, "
                        f"{block} reaches {block.end}"
                    )
            self.params.append((param_name, dim, blocks))

    def param(self, name: str) -> Tensor:
        module = self.module()
        if module is None:
            raise RuntimeError(f"QKClip: the attention module {self.name} no longer exists")
        return module.get_parameter(name)

    def observe(self, query: Tensor, key: Tensor, *, scale: float, mask: Tensor | None, causal: bool) -> None:
        heads, kv = self.layout.num_heads, self.layout.num_kv_heads
        if query.shape[1] != heads or key.shape[1] != kv:
            raise RuntimeError(
                f"QKClip: {self.name} ran attention with {query.shape[1]} query and {key.shape[1]} key heads, "
                f"its layout declares {heads} and {kv} (tensor-parallel attention is not supported)"
            )
        found = max_attention_logits(query, key, scale=scale, mask=mask, causal=causal)
        self.maxima = found if self.maxima is None else torch.maximum(self.maxima, found)


def _slot_of(module: nn.Module) -> _Slot | None:
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
    """
    slot = _slot_of(module)
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


@dataclass(frozen=True)
class _Found:
    name: str
    module: nn.Module
    layout: QKLayout
    via_transformers: bool


def _find(model: nn.Module) -> list[_Found]:
    found = []
    for name, module in model.named_modules():
        declared = getattr(module, "qk_clip_layout", None)
        if callable(declared):
            layout = declared()
            if not isinstance(layout, QKLayout):
                raise TypeError(f"QKClip: {name}.qk_clip_layout() returned {type(layout).__name__}, must be a QKLayout")
            found.append(_Found(name, module, layout, False))
        elif (layout := transformers_layout(module)) is not None:
            found.append(_Found(name, module, layout, True))
    return found


class QKClip:
    """Observe every attention head's largest logit and rescale its q/k rows after each optimizer step.

    Args:
        model: the model (or the module holding the attention layers; a DDP wrapper is fine).
        optimizer: attach to this optimizer now (:meth:`attach`); or call :meth:`attach` later,
            or :meth:`clip` yourself after each step.
        threshold: tau, the largest logit allowed (Kimi K2 used 100 for K2, 30 in ablations).
        alpha: the share of the factor taken by the queries (0.5: half each, the paper's choice).
        process_group: the data-parallel group the maxima are reduced over (default: the world
            when torch.distributed is initialized).

    Raises ``ValueError`` before anything changes for a bad threshold or alpha, a model with no
    attention it can observe, or a transformers attention implementation other than eager/sdpa.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        threshold: float = 100.0,
        alpha: float = 0.5,
        process_group: Any = None,
    ) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold < math.inf:
            raise ValueError(f"Invalid threshold={threshold!r}: must be a finite number > 0")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
            raise ValueError(f"Invalid alpha={alpha!r}: must be in [0, 1]")
        found = _find(model)
        if not found:
            raise ValueError(
                "QKClip found no attention it can observe in the model: it reads transformers attention modules "
                "(q_proj/k_proj, GPT-2 c_attn, GPT-NeoX query_key_value, Phi-3 qkv_proj, DeepSeek MLA) and modules "
                "with a qk_clip_layout() method that call muonkit.qk_clip.observed_attention"
            )
        for f in found:
            if SLOT in f.module.__dict__:
                raise ValueError(f"QKClip: {f.name} already has a QKClip attached; call .remove() on that one first")
        from muonkit import qk_transformers

        switch = qk_transformers.prepare([f.module for f in found if f.via_transformers])
        _refuse_zero3(model)
        self.threshold = float(threshold)
        self.alpha = float(alpha)
        self.process_group = process_group
        self._slots = [_Slot(f.name, f.module, f.layout) for f in found]
        for f, slot in zip(found, self._slots, strict=True):
            f.module.__dict__[SLOT] = slot
        self._restore = switch()
        self._handles: list[Any] = []
        self.last_max_logits: dict[str, Tensor] = {}
        self.last_clipped_heads = 0
        if optimizer is not None:
            self.attach(optimizer)

    @property
    def layers(self) -> list[str]:
        """The names of the observed attention modules."""
        return [s.name for s in self._slots]

    def attach(self, optimizer: torch.optim.Optimizer) -> QKClip:
        """Run :meth:`clip` after every ``optimizer.step()`` (torch's step post-hook)."""
        self._handles.append(optimizer.register_step_post_hook(lambda *_: self.clip()))
        return self

    def remove(self) -> None:
        """Detach: remove the hooks, stop observing, give the model back its attention implementation."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for slot in self._slots:
            module = slot.module()
            if module is not None:
                module.__dict__.pop(SLOT, None)
        self._restore()

    def max_logits(self) -> dict[str, Tensor]:
        """Per layer, the per-head maxima this rank saw since the last clip (float32, detached, ``-inf`` if none)."""
        return {s.name: self._maxima(s, None) for s in self._slots}

    @property
    def last_max_logit(self) -> float:
        """The largest logit (all layers and heads, all ranks) the last :meth:`clip` acted on; nan before any."""
        values = [v.max() for v in self.last_max_logits.values()]
        return float(torch.stack(values).max()) if values else math.nan

    def _maxima(self, slot: _Slot, device: torch.device | None) -> Tensor:
        if slot.maxima is None:
            return torch.full((slot.layout.num_heads,), -math.inf, device=device)
        return slot.maxima.detach().to(device=device or slot.maxima.device, dtype=torch.float32)

    def clip(self) -> None:
        """Reduce the maxima over the ranks, rescale the q/k rows of every head above the threshold, reset."""
        first = local_tensor(self._slots[0].param(self._slots[0].params[0][0]))
        device = reduction_device(self.process_group, first.device)
        joined = torch.cat([self._maxima(s, device) for s in self._slots])
        all_reduce_max_(joined, self.process_group)
        sizes = [s.layout.num_heads for s in self._slots]
        per_layer = joined.split(sizes)
        hot = torch.isfinite(joined) & (joined > self.threshold)
        clipped = hot.split(sizes)
        flags = [bool(x) for x in torch.stack([c.any() for c in clipped]).tolist()]  # one host sync per step
        with torch.no_grad():
            for slot, maxima, any_hot in zip(self._slots, per_layer, flags, strict=True):
                if any_hot:
                    self._rescale(slot, maxima)
                slot.maxima = None
        self.last_max_logits = {s.name: m.cpu() for s, m in zip(self._slots, per_layer, strict=True)}
        self.last_clipped_heads = int(hot.sum())
        bad = int((~torch.isfinite(joined) & (joined != -math.inf)).sum())
        if bad:
            logger.warning("QKClip: %d heads had a non-finite max logit this step; left unclipped", bad)

    def _rescale(self, slot: _Slot, maxima: Tensor) -> None:
        q_gamma, k_gamma = qk_clip_factors(maxima, threshold=self.threshold, num_kv_heads=slot.layout.num_kv_heads)
        for name, dim, blocks in slot.params:
            param = slot.param(name)
            local = local_tensor(param)
            scale = qk_row_scale(blocks, param.shape[dim], q_gamma, k_gamma, alpha=self.alpha)
            runs = local_index_runs(param, dim)
            if not runs or local.numel() == 0:
                continue
            mine = torch.cat([scale[a:b] for a, b in runs]) if len(runs) > 1 else scale[runs[0][0] : runs[0][1]]
            scale_rows_(local, mine, dim=dim)


def _refuse_zero3(model: nn.Module) -> None:
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        raise ValueError(
            "QKClip does not support DeepSpeed ZeRO-3 yet: its partitioned params hold flat slices of the weights "
            "outside the optimizer step; use ZeRO-1/2, DDP or FSDP2"
        )

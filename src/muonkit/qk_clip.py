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
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from muonkit.distributed.qk_clip import all_reduce_max_, local_index_runs, local_tensor, reduction_device
from muonkit.distributed.zero import ZeroStrategy
from muonkit.functional.qk_clip import (
    HeadRows,
    QKLayout,
    flat_scale,
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
        optimizer: Any = None,
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
        self._checked = False
        self._unseen: list[str] = []
        self._pending: tuple[list[tuple[Tensor, Tensor] | None], set[int]] | None = None
        if optimizer is not None:
            self.attach(optimizer)

    @property
    def layers(self) -> list[str]:
        """The names of the observed attention modules."""
        return [s.name for s in self._slots]

    def attach(self, optimizer: Any) -> QKClip:
        """Run the clip after every ``optimizer.step()`` (torch's step post-hook).

        Wrappers (accelerate's, DeepSpeed's ZeRO optimizer) are looked through to the optimizer
        that steps. Under DeepSpeed ZeRO-1/2/3 (a :class:`muonkit.HybridMuon` set up by
        :mod:`muonkit.integrations.deepspeed`) the fp32 master partitions are rescaled, once each
        after their own ``step()`` call; DeepSpeed then copies them into the low-precision weights.
        """
        inner = optimizer
        while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer) or not hasattr(
            inner, "register_step_post_hook"
        ):
            if getattr(inner, "optimizer", None) is None:
                raise TypeError(f"QKClip.attach: {type(optimizer).__name__} is not a torch optimizer nor wraps one")
            inner = inner.optimizer
        self._handles.append(inner.register_step_post_hook(lambda opt, *_: self._after_step(opt)))
        return self

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        strategy = getattr(optimizer, "strategy", None)
        if isinstance(strategy, ZeroStrategy):
            self._clip_flat(optimizer, strategy)
            return
        if not self._checked:
            held = {id(p) for g in optimizer.param_groups for p in g["params"]}
            if not any(id(s.param(n)) in held for s in self._slots for n, _, _ in s.params):
                raise RuntimeError(
                    f"QKClip: the optimizer it is attached to ({type(optimizer).__name__}) holds none of the q/k weights, "
                    "so a rescale would be overwritten or lost; attach it to the optimizer of the attention matrices "
                    "(under DeepSpeed ZeRO: a muonkit.HybridMuon from muonkit.integrations.deepspeed)"
                )
            self._checked = True
        self.clip()

    def remove(self) -> None:
        """Detach: remove the hooks, stop observing, give the model back its attention implementation."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for slot in self._slots:
            slot.module.__dict__.pop(SLOT, None)
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
        """Reduce the maxima over the ranks, rescale the q/k rows of every head above the threshold, reset.

        What the step hook runs (except under DeepSpeed ZeRO, where the hook rescales the flat fp32
        partitions instead); call it yourself after each step if you did not :meth:`attach`.
        """
        factors = self._reduce()
        with torch.no_grad():
            for slot, factor in zip(self._slots, factors, strict=True):
                if factor is not None:
                    self._rescale(slot, *factor)

    def _reduce(self) -> list[tuple[Tensor, Tensor] | None]:
        """All-reduce (MAX) the maxima, reset them, record them; per layer the factors, None where nothing clips."""
        first = local_tensor(self._slots[0].param(self._slots[0].params[0][0]))
        device = reduction_device(self.process_group, first.device)
        joined = torch.cat([self._maxima(s, device) for s in self._slots])
        all_reduce_max_(joined, self.process_group)
        for slot in self._slots:
            slot.maxima = None
        sizes = [s.layout.num_heads for s in self._slots]
        per_layer = joined.split(sizes)
        hot = torch.isfinite(joined) & (joined > self.threshold)
        seen = joined != -math.inf
        flags, observed = torch.stack(
            [torch.stack([h.any() for h in hot.split(sizes)]), torch.stack([o.any() for o in seen.split(sizes)])]
        ).tolist()  # the one host sync of a step
        unseen = [s.name for s, o in zip(self._slots, observed, strict=True) if not o]
        if unseen and unseen != self._unseen:
            logger.warning(
                "QKClip: no training-mode forward pass reached %d of %d observed attention layers since the last "
                "step (%s): nothing was recorded or clipped there. Was the model in eval mode, or was its attention "
                "implementation changed (set_attn_implementation) after the QKClip was built? Build the QKClip "
                "after choosing the implementation.",
                len(unseen),
                len(self._slots),
                ", ".join(unseen[:4]) + (", ..." if len(unseen) > 4 else ""),
            )
        self._unseen = unseen
        self.last_max_logits = {s.name: m.cpu() for s, m in zip(self._slots, per_layer, strict=True)}
        self.last_clipped_heads = int(hot.sum())
        bad = int((~torch.isfinite(joined) & (joined != -math.inf)).sum())
        if bad:
            logger.warning("QKClip: %d heads had a non-finite max logit this step; left unclipped", bad)
        return [
            qk_clip_factors(m, threshold=self.threshold, num_kv_heads=s.layout.num_kv_heads) if flag else None
            for s, m, flag in zip(self._slots, per_layer, flags, strict=True)
        ]

    def _rescale(self, slot: _Slot, q_gamma: Tensor, k_gamma: Tensor) -> None:
        for name, dim, blocks in slot.params:
            param = slot.param(name)
            local = local_tensor(param)
            runs = local_index_runs(param, dim)
            if not runs or local.numel() == 0:
                continue
            scale = qk_row_scale(blocks, param.shape[dim], q_gamma, k_gamma, alpha=self.alpha)
            mine = torch.cat([scale[a:b] for a, b in runs]) if len(runs) > 1 else scale[runs[0][0] : runs[0][1]]
            scale_rows_(local, mine, dim=dim)

    def _clip_flat(self, optimizer: torch.optim.Optimizer, strategy: ZeroStrategy) -> None:
        """DeepSpeed ZeRO: rescale this rank's pieces of the q/k weights in the flat fp32 partitions.

        DeepSpeed calls ``step()`` once per param group (ZeRO-1/2) or sub-group (ZeRO-3), with
        only that partition in ``param_groups``: the maxima are reduced at the first call of a
        step, and each partition is rescaled right after its own update.
        """
        if self._pending is None:
            self._pending = (self._reduce(), set())
        factors, done = self._pending
        targets = self._flat_targets(strategy)
        with torch.no_grad():
            for flat in (p for g in optimizer.param_groups for p in g["params"]):
                for entry in strategy.layout_of(flat).params:
                    target = targets.get(entry.name)
                    piece = entry.piece_on(strategy.rank)
                    if target is None or piece is None or factors[target[0]] is None:
                        continue
                    index, dim, blocks = target
                    q_gamma, k_gamma = factors[index]  # type: ignore[misc]
                    scale = qk_row_scale(blocks, entry.shape[dim], q_gamma, k_gamma, alpha=self.alpha)
                    part = flat[piece.local_offset : piece.local_offset + piece.length]
                    part.mul_(flat_scale(scale, entry.shape, dim=dim, start=piece.param_offset, length=piece.length))
                done.add(id(flat))
        if done >= {id(f) for f in strategy.partitions}:
            self._pending = None

    def _flat_targets(self, strategy: ZeroStrategy) -> dict[str, tuple[int, int, list[HeadRows]]]:
        """Model param name -> (slot index, dim, blocks), checked once against DeepSpeed's param names."""
        targets = {
            f"{slot.name}.{name}" if slot.name else name: (i, dim, blocks)
            for i, slot in enumerate(self._slots)
            for name, dim, blocks in slot.params
        }
        if not self._checked:
            known = {entry.name for flat in strategy.partitions for entry in strategy.layout_of(flat).params}
            missing = sorted(set(targets) - known)
            if missing:
                raise RuntimeError(
                    f"QKClip: DeepSpeed's partitions hold no param named {missing[0]!r} ({len(missing)} missing): build "
                    "the QKClip on the model given to deepspeed.initialize (not the engine), and train the q/k weights"
                )
            self._checked = True
        return targets

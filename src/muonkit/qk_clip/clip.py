"""The :class:`QKClip` object: reduce the step's logit maxima over the ranks, rescale the q/k rows each rank holds.

After each optimizer step (torch's step post-hook) the per-head maxima every rank observed
(:mod:`muonkit.qk_clip.observe`) are reduced with MAX over the data-parallel ranks: all layers'
maxima concatenated, one all-reduce through :class:`~muonkit.distributed.collectives.Collectives`
(counted in :attr:`QKClip.stats`). Every rank then computes the same factors
(:func:`~muonkit.functional.qk_clip.qk_clip_factors`) and rescales the part of each q/k weight
it holds, which it asks the optimizer's distribution strategy
(:meth:`~muonkit.distributed.base.Strategy.regions`): the whole tensor on one device and under
DDP, its box under FSDP2 and N-D meshes, the spans of each q/k weight in DeepSpeed ZeRO's flat
fp32 partitions. An optimizer without a muonkit strategy (a torch optimizer) gets the strategy
:func:`~muonkit.distributed.select_strategy` picks for the q/k weights.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from muonkit._compat import dtensor_params
from muonkit.distributed import Strategy, StrategyStats, select_strategy
from muonkit.distributed.base import Held
from muonkit.distributed.collectives import Collectives, flag_device, group_of
from muonkit.distributed.pieces import Span
from muonkit.functional.qk_clip import HeadRows, flat_scale, qk_clip_factors, qk_row_scale, scale_rows_
from muonkit.qk_clip.layouts import find_attention
from muonkit.qk_clip.observe import SLOT, Slot
from muonkit.qk_clip.transformers_attention import prepare

__all__ = ["QKClip"]

logger = logging.getLogger(__name__)

Factors = list[tuple[Tensor, Tensor] | None]
"""Per observed layer: (query gammas, key gammas), or None where no head clips."""
Target = tuple[int, int, list[HeadRows]]
"""Where a q/k tensor's rows are: (index of its layer, dim, its row blocks)."""


@dataclass
class _Round:
    """The step() calls of one optimizer step that step stand-ins (DeepSpeed calls ``step()`` once per
    flat partition): the factors reduced at its first call, what it stepped and which q/k names it saw."""

    factors: Factors
    stepped: set[int] = field(default_factory=set)
    names: set[str] = field(default_factory=set)


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
    :attr:`stats` counts the collectives it issues (one all-reduce per step over more than one rank).
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
        found = find_attention(model)
        if not found:
            raise ValueError(
                "QKClip found no attention it can observe in the model: it reads transformers attention modules "
                "(q_proj/k_proj, GPT-2 c_attn, GPT-NeoX query_key_value, Phi-3 qkv_proj, DeepSeek MLA) and modules "
                "with a qk_clip_layout() method that call muonkit.qk_clip.observed_attention"
            )
        for f in found:
            if SLOT in f.module.__dict__:
                raise ValueError(f"QKClip: {f.name} already has a QKClip attached; call .remove() on that one first")
        switch = prepare([f.module for f in found if f.via_transformers])
        self.threshold = float(threshold)
        self.alpha = float(alpha)
        self.process_group = process_group
        self.stats = StrategyStats()
        """The collectives this QKClip issued and their bytes (the MAX all-reduce of the maxima)."""
        self._slots = [Slot(f.name, f.module, f.layout) for f in found]
        for f, slot in zip(found, self._slots, strict=True):
            f.module.__dict__[SLOT] = slot
        self._restore = switch()
        self._handles: list[Any] = []
        self.last_max_logits: dict[str, Tensor] = {}
        self.last_clipped_heads = 0
        self._checked = False
        self._unseen: list[str] = []
        self._comm: Collectives | None = None  # made at the first reduce over more than one rank
        self._strategy: Strategy | None = None  # for optimizers without one: picked at the first clip
        self._stand_ins: bool | None = None  # whether the optimizer steps stand-ins (flat partitions)
        self._round: _Round | None = None
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

    def clip(self) -> None:
        """Reduce the maxima over the ranks, rescale the q/k rows of every head above the threshold, reset.

        What the step hook runs (except under DeepSpeed ZeRO, where the hook rescales the flat fp32
        partitions instead); call it yourself after each step if you did not :meth:`attach`.
        """
        self._clip_model(self._strategy_of(None))

    # ------------------------------------------------------------------ after a step

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        strategy = self._strategy_of(optimizer)
        stepped = [p for g in optimizer.param_groups for p in g["params"]]
        if self._stand_ins is None:
            self._stand_ins = self._steps_stand_ins(optimizer, strategy, stepped)
        if self._stand_ins:
            self._clip_stand_ins(strategy, stepped)
        else:
            self._clip_model(strategy)

    def _steps_stand_ins(self, optimizer: Any, strategy: Strategy, stepped: list[Tensor]) -> bool:
        """Whether the optimizer steps the q/k tensors themselves (False) or flat partitions that stand for
        named tensors of the model (True: DeepSpeed ZeRO); raises ``RuntimeError`` if neither."""
        own = {id(s.param(n)) for s in self._slots for n, _, _ in s.params}
        if any(id(p) in own for p in stepped):
            return False
        if any(h.name is not None for p in stepped for h in strategy.regions(p)):
            return True
        raise RuntimeError(
            f"QKClip: the optimizer it is attached to ({type(optimizer).__name__}) holds none of the q/k weights, "
            "so a rescale would be overwritten or lost; attach it to the optimizer of the attention matrices "
            "(under DeepSpeed ZeRO: a muonkit.HybridMuon from muonkit.integrations.deepspeed)"
        )

    def _strategy_of(self, optimizer: Any) -> Strategy:
        """The optimizer's distribution strategy; for one without (a torch optimizer, or no optimizer), the
        strategy :func:`select_strategy` picks for the q/k weights (DTensors: their meshes; plain tensors:
        whole on every rank of :attr:`process_group`)."""
        strategy = getattr(optimizer, "strategy", None)
        if isinstance(strategy, Strategy):
            return strategy
        if self._strategy is None:
            params = [s.param(n) for s in self._slots for n, _, _ in s.params]
            sharded = bool(dtensor_params(params))
            group = None if sharded else self._group()
            if not sharded and group is None and dist.is_available() and dist.is_initialized():
                group = dist.group.WORLD  # every rank holds the plain tensors whole
            self._strategy = select_strategy(params, process_group=group)
        return self._strategy

    def _clip_model(self, strategy: Strategy) -> None:
        """Reduce, then rescale the part of every q/k tensor of the model this rank holds."""
        factors = self._reduce()
        with torch.no_grad():
            for slot, factor in zip(self._slots, factors, strict=True):
                if factor is None:
                    continue
                for name, dim, blocks in slot.params:
                    param = slot.param(name)
                    for held in strategy.regions(param):
                        self._rescale(strategy.local(param), held, blocks, factor, dim=dim)

    def _clip_stand_ins(self, strategy: Strategy, stepped: list[Tensor]) -> None:
        """DeepSpeed ZeRO: rescale this rank's pieces of the q/k weights in the flat fp32 partitions just stepped.

        DeepSpeed calls ``step()`` once per param group (ZeRO-1/2) or sub-group (ZeRO-3), with
        only that partition in ``param_groups``: the maxima are reduced at the first call of a
        step (a call that steps a partition already stepped since the last reduce opens the next
        step), and each partition is rescaled right after its own update.
        """
        targets = self._targets()
        if self._round is None or any(id(p) in self._round.stepped for p in stepped):
            if self._round is not None:
                self._check_names(self._round, targets)
            self._round = _Round(self._reduce())
        factors = self._round.factors
        self._round.stepped.update(id(p) for p in stepped)
        with torch.no_grad():
            for flat in stepped:
                for held in strategy.regions(flat):
                    target = targets.get(held.name) if held.name is not None else None
                    if target is None:
                        continue
                    self._round.names.add(held.name)  # type: ignore[arg-type]
                    index, dim, blocks = target
                    factor = factors[index]
                    if factor is not None:
                        self._rescale(strategy.local(flat), held, blocks, factor, dim=dim)

    def _targets(self) -> dict[str, Target]:
        """Model param name -> where its q/k rows are."""
        return {
            f"{slot.name}.{name}" if slot.name else name: (i, dim, blocks)
            for i, slot in enumerate(self._slots)
            for name, dim, blocks in slot.params
        }

    def _check_names(self, done: _Round, targets: dict[str, Target]) -> None:
        """Once, after the first step: the partitions stood for every q/k weight (each lists all of its params)."""
        if self._checked:
            return
        missing = sorted(set(targets) - done.names)
        if missing:
            raise RuntimeError(
                f"QKClip: DeepSpeed's partitions hold no param named {missing[0]!r} ({len(missing)} missing; "
                "found at the end of the first step, which left them unclipped): build the QKClip on the model "
                "given to deepspeed.initialize (not the engine), and train the q/k weights"
            )
        self._checked = True

    def _rescale(
        self, local: Tensor, held: Held, blocks: list[HeadRows], factor: tuple[Tensor, Tensor], *, dim: int
    ) -> None:
        """Multiply the part ``held`` of ``local`` by the factors of its indices along ``dim`` of the whole tensor."""
        region = held.region
        if not region.numel:
            return
        scale = qk_row_scale(blocks, held.shape[dim], *factor, alpha=self.alpha)
        part = held.part_of(local)
        if isinstance(region, Span):  # flattened elements: each its own factor
            scale_rows_(part, flat_scale(scale, held.shape, dim=dim, start=region.start, length=region.numel), dim=0)
        else:
            runs = region.runs[dim]
            mine = torch.cat([scale[a:b] for a, b in runs]) if len(runs) > 1 else scale[runs[0][0] : runs[0][1]]
            scale_rows_(part, mine, dim=dim)

    # ------------------------------------------------------------------ the reduce

    def _group(self) -> Any:
        """The group the maxima are reduced over (a ProcessGroup, or None: the default group)."""
        return group_of(self.process_group)

    def _collectives(self) -> Collectives | None:
        """Counted collectives over :meth:`_group`; None where it has one rank (nothing to reduce)."""
        if self._comm is None:
            group = self._group()
            if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) <= 1:
                return None
            self._comm = Collectives(group, self.stats)
        return self._comm

    def _maxima(self, slot: Slot, device: torch.device | None) -> Tensor:
        if slot.maxima is None:
            return torch.full((slot.layout.num_heads,), -math.inf, device=device)
        return slot.maxima.detach().to(device=device or slot.maxima.device, dtype=torch.float32)

    def _reduce(self) -> Factors:
        """All-reduce (MAX) the maxima, reset them, record them; per layer the factors, None where nothing clips."""
        comm = self._collectives()
        if comm is not None:  # where the backend reduces: the CPU for gloo, the current GPU for NCCL
            device = flag_device(comm.group)
        else:
            device = self._slots[0].param(self._slots[0].params[0][0]).device
        joined = torch.cat([self._maxima(s, device) for s in self._slots])
        if comm is not None:
            comm.all_reduce(joined, op=dist.ReduceOp.MAX)
        for slot in self._slots:
            slot.maxima = None
        sizes = [s.layout.num_heads for s in self._slots]
        per_layer = joined.split(sizes)
        hot = torch.isfinite(joined) & (joined > self.threshold)
        seen = joined != -math.inf
        flags, observed = torch.stack(
            [torch.stack([h.any() for h in hot.split(sizes)]), torch.stack([o.any() for o in seen.split(sizes)])]
        ).tolist()  # the one host sync of a step
        self._warn_unseen([s.name for s, o in zip(self._slots, observed, strict=True) if not o])
        self.last_max_logits = {s.name: m.cpu() for s, m in zip(self._slots, per_layer, strict=True)}
        self.last_clipped_heads = int(hot.sum())
        bad = int((~torch.isfinite(joined) & (joined != -math.inf)).sum())
        if bad:
            logger.warning("QKClip: %d heads had a non-finite max logit this step; left unclipped", bad)
        return [
            qk_clip_factors(m, threshold=self.threshold, num_kv_heads=s.layout.num_kv_heads) if flag else None
            for s, m, flag in zip(self._slots, per_layer, flags, strict=True)
        ]

    def _warn_unseen(self, unseen: list[str]) -> None:
        """Say once (until it changes) which layers no training-mode forward reached since the last step."""
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

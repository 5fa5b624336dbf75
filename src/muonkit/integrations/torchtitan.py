"""torchtitan (0.3) with muonkit: :class:`muonkit.HybridMuon` as torchtitan's optimizer container.

torchtitan builds its optimizers from a hard-coded table (Adam, AdamW, DistMuon) and routes
params by regex only. :class:`HybridMuonContainer` is an ``OptimizersContainer`` whose config
builds one HybridMuon per model part, routed by :func:`muonkit.param_groups` (hidden matrices to
Muon; embeddings, heads, norms, biases, routers to AdamW)::

    from muonkit.integrations.torchtitan import HybridMuonContainer

    config.optimizer = HybridMuonContainer.Config(lr=0.02, adamw_lr=3e-4, weight_decay=0.01)
    # torchtitan's Trainer then calls config.optimizer.build(model_parts=model_parts)

Everything else is torchtitan's contract, inherited unchanged: ``step`` / ``zero_grad`` over
the parts, the flat FQN-keyed ``state_dict`` its checkpointer saves with DCP (param names are
cleaned with torchtitan's ``canonical_fqn``, so activation-checkpoint and compile wrappers do not
change the keys), and ``LRSchedulersContainer``, whose ``LambdaLR`` scales each group from its own
lr (Muon's and AdamW's stay apart). Under FSDP2 (``fully_shard``) the params are DTensors and
HybridMuon takes its sharded path.

Not silently ignored: torchtitan's ``param_groups`` (muonkit routes by structure: give
``rules=[(pattern, "muon" | "adamw"), ...]``), ``optimizer_factory_kwargs_by_name``, and an
``implementation`` other than ``"foreach"`` (torchtitan adds ``fused`` / ``foreach`` keys to every
group of its own optimizers; HybridMuon batches its math by shape, foreach-style, and has no fused
kernel) raise ``ValueError``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import Any

from torch import nn

from muonkit.defaults import Defaults, with_default_fields
from muonkit.optimizer import NONFINITE_CHOICES, HybridMuon
from muonkit.param_groups import no_decay_on_vectors, param_groups

try:
    from torchtitan.components.checkpointer.utils import canonical_fqn
    from torchtitan.components.optimizer import OptimizersContainer
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "muonkit's torchtitan integration needs torchtitan: pip install torchtitan (the integrations extra; in a clone of muonkit: pip install -e '.[integrations]')"
    ) from e

__all__ = ["HybridMuonContainer"]

logger = logging.getLogger(__name__)

_ROUTING = ("layout", "split_sizes")
"""HybridMuon keywords that are not config fields: routing decides them per tensor (``rules``, ``split_qkv``)."""


class HybridMuonContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` holding one :class:`muonkit.HybridMuon` per model part."""

    @dataclass(kw_only=True, slots=True)
    @with_default_fields(leave_out=_ROUTING)
    class Config(OptimizersContainer.Config):
        """HybridMuon's settings: a field per keyword of :class:`muonkit.HybridMuon` (its defaults
        for every group: :class:`muonkit.defaults.Defaults`' fields, added by
        :func:`~muonkit.defaults.with_default_fields`) but the routing's ``layout`` and
        ``split_sizes``, then how :func:`muonkit.param_groups` routes the model. ``lr``,
        ``adamw_lr``, ``weight_decay`` and ``adamw_weight_decay`` are also set in the groups."""

        no_decay_on_vectors: bool = True
        """AdamW weight decay on >= 2D tensors only (norms, biases: none)."""
        rules: list[tuple[str, str]] = field(default_factory=list)
        """Routing overrides, checked first: ``(regex on the param name, "muon" | "adamw")``."""
        split_qkv: bool = False
        per_head: bool = False
        """Attention projections as per-head matrices (:func:`muonkit.param_groups`' ``per_head``)."""
        heads: int | None = None
        """With ``per_head``: the head count where the model's config does not say (``heads=``)."""
        head_dim: int | None = None
        """With ``per_head``: the head size where the model's config does not say (``head_dim=``)."""
        muon_algorithm: str = "muon"
        """The hidden matrices' algorithm: ``"muon"`` or another update rule (:data:`muonkit.functional.rules.RULES`)."""
        muon_options: dict[str, Any] = field(default_factory=dict)
        """Other Muon group keys, set in the groups."""
        adamw_options: dict[str, Any] = field(default_factory=dict)
        """Other AdamW group keys, set in the groups (``betas``, ``eps``)."""
        implementation: str = "foreach"
        """Only ``"foreach"``: HybridMuon batches its math by shape and has no fused kernel."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        _check_config(config)
        self.optimizers: list[HybridMuon] = []
        self.model_parts = model_parts
        all_params: list[nn.Parameter] = []
        for part_idx, model in enumerate(model_parts):
            optimizer = HybridMuon(_groups(model, config), **_keywords(config))
            self.optimizers.append(optimizer)
            for group in optimizer.param_groups:
                all_params.extend(group["params"])
                logger.info(
                    "HybridMuon (model_part=%d): %d params on %s, lr %s",
                    part_idx, len(group["params"]), group["algorithm"], group["lr"],
                )  # fmt: skip
        self._validate_params(all_params)
        self._post_init(all_params)


def _keywords(config: HybridMuonContainer.Config) -> dict[str, Any]:
    """HybridMuon's keywords: the config's fields that are."""
    return {f.name: getattr(config, f.name) for f in fields(Defaults) if f.name not in _ROUTING}


def _groups(model: nn.Module, config: HybridMuonContainer.Config) -> list[dict[str, Any]]:
    # lr and weight decay are set in the groups too, so that no_decay_on_vectors keeps a group with
    # weight decay 0 whole (the groups, and checkpoints, as before the keywords became fields)
    keywords = _keywords(config)
    groups = param_groups(
        model, lr=keywords["lr"], adamw_lr=keywords["adamw_lr"], weight_decay=keywords["weight_decay"],
        adamw_weight_decay=keywords["adamw_weight_decay"], rules=[(str(p), str(a)) for p, a in config.rules] or None,
        split_qkv=config.split_qkv, per_head=config.per_head, heads=config.heads, head_dim=config.head_dim,
        muon_algorithm=config.muon_algorithm, muon_options=config.muon_options,
        adamw_options=config.adamw_options,
    )  # fmt: skip
    if config.no_decay_on_vectors:
        groups = no_decay_on_vectors(groups)
    for group in groups:  # the FQNs torchtitan's checkpointer keys optimizer state by
        group["param_names"] = [canonical_fqn(n) for n in group["param_names"]]
    return groups


def _check_config(config: HybridMuonContainer.Config) -> None:
    if config.param_groups:
        raise ValueError(
            f"HybridMuonContainer.Config has param_groups={config.param_groups!r}: muonkit routes params by model "
            "structure (muonkit.explain(model) shows where each goes); give overrides as "
            "rules=[(regex, 'muon' | 'adamw'), ...]"
        )
    if config.optimizer_factory_kwargs_by_name:
        raise ValueError(
            "HybridMuonContainer.Config has optimizer_factory_kwargs_by_name="
            f"{config.optimizer_factory_kwargs_by_name!r}: HybridMuon takes none; use muon_options / adamw_options"
        )
    if config.implementation != "foreach":
        raise ValueError(
            f"Invalid implementation={config.implementation!r} for HybridMuon: must be 'foreach' (it batches its "
            "math by shape and has no fused or for-loop variant; torch.optim's fused/foreach keys are not group "
            "keys of HybridMuon)"
        )
    nonfinite = _keywords(config)["nonfinite"]
    if nonfinite not in NONFINITE_CHOICES:
        raise ValueError(f"Invalid nonfinite={nonfinite!r}: must be one of {NONFINITE_CHOICES}")

"""Model -> HybridMuon param groups, and a printable explanation of the routing.

groups = muonkit.param_groups(model)
opt = muonkit.HybridMuon(groups, lr=0.02, adamw_lr=3e-4, weight_decay=0.01)
print(muonkit.explain(model))
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from muonkit.config import ADAMW_KEYS, MATRIX_ALGORITHMS, RULE_KEYS, check_group_keys
from muonkit.defaults import DEFAULTS
from muonkit.functional.quantize import STATE_DTYPES, block_count
from muonkit.routing import STATE_BYTES, Route, RuleLike, route


def param_groups(
    model: nn.Module,
    *,
    lr: float | None = None,
    adamw_lr: float | None = None,
    weight_decay: float | None = None,
    adamw_weight_decay: float | None = None,
    rules: Sequence[RuleLike] | Mapping[str, str] | None = None,
    split_qkv: bool = False,
    per_head: bool = False,
    heads: int | None = None,
    head_dim: int | None = None,
    muon_algorithm: str = "muon",
    muon_options: Mapping[str, Any] | None = None,
    adamw_options: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Param groups for :class:`muonkit.HybridMuon`, routed by model structure.

    One group per (algorithm, layout, split). A group carries what routing decides (``algorithm``,
    ``layout``, ``split_sizes``, ``param_names``) and only the hyperparameters passed here: Muon
    groups ``lr`` and ``weight_decay``, AdamW groups ``adamw_lr`` and ``adamw_weight_decay`` (as
    ``lr`` and ``weight_decay``), and ``muon_options`` / ``adamw_options`` (any other group key:
    ``adjust_lr``, ``ns_steps``... / ``betas``, ``eps``; an unknown key is an error). Everything
    else comes from the optimizer's defaults, so
    ``HybridMuon(param_groups(model), lr=0.05, adamw_lr=1e-3)`` trains at 0.05 and 1e-3.
    See :mod:`muonkit.routing` for the rules; ``rules`` are checked first.

    ``muon_algorithm``: the algorithm of the matrix groups, ``"muon"`` or another update rule of
    :data:`muonkit.functional.rules.RULES` (routed exactly like Muon; the rule's own keys, such as
    its ``beta2`` and ``eps``, go in ``muon_options``): see ``docs/`` for each rule.

    ``per_head``: each attention projection a batch of per-head matrices (Q, K, V rows by head,
    the output projection's columns by head, MLA's per-head blocks; :mod:`muonkit.per_head`), its
    lr shape scale that of a head's matrix; ``heads`` / ``head_dim`` override the head count and
    size read from the model. ``explain(model, per_head=True)`` shows each split.
    """
    if muon_algorithm not in MATRIX_ALGORITHMS:
        raise ValueError(f"Invalid muon_algorithm={muon_algorithm!r}: must be one of {MATRIX_ALGORITHMS}")
    allowed = RULE_KEYS[muon_algorithm]
    check_group_keys(muon_options or {}, " in muon_options", allowed=allowed, algorithm=muon_algorithm)
    check_group_keys(adamw_options or {}, " in adamw_options", allowed=ADAMW_KEYS, algorithm="adamw")
    warn_adamw_sized_lr(lr, adamw_lr=adamw_lr, muon_options=muon_options)
    # The options win: muon_options={"weight_decay": 0.1} must not clash with the keyword.
    options = {
        "muon": {**_given(lr=lr, weight_decay=weight_decay), **(muon_options or {})},
        "adamw": {**_given(lr=adamw_lr, weight_decay=adamw_weight_decay), **(adamw_options or {})},
    }
    routes = route(model, rules=rules, split_qkv=split_qkv, per_head=per_head, heads=heads, head_dim=head_dim)
    named = dict(model.named_parameters())
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in routes:
        key = (r.algorithm, r.layout, r.split_sizes, r.split_along)
        if key not in groups:
            routed = _routed(r) | ({"algorithm": muon_algorithm} if r.algorithm == "muon" else {})
            groups[key] = {"params": [], "param_names": [], **routed, **options[r.algorithm]}
        groups[key]["params"].append(named[r.name])
        groups[key]["param_names"].append(r.name)
    return list(groups.values())


ADAMW_SIZED_LR = 1e-3
"""A Muon lr at or below this (with Muon's own lr scaling) is an AdamW lr given to Muon by habit."""


def warn_adamw_sized_lr(lr: float | None, *, adamw_lr: float | None, muon_options: Mapping[str, Any] | None) -> None:
    """``param_groups(model, lr=3e-4)``, as one writes for AdamW: ``lr`` is the Muon groups' lr only.

    Warned where the intent is clear: ``lr`` given at an AdamW size, ``adamw_lr`` not given (so the
    caller did not tell the two apart), and no ``adjust_lr`` in ``muon_options`` (with
    ``"match_adamw"``, Moonlight's scaling, Muon takes AdamW's lr on purpose).
    """
    if lr is None or adamw_lr is not None or "adjust_lr" in (muon_options or {}):
        return
    if not isinstance(lr, (int, float)) or not 0 < lr <= ADAMW_SIZED_LR:
        return
    warnings.warn(
        f"param_groups(model, lr={lr!r}): lr= is the Muon groups' lr, and {lr!r} is an AdamW-sized lr (Muon's "
        f"default is {DEFAULTS.lr} with adjust_lr={DEFAULTS.adjust_lr!r}): Muon would take tiny steps. The AdamW "
        f"groups take adamw_lr= (default {DEFAULTS.adamw_lr}). Pass param_groups(model, adamw_lr={lr!r}) and leave lr "
        f"to Muon's default, or muon_options={{'adjust_lr': 'match_adamw'}} to give Muon AdamW's lr on purpose "
        "(Moonlight's scaling); either silences this warning",
        UserWarning,
        stacklevel=3,  # the caller of param_groups
    )


def _given(**hyperparameters: Any) -> dict[str, Any]:
    return {k: v for k, v in hyperparameters.items() if v is not None}


def _routed(r: Route) -> dict[str, Any]:
    """The group keys routing decides for ``r``."""
    if r.algorithm == "muon":
        along = {"split_along": r.split_along} if r.split_along != "rows" else {}  # rows: the groups' default
        return {"algorithm": "muon", "layout": r.layout, "split_sizes": r.split_sizes, **along}
    return {"algorithm": r.algorithm}


def no_decay_on_vectors(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Split each AdamW group into its >= 2D tensors and its vectors, the vectors with ``weight_decay=0``.

    What ``torch.optim.AdamW`` recipes (nanoGPT, the HF Trainer) do: decay embeddings and heads,
    never biases and norm gains. The >= 2D part keeps the group's weight decay, or the optimizer's
    ``adamw_weight_decay`` when the group has none; a group with ``weight_decay=0`` stays whole.
    """
    out = []
    for g in groups:
        if g["algorithm"] != "adamw" or g.get("weight_decay", None) == 0:
            out.append(g)
            continue
        pairs = list(zip(g["params"], g["param_names"], strict=True))
        for matrices in (True, False):
            chosen = [(p, n) for p, n in pairs if (p.ndim >= 2) == matrices]
            if chosen:
                part = {**g, "params": [p for p, _ in chosen], "param_names": [n for _, n in chosen]}
                out.append(part if matrices else {**part, "weight_decay": 0.0})
    return out


@dataclass(frozen=True)
class RoutingReport:
    """The routing of a model: one row per tensor, plus totals. ``str()`` renders a table."""

    routes: tuple[Route, ...]

    def numel(self, algorithm: str) -> int:
        """How many parameters (elements) go to ``algorithm``."""
        return sum(r.numel for r in self.routes if r.algorithm == algorithm)

    def names(self, algorithm: str) -> list[str]:
        """The names of the tensors that go to ``algorithm``."""
        return [r.name for r in self.routes if r.algorithm == algorithm]

    @property
    def total_params(self) -> int:
        return sum(r.numel for r in self.routes)

    @property
    def muon_fraction(self) -> float:
        """f: the share of parameters on Muon."""
        return self.numel("muon") / self.total_params if self.total_params else 0.0

    @property
    def hybrid_state_bytes(self) -> int:
        """Optimizer-state bytes under HybridMuon (fp32: 4 B/param on Muon, 8 B/param on AdamW)."""
        return sum(r.numel * STATE_BYTES[r.algorithm] for r in self.routes)

    @property
    def adamw_state_bytes(self) -> int:
        """Optimizer-state bytes if every parameter were on AdamW (8 B/param)."""
        return self.total_params * STATE_BYTES["adamw"]

    def state_bytes(self, state_dtype: str = "fp32") -> int:
        """Optimizer-state bytes under HybridMuon with every group's ``state_dtype`` (one or two
        states per tensor, :mod:`muonkit.state_precision`): fp32 4 B per value, bf16 2 B, 8-bit 1 B
        plus one fp32 scale per block of 256 along each row (counted on the whole tensor; a shard's
        blocks start at its own row starts). Step counters are not counted."""
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"Invalid state_dtype={state_dtype!r}: must be one of {STATE_DTYPES}")
        total = 0
        for r in self.routes:
            states = STATE_BYTES[r.algorithm] // 4  # fp32 bytes per param / 4: how many states it keeps
            if state_dtype == "8bit":
                rows = math.prod(r.shape[:-1]) if r.shape else 1
                per_state = r.numel + 4 * rows * block_count(r.shape[-1] if r.shape else 1)
            else:
                per_state = r.numel * (2 if state_dtype == "bf16" else 4)
            total += states * per_state
        return total

    def to_dict(self) -> dict[str, Any]:
        return {
            "tensors": [
                {
                    "name": r.name,
                    "shape": list(r.shape),
                    "algorithm": r.algorithm,
                    "reason": r.reason,
                    "layout": r.layout,
                }
                for r in self.routes
            ],
            "params": {"muon": self.numel("muon"), "adamw": self.numel("adamw"), "total": self.total_params},
            "muon_fraction": self.muon_fraction,
            "state_bytes": {"hybrid_muon": self.hybrid_state_bytes, "adamw": self.adamw_state_bytes},
            "hybrid_state_bytes_by_state_dtype": {d: self.state_bytes(d) for d in STATE_DTYPES},
        }

    def __str__(self) -> str:
        rows = [("name", "shape", "algorithm", "reason")]
        rows += [(r.name, "x".join(map(str, r.shape)) or "scalar", r.algorithm, r.reason) for r in self.routes]
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row[:3], widths, strict=True)) + "  " + row[3] for row in rows]
        lines.insert(1, "-" * len(lines[0]))
        saving = 1 - self.hybrid_state_bytes / self.adamw_state_bytes if self.adamw_state_bytes else 0.0
        lines += [
            "",
            f"params on Muon:  {self.numel('muon'):>14,}",
            f"params on AdamW: {self.numel('adamw'):>14,}",
            f"Muon fraction f: {self.muon_fraction:>14.3f}",
            f"optimizer state: HybridMuon {_gib(self.hybrid_state_bytes)} vs AdamW {_gib(self.adamw_state_bytes)}"
            f" ({saving:.1%} less; f/2 = {self.muon_fraction / 2:.1%})",
            "state_dtype:     "
            + ", ".join(
                f"{d} {_gib(self.state_bytes(d))} ({self.state_bytes(d) / max(self.adamw_state_bytes, 1):.1%} of AdamW's)"
                for d in STATE_DTYPES
            ),
        ]
        return "\n".join(lines)


def explain(
    model: nn.Module,
    *,
    rules: Sequence[RuleLike] | Mapping[str, str] | None = None,
    split_qkv: bool = False,
    per_head: bool = False,
    heads: int | None = None,
    head_dim: int | None = None,
) -> RoutingReport:
    """Where each tensor of ``model`` goes (name, shape, algorithm, reason) and the totals;
    ``per_head`` (see :func:`param_groups`) adds each split to the reason: ``per head: 12 x (64, 768)``."""
    routes = route(model, rules=rules, split_qkv=split_qkv, per_head=per_head, heads=heads, head_dim=head_dim)
    return RoutingReport(tuple(routes))


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"

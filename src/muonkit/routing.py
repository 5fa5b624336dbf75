"""Hybrid routing: which tensors of a model get Muon and which get AdamW, and why.

Muon is for the 2D hidden matrices of attention and MLP blocks (and conv filters, and each
expert of a fused MoE tensor). Everything else goes to AdamW. The built-in rules are
:data:`BUILT_IN_RULES`, checked in that order by :func:`route` (first match wins, after the
user's ``rules``); the docs' table of them (docs/routing.md) is generated from it (``python -m muonkit._doc_tables``).
Tied heads share the embedding's tensor and are caught by rule 1.

PEFT LoRA factors (the ``nn.Linear`` weights of ``*.lora_A.*``, r x in, and ``*.lora_B.*``, out x r)
are routed by rule 5 with their own reason: both go to Muon. ``muonkit bench lora`` (BENCHMARKS.md)
measured the three choices: at muonkit's default Muon lr, Muon on both beat AdamW on both at the
usual LoRA lrs (1e-3, 3e-3) and tied with AdamW at 1e-2 (the best of the three AdamW lrs tried,
not significantly different); Muon on B with A on AdamW was never better. So Muon on both works
without tuning an AdamW lr for the adapters (under the HF Trainer, AdamW groups take
``learning_rate``). :func:`lora_rules` gives the other two as rule presets.

A user rule is ``(pattern, algorithm)`` or a :class:`Rule`; patterns are Python regular
expressions searched in the parameter's full name (``re.search``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from muonkit.distributed.base import full_shape
from muonkit.functional.matrices import LAYOUT_KINDS, MatrixLayout
from muonkit.per_head import describe, head_splits

_HEAD_NAMES = {"lm_head", "head", "classifier", "score", "qa_outputs", "output", "output_layer"}
_ROUTER_NAMES = {"gate", "router"}
_FUSED_QKV_NAMES = {"c_attn", "qkv", "qkv_proj", "wqkv", "query_key_value", "in_proj"}
STATE_BYTES = {"muon": 4, "adamw": 8}
ROUTED: tuple[str, ...] = ("muon", "adamw")
"""What a rule routes to; the matrices' update rule is ``param_groups(muon_algorithm=...)``'s."""
"""Optimizer-state bytes per parameter: one fp32 momentum for Muon, two fp32 moments for AdamW."""


BUILT_IN_RULES: tuple[tuple[str, str, str], ...] = (
    ("weight of an embedding module (`nn.Embedding`, `*Embedding(s)`), including a tied LM head", "adamw", ""),
    (
        "output head: `model.get_output_embeddings()`, or a module named `lm_head`, `head`, `classifier`, `score`, "
        "`qa_outputs`, `output`, `output_layer`",
        "adamw",
        "",
    ),
    ("fewer than 2 dims: norms, biases, scalars, gains", "adamw", ""),
    ("MoE router (`*.gate`, `*.router` or inside one, `*Router`: 2D but small, out = number of experts)", "adamw", ""),
    ("`nn.Linear` weight", "muon", "`matrix` (out, in)"),
    ("transformers `Conv1D` weight (GPT-2), stored (in, out)", "muon", "`transposed`"),
    ("`nn.MultiheadAttention` `in_proj_weight` (fused QKV) and `q/k/v_proj_weight`", "muon", "`matrix`"),
    ("`nn.Conv1d/2d/3d` weight (out, in, k...)", "muon", "`flatten`: one (out, in·k...) matrix"),
    (
        "3D tensor of an experts module (`*Experts`, `experts`; transformers 5.x fused MoE)",
        "muon",
        "`experts`: each expert its own matrix",
    ),
    ("anything else (raw `nn.Parameter`s, positional tables, RNN weights)", "adamw", ""),
)
"""The built-in rules, in the order :func:`route` checks them: ``(tensor, algorithm, layout)``
(Markdown: docs/routing.md's table of the built-in rules is rendered from it)."""


@dataclass(frozen=True)
class Rule:
    """Send every parameter whose name matches ``pattern`` (``re.search``) to ``algorithm``."""

    pattern: str
    algorithm: str
    layout: str = "auto"
    split_sizes: tuple[int, ...] | None = None
    reason: str = ""
    split_along: str = "rows"
    """``"cols"``: ``split_sizes`` cuts the matrices' columns (a per-head output projection)."""

    def __post_init__(self) -> None:
        if self.algorithm not in ROUTED:
            raise ValueError(f"Invalid algorithm={self.algorithm!r} in rule {self.pattern!r}: must be one of {ROUTED}")
        if self.layout not in LAYOUT_KINDS:
            raise ValueError(f"Invalid layout={self.layout!r} in rule {self.pattern!r}: must be one of {LAYOUT_KINDS}")
        MatrixLayout(self.layout, self.split_sizes, self.split_along)  # type: ignore[arg-type]  # raises on a bad split
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ValueError(f"Invalid rule pattern {self.pattern!r}: {e}") from None


@dataclass(frozen=True)
class Route:
    """Where one parameter goes, and why."""

    name: str
    shape: tuple[int, ...]
    algorithm: str
    reason: str
    layout: str = "auto"
    split_sizes: tuple[int, ...] | None = None
    split_along: str = "rows"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


RuleLike = Rule | tuple[str, str]


LORA_ROUTINGS: tuple[str, ...] = ("muon", "b_muon", "adamw")
"""Where PEFT LoRA factors can go: both on Muon, ``lora_B`` on Muon and ``lora_A`` on AdamW, both on AdamW."""
_LORA_A, _LORA_B = r"\.lora_A\.", r"\.lora_B\."
LORA_DEFAULT = "muon"
"""Where both LoRA factors go without a preset (why: the module docstring)."""


def lora_rules(routing: str) -> tuple[Rule, ...]:
    """Rules that route PEFT LoRA factors (``*.lora_A.*``, ``*.lora_B.*``) as ``routing`` says.

    ``"muon"``: both factors on Muon; ``"b_muon"``: ``lora_B`` (out x r) on Muon, ``lora_A``
    (r x in) on AdamW; ``"adamw"``: both on AdamW. Pass them first:
    ``muonkit.param_groups(peft_model, rules=muonkit.lora_rules("adamw"))``. What the default
    does without them, and why, is in the module docstring (``muonkit bench lora`` measures it).
    """
    if routing not in LORA_ROUTINGS:
        raise ValueError(f"Invalid LoRA routing={routing!r}: must be one of {LORA_ROUTINGS}")
    a = "muon" if routing == "muon" else "adamw"
    b = "adamw" if routing == "adamw" else "muon"
    reason = f"LoRA factor (lora_rules({routing!r}))"
    return (Rule(_LORA_A, a, reason=reason), Rule(_LORA_B, b, reason=reason))


def route(
    model: nn.Module,
    *,
    rules: Sequence[RuleLike] | Mapping[str, str] | None = None,
    split_qkv: bool = False,
    per_head: bool = False,
    heads: int | None = None,
    head_dim: int | None = None,
) -> list[Route]:
    """The route of every trainable parameter of ``model``, in ``named_parameters`` order.

    ``per_head``: attention projections routed to Muon as matrices split by head
    (:mod:`muonkit.per_head`; ``heads`` / ``head_dim`` override what the model says); a tensor a
    user rule matched keeps the rule's layout.
    """
    if not per_head and (heads is not None or head_dim is not None):
        raise ValueError(f"heads={heads!r} / head_dim={head_dim!r} are per-head settings: pass per_head=True")
    user_rules = _as_rules(rules)
    output_heads = _output_head_ids(model)
    owners = _owning_modules(model)
    config = getattr(model, "config", None)
    splits = head_splits(model, heads=heads, head_dim=head_dim) if per_head else {}
    routes = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        module_name, module = owners[name]
        r = _route_one(name, p, module_name, module, user_rules, output_heads, split_qkv, config)
        split = splits.get(name)
        if split is not None and r.algorithm == "muon" and not any(re.search(u.pattern, name) for u in user_rules):
            reason = r.reason.split(", fused QKV split", 1)[0] + ", " + describe(split, r.shape, r.layout)
            r = Route(name, r.shape, "muon", reason, r.layout, split.split_sizes, split.split_along)
        routes.append(r)
    return routes


def _route_one(
    name: str,
    p: torch.Tensor,
    module_name: str,
    module: nn.Module,
    user_rules: list[Rule],
    heads: set[int],
    split_qkv: bool,
    config: Any,
) -> Route:
    shape = full_shape(p)  # ZeRO-3 partitions keep their layer's shape in ds_shape
    for rule in user_rules:
        if re.search(rule.pattern, name):
            return Route(
                name,
                shape,
                rule.algorithm,
                rule.reason or f"rule {rule.pattern!r}",
                rule.layout,
                rule.split_sizes,
                rule.split_along,
            )
    leaf = module_name.rsplit(".", 1)[-1].lower()
    cls = type(module).__name__
    # BUILT_IN_RULES, in order
    if isinstance(module, nn.Embedding) or cls.endswith("Embedding") or cls.endswith("Embeddings"):  # 1
        return Route(name, shape, "adamw", "embedding (tied with the output head)" if id(p) in heads else "embedding")
    if id(p) in heads or leaf in _HEAD_NAMES:  # 2
        return Route(name, shape, "adamw", "output head")
    if len(shape) < 2:  # 3
        return Route(name, shape, "adamw", _vector_reason(name, module))
    # DBRX-style routers wrap their Linear (ffn.router.layer): any ancestor named router counts.
    if leaf in _ROUTER_NAMES or "Router" in cls or "router" in module_name.lower().split("."):  # 4
        return Route(name, shape, "adamw", "MoE router")
    if isinstance(module, nn.Linear) and len(shape) == 2:  # 5
        factor = _lora_factor(module_name)
        if factor is not None:
            return Route(name, shape, LORA_DEFAULT, f"PEFT LoRA {factor} (default LoRA routing: lora_rules)", "matrix")
        return _matrix_route(name, shape, "matrix", "hidden Linear", leaf, split_qkv, config)
    if cls == "Conv1D" and len(shape) == 2:  # 6
        return _matrix_route(name, shape, "transposed", "GPT-2 Conv1D (stored in x out)", leaf, split_qkv, config)
    if isinstance(module, nn.MultiheadAttention) and len(shape) == 2:  # 7
        # Its projections are raw Parameters of the attention module, not Linear submodules.
        pname = name.rsplit(".", 1)[-1]
        fused = "in_proj" if pname == "in_proj_weight" else leaf
        return _matrix_route(name, shape, "matrix", f"nn.MultiheadAttention {pname}", fused, split_qkv, None)
    if isinstance(module, nn.modules.conv._ConvNd):  # 8
        return Route(name, shape, "muon", "conv filter as (out, in*k)", "flatten")
    if len(shape) == 3 and ("Experts" in cls or "experts" in name.split(".")):  # 9
        return Route(name, shape, "muon", "MoE experts (each expert its own matrix)", "experts")
    return Route(name, shape, "adamw", "not a weight of a known matrix module (add a rule to use Muon)")  # 10


def _matrix_route(
    name: str, shape: tuple[int, ...], layout: str, reason: str, leaf: str, split_qkv: bool, config: Any
) -> Route:
    if split_qkv and leaf in _FUSED_QKV_NAMES:
        rows = shape[1] if layout == "transposed" else shape[0]
        sizes = qkv_split_sizes(rows, config)
        if sizes is not None:
            return Route(name, shape, "muon", f"{reason}, fused QKV split {list(sizes)}", layout, sizes)
    return Route(name, shape, "muon", reason, layout)


def qkv_split_sizes(rows: int, config: Any = None) -> tuple[int, ...] | None:
    """Row blocks (Q, K, V) of a fused projection with ``rows`` output rows.

    Uses the model config's head counts (grouped-query attention) when it has them, else
    equal thirds. Returns None when the rows cannot be split that way.
    """
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    hidden = getattr(config, "hidden_size", None)
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if hidden and heads else None)
    if heads and kv_heads and head_dim:
        q, kv = heads * head_dim, kv_heads * head_dim
        if q + 2 * kv == rows:
            return (q, kv, kv)
    if rows % 3 == 0:
        return (rows // 3,) * 3
    return None


def _lora_factor(module_name: str) -> str | None:
    """``"lora_A (r x in)"`` / ``"lora_B (out x r)"`` for PEFT's factor Linears (``*.lora_A.<adapter>``)."""
    parts = module_name.split(".")
    if "lora_A" in parts:
        return "lora_A (r x in)"
    if "lora_B" in parts:
        return "lora_B (out x r)"
    return None


def _vector_reason(name: str, module: nn.Module) -> str:
    cls = type(module).__name__
    if "Norm" in cls:
        return "norm"
    if name.endswith("bias"):
        return "bias"
    return "scalar or vector (< 2 dims)"


def _as_rules(rules: Sequence[RuleLike] | Mapping[str, str] | None) -> list[Rule]:
    if rules is None:
        return []
    items: Iterable[Any] = rules.items() if isinstance(rules, Mapping) else rules
    out = []
    for item in items:
        if isinstance(item, Rule):
            out.append(item)
        elif isinstance(item, tuple) and len(item) == 2:
            out.append(Rule(str(item[0]), str(item[1])))
        else:
            raise ValueError(f"Invalid rule {item!r}: must be a muonkit.Rule or a (pattern, algorithm) pair")
    return out


def _output_head_ids(model: nn.Module) -> set[int]:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return {id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set()


def _owning_modules(model: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    """Full parameter name -> (module name, module that registers it), first registration wins."""
    owners: dict[str, tuple[str, nn.Module]] = {}
    for module_name, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{pname}" if module_name else pname
            owners.setdefault(full, (module_name, module))
    return owners

"""The Muon matrices of a model, as the plan simulator needs them: shapes, layouts, layers, tensor parallelism.

A :class:`ModelShapes` lists every matrix the default routing (:func:`muonkit.routing.route`)
sends to Muon, with its transformer block (for pipeline stages) and the tensor dim tensor
parallelism shards (from the model's ``base_model_tp_plan``: ``colwise`` shards the out features,
``rowwise`` the in features), plus the parameter counts the cost model needs.

Two sources:

- :func:`bundled`: GPT-2 (124M), Llama-70B-like, Kimi-K2-like and DeepSeek-V3-like, computed from
  their public ``config.json`` values with the same names, shapes and layouts transformers and the
  routing give (a test checks that on small versions); no transformers needed.
- :func:`from_config`: any Hugging Face ``config.json`` (or its folder): transformers builds the
  model on the meta device (no memory, no weights) and the routing reads it, as ``muonkit inspect``
  does.

Example::

    >>> k2 = bundled("kimi-k2")
    >>> k2.matrices[-2].name, k2.matrices[-2].shape, k2.experts
    ('model.layers.60.mlp.shared_experts.up_proj.weight', (2048, 7168), 384)
"""

from __future__ import annotations

import fnmatch
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BUNDLED", "Matrix", "ModelShapes", "bundled", "from_config", "load"]


@dataclass(frozen=True)
class Matrix:
    """One Muon param."""

    name: str
    shape: tuple[int, ...]
    layout: str
    """``"matrix"``, ``"transposed"`` (GPT-2 Conv1D), ``"experts"`` (a stack) or ``"flatten"``."""
    split_sizes: tuple[int, ...] | None = None
    layer: int | None = None
    """Its transformer block (None: outside the blocks, on the first pipeline stage)."""
    tp_dim: int | None = None
    """The tensor dim tensor parallelism shards (None: left whole by the TP plan)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ModelShapes:
    """A model's Muon matrices and its parameter counts."""

    name: str
    matrices: tuple[Matrix, ...]
    params: int
    """Every parameter (Muon, AdamW)."""
    active: int
    """Parameters each token passes through (the input embedding left out, routed experts
    counted at top-k / experts): training costs about ``6 * active`` FLOPs per token."""
    layers: int
    experts: int = 0
    """Routed experts per MoE layer (0: dense)."""

    @property
    def muon_numel(self) -> int:
        return sum(m.numel for m in self.matrices)


GPT2 = {
    "model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024,
}  # fmt: skip
LLAMA_70B = {
    "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
}  # fmt: skip
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "first_k_dense_replace": 3, "n_routed_experts": 256, "num_experts_per_tok": 8,
    "n_shared_experts": 1, "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280,
    "n_group": 8, "topk_group": 4, "tie_word_embeddings": False,
}  # fmt: skip
KIMI_K2 = {
    **DEEPSEEK_V3, "first_k_dense_replace": 1, "n_routed_experts": 384, "num_attention_heads": 64,
    "num_key_value_heads": 64, "vocab_size": 163840, "n_group": 1, "topk_group": 1,
}  # fmt: skip
GPT2_TP_PLAN = {"h.*.attn.c_attn": "colwise", "h.*.attn.c_proj": "rowwise", "h.*.mlp.c_fc": "colwise",
                "h.*.mlp.c_proj": "rowwise"}  # fmt: skip
"""Megatron's split of GPT-2 (transformers ships no TP plan for it)."""
LLAMA_TP_PLAN = {
    "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
}  # fmt: skip
DEEPSEEK_TP_PLAN = {
    "layers.*.mlp.experts.gate_up_proj": "packed_colwise", "layers.*.mlp.experts.down_proj": "rowwise",
    "layers.*.mlp.shared_experts.gate_proj": "colwise", "layers.*.mlp.shared_experts.up_proj": "colwise",
    "layers.*.mlp.shared_experts.down_proj": "rowwise", "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
}  # fmt: skip
"""transformers 5's ``base_model_tp_plan`` of these models (attention left whole under DeepSeek-V3's)."""

BUNDLED: dict[str, tuple[str, dict[str, Any], dict[str, str]]] = {
    "gpt2": ("GPT-2 (124M)", GPT2, GPT2_TP_PLAN),
    "llama-70b": ("Llama-70B-like (Llama 3 70B config)", LLAMA_70B, LLAMA_TP_PLAN),
    "kimi-k2": ("Kimi-K2-like (384 experts, 61 layers)", KIMI_K2, DEEPSEEK_TP_PLAN),
    "deepseek-v3": ("DeepSeek-V3-like (256 experts, 61 layers)", DEEPSEEK_V3, DEEPSEEK_TP_PLAN),
}
"""Name -> (title, public config.json values, TP plan)."""


def load(model: str) -> ModelShapes:
    """A bundled name (:data:`BUNDLED`) or a path to a Hugging Face ``config.json`` or its folder."""
    if model in BUNDLED:
        return bundled(model)
    if os.path.exists(model):
        return from_config(model)
    raise ValueError(
        f"Invalid model={model!r}: must be one of {sorted(BUNDLED)} or a path to a Hugging Face config.json (or folder)"
    )


def bundled(name: str) -> ModelShapes:
    """A bundled model's shapes, from its config values alone."""
    if name not in BUNDLED:
        raise ValueError(f"Invalid bundled model {name!r}: must be one of {sorted(BUNDLED)}")
    title, config, plan = BUNDLED[name]
    return shapes_of(title, config, plan)


def shapes_of(title: str, config: Mapping[str, Any], plan: Mapping[str, str]) -> ModelShapes:
    """The shapes of a GPT-2, Llama or DeepSeek-V3 config (the families bundled), without transformers."""
    kind = config["model_type"]
    build = {"gpt2": _gpt2, "llama": _llama, "deepseek_v3": _deepseek_v3}.get(kind)
    if build is None:
        raise ValueError(f"No built-in shapes for model_type={kind!r}: pass its config.json (needs transformers)")
    matrices, others = build(config)
    listed = tuple(Matrix(n, s, lay, None, layer, tp_dim(n, lay, plan)) for n, s, lay, layer in matrices)
    return _counted(title, listed, others, config)


def _counted(
    title: str, matrices: tuple[Matrix, ...], others: Mapping[str, int], config: Mapping[str, Any]
) -> ModelShapes:
    """Parameter counts: ``others`` the non-Muon params by kind (``embedding``, ``head``, ``rest``)."""
    experts = int(config.get("n_routed_experts") or config.get("num_local_experts") or config.get("num_experts") or 0)
    top_k = int(config.get("num_experts_per_tok") or 0)
    routed = sum(m.numel for m in matrices if m.layout == "experts")
    params = sum(m.numel for m in matrices) + sum(others.values())
    idle = routed - (routed * top_k // experts if experts else routed)
    active = params - others.get("embedding", 0) - idle
    layers = int(config.get("num_hidden_layers") or config.get("n_layer") or 0)
    return ModelShapes(title, matrices, params, active, layers, experts)


def tp_dim(name: str, layout: str, plan: Mapping[str, str]) -> int | None:
    """The tensor dim the TP plan shards for param ``name`` (``colwise``: out features, ``rowwise``: in features)."""
    module = re.sub(r"^(model|transformer)\.", "", name.rsplit(".", 1)[0] if name.endswith((".weight",)) else name)
    style = next((s for pattern, s in plan.items() if fnmatch.fnmatchcase(module, pattern)), None)
    if style is None or not ("colwise" in style or "rowwise" in style):
        return None
    out_dim = {"matrix": 0, "transposed": 1, "experts": 1, "flatten": 0}[layout]
    in_dim = {"matrix": 1, "transposed": 0, "experts": 2, "flatten": 1}[layout]
    return out_dim if "colwise" in style else in_dim


Listed = tuple[list[tuple[str, tuple[int, ...], str, int | None]], dict[str, int]]


def _gpt2(c: Mapping[str, Any]) -> Listed:
    h, layers = c["n_embd"], c["n_layer"]
    inner = c.get("n_inner") or 4 * h
    out: list[tuple[str, tuple[int, ...], str, int | None]] = []
    for i in range(layers):
        p = f"transformer.h.{i}."
        out += [
            (p + "attn.c_attn.weight", (h, 3 * h), "transposed", i),
            (p + "attn.c_proj.weight", (h, h), "transposed", i),
            (p + "mlp.c_fc.weight", (h, inner), "transposed", i),
            (p + "mlp.c_proj.weight", (inner, h), "transposed", i),
        ]
    rest = layers * (4 * h + 3 * h + h + inner + h) + 2 * h  # norms and biases, the final norm
    return out, {"embedding": c["vocab_size"] * h + c["n_positions"] * h, "rest": rest}


def _llama(c: Mapping[str, Any]) -> Listed:
    h, heads, layers, inner = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"], c["intermediate_size"]
    kv = c.get("num_key_value_heads") or heads
    hd = c.get("head_dim") or h // heads
    out: list[tuple[str, tuple[int, ...], str, int | None]] = []
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (heads * hd, h), "matrix", i),
            (p + "self_attn.k_proj.weight", (kv * hd, h), "matrix", i),
            (p + "self_attn.v_proj.weight", (kv * hd, h), "matrix", i),
            (p + "self_attn.o_proj.weight", (h, heads * hd), "matrix", i),
            *_mlp(p + "mlp.", h, inner, i),
        ]
    return out, _embeddings(c, h) | {"rest": layers * 2 * h + h}


def _mlp(prefix: str, h: int, inner: int, layer: int) -> list[tuple[str, tuple[int, ...], str, int | None]]:
    return [
        (prefix + "gate_proj.weight", (inner, h), "matrix", layer),
        (prefix + "up_proj.weight", (inner, h), "matrix", layer),
        (prefix + "down_proj.weight", (h, inner), "matrix", layer),
    ]


def _deepseek_v3(c: Mapping[str, Any]) -> Listed:
    h, heads, layers = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]
    nope, rope, v, kv_rank, q_rank = (
        c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"], c.get("q_lora_rank"),
    )  # fmt: skip
    experts, moe = c["n_routed_experts"], c["moe_intermediate_size"]
    shared = moe * c.get("n_shared_experts", 1)
    out: list[tuple[str, tuple[int, ...], str, int | None]] = []
    norms = h
    for i in range(layers):
        p = f"model.layers.{i}."
        if q_rank:
            out += [(p + "self_attn.q_a_proj.weight", (q_rank, h), "matrix", i)]
            out += [(p + "self_attn.q_b_proj.weight", (heads * (nope + rope), q_rank), "matrix", i)]
            norms += q_rank
        else:
            out += [(p + "self_attn.q_proj.weight", (heads * (nope + rope), h), "matrix", i)]
        out += [
            (p + "self_attn.kv_a_proj_with_mqa.weight", (kv_rank + rope, h), "matrix", i),
            (p + "self_attn.kv_b_proj.weight", (heads * (nope + v), kv_rank), "matrix", i),
            (p + "self_attn.o_proj.weight", (h, heads * v), "matrix", i),
        ]
        norms += kv_rank + 2 * h
        if i < c.get("first_k_dense_replace", 0):
            out += _mlp(p + "mlp.", h, c["intermediate_size"], i)
            continue
        out += [
            (p + "mlp.experts.gate_up_proj", (experts, 2 * moe, h), "experts", i),
            (p + "mlp.experts.down_proj", (experts, h, moe), "experts", i),
            *_mlp(p + "mlp.shared_experts.", h, shared, i),
        ]
        norms += experts * h  # the router (AdamW; its score-correction bias is a buffer)
    return out, _embeddings(c, h) | {"rest": norms}


def _embeddings(c: Mapping[str, Any], h: int) -> dict[str, int]:
    vocab = c["vocab_size"]
    return {"embedding": vocab * h, "head": 0 if c.get("tie_word_embeddings", True) else vocab * h}


def from_config(path: str | os.PathLike[str]) -> ModelShapes:
    """A Hugging Face ``config.json`` (or its folder): transformers builds the model on the meta device."""
    from muonkit.integrations.transformers import model_from_config
    from muonkit.routing import route

    model = model_from_config(path)
    hf_config: Any = getattr(model, "config", None)
    config = hf_config.to_dict() if hf_config is not None else {}
    plan = dict(getattr(hf_config, "base_model_tp_plan", None) or {})
    matrices = tuple(
        Matrix(r.name, r.shape, r.layout if r.layout != "auto" else _auto(r.shape), r.split_sizes,
               _layer(r.name), tp_dim(r.name, r.layout if r.layout != "auto" else _auto(r.shape), plan))
        for r in route(model)
        if r.algorithm == "muon"
    )  # fmt: skip
    kinds = {"embedding": 0, "rest": 0}
    embeddings = {
        id(m.weight)
        for m in model.modules()
        if type(m).__name__.endswith("Embedding") and isinstance(getattr(m, "weight", None), torch.Tensor)
    }  # not rotary embeddings: no weight
    muon = {m.name for m in matrices}
    for name, p in model.named_parameters():  # a tied weight once
        if name not in muon:
            kinds["embedding" if id(p) in embeddings else "rest"] += p.numel()
    name = os.path.basename(os.path.normpath(path))
    if name == "config.json":  # a checkpoint folder's config: name it by the folder
        name = os.path.basename(os.path.dirname(os.path.abspath(path))) or name
    return _counted(name, matrices, kinds, config)


def _auto(shape: tuple[int, ...]) -> str:
    return "matrix" if len(shape) == 2 else "experts" if len(shape) == 3 else "flatten"


def _layer(name: str) -> int | None:
    """The transformer block of a param name (``...layers.3...``, ``...h.3...``, ``...blocks.3...``)."""
    found = re.search(r"\.(?:layers|h|blocks|layer)\.(\d+)\.", f".{name}")
    return int(found.group(1)) if found else None

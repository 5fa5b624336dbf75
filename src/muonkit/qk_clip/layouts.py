"""Which modules of a model QK-Clip observes, and where their query and key rows live (:class:`QKLayout`).

:func:`find_attention` takes every module with a ``qk_clip_layout()`` method (hand-written
attention, see :func:`muonkit.qk_clip.observed_attention`) and every transformers self-attention
module :func:`transformers_layout` can read. The transformers layouts are read from the module's
own attributes, so every model built on the same attention shape is covered, whatever its class
is called:

===========================  =============================================================
attributes                   layout (H query heads, K key heads, head size d)
===========================  =============================================================
``q_proj``, ``k_proj``       Llama, Qwen2, Mistral, Mixtral, ...: rows ``h*d..`` of each
``c_attn`` (``Conv1D``)      GPT-2: weight stored ``(in, 3Hd)``, q then k *columns*
``query_key_value``          GPT-NeoX: per head ``[q | k | v]`` interleaved rows
``qkv_proj``                 Phi-3: q rows ``0..Hd``, then k rows ``Hd..Hd+Kd``
``kv_b_proj``                DeepSeek-V3 MLA: ``q_b_proj``/``q_proj`` rows per head
                             ``[nope | rope]``, ``kv_b_proj`` rows per head ``[k_nope | v]``
===========================  =============================================================

Biases of q and k are listed beside their weights. A module with ``q_norm``/``k_norm`` is refused:
the norm after the projection undoes any rescale of its rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from muonkit.functional.qk_clip import HeadRows, QKLayout

__all__ = ["Found", "find_attention", "transformers_layout"]


@dataclass(frozen=True)
class Found:
    """An attention module QK-Clip can observe: its name in the model, its layout, and whether it is
    observed through transformers' attention interface (else it calls ``observed_attention`` itself)."""

    name: str
    module: nn.Module
    layout: QKLayout
    via_transformers: bool


def find_attention(model: nn.Module) -> list[Found]:
    """Every module of ``model`` with a ``qk_clip_layout()`` method or a transformers self-attention layout.

    Raises ``TypeError`` for a ``qk_clip_layout()`` that returns no :class:`QKLayout`, ``ValueError``
    for transformers attention it cannot clip (see :func:`transformers_layout`).
    """
    found = []
    for name, module in model.named_modules():
        declared = getattr(module, "qk_clip_layout", None)
        if callable(declared):
            layout = declared()
            if not isinstance(layout, QKLayout):
                raise TypeError(f"QKClip: {name}.qk_clip_layout() returned {type(layout).__name__}, must be a QKLayout")
            found.append(Found(name, module, layout, False))
        elif (layout := transformers_layout(module)) is not None:
            found.append(Found(name, module, layout, True))
    return found


def transformers_layout(module: nn.Module) -> QKLayout | None:
    """The layout of a transformers self-attention module, None for any other module."""
    config = getattr(module, "config", None)
    if config is None or not type(module).__module__.startswith("transformers.models."):
        return None
    if getattr(module, "is_cross_attention", False):
        return None
    reader = _reader(module)
    if reader is None:
        return None
    for norm in ("q_norm", "k_norm", "q_layernorm", "k_layernorm"):
        if isinstance(getattr(module, norm, None), nn.Module):
            raise ValueError(
                f"QKClip cannot clip {type(module).__name__}: it normalizes q/k after the projection ({norm}), "
                "which undoes a rescale of the projection rows; QK-norm models need no QK-Clip"
            )
    return reader(module, config)


def _reader(module: nn.Module) -> Any:
    if isinstance(getattr(module, "kv_b_proj", None), nn.Linear):
        return _mla
    if isinstance(getattr(module, "q_proj", None), nn.Linear) and isinstance(
        getattr(module, "k_proj", None), nn.Linear
    ):
        return _separate
    if hasattr(module, "c_attn") and type(module.c_attn).__name__ == "Conv1D":
        return _gpt2
    if isinstance(getattr(module, "query_key_value", None), nn.Linear):
        return _neox
    if isinstance(getattr(module, "qkv_proj", None), nn.Linear):
        return _phi3
    return None


def _heads(config: Any) -> tuple[int, int]:
    heads = int(config.num_attention_heads)
    return heads, int(getattr(config, "num_key_value_heads", None) or heads)


def _with_bias(module: nn.Module, blocks: list[HeadRows]) -> tuple[HeadRows, ...]:
    """Each weight block, and the same block on the layer's bias when it has one (always dim 0)."""
    out = list(blocks)
    for b in blocks:
        layer = module.get_submodule(b.param.rsplit(".", 1)[0])
        if getattr(layer, "bias", None) is not None:
            out.append(HeadRows(b.param.rsplit(".", 1)[0] + ".bias", b.part, b.count, b.width, b.offset, b.stride, 0))
    return tuple(out)


def _check(module: nn.Module, name: str, size: int, want: int) -> None:
    if size != want:
        raise ValueError(
            f"QKClip cannot read {type(module).__name__}: {name} has {size} output features, the config says {want}"
        )


def _separate(module: Any, config: Any) -> QKLayout:
    heads, kv = _heads(config)
    d = int(getattr(module, "head_dim", None) or module.q_proj.out_features // heads)
    _check(module, "q_proj", module.q_proj.out_features, heads * d)
    _check(module, "k_proj", module.k_proj.out_features, kv * d)
    blocks = [HeadRows("q_proj.weight", "query", heads, d), HeadRows("k_proj.weight", "key", kv, d)]
    return QKLayout(heads, kv, _with_bias(module, blocks))


def _gpt2(module: Any, config: Any) -> QKLayout:
    if getattr(module, "reorder_and_upcast_attn", False):
        raise ValueError(
            "QKClip cannot observe GPT-2 with reorder_and_upcast_attn=True: that path bypasses the attention "
            "interface; build the model with reorder_and_upcast_attn=False"
        )
    heads, d = int(module.num_heads), int(module.head_dim)
    hidden = heads * d
    _check(module, "c_attn", module.c_attn.weight.shape[1], 3 * hidden)
    blocks = [
        HeadRows("c_attn.weight", "query", heads, d, dim=1),
        HeadRows("c_attn.weight", "key", heads, d, hidden, dim=1),
    ]
    return QKLayout(heads, heads, _with_bias(module, blocks))


def _neox(module: Any, config: Any) -> QKLayout:
    heads = int(config.num_attention_heads)
    d = int(module.head_size)
    _check(module, "query_key_value", module.query_key_value.out_features, 3 * heads * d)
    blocks = [
        HeadRows("query_key_value.weight", "query", heads, d, 0, 3 * d),
        HeadRows("query_key_value.weight", "key", heads, d, d, 3 * d),
    ]
    return QKLayout(heads, heads, _with_bias(module, blocks))


def _phi3(module: Any, config: Any) -> QKLayout:
    heads, kv = _heads(config)
    d = int(module.head_dim)
    _check(module, "qkv_proj", module.qkv_proj.out_features, (heads + 2 * kv) * d)
    blocks = [HeadRows("qkv_proj.weight", "query", heads, d), HeadRows("qkv_proj.weight", "key", kv, d, heads * d)]
    return QKLayout(heads, kv, _with_bias(module, blocks))


def _mla(module: Any, config: Any) -> QKLayout:
    heads = int(config.num_attention_heads)
    nope, rope, v = int(module.qk_nope_head_dim), int(module.qk_rope_head_dim), int(module.v_head_dim)
    q_name = "q_b_proj" if isinstance(getattr(module, "q_b_proj", None), nn.Linear) else "q_proj"
    _check(module, q_name, getattr(module, q_name).out_features, heads * (nope + rope))
    _check(module, "kv_b_proj", module.kv_b_proj.out_features, heads * (nope + v))
    blocks = [
        HeadRows(f"{q_name}.weight", "query", heads, nope, 0, nope + rope),
        HeadRows(f"{q_name}.weight", "query_rope", heads, rope, nope, nope + rope),
        HeadRows("kv_b_proj.weight", "key", heads, nope, 0, nope + v),
    ]
    return QKLayout(heads, heads, _with_bias(module, blocks))

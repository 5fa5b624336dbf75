"""Per-head Muon: which attention projections of a model split by head, and how (:func:`head_splits`).

Per-head Muon (Kimi K3's "Per-Head Muon", GLM-5's "Muon Split", modded-nanogpt's paired heads)
orthogonalizes each attention head's block of a projection as its own matrix instead of the whole
projection. A split is a :class:`~muonkit.functional.MatrixLayout`'s ``split_sizes`` (with
``split_along``), read here from the modules of the model:

==============================================  ==========================================================
attention module (its children)                 blocks, each its own matrix (``d``: the head size)
==============================================  ==========================================================
``q_proj``/``k_proj``/``v_proj`` (``query``...)  rows: ``d`` each, ``H`` of Q, ``K`` of K and V (GQA)
fused ``c_attn``, ``qkv_proj``, ``query_key_``   rows: ``d`` each, ``H + 2K`` of them (Q, K, V heads, in
``value``, ``wqkv``, ``in_proj``                  any order: every block is ``d`` rows)
``o_proj``, ``out_proj``, ``c_proj``, ``dense``  columns: ``d`` each, ``H`` of them (each head's inputs)
MLA ``q_b_proj`` (or ``q_proj``), ``kv_b_proj``  rows per head ``nope + rope``; ``kv_b_proj`` rows per head
                                                 ``nope`` (K) then ``v`` (V); ``o_proj`` columns ``v`` each
``nn.MultiheadAttention``                       ``in_proj_weight`` (or ``q/k/v_proj_weight``) rows,
                                                 ``out_proj`` columns
==============================================  ==========================================================

Low-rank MLA ``*_a_proj`` and everything else stay whole. The head size comes from ``head_dim=``,
else the module's ``head_dim``/``head_size``, else the output projection's columns (or Q's rows)
divided by the head count: ``heads=``, else the module's ``num_heads``/``n_head``/``n_heads``/
``num_attention_heads``, else its (or the model's) config ``num_attention_heads``: the same
config keys QK-Clip reads (:mod:`muonkit.qk_clip.layouts`). A module it cannot size is an error
naming it and the keywords that fix it.

Example::

    >>> splits = head_splits(transformers.GPT2LMHeadModel(GPT2Config(n_embd=64, n_head=4)))
    >>> splits["transformer.h.0.attn.c_proj.weight"]
    HeadSplit(split_sizes=(16, 16, 16, 16), split_along='cols')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from muonkit.distributed.base import full_shape
from muonkit.functional.matrices import MatrixLayout

__all__ = ["HeadSplit", "describe", "head_splits"]

_FUSED = ("c_attn", "qkv_proj", "query_key_value", "wqkv", "qkv", "in_proj")
_Q, _K, _V = ("q_proj", "query", "wq"), ("k_proj", "key", "wk"), ("v_proj", "value", "wv")
_OUT = ("o_proj", "out_proj", "c_proj", "dense", "wo")
_HEAD_COUNTS = ("num_heads", "n_head", "n_heads", "num_attention_heads")
_HEAD_SIZES = ("head_dim", "head_size")


@dataclass(frozen=True)
class HeadSplit:
    """How one projection weight splits by head: ``split_sizes`` along the matrix's ``split_along``."""

    split_sizes: tuple[int, ...]
    split_along: str = "rows"


def head_splits(model: nn.Module, *, heads: int | None = None, head_dim: int | None = None) -> dict[str, HeadSplit]:
    """Each attention projection weight of ``model`` (full parameter name) and its per-head split.

    ``heads`` / ``head_dim``: the head count and size for every attention module, overriding what
    the modules and the config say (MLA modules take only ``heads``: their per-head sizes are the
    module's ``qk_nope_head_dim``, ``qk_rope_head_dim`` and ``v_head_dim``). Raises ``ValueError``
    naming the module where the head size cannot be known or does not divide a projection.
    """
    for key, value in (("heads", heads), ("head_dim", head_dim)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"Invalid {key}={value!r}: must be None or a positive int")
    config = getattr(model, "config", None)
    splits: dict[str, HeadSplit] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        for pname, split in _module_splits(name, module, heads, head_dim, config).items():
            splits[prefix + pname] = split
    return splits


def describe(split: HeadSplit, shape: tuple[int, ...], layout: str) -> str:
    """``"per head: 12 x (64, 768)"``: the blocks of a weight of ``shape``, by block shape."""
    blocks = MatrixLayout(layout, split.split_sizes, split.split_along).blocks(shape)  # type: ignore[arg-type]
    counts: dict[tuple[int, int], int] = {}
    for b in blocks:
        counts[b.rows, b.cols] = counts.get((b.rows, b.cols), 0) + b.count
    return "per head: " + " + ".join(f"{n} x ({r}, {c})" for (r, c), n in counts.items())


def _module_splits(
    name: str, module: nn.Module, heads: int | None, head_dim: int | None, config: Any
) -> dict[str, HeadSplit]:
    """The splits of one module's own projections (names relative to it), ``{}`` if it is no attention."""
    if isinstance(module, nn.MultiheadAttention):
        return _multihead(name, module, heads, head_dim)
    children = {n: c for n, c in module.named_children() if _matrix(c) is not None}
    config = getattr(module, "config", None) or config
    if "kv_b_proj" in children:
        return _mla(name, module, children, heads, config)
    fused = next((n for n in _FUSED if n in children), None)
    qkv = [next((n for n in names if n in children), None) for names in (_Q, _K, _V)]
    if fused is None and None in qkv:
        return {}
    out = next((n for n in _OUT if n in children), None)
    rows = [fused] if fused is not None else [n for n in qkv if n is not None]
    d = _head_dim(name, module, children, heads, head_dim, config, fused=fused, q=qkv[0], out=out)
    splits = {f"{n}.weight": _even(name, n, _matrix(children[n])[0], d, "rows") for n in rows}  # type: ignore[index]
    if out is not None:
        splits[f"{out}.weight"] = _even(name, out, _matrix(children[out])[1], d, "cols")  # type: ignore[index]
    return splits


def _matrix(module: nn.Module) -> tuple[int, int] | None:
    """``(rows, cols)`` of a Linear's or a transformers Conv1D's weight as a matrix (out, in); else None."""
    weight = getattr(module, "weight", None)
    if weight is None or len(full_shape(weight)) != 2:
        return None
    shape = full_shape(weight)
    if isinstance(module, nn.Linear):
        return shape[0], shape[1]
    if type(module).__name__ == "Conv1D":  # stored (in, out)
        return shape[1], shape[0]
    return None


def _count(module: nn.Module, config: Any, heads: int | None) -> int | None:
    if heads is not None:
        return heads
    for attr in _HEAD_COUNTS:
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    value = getattr(config, "num_attention_heads", None)
    return value if isinstance(value, int) and value > 0 else None


def _head_dim(
    name: str,
    module: nn.Module,
    children: dict[str, nn.Module],
    heads: int | None,
    head_dim: int | None,
    config: Any,
    *,
    fused: str | None,
    q: str | None,
    out: str | None,
) -> int:
    if head_dim is not None:
        return head_dim
    if heads is None:
        for attr in _HEAD_SIZES:
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    count = _count(module, config, heads)
    if count is not None:
        if out is not None:
            width = _matrix(children[out])[1]  # type: ignore[index]
        elif q is not None:
            width = _matrix(children[q])[0]  # type: ignore[index]
        else:
            width = None
        if width is not None and width % count == 0:
            return width // count
    raise ValueError(
        f"per_head: cannot tell the head size of attention module {name!r} ({type(module).__name__}): "
        f"it has no {'/'.join(_HEAD_SIZES)} or head count ({'/'.join(_HEAD_COUNTS)}) attribute the projections "
        "divide by, and no config num_attention_heads; pass heads= or head_dim="
    )


def _even(module: str, child: str, size: int, d: int, along: str) -> HeadSplit:
    if size % d:
        raise ValueError(
            f"per_head: {module}.{child} has {size} {along}, not a multiple of the head size {d}; "
            "pass the right heads= or head_dim="
        )
    return HeadSplit((d,) * (size // d), along)


def _mla(
    name: str, module: nn.Module, children: dict[str, nn.Module], heads: int | None, config: Any
) -> dict[str, HeadSplit]:
    count = _count(module, config, heads)
    dims = [getattr(module, a, None) for a in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")]
    sizes_ok = all(isinstance(v, int) and v > 0 for v in dims)
    if count is None or not sizes_ok:
        raise ValueError(
            f"per_head: cannot read the MLA heads of {name!r} ({type(module).__name__}): it needs a head count "
            "(heads=, or num_heads / config num_attention_heads) and qk_nope_head_dim, qk_rope_head_dim, v_head_dim"
        )
    nope, rope, v = (int(x) for x in dims)  # type: ignore[arg-type]  # checked above
    want = {"q_b_proj": (0, nope + rope), "q_proj": (0, nope + rope), "kv_b_proj": (0, nope + v), "o_proj": (1, v)}
    splits = {}
    for child, (dim, per_head) in want.items():
        if child not in children:
            continue
        size = _matrix(children[child])[dim]  # type: ignore[index]
        if size != count * per_head:
            raise ValueError(
                f"per_head: {name}.{child} has {size} {('rows', 'cols')[dim]}, {count} heads of {per_head} need "
                f"{count * per_head}; pass the right heads="
            )
        sizes = (nope, v) * count if child == "kv_b_proj" else (per_head,) * count
        splits[f"{child}.weight"] = HeadSplit(sizes, ("rows", "cols")[dim])
    return splits


def _multihead(
    name: str, module: nn.MultiheadAttention, heads: int | None, head_dim: int | None
) -> dict[str, HeadSplit]:
    count = heads or module.num_heads
    d = head_dim or module.embed_dim // count
    splits = {}
    if module.in_proj_weight is not None:
        splits["in_proj_weight"] = _even(name, "in_proj_weight", full_shape(module.in_proj_weight)[0], d, "rows")
    for pname in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
        weight = getattr(module, pname, None)
        if weight is not None:
            splits[pname] = _even(name, pname, full_shape(weight)[0], d, "rows")
    splits["out_proj.weight"] = _even(name, "out_proj", full_shape(module.out_proj.weight)[1], d, "cols")
    return splits

"""Per-head Muon against the plain float64 reference (tests/reference.py), on hand-built attention shapes.

A per-head split is a :class:`~muonkit.functional.MatrixLayout`: Q, K, V (separate or fused, with
grouped-query attention: K and V have their own head count) cut into row blocks of ``head_dim``;
the output projection cut into column blocks of ``head_dim`` (``split_along="cols"``: each head's
input columns are its own matrix); MLA's ``q_b_proj`` by head and ``kv_b_proj`` by head into its
K and V parts. Each block is orthogonalized on its own and takes the lr shape scale of its own
shape, under every convention.

Tolerances: float64 params and Newton-Schulz, 1e-10 absolute on every weight and momentum after 6
steps (the same math in another order and batching, as tests/numerics/test_hybrid_muon.py).
Ill-conditioned (singular values 1 .. 1e-6) and low-rank (rank 1 per head, one head all zero)
gradients included: a zero head stays a zero direction on both sides.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import muonkit
import reference as ref
from muonkit.functional import MatrixBlock, MatrixLayout

F64 = torch.float64
STEPS = 6
D, HEADS, KV_HEADS, HD = 32, 4, 2, 8  # d_model, query heads, key/value heads, head dim
# MLA (DeepSeek-V3 style, tiny): q_lora_rank, kv_lora_rank, nope and rope dims of q/k, v dim
Q_LORA, KV_LORA, NOPE, ROPE, V_DIM = 12, 10, 6, 4, 5

# name: (shape, layout, split_sizes, split_along)
SHAPES: dict[str, tuple[tuple[int, ...], str, tuple[int, ...], str]] = {
    "q_proj": ((HEADS * HD, D), "matrix", (HD,) * HEADS, "rows"),
    "k_proj": ((KV_HEADS * HD, D), "matrix", (HD,) * KV_HEADS, "rows"),
    "v_proj": ((KV_HEADS * HD, D), "matrix", (HD,) * KV_HEADS, "rows"),
    "o_proj": ((D, HEADS * HD), "matrix", (HD,) * HEADS, "cols"),
    "qkv_proj (GQA)": (((HEADS + 2 * KV_HEADS) * HD, D), "matrix", (HD,) * (HEADS + 2 * KV_HEADS), "rows"),
    "c_attn (Conv1D)": ((D, 3 * HEADS * HD), "transposed", (HD,) * (3 * HEADS), "rows"),
    "c_proj (Conv1D)": ((HEADS * HD, D), "transposed", (HD,) * HEADS, "cols"),
    "q_b_proj (MLA)": ((HEADS * (NOPE + ROPE), Q_LORA), "matrix", (NOPE + ROPE,) * HEADS, "rows"),
    "kv_b_proj (MLA)": ((HEADS * (NOPE + V_DIM), KV_LORA), "matrix", (NOPE, V_DIM) * HEADS, "rows"),
    "o_proj (MLA)": ((D, HEADS * V_DIM), "matrix", (V_DIM,) * HEADS, "cols"),
}


def _gradient(shape: tuple[int, ...], layout: MatrixLayout, kind: str, step: int, k: int) -> torch.Tensor:
    """A gradient whose per-head blocks are random, ill-conditioned or low-rank (one block zero)."""
    g = torch.Generator().manual_seed(1000 * k + step)
    out = torch.randn(shape, generator=g, dtype=F64)
    if kind == "random":
        return out
    blocks = layout.to_matrices(out)  # views of ``out``'s storage, or of its transpose
    for i, block in enumerate(blocks):
        m = block[0]
        if kind == "low_rank":
            value = torch.zeros_like(m) if i == 1 else torch.outer(m[:, 0], m[0])
        else:  # ill-conditioned: singular values from 1 down to 1e-6
            u, _, vt = torch.linalg.svd(m, full_matrices=False)
            value = u @ torch.diag(torch.logspace(0, -6, u.size(1), dtype=F64)) @ vt
        m.copy_(value)
    whole = layout.from_matrices(blocks, shape)
    return whole


def _run(adjust_lr: str | None, kind: str, algorithm: str = "muon") -> tuple[dict, muonkit.HybridMuon, list]:
    init = {
        n: torch.randn(s, generator=torch.Generator().manual_seed(i), dtype=F64)
        for i, (n, (s, *_)) in enumerate(SHAPES.items())
    }
    params = {n: torch.nn.Parameter(init[n].clone()) for n in SHAPES}
    hp: dict[str, Any] = {"lr": 0.02, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1, "eps": 1e-7}
    hp |= {"adjust_lr": adjust_lr, "ns_coefficients": "polar_express", "ns_steps": None}
    groups = [
        {**hp, "params": [params[n]], "layout": layout, "split_sizes": split, "split_along": along}
        for n, (_, layout, split, along) in SHAPES.items()
    ]
    opt = muonkit.HybridMuon(groups, ns_dtype=F64)
    schedule, norm = ref.SCHEDULES["polar_express"]
    refs = [
        ref.RefParam(
            init[n].clone(),
            "muon",
            {
                **hp,
                "layout": layout,
                "split_sizes": split,
                "split_along": along,
                "schedule": schedule,
                "norm_factor": norm,
            },
        )
        for n, (_, layout, split, along) in SHAPES.items()
    ]
    reference = ref.ReferenceHybridMuon(refs)
    layouts = [MatrixLayout(layout, split, along) for _, layout, split, along in SHAPES.values()]
    for step in range(STEPS):
        grads = [
            _gradient(s, lay, kind, step, k)
            for k, ((s, *_), lay) in enumerate(zip(SHAPES.values(), layouts, strict=True))
        ]
        for p, g in zip(params.values(), grads, strict=True):
            p.grad = g.clone()
        opt.step()
        reference.step(grads)
    return params, opt, refs


@pytest.mark.parametrize("kind", ["random", "ill_conditioned", "low_rank"])
@pytest.mark.parametrize("adjust_lr", ["keller", "match_adamw", "spectral", None])
def test_per_head_matches_the_float64_reference(adjust_lr: str | None, kind: str) -> None:
    params, opt, refs = _run(adjust_lr, kind)
    for (name, p), rp in zip(params.items(), refs, strict=True):
        torch.testing.assert_close(p.detach(), rp.value, rtol=0, atol=1e-10, msg=name)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], rp.state["momentum_buffer"], rtol=0, atol=1e-10)


def test_each_head_takes_its_own_lr_scale() -> None:
    """The scale follows each block's shape: an output projection's head block (D, HD) is tall,
    a Q head (HD, D) is wide, so Keller's scale differs between them though the tensors are square."""
    from muonkit.functional.muon import tensor_scale

    like = torch.zeros((), dtype=F64)
    o = MatrixLayout("matrix", (HD,) * HEADS, "cols")
    q = MatrixLayout("matrix", (HD,) * HEADS)
    assert tensor_scale((D, HEADS * HD), o, "keller", like=like) == pytest.approx((D / HD) ** 0.5)
    assert tensor_scale((HEADS * HD, D), q, "keller", like=like) == 1.0
    assert tensor_scale((D, HEADS * HD), o, "match_adamw", like=like) == pytest.approx(0.2 * D**0.5)
    mla = MatrixLayout("matrix", (NOPE, V_DIM) * HEADS)  # K and V parts of a head: one scale per element
    scale = tensor_scale((HEADS * (NOPE + V_DIM), KV_LORA), mla, "spectral", like=like)
    assert isinstance(scale, torch.Tensor)
    assert scale[0, 0] == pytest.approx((NOPE / KV_LORA) ** 0.5) and scale[NOPE, 0] == pytest.approx(
        (V_DIM / KV_LORA) ** 0.5
    )
    assert scale[NOPE + V_DIM, 0] == scale[0, 0]


def test_column_split_blocks_and_round_trip() -> None:
    t = torch.arange(6 * 12, dtype=F64).reshape(6, 12)
    layout = MatrixLayout("matrix", (4, 4, 4), "cols")
    assert layout.blocks(t.shape) == [MatrixBlock(1, 6, 4)] * 3
    mats = layout.to_matrices(t)
    assert [tuple(m.shape) for m in mats] == [(1, 6, 4)] * 3
    assert torch.equal(mats[1][0], t[:, 4:8])
    assert torch.equal(layout.from_matrices(mats, t.shape), t)
    conv1d = MatrixLayout("transposed", (4, 4, 4), "cols")  # storage (in, out): the matrix's columns are its rows
    assert torch.equal(conv1d.to_matrices(t.T)[2][0], t[:, 8:])
    assert torch.equal(conv1d.from_matrices(conv1d.to_matrices(t.T), t.T.shape), t.T)


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (lambda: MatrixLayout("matrix", (4,), "diagonal"), "Invalid split_along='diagonal': must be one of"),
        (lambda: MatrixLayout("matrix", None, "cols"), "a column split needs split_sizes"),
        (lambda: MatrixLayout("matrix", (4, 4), "cols").blocks((8, 12)), "must sum to the 12 cols"),
    ],
)
def test_bad_column_splits_raise(layout: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        layout()


def test_bad_split_along_in_a_group_raises() -> None:
    w = torch.nn.Parameter(torch.randn(8, 8))
    w.grad = torch.randn(8, 8)
    with pytest.raises(ValueError, match="Invalid split_along='heads': must be one of"):
        muonkit.HybridMuon([{"params": [w], "split_sizes": (4, 4), "split_along": "heads"}]).step()


def test_heads_of_one_shape_are_orthogonalized_in_one_batched_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Q's 4 heads (HD, D) and O's 4 heads (D, HD) of two layers: two batched calls, not 16."""
    from muonkit.functional import muon as muon_module

    calls: list[tuple[int, ...]] = []
    real = muon_module.orthogonalize_resolved

    def spy(parts: list[torch.Tensor], **kwargs: Any) -> torch.Tensor:
        calls.append((sum(p.size(0) for p in parts), *parts[0].shape[1:]))
        return real(parts, **kwargs)

    monkeypatch.setattr(muon_module, "orthogonalize_resolved", spy)
    qs = [torch.nn.Parameter(torch.randn(HEADS * HD, D)) for _ in range(2)]
    os_ = [torch.nn.Parameter(torch.randn(D, HEADS * HD)) for _ in range(2)]
    opt = muonkit.HybridMuon(
        [
            {"params": qs, "split_sizes": (HD,) * HEADS},
            {"params": os_, "split_sizes": (HD,) * HEADS, "split_along": "cols"},
        ]
    )
    for p in qs + os_:
        p.grad = torch.randn_like(p)
    opt.step()
    assert sorted(calls) == sorted([(2 * HEADS, HD, D), (2 * HEADS, D, HD)])
    assert opt.strategy.stats.matrices == 4 * HEADS

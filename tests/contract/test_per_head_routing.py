"""Per-head routing (``param_groups(model, per_head=True)``) on tiny models built from transformers
configs (no download), ``nn.MultiheadAttention`` and a hand-written attention: each attention
projection's split is read from the model (GQA, MLA, fused QKV), ``heads=``/``head_dim=`` override
it, a model that does not say its heads is a clear error, and one float64 step of the routed
optimizer gives every per-head matrix its own orthogonalized, per-head-scaled direction
(tests/reference.py; 1e-10 absolute).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import muonkit
import reference as ref
from muonkit.per_head import HeadSplit, head_splits

transformers = pytest.importorskip("transformers", reason="the [hf] extra is part of `make test`'s install")

F64 = torch.float64


def _gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(n_embd=32, n_head=4, n_layer=1, vocab_size=97, n_positions=16)
    return transformers.GPT2LMHeadModel(cfg)


def _llama() -> nn.Module:  # 4 heads of 8, 2 KV heads
    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return transformers.LlamaForCausalLM(cfg)


def _deepseek_v3() -> nn.Module:  # MLA: 4 heads, nope 8, rope 4, v 6
    cfg = transformers.DeepseekV3Config(
        vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
    )  # fmt: skip
    return transformers.DeepseekV3ForCausalLM(cfg)


class HandAttention(nn.Module):
    """A nanoGPT-style attention: fused ``c_attn``, ``c_proj``; its head count only in ``n_head``."""

    def __init__(self, width: int = 32, n_head: int | None = 4) -> None:
        super().__init__()
        if n_head is not None:
            self.n_head = n_head
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)


def test_gpt2_fused_qkv_rows_and_output_columns_by_head() -> None:
    splits = head_splits(_gpt2())
    assert splits == {
        "transformer.h.0.attn.c_attn.weight": HeadSplit((8,) * 12, "rows"),
        "transformer.h.0.attn.c_proj.weight": HeadSplit((8,) * 4, "cols"),
    }  # the MLP's c_proj stays whole
    reasons = {r.name: r.reason for r in muonkit.explain(_gpt2(), per_head=True).routes}
    assert reasons["transformer.h.0.attn.c_attn.weight"].endswith("per head: 12 x (8, 32)")
    assert reasons["transformer.h.0.attn.c_proj.weight"].endswith("per head: 4 x (32, 8)")
    assert "per head" not in reasons["transformer.h.0.mlp.c_proj.weight"]


def test_llama_gqa_keys_and_values_have_their_own_head_count() -> None:
    splits = head_splits(_llama())
    attn = "model.layers.0.self_attn."
    assert splits == {
        attn + "q_proj.weight": HeadSplit((8,) * 4),
        attn + "k_proj.weight": HeadSplit((8,) * 2),
        attn + "v_proj.weight": HeadSplit((8,) * 2),
        attn + "o_proj.weight": HeadSplit((8,) * 4, "cols"),
    }


def test_mla_per_head_blocks_and_low_rank_projections_whole() -> None:
    splits = head_splits(_deepseek_v3())
    attn = "model.layers.0.self_attn."
    assert splits == {
        attn + "q_b_proj.weight": HeadSplit((12,) * 4),  # nope + rope per head
        attn + "kv_b_proj.weight": HeadSplit((8, 6) * 4),  # per head: K's nope rows, then V's
        attn + "o_proj.weight": HeadSplit((6,) * 4, "cols"),  # v_head_dim columns per head
    }
    reasons = {r.name: r.reason for r in muonkit.explain(_deepseek_v3(), per_head=True).routes}
    assert reasons[attn + "kv_b_proj.weight"].endswith("per head: 4 x (8, 16) + 4 x (6, 16)")
    assert "per head" not in reasons[attn + "q_a_proj.weight"]
    assert "per head" not in reasons[attn + "kv_a_proj_with_mqa.weight"]


def test_multihead_attention_in_proj_and_separate_kv_weights() -> None:
    fused = nn.MultiheadAttention(32, 4)
    assert head_splits(fused) == {
        "in_proj_weight": HeadSplit((8,) * 12),
        "out_proj.weight": HeadSplit((8,) * 4, "cols"),
    }
    separate = nn.MultiheadAttention(32, 4, kdim=12, vdim=20)
    assert head_splits(separate) == {
        "q_proj_weight": HeadSplit((8,) * 4),
        "k_proj_weight": HeadSplit((8,) * 4),
        "v_proj_weight": HeadSplit((8,) * 4),
        "out_proj.weight": HeadSplit((8,) * 4, "cols"),
    }


def test_heads_and_head_dim_override_and_unknown_heads_raise() -> None:
    assert head_splits(HandAttention())["c_proj.weight"] == HeadSplit((8,) * 4, "cols")  # from n_head
    assert head_splits(HandAttention(), heads=2)["c_attn.weight"] == HeadSplit((16,) * 6)
    assert head_splits(HandAttention(), head_dim=4)["c_proj.weight"] == HeadSplit((4,) * 8, "cols")
    assert head_splits(_llama(), heads=8)["model.layers.0.self_attn.k_proj.weight"] == HeadSplit((4,) * 4)
    with pytest.raises(
        ValueError, match=r"cannot tell the head size of attention module '' \(HandAttention\).*heads= or head_dim="
    ):
        head_splits(HandAttention(n_head=None))
    with pytest.raises(ValueError, match=r"c_attn has 96 rows, not a multiple of the head size 5"):
        head_splits(HandAttention(), head_dim=5)
    with pytest.raises(ValueError, match=r"Invalid heads=0: must be None or a positive int"):
        head_splits(HandAttention(), heads=0)
    with pytest.raises(ValueError, match=r"per-head settings: pass per_head=True"):
        muonkit.param_groups(HandAttention(), heads=4)


def test_a_user_rule_keeps_its_own_layout() -> None:
    groups = muonkit.param_groups(_llama(), per_head=True, rules=[muonkit.Rule(r"o_proj", "muon")])
    o = next(g for g in groups if any(n.endswith("o_proj.weight") for n in g["param_names"]))
    assert o["split_sizes"] is None and "split_along" not in o


@pytest.mark.parametrize("adjust_lr", ["keller", "match_adamw"])
@pytest.mark.parametrize("build", [_gpt2, _llama, _deepseek_v3], ids=["gpt2", "llama_gqa", "deepseek_v3_mla"])
def test_one_routed_step_matches_the_per_head_reference(build: Any, adjust_lr: str) -> None:
    torch.manual_seed(0)
    model = build().to(F64)
    groups = muonkit.param_groups(model, per_head=True, muon_options={"adjust_lr": adjust_lr, "ns_steps": None})
    opt = muonkit.HybridMuon(groups, lr=0.1, weight_decay=0.0, momentum=0.9, ns_dtype=F64)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    schedule, norm = ref.SCHEDULES["polar_express"]
    checked = 0
    for g in groups:
        if g["algorithm"] != "muon" or g["split_sizes"] is None:
            continue
        for name in g["param_names"]:
            u = 0.1 * grads[name] + 0.9 * (0.1 * grads[name])  # Nesterov from zero momentum
            d = ref.muon_direction(
                u, layout=g["layout"], split_sizes=g["split_sizes"], split_along=g.get("split_along", "rows"),
                schedule=schedule, norm_factor=norm, eps=1e-7, adjust_lr=adjust_lr,
            )  # fmt: skip
            after = dict(model.named_parameters())[name].detach()
            torch.testing.assert_close(after, before[name] - 0.1 * d, rtol=0, atol=1e-10, msg=name)
            checked += 1
    assert checked >= 2


def test_entry_points_pass_per_head_on() -> None:
    from muonkit.integrations.deepspeed_config import MuonkitOptions
    from muonkit.integrations.transformers import make_optimizer

    opt = make_optimizer(_llama(), per_head=True)
    along = {n: g.get("split_along", "rows") for g in opt.param_groups for n in g["param_names"]}
    assert along["model.layers.0.self_attn.o_proj.weight"] == "cols"
    options = MuonkitOptions.from_params({"per_head": True, "heads": 2})
    groups = muonkit.param_groups(HandAttention(), **options.param_groups_kwargs())
    assert {g.get("split_along", "rows"): g["split_sizes"] for g in groups if g["algorithm"] == "muon"} == {
        "rows": (16,) * 6,
        "cols": (16,) * 2,
    }

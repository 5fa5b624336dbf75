"""Routing on tiny randomly initialized Hugging Face models (built from configs, no download) and
a small conv net: every tensor lands where BRIEF section 2 says, user rules override (first match
wins), explain() totals match a hand count, and param_groups() trains with HybridMuon.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
from torch import nn

import muonkit
from muonkit.param_groups import no_decay_on_vectors
from muonkit.routing import Rule

transformers = pytest.importorskip("transformers", reason="the [hf] extra is part of `make test`'s install")

SMALL = {
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.conv = nn.Conv2d(8, 16, 3, padding=1, bias=False)
        self.hidden = nn.Linear(16, 32)
        self.head = nn.Linear(32, 10)
        self.pos = nn.Parameter(torch.zeros(4, 4))  # a raw 2D table: not a known matrix module
        self.temperature = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.norm(self.stem(x)))
        x = torch.relu(self.conv(x)) + self.pos.mean()
        return self.head(torch.relu(self.hidden(x.mean(dim=(2, 3))))) / self.temperature


class TopKRouter(nn.Module):  # owns its weight, like transformers' MixtralTopKRouter
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 16))


class ToyExperts(nn.Module):  # fused (experts, out, in) weights, like transformers 5.x
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(4, 32, 16))
        self.down = nn.Parameter(torch.randn(4, 16, 32))


class ToyMoE(nn.Module):
    """Routers found by class name (``select``) and by an ancestor named router (DBRX's ffn.router.layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.select = TopKRouter()
        self.router = nn.ModuleDict({"layer": nn.Linear(16, 4, bias=False)})
        self.moe = ToyExperts()
        self.proj = nn.Linear(16, 16)

    def forward(self) -> torch.Tensor:
        h = self.proj(torch.ones(2, 16))
        gates = torch.softmax(h @ self.select.weight.T + self.router["layer"](h), dim=-1)  # (batch, experts)
        y = torch.einsum("eoi,bi->ebo", self.moe.up, h).relu()
        y = torch.einsum("eoi,ebi->ebo", self.moe.down, y)
        return torch.einsum("be,ebo->bo", gates, y)


def _build(kind: str) -> nn.Module:
    t = transformers
    if kind == "gpt2":
        cfg = t.GPT2Config(
            vocab_size=97, n_embd=32, n_layer=1, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=0
        )
        return t.GPT2LMHeadModel(cfg)
    if kind == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(**SMALL))
    if kind == "qwen2":
        return t.Qwen2ForCausalLM(t.Qwen2Config(**SMALL, tie_word_embeddings=True))
    if kind == "mixtral":
        return t.MixtralForCausalLM(t.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2))
    if kind == "qwen3_moe":
        cfg = t.Qwen3MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, head_dim=8)
        return t.Qwen3MoeForCausalLM(cfg)
    if kind == "bert":
        cfg = t.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
        return t.BertForSequenceClassification(
            cfg.__class__(**{**cfg.to_dict(), "intermediate_size": 64, "num_labels": 3})
        )
    if kind == "torch_transformer":
        layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
        return nn.Sequential(nn.Embedding(97, 32), nn.TransformerEncoder(layer, 1), nn.Linear(32, 5))
    if kind == "toy_moe":
        return ToyMoE()
    assert kind == "convnet"
    return ConvNet()


# BRIEF section 2, written as (pattern, algorithm, layout) per model; first match wins.
ADAMW = ("adamw", "auto")
EXPECTED: dict[str, list[tuple[str, tuple[str, str]]]] = {
    "gpt2": [
        (r"\.(wte|wpe)\.weight$", ADAMW),  # embeddings (wte is also the tied LM head)
        (r"\.(c_attn|c_proj|c_fc)\.weight$", ("muon", "transposed")),  # Conv1D stored (in, out)
        (r"(ln_\d|ln_f)\.|\.bias$", ADAMW),
    ],
    "llama": [
        (r"embed_tokens|lm_head|norm\.weight$", ADAMW),
        (r"(q|k|v|o|gate|up|down)_proj\.weight$", ("muon", "matrix")),
    ],
    "qwen2": [
        (r"embed_tokens|norm\.weight$|\.bias$", ADAMW),
        (r"(q|k|v|o|gate|up|down)_proj\.weight$", ("muon", "matrix")),
    ],
    "mixtral": [
        (r"embed_tokens|lm_head|norm\.weight$", ADAMW),
        (r"\.mlp\.gate\.weight$", ADAMW),  # the MoE router
        (r"\.experts\.(gate_up_proj|down_proj)$", ("muon", "experts")),  # 3D: one matrix per expert
        (r"(q|k|v|o)_proj\.weight$", ("muon", "matrix")),
    ],
    "qwen3_moe": [
        (r"embed_tokens|lm_head|norm\.weight$", ADAMW),
        (r"\.mlp\.gate\.weight$", ADAMW),
        (r"\.experts\.(gate_up_proj|down_proj)$", ("muon", "experts")),
        (r"(q|k|v|o)_proj\.weight$", ("muon", "matrix")),
    ],
    "bert": [
        (r"embeddings\.|LayerNorm|\.bias$|^classifier\.", ADAMW),
        (r"(query|key|value|dense)\.weight$", ("muon", "matrix")),
    ],
    "torch_transformer": [  # nn.MultiheadAttention keeps its QKV projection as a raw Parameter
        (r"^0\.weight$|bias$|norm\d\.", ADAMW),
        (r"self_attn\.in_proj_weight$|out_proj\.weight$|linear\d\.weight$", ("muon", "matrix")),
        (r"^2\.weight$", ("muon", "matrix")),  # an unnamed last Linear is not known to be a head: use rules=
    ],
    "toy_moe": [
        (r"^(select\.weight|router\.layer\.weight)$", ADAMW),
        (r"^moe\.(up|down)$", ("muon", "experts")),
        (r"^proj\.weight$", ("muon", "matrix")),
        (r"^proj\.bias$", ADAMW),
    ],
    "convnet": [
        (r"^(stem|conv)\.weight$", ("muon", "flatten")),
        (r"^hidden\.weight$", ("muon", "matrix")),
        (r"\.bias$|^(norm|head)\.|^(pos|temperature)$", ADAMW),
    ],
}
KINDS = list(EXPECTED)


@pytest.fixture(scope="module")
def models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {kind: _build(kind) for kind in KINDS}


def _expected(kind: str, name: str) -> tuple[str, str]:
    for pattern, where in EXPECTED[kind]:
        if re.search(pattern, name):
            return where
    raise AssertionError(f"no expectation for {kind}:{name}")


@pytest.mark.parametrize("kind", KINDS)
def test_every_tensor_lands_where_the_brief_says(models: dict[str, nn.Module], kind: str) -> None:
    model = models[kind]
    routes = muonkit.explain(model).routes
    assert [r.name for r in routes] == [n for n, _ in model.named_parameters()]
    for r in routes:
        assert (r.algorithm, r.layout) == _expected(kind, r.name), (r.name, r.reason)
        assert r.reason


def test_tied_head_is_one_adamw_tensor(models: dict[str, nn.Module]) -> None:
    for kind in ("gpt2", "qwen2"):
        model = models[kind]
        head = model.get_output_embeddings().weight
        assert head is model.get_input_embeddings().weight
        groups = muonkit.param_groups(model)
        hits = [g["algorithm"] for g in groups for p in g["params"] if p is head]
        assert hits == ["adamw"]
        route = next(r for r in muonkit.explain(model).routes if r.name.endswith(("wte.weight", "embed_tokens.weight")))
        assert "tied" in route.reason


@pytest.mark.parametrize("kind", KINDS)
def test_param_groups_cover_every_param_once(models: dict[str, nn.Module], kind: str) -> None:
    model = models[kind]
    groups = muonkit.param_groups(model, lr=0.01, adamw_lr=1e-3, weight_decay=0.1, adamw_weight_decay=0.01)
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())
    for g in groups:
        assert len(g["param_names"]) == len(g["params"])
        if g["algorithm"] == "muon":
            assert (g["lr"], g["weight_decay"]) == (0.01, 0.1)
        else:
            assert (g["lr"], g["weight_decay"]) == (1e-3, 0.01)


def test_param_groups_options_override_the_keywords(models: dict[str, nn.Module]) -> None:
    groups = muonkit.param_groups(
        models["llama"],
        weight_decay=0.1,
        muon_options={"weight_decay": 0.0, "adjust_lr": "match_adamw"},
        adamw_options={"lr": 1e-3, "betas": (0.9, 0.99)},
    )
    muon = next(g for g in groups if g["algorithm"] == "muon")
    adamw = next(g for g in groups if g["algorithm"] == "adamw")
    assert (muon["weight_decay"], muon["adjust_lr"]) == (0.0, "match_adamw")
    assert (adamw["lr"], adamw["betas"]) == (1e-3, (0.9, 0.99))
    assert "lr" not in muon and "weight_decay" not in adamw  # not passed: the optimizer's defaults apply


def test_param_groups_leave_unpassed_hyperparameters_to_the_optimizer(models: dict[str, nn.Module]) -> None:
    """Groups carry the routing and what the caller passed; the optimizer's keywords apply to the rest."""
    model = copy.deepcopy(models["llama"])  # stepped below: leave the shared fixture alone
    groups = muonkit.param_groups(model)
    assert {k for g in groups for k in g} == {"params", "param_names", "algorithm", "layout", "split_sizes"}
    opt = muonkit.HybridMuon(groups, lr=0.05, adamw_lr=1e-3, weight_decay=0.1, adamw_weight_decay=0.01)
    seen = {(g["algorithm"], g["lr"], g["weight_decay"]) for g in opt.param_groups}
    assert seen == {("muon", 0.05, 0.1), ("adamw", 1e-3, 0.01)}
    # and the step uses them: the same step as groups that carry these values themselves
    twin = copy.deepcopy(model)
    explicit = muonkit.param_groups(twin, lr=0.05, adamw_lr=1e-3, weight_decay=0.1, adamw_weight_decay=0.01)
    twin_opt = muonkit.HybridMuon(explicit)
    for m, o in ((model, opt), (twin, twin_opt)):
        for p in m.parameters():
            p.grad = torch.ones_like(p)
        o.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
    muon_only = [g for g in muonkit.param_groups(model) if g["algorithm"] == "muon"]
    torch_style = muonkit.Muon(muon_only)  # torch.optim.Muon's lr=1e-3 and weight_decay=0.1, not 0.02 and 0
    assert {(g["lr"], g["weight_decay"]) for g in torch_style.param_groups} == {(1e-3, 0.1)}


def _batch(kind: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    if kind == "convnet":
        return (torch.randn(2, 3, 8, 8, generator=g),), {}
    if kind == "toy_moe":
        return (), {}
    if kind == "torch_transformer":
        return (torch.randint(0, 97, (2, 8), generator=g),), {}
    ids = torch.randint(0, 97, (2, 8), generator=g)
    if kind == "bert":
        return (), {"input_ids": ids, "labels": torch.tensor([0, 2])}
    return (), {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("kind", KINDS)
def test_param_groups_train_with_hybrid_muon(models: dict[str, nn.Module], kind: str) -> None:
    model = models[kind]
    opt = muonkit.HybridMuon(muonkit.param_groups(model))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args, kwargs = _batch(kind)
    out = model(*args, **kwargs)
    loss = out.pow(2).mean() if isinstance(out, torch.Tensor) else out.loss
    assert torch.isfinite(loss)
    loss.backward()
    opt.step()
    opt.zero_grad()
    moved = [n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())]
    with_grad = [n for n, p in model.named_parameters() if opt.state[p]]
    assert moved and set(moved) <= set(with_grad)
    for group in opt.param_groups:
        for p in group["params"]:
            if opt.state[p]:
                key = "momentum_buffer" if group["algorithm"] == "muon" else "exp_avg"
                assert opt.state[p][key].dtype == torch.float32


def test_split_qkv_uses_the_head_counts(models: dict[str, nn.Module]) -> None:
    groups = muonkit.param_groups(models["gpt2"], split_qkv=True)
    split = [g for g in groups if g.get("split_sizes")]
    assert len(split) == 1
    assert split[0]["param_names"] == ["transformer.h.0.attn.c_attn.weight"]
    assert split[0]["split_sizes"] == (32, 32, 32) and split[0]["layout"] == "transposed"
    muonkit.HybridMuon(groups)  # the split fits the tensor: validation passes


def test_split_qkv_of_torch_multihead_attention(models: dict[str, nn.Module]) -> None:
    routes = {r.name: r for r in muonkit.explain(models["torch_transformer"], split_qkv=True).routes}
    assert routes["1.layers.0.self_attn.in_proj_weight"].split_sizes == (32, 32, 32)


def test_qkv_split_sizes_for_grouped_query_attention() -> None:
    from muonkit.routing import qkv_split_sizes

    cfg = transformers.LlamaConfig(**SMALL)  # 4 heads of 8, 2 KV heads
    assert qkv_split_sizes(32 + 2 * 16, cfg) == (32, 16, 16)
    assert qkv_split_sizes(96) == (32, 32, 32)
    assert qkv_split_sizes(10) is None


def test_user_rules_override_first_match_wins(models: dict[str, nn.Module]) -> None:
    model = models["llama"]
    rules = [
        ("lm_head", "muon"),
        (r"\.mlp\.", "adamw"),
        (r"down_proj", "muon"),  # never reached for mlp.down_proj: the rule above matched first
        Rule(r"q_proj", "muon", split_sizes=(16, 16), reason="per-head-pair blocks"),
    ]
    routes = {r.name: r for r in muonkit.explain(model, rules=rules).routes}
    assert routes["lm_head.weight"].algorithm == "muon"
    assert routes["lm_head.weight"].reason == "rule 'lm_head'"
    assert routes["model.layers.0.mlp.down_proj.weight"].algorithm == "adamw"
    assert routes["model.layers.0.mlp.up_proj.weight"].reason == r"rule '\\.mlp\\.'"
    q = routes["model.layers.0.self_attn.q_proj.weight"]
    assert (q.algorithm, q.split_sizes, q.reason) == ("muon", (16, 16), "per-head-pair blocks")
    assert routes["model.layers.0.self_attn.k_proj.weight"].reason == "hidden Linear"  # built-in rules still apply
    as_dict = {r.name: r.algorithm for r in muonkit.explain(model, rules={"lm_head": "muon"}).routes}
    assert as_dict["lm_head.weight"] == "muon"
    opt = muonkit.HybridMuon(muonkit.param_groups(model, rules=rules))
    assert {g["algorithm"] for g in opt.param_groups} == {"muon", "adamw"}


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        (("x", "sgd"), "Invalid algorithm='sgd' in rule 'x': must be one of ('muon', 'adamw')"),
        (("(", "muon"), "Invalid rule pattern '(': "),
        ("lm_head", "Invalid rule 'lm_head': must be a muonkit.Rule or a (pattern, algorithm) pair"),
    ],
)
def test_bad_rules_raise(models: dict[str, nn.Module], rule: Any, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        muonkit.explain(models["llama"], rules=[rule])


def test_bad_rule_layout_raises() -> None:
    with pytest.raises(ValueError, match=r"^Invalid layout='diag' in rule 'w': must be one of \('auto', "):
        Rule("w", "muon", layout="diag")


def test_frozen_params_are_left_out(models: dict[str, nn.Module]) -> None:
    model = _build("llama")
    model.model.embed_tokens.weight.requires_grad_(False)
    names = [n for g in muonkit.param_groups(model) for n in g["param_names"]]
    assert "model.embed_tokens.weight" not in names and len(names) == len(list(model.parameters())) - 1


def test_explain_totals_match_a_hand_count(models: dict[str, nn.Module]) -> None:
    """Llama, hidden 32, 4 heads of 8, 2 KV heads, intermediate 64, vocab 97, 1 layer, untied."""
    q = o = 32 * 32
    k = v = 16 * 32
    gate = up = down = 64 * 32
    muon = q + k + v + o + gate + up + down  # 9216
    adamw = 97 * 32 * 2 + 3 * 32  # embedding + lm_head + 3 RMSNorm gains = 6304
    report = muonkit.explain(models["llama"])
    assert (report.numel("muon"), report.numel("adamw"), report.total_params) == (muon, adamw, muon + adamw)
    assert report.muon_fraction == pytest.approx(muon / (muon + adamw))
    assert report.hybrid_state_bytes == 4 * muon + 8 * adamw
    assert report.adamw_state_bytes == 8 * (muon + adamw)
    data = report.to_dict()
    assert data["params"] == {"muon": muon, "adamw": adamw, "total": muon + adamw}
    assert data["state_bytes"] == {"hybrid_muon": 4 * muon + 8 * adamw, "adamw": 8 * (muon + adamw)}
    # state_dtype: bf16 2 B per value; 8-bit 1 B + one fp32 scale per row here (every row <= 256 wide):
    # Muon rows 32 + 16 + 16 + 32 + 64 + 64 + 32 = 256; AdamW two states of 2 x 97 rows and 3 gains
    eight = (muon + 4 * 256) + 2 * (adamw + 4 * (2 * 97 + 3))
    assert data["hybrid_state_bytes_by_state_dtype"] == {
        "fp32": 4 * muon + 8 * adamw,
        "bf16": 2 * muon + 4 * adamw,
        "8bit": eight,
    }
    assert eight == 24_424 and report.state_bytes("8bit") == eight
    text = str(report)
    assert text.splitlines()[0].split() == ["name", "shape", "algorithm", "reason"]
    assert "model.layers.0.mlp.down_proj.weight" in text and f"{muon:,}" in text and f"{adamw:,}" in text
    assert f"Muon fraction f:          {muon / (muon + adamw):.3f}" in text


def test_explain_on_the_meta_device() -> None:
    """No memory, no weights: what `muonkit inspect` uses for large configs."""
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**SMALL, num_local_experts=8))
    report = muonkit.explain(model)
    experts = [r for r in report.routes if r.layout == "experts"]
    assert len(experts) == 2 and all(r.shape[0] == 8 for r in experts)


def test_no_decay_on_vectors_leaves_the_matrices_decay_to_the_optimizer() -> None:
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8))
    groups = no_decay_on_vectors(muonkit.param_groups(model))
    opt = muonkit.HybridMuon(groups, adamw_weight_decay=0.1)
    decay = {n: g["weight_decay"] for g in opt.param_groups if g["algorithm"] == "adamw" for n in g["param_names"]}
    assert decay == {"0.weight": 0.1, "1.bias": 0.0, "2.weight": 0.0, "2.bias": 0.0}
    # a group whose decay is explicitly 0 stays whole
    whole = no_decay_on_vectors(muonkit.param_groups(model, adamw_weight_decay=0.0))
    assert sorted(g["algorithm"] for g in whole) == ["adamw", "muon"]


def test_lora_factors_have_their_own_route_and_presets_move_them() -> None:
    peft = pytest.importorskip("peft")
    base = nn.Sequential()
    base.add_module("attn", nn.Linear(16, 16))
    base.add_module("mlp", nn.Linear(16, 32))
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["attn", "mlp"]))

    def where(rules: Any = None) -> dict[str, str]:
        routes = muonkit.explain(model, rules=rules).routes
        return {r.name.split(".lora_")[1].split(".")[0]: r.algorithm for r in routes if ".lora_" in r.name}

    reasons = {r.reason for r in muonkit.explain(model).routes}
    assert {"PEFT LoRA lora_A (r x in) (default LoRA routing: lora_rules)"} <= reasons
    assert len(muonkit.explain(model).routes) == 4  # the frozen base weights are left out
    assert where() == where(muonkit.lora_rules("muon")) == {"A": "muon", "B": "muon"}
    assert where(muonkit.lora_rules("b_muon")) == {"A": "adamw", "B": "muon"}
    assert where(muonkit.lora_rules("adamw")) == {"A": "adamw", "B": "adamw"}
    with pytest.raises(ValueError, match=r"Invalid LoRA routing='B': must be one of \('muon', 'b_muon', 'adamw'\)"):
        muonkit.lora_rules("B")

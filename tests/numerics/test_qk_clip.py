"""QK-Clip: maxima equal a float64 reference of the masked logits; rows rescaled by the formula; bad settings refused."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import muonkit
from muonkit.functional.qk_clip import max_attention_logits, qk_clip_factors
from muonkit.qk_clip import SLOT
from qk_models import MODELS, tiny_model

pytest.importorskip("transformers")

CAPTURE = "muonkit_test_capture"


@pytest.fixture(scope="module")
def capture() -> dict[nn.Module, list[tuple[torch.Tensor, torch.Tensor, float]]]:
    """An attention function that records each module's (query, key, scaling), then runs its eager forward."""
    import sys

    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    seen: dict[nn.Module, list[tuple[torch.Tensor, torch.Tensor, float]]] = {}

    def forward(
        module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, **kw: Any
    ) -> Any:
        scaling = kw.get("scaling")
        seen.setdefault(module, []).append(
            (query.detach(), key.detach(), query.shape[-1] ** -0.5 if scaling is None else scaling)
        )
        return sys.modules[type(module).__module__].eager_attention_forward(module, query, key, value, mask, **kw)

    AttentionInterface.register(CAPTURE, forward)
    AttentionMaskInterface.register(CAPTURE, eager_mask)
    return seen


def reference_maxima(
    query: torch.Tensor, key: torch.Tensor, scale: float, pad: torch.Tensor, window: int | None
) -> torch.Tensor:
    """float64: every logit, masked causal (j <= i), padding (pad[b, j]) and window (i - j < w); max per head."""
    q, k = query.double(), key.double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = q @ k.transpose(-1, -2) * scale  # (B, H, T, T)
    t = q.shape[2]
    i, j = torch.arange(t).unsqueeze(1), torch.arange(t)
    allowed = (j <= i) & pad.bool()[:, None, None, :]
    if window is not None:
        allowed = allowed & (i - j < window)
    logits = logits.masked_fill(~allowed.expand_as(logits), -math.inf)
    return logits.amax(dim=(0, 2, 3))


def batch(padding: str) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(2, 64, (2, 10))
    pad = torch.ones(2, 10, dtype=torch.long)
    if padding == "right":
        pad[1, 7:] = 0
    elif padding == "left":
        pad[1, :3] = 0
    return ids, pad


@pytest.mark.parametrize(("padding", "implementation"), [("none", "sdpa"), ("right", "eager"), ("left", "sdpa")])
@pytest.mark.parametrize("name", MODELS)
def test_maxima_equal_float64_reference(name: str, padding: str, implementation: str, capture: dict) -> None:
    """Per layer and head, max q.k*scale over unmasked positions, post-RoPE, GQA/MLA/sliding window (rel 1e-5)."""
    ids, pad = batch(padding)
    model = tiny_model(name, attn_implementation=implementation, gain=4.0)
    clip = muonkit.QKClip(model)
    model(input_ids=ids, attention_mask=pad)
    model(input_ids=ids[:, :6], attention_mask=pad[:, :6])  # a second micro-batch: the max over both
    got = clip.max_logits()
    clip.remove()
    model.config._attn_implementation_internal = CAPTURE
    capture.clear()
    model(input_ids=ids, attention_mask=pad)
    model(input_ids=ids[:, :6], attention_mask=pad[:, :6])
    window = getattr(model.config, "sliding_window", None)
    modules = dict(model.named_modules())
    assert set(got) == {n for n, m in modules.items() if m in capture} and len(got) == 2
    for layer, maxima in got.items():
        calls = capture[modules[layer]]
        want = torch.stack([reference_maxima(q, k, s, pad[:, : q.shape[2]], window) for q, k, s in calls]).amax(0)
        assert torch.isfinite(want).all()
        torch.testing.assert_close(maxima.double(), want, rtol=1e-5, atol=1e-6)


def test_sliding_window_is_respected() -> None:
    """The window matters here (the unwindowed causal max is larger), so the check above cannot pass by ignoring it."""
    ids, pad = batch("none")
    model = tiny_model("mistral_window", gain=4.0)
    clip = muonkit.QKClip(model)
    model(input_ids=ids, attention_mask=pad)
    windowed = torch.cat(list(clip.max_logits().values()))
    model.config.sliding_window = None
    clip.clip()
    model(input_ids=ids, attention_mask=pad)
    assert (torch.cat(list(clip.max_logits().values())) > windowed).any()


def captured(model: nn.Module, capture: dict, ids: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """Per layer name, the (query, key, scale) the attention got, from the capturing implementation."""
    before = model.config._attn_implementation
    model.config._attn_implementation_internal = CAPTURE
    capture.clear()
    with torch.no_grad():
        model(input_ids=ids)
    model.config._attn_implementation_internal = before
    return {name: capture[m][0] for name, m in model.named_modules() if m in capture}


def expected_factors(maxima: torch.Tensor, threshold: float, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule written out head by head: gamma_h = tau / S_h above tau, else 1; a key head takes its group's min."""
    gamma = [threshold / s if s > threshold else 1.0 for s in maxima.tolist()]
    size = len(gamma) // kv_heads
    return torch.tensor(gamma, dtype=torch.float64), torch.tensor(
        [min(gamma[g * size : (g + 1) * size]) for g in range(kv_heads)], dtype=torch.float64
    )


CLIP_CASES = [(n, a) for n in ("llama_gqa", "gpt2", "deepseek_v3_mla") for a in (0.0, 0.5, 1.0)] + [
    (n, 0.5) for n in ("qwen2_gqa_bias", "gpt_neox", "phi3", "mistral_window")
]


@pytest.mark.parametrize(("name", "alpha"), CLIP_CASES)
def test_step_rescales_queries_and_keys_by_the_formula(name: str, alpha: float, capture: dict) -> None:
    """After a step, per head q' = q * gamma_h**alpha, k' = k * gamma_g**(1-alpha) (MLA: rotary q * gamma_h, rotary k
    untouched), v unchanged; every max <= tau, the hottest head of a clipped group exactly tau."""
    ids, pad = batch("none")
    model = tiny_model(name, gain=6.0, layers=1)  # one layer: a clip of layer 0 would change layer 1's input
    window = getattr(model.config, "sliding_window", None)
    before = captured(model, capture, ids)
    maxima = {n: reference_maxima(q, k, s, pad, window) for n, (q, k, s) in before.items()}
    threshold = float(torch.cat(list(maxima.values())).median())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    clip = muonkit.QKClip(model, opt, threshold=threshold, alpha=alpha)
    model(input_ids=ids, attention_mask=pad).logits.sum().backward()
    opt.step()
    assert clip.last_clipped_heads > 0 and clip.max_logits()[clip.layers[0]].isneginf().all()
    after = captured(model, capture, ids)
    mla = name == "deepseek_v3_mla"
    for layer, (q0, k0, scale) in before.items():
        q1, k1, _ = after[layer]
        gq, gk = expected_factors(maxima[layer], threshold, k0.shape[1])
        if mla:  # per head [nope | rope]: nope parts by gamma**alpha / gamma**(1-alpha), rotary query by gamma
            nope = model.config.qk_nope_head_dim
            want_q = torch.cat(
                [
                    q0[..., :nope].double() * gq.pow(alpha).view(1, -1, 1, 1),
                    q0[..., nope:].double() * gq.view(1, -1, 1, 1),
                ],
                -1,
            )
            want_k = torch.cat(
                [k0[..., :nope].double() * gk.pow(1 - alpha).view(1, -1, 1, 1), k0[..., nope:].double()], -1
            )
        else:
            want_q = q0.double() * gq.pow(alpha).view(1, -1, 1, 1)
            want_k = k0.double() * gk.pow(1 - alpha).view(1, -1, 1, 1)
        torch.testing.assert_close(q1.double(), want_q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(k1.double(), want_k, rtol=1e-5, atol=1e-6)
        new = reference_maxima(q1, k1, scale, pad, window)
        assert (new <= threshold * (1 + 1e-5)).all()
        groups = gq.view(k0.shape[1], -1) if not mla else gq.view(-1, 1)
        for g, old in enumerate(maxima[layer].view(groups.shape)):
            if old.max() > threshold:
                assert new.view(groups.shape)[g].max().item() == pytest.approx(threshold, rel=1e-5)
        torch.testing.assert_close(clip.last_max_logits[layer].double(), maxima[layer], rtol=1e-5, atol=1e-6)


def test_heads_below_threshold_and_bad_maxima_are_left_alone() -> None:
    """A max <= tau, <= 0, nan or +-inf gives no clip: the weights stay bit-identical and finite."""
    model = tiny_model("gpt2")
    clip = muonkit.QKClip(model, threshold=1.0)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    for slot, values in zip(
        clip._slots, ([math.nan, -3.0, math.inf, 0.0], [1.0, -math.inf, 0.5, math.nan]), strict=True
    ):
        slot.maxima = torch.tensor(values)
    clip.clip()
    assert clip.last_clipped_heads == 0
    for n, p in model.named_parameters():
        assert torch.equal(p, weights[n]), n
    gamma, key_gamma = qk_clip_factors(
        torch.tensor([math.nan, math.inf, -math.inf, -1.0, 0.0, 4.0]), threshold=2.0, num_kv_heads=3
    )
    assert gamma.tolist() == [1.0, 1.0, 1.0, 1.0, 1.0, 0.5] and key_gamma.tolist() == [1.0, 1.0, 0.5]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"threshold": 0.0}, "Invalid threshold=0.0: must be a finite number > 0"),
        ({"threshold": -5}, "Invalid threshold=-5"),
        ({"threshold": math.nan}, "Invalid threshold=nan"),
        ({"threshold": math.inf}, "Invalid threshold=inf"),
        ({"threshold": True}, "Invalid threshold=True"),
        ({"alpha": -0.1}, r"Invalid alpha=-0.1: must be in \[0, 1\]"),
        ({"alpha": 1.5}, r"Invalid alpha=1.5: must be in \[0, 1\]"),
    ],
)
def test_bad_settings_raise_before_anything_changes(kwargs: dict, message: str) -> None:
    model = tiny_model("llama_gqa")
    with pytest.raises(ValueError, match=message):
        muonkit.QKClip(model, **kwargs)
    assert model.config._attn_implementation == "sdpa"
    assert not any(SLOT in m.__dict__ for m in model.modules())


def test_models_it_cannot_observe_are_refused() -> None:
    with pytest.raises(ValueError, match="QKClip found no attention it can observe"):
        muonkit.QKClip(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    model = tiny_model("llama_gqa")
    model.config._attn_implementation_internal = "flash_attention_2"
    with pytest.raises(
        ValueError, match=r"cannot observe attn_implementation='flash_attention_2'.*attn_implementation='sdpa'"
    ):
        muonkit.QKClip(model)
    assert model.config._attn_implementation == "flash_attention_2"
    assert not any(SLOT in m.__dict__ for m in model.modules())
    import transformers as tf

    qk_norm = tf.AutoModelForCausalLM.from_config(
        tf.Qwen3Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    with pytest.raises(ValueError, match="normalizes q/k after the projection"):
        muonkit.QKClip(qk_norm)


def test_attach_twice_is_refused_and_remove_restores() -> None:
    model = tiny_model("gpt2", attn_implementation="eager")
    clip = muonkit.QKClip(model)
    assert model.config._attn_implementation == "muonkit_qk_clip_eager"
    with pytest.raises(ValueError, match="already has a QKClip attached"):
        muonkit.QKClip(model)
    clip.remove()
    assert model.config._attn_implementation == "eager"
    assert not any(SLOT in m.__dict__ for m in model.modules())
    muonkit.QKClip(model).remove()


def test_eval_mode_is_not_observed_and_outputs_are_unchanged() -> None:
    ids, pad = batch("right")
    model = tiny_model("qwen2_gqa_bias", gain=4.0)
    plain = model(input_ids=ids, attention_mask=pad).logits
    clip = muonkit.QKClip(model)
    assert torch.equal(model(input_ids=ids, attention_mask=pad).logits, plain)
    assert all(v.isfinite().all() for v in clip.max_logits().values())
    clip.clip()
    model.eval()
    model(input_ids=ids, attention_mask=pad)
    assert all(v.isneginf().all() for v in clip.max_logits().values())


def test_query_row_blocks_give_the_one_block_result() -> None:
    """The memory bound: a few rows of logits at a time (here 1 and 3 rows) give the same maxima as all at once."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 6, 11, 8), torch.randn(2, 3, 11, 8)
    mask = torch.rand(2, 1, 11, 11) > 0.3
    whole = max_attention_logits(q, k, scale=0.3, mask=mask, causal=True)
    for elements in (1, 3 * 2 * 6 * 11):
        blocked = max_attention_logits(q, k, scale=0.3, mask=mask, causal=True, block_elements=elements)
        torch.testing.assert_close(blocked, whole, rtol=1e-6, atol=1e-6)
    want = reference_maxima(q, k, 0.3, torch.ones(2, 11), None)  # causal only
    torch.testing.assert_close(max_attention_logits(q, k, scale=0.3, causal=True, block_elements=1).double(), want)


class HandWritten(nn.Module):
    """A hand-written GQA attention (separate q, fused k|v) that declares its rows and calls observed_attention."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(16, 16, bias=True)
        self.kv = nn.Linear(16, 16, bias=False)  # rows: k heads (2 x 4), then v heads

    def qk_clip_layout(self) -> muonkit.qk_clip.QKLayout:
        from muonkit.qk_clip import HeadRows, QKLayout

        rows = (
            HeadRows("q.weight", "query", 4, 4),
            HeadRows("q.bias", "query", 4, 4),
            HeadRows("kv.weight", "key", 2, 4),
        )
        return QKLayout(num_heads=4, num_kv_heads=2, rows=rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 4, 4).transpose(1, 2)
        k, v = (z.view(b, t, 2, 4).transpose(1, 2) for z in self.kv(x).split(8, dim=-1))
        return (
            muonkit.qk_clip.observed_attention(self, q, k, v, causal=True, scale=0.7).transpose(1, 2).reshape(b, t, 16)
        )


def test_hand_written_attention_in_a_plain_loop_with_hybridmuon() -> None:
    """The protocol: qk_clip_layout() + observed_attention; the hook runs after HybridMuon.step()."""
    torch.manual_seed(0)
    model = nn.Sequential(HandWritten()).train()
    with torch.no_grad():
        model[0].q.weight.mul_(8)
        model[0].kv.weight.mul_(8)
    x = torch.randn(2, 5, 16)
    opt = muonkit.HybridMuon(
        [
            {"params": [model[0].q.weight, model[0].kv.weight], "algorithm": "muon", "lr": 1e-4},
            {"params": [model[0].q.bias], "algorithm": "adamw", "lr": 1e-4},
        ]
    )
    clip = muonkit.QKClip(model, opt, threshold=5.0)
    out = model(x)
    q = model[0].q(x).view(2, 5, 4, 4).transpose(1, 2)
    k = model[0].kv(x)[..., :8].view(2, 5, 2, 4).transpose(1, 2)
    want = reference_maxima(q.detach(), k.detach(), 0.7, torch.ones(2, 5), None)
    torch.testing.assert_close(clip.max_logits()["0"].double(), want, rtol=1e-5, atol=1e-6)
    assert want.max() > 5.0
    out.square().sum().backward()
    opt.step()
    assert clip.last_clipped_heads > 0
    model(x)
    assert clip.max_logits()["0"].max() <= 5.0 * 1.01  # the tiny lr moved the weights a little after the clip only


def test_an_optimizer_without_the_qk_weights_is_refused_at_its_first_step() -> None:
    """A rescale of weights the optimizer does not hold (ZeRO's foreign flat copies, a wrong optimizer) is refused."""
    model = tiny_model("llama_gqa")
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    opt = torch.optim.SGD(norms, lr=0.1)
    muonkit.QKClip(model, opt)
    with pytest.raises(RuntimeError, match="holds none of the q/k weights"):
        opt.step()


def test_a_watched_model_pickles_and_deep_copies() -> None:
    import copy
    import io

    model = tiny_model("gpt2")
    muonkit.QKClip(model)
    twin = copy.deepcopy(model)
    assert twin.transformer.h[0].attn.__dict__[SLOT].module is twin.transformer.h[0].attn
    torch.save(model, io.BytesIO())


def test_a_step_without_an_observed_forward_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    """The attention implementation changed after the QKClip was built (or eval mode): said once, not silent."""
    ids, pad = batch("none")
    model = tiny_model("llama_gqa", gain=4.0)
    clip = muonkit.QKClip(model)
    model(input_ids=ids, attention_mask=pad)
    with caplog.at_level("WARNING", logger="muonkit.qk_clip"):
        clip.clip()
    assert "no training-mode forward" not in caplog.text
    model.config._attn_implementation = "eager"  # what set_attn_implementation does: the wrapper is bypassed
    for _ in range(2):
        model(input_ids=ids, attention_mask=pad)
        with caplog.at_level("WARNING", logger="muonkit.qk_clip"):
            clip.clip()
    assert caplog.text.count("no training-mode forward pass reached 2 of 2 observed attention layers") == 1


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_gqa_bias"])
def test_per_head_muon_then_the_clip(name: str, capture: dict) -> None:
    """QK-Clip composes with per-head Muon (issue 23): after one step of HybridMuon with
    ``param_groups(model, per_head=True)``, the clipped model's q rows are the unclipped twin's
    times gamma_h**alpha and its k rows times gamma_g**(1-alpha), head by head; everything else
    equal. The clip's maxima are the forward's, whatever the groups' layout."""
    ids, _ = batch("none")
    twins = [tiny_model(name, gain=6.0, layers=1) for _ in range(2)]
    before = captured(twins[0], capture, ids)
    ((layer, (q0, k0, scale)),) = before.items()
    maxima = reference_maxima(q0, k0, scale, torch.ones(ids.shape, dtype=torch.long), None)
    threshold = float(maxima.median())
    opts = [muonkit.HybridMuon(muonkit.param_groups(m, per_head=True), lr=0.02) for m in twins]
    assert any(g.get("split_sizes") for g in opts[0].param_groups)  # the attention is per head
    clip = muonkit.QKClip(twins[1], opts[1], threshold=threshold, alpha=0.5)
    for model, opt in zip(twins, opts, strict=True):
        model(input_ids=ids).logits.sum().backward()
        opt.step()
    assert clip.last_clipped_heads > 0
    gq, gk = expected_factors(maxima, threshold, k0.shape[1])
    head_dim = q0.shape[-1]
    plain, clipped = dict(twins[0].named_parameters()), dict(twins[1].named_parameters())
    prefix = layer + "."
    for pname, value in plain.items():
        other = clipped[pname]
        if pname.startswith(prefix + "q_proj"):
            factor = gq.pow(0.5).repeat_interleave(head_dim)
        elif pname.startswith(prefix + "k_proj"):
            factor = gk.pow(0.5).repeat_interleave(head_dim)
        else:
            torch.testing.assert_close(other, value, rtol=0, atol=0)
            continue
        shape = (-1, 1) if value.ndim == 2 else (-1,)
        torch.testing.assert_close(other.double(), value.double() * factor.view(shape), rtol=1e-5, atol=1e-7)

"""The benchmark GPT declares its fused c_attn rows and reports its logits to muonkit.QKClip."""

from __future__ import annotations

import math

import pytest
import torch

import muonkit
from muonkit_bench.model import GPT, GPTConfig


def reference(model: GPT, idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """float64 causal max of q.k / sqrt(d) per head, from each block's c_attn output (the ln_1 input recomputed)."""
    out = {}
    x = model.wte(idx) + model.wpe(torch.arange(idx.shape[1]))
    for i, block in enumerate(model.blocks):
        h = block.ln_1(x).double()
        w, b = block.attn.c_attn.weight.double(), block.attn.c_attn.bias.double()
        q, k, _ = (h @ w.T + b).split(model.config.n_embd, dim=-1)
        heads, d = model.config.n_head, model.config.n_embd // model.config.n_head
        q, k = (t.view(*t.shape[:2], heads, d).transpose(1, 2) for t in (q, k))
        logits = q @ k.transpose(-1, -2) / math.sqrt(d)
        causal = torch.ones(idx.shape[1], idx.shape[1], dtype=torch.bool).tril()
        out[f"blocks.{i}.attn"] = logits.masked_fill(~causal, -math.inf).amax(dim=(0, 2, 3))
        x = block(x)
    return out


def test_gpt_logits_observed_and_clipped() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=4, n_embd=32, bias=True)).train()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.c_attn.weight.mul_(20)
            block.attn.c_attn.bias.normal_()
    idx = torch.randint(0, 32, (2, 12))
    plain, _ = model(idx)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    clip = muonkit.QKClip(model, opt, threshold=3.0, alpha=0.5)
    logits, loss = model(idx, idx)
    assert torch.equal(logits, plain)  # observing changes nothing
    want = reference(model, idx)
    assert clip.layers == list(want)
    for name, maxima in clip.max_logits().items():
        torch.testing.assert_close(maxima.double(), want[name], rtol=1e-5, atol=1e-5)
    assert max(v.max() for v in want.values()) > 3.0
    loss.backward()
    opt.step()
    assert clip.last_clipped_heads > 0
    model(idx)
    for name, maxima in clip.max_logits().items():
        if name == "blocks.0.attn":  # the first block's input is unchanged, so its new max is exactly tau or less
            assert maxima.max().item() == pytest.approx(3.0, rel=1e-5)

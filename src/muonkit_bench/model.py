"""The benchmark GPT: a small, readable decoder-only transformer in the style of nanoGPT.

Pre-norm blocks, each ``x + attn(ln(x))`` then ``x + mlp(ln(x))``::

    h_0     = wte[idx] + wpe[0..T)                       token + learned position embeddings
    h       = h + c_proj(softmax(Q K^T / sqrt(d)) V)     causal, Q K V = split(c_attn(ln_1(h)))
    h       = h + c_proj(gelu(c_fc(ln_2(h))))            MLP, 4x wide
    logits  = lm_head(ln_f(h))

The names are chosen so that :func:`muonkit.param_groups` routes the model the standard way:
every ``c_attn`` / ``c_proj`` / ``c_fc`` weight is a hidden ``nn.Linear`` (Muon; ``c_attn`` is a
fused QKV projection that ``split_qkv=True`` cuts into thirds), ``wte`` / ``wpe`` are embeddings,
``lm_head`` is the output head, and the LayerNorm gains and biases are vectors (all AdamW).

Example::

    >>> import torch
    >>> from muonkit_bench.model import GPT, GPTConfig
    >>> model = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64))
    >>> logits, loss = model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))
    >>> logits.shape
    torch.Size([1, 8, 256])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GPT", "GPTConfig"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the benchmark GPT. The defaults are the ``muonkit bench nanogpt --preset demo`` model.

    Args:
        vocab_size: number of token ids (the BPE vocabulary).
        block_size: longest context, and the size of the position table.
        n_layer, n_head, n_embd: depth, attention heads, width (``n_embd % n_head == 0``).
        dropout: dropout on attention output, MLP output and embeddings (0 for the benchmark:
            the runs are far shorter than one would need to overfit).
        bias: biases in the Linear layers and LayerNorms (nanoGPT's default for GPT-2 parity;
            off here because they cost time and help nothing at this scale).
        tie_embeddings: share ``lm_head.weight`` with ``wte.weight``. Off by default so the head
            is its own AdamW tensor, as in modded-nanogpt's Muon runs.
    """

    vocab_size: int = 2048
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    dropout: float = 0.0
    bias: bool = False
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Invalid {name}={value!r}: must be a positive int")
        if self.n_embd % self.n_head:
            raise ValueError(f"Invalid n_embd={self.n_embd}: must be divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"Invalid dropout={self.dropout!r}: must be in [0, 1)")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused QKV projection (``c_attn``)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        batch, time, channels = x.shape
        q, k, v = self.c_attn(x).split(channels, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim)
        q, k, v = (t.view(batch, time, self.n_head, channels // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )  # fmt: skip
        y = y.transpose(1, 2).contiguous().view(batch, time, channels)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Two Linear layers, 4x wide, GELU between."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-norm transformer block."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(idx, targets=None) -> (logits, loss)``.

    Initialization follows GPT-2: weights ~ N(0, 0.02), biases 0, and the two residual output
    projections (``c_proj``) scaled by ``1/sqrt(2 * n_layer)`` so the residual stream's variance
    does not grow with depth. Works under ``with torch.device("meta")`` (no memory allocated),
    which is how ``muonkit inspect gpt`` builds it.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def get_output_embeddings(self) -> nn.Linear:
        """The output head (the name Hugging Face uses; :mod:`muonkit.routing` looks for it)."""
        return self.lm_head

    def num_params(self) -> int:
        """Distinct parameters (a tied head counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Logits ``(B, T, vocab)`` for token ids ``idx`` ``(B, T)``; mean cross-entropy if ``targets``."""
        time = idx.size(1)
        if time > self.config.block_size:
            raise ValueError(f"Invalid sequence length {time}: must be <= block_size={self.config.block_size}")
        pos = torch.arange(time, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        # The loss in fp32 even under bf16 autocast: log-softmax over the vocabulary needs the range.
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

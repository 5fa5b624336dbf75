"""Model, data, configs and the single-device reference shared by the DeepSpeed checks.

The reference is the control of STYLE rule 7: single-device :class:`muonkit.HybridMuon` on the
averaged gradient of the same micro-batches, clipped with ``clip_grad_norm_`` on the raw
accumulated gradient exactly as DeepSpeed clips for AdamW. For bf16 runs it mirrors DeepSpeed's
mixed precision: bf16 forward and backward, fp32 master weights, gradients summed in fp32.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import muonkit
from muonkit.distributed import SingleDeviceStrategy

GA = 2  # gradient accumulation steps in every check
MICRO = 4  # sequences per micro-batch and rank
SEQ = 8
VOCAB = 64
OPTIONS = {"lr": 0.02, "adamw_lr": 3e-3, "weight_decay": 0.01, "adamw_weight_decay": 0.01, "ns_dtype": "float64"}
NORMUON_OPTIONS = {"muon_algorithm": "normuon", "cautious_wd": True, "normuon_beta2": 0.9}
"""Added to :data:`OPTIONS` (the DeepSpeed config's muonkit params) by the NorMuon checks."""


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.Linear(d, d)
        self.fc1 = nn.Linear(d, 3 * d)
        self.fc2 = nn.Linear(3 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        h = self.ln(x)
        return x + self.attn(h) + self.fc2(F.gelu(self.fc1(h)))


class Net(nn.Module):
    """A small residual LM: 9 hidden matrices whose flat group a 2-rank ZeRO partition cuts through."""

    def __init__(self, d: int = 32, layers: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        # x4 so the raw gradient norm (~2.7) exceeds the clip of 1.0: clipping is active
        return 4 * F.cross_entropy(self.head(self.norm(x)).flatten(0, 1).float(), targets.flatten())


def batch(step: int, micro: int, rank: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    tokens = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def config(stage: int, *, bf16: bool = False, fp32_accumulation: bool = False, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GA,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "muonkit.HybridMuon", "params": dict(OPTIONS)},
        "bf16": {"enabled": bf16},
    }
    if fp32_accumulation:
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
        cfg["communication_data_type"] = "fp32"
    cfg.update(extra)
    return cfg


def train(engine: Any, steps: int, start: int = 0) -> list[float]:
    """``steps`` optimizer steps of GA micro-batches; returns DeepSpeed's global gradient norms."""
    norms = []
    for step in range(start, start + steps):
        for micro in range(GA):
            idx, targets = batch(step, micro, dist.get_rank())
            engine.backward(engine(idx, targets))
            engine.step()
        norms.append(float(engine.get_global_grad_norm()))
    return norms


def reference(
    init: dict[str, Tensor], steps: int, *, world: int, bf16: bool, normuon: bool = False, state_dtype: str = "fp32"
) -> tuple[nn.Module, list[float]]:
    """Single-device HybridMuon on the same micro-batches; returns the fp32 model and raw gradient norms.

    ``normuon``: NorMuon on the matrices and cautious weight decay everywhere (:data:`NORMUON_OPTIONS`);
    ``state_dtype``: how the reference keeps its optimizer states."""
    master = Net()
    master.load_state_dict(init)
    options = {k: v for k, v in OPTIONS.items() if k != "ns_dtype"}
    groups = muonkit.param_groups(master, **options, muon_algorithm="normuon" if normuon else "muon")
    opt = muonkit.HybridMuon(
        groups,
        ns_dtype=torch.float64,
        strategy=SingleDeviceStrategy(),
        cautious_wd=normuon,
        normuon_beta2=0.9,
        state_dtype=state_dtype,
    )
    work = copy.deepcopy(master).to(torch.bfloat16) if bf16 else master
    norms = []
    for step in range(steps):
        total = [torch.zeros_like(p) for p in master.parameters()]
        for rank in range(world):
            local = [torch.zeros_like(p) for p in master.parameters()]
            for micro in range(GA):
                loss = work(*batch(step, micro, rank)) / GA
                grads = torch.autograd.grad(loss, list(work.parameters()))
                local = [acc + g.float() for acc, g in zip(local, grads, strict=True)]
            total = [t + acc for t, acc in zip(total, local, strict=True)]
        for p, g in zip(master.parameters(), total, strict=True):
            p.grad = g / world
        norms.append(float(torch.nn.utils.clip_grad_norm_(master.parameters(), 1.0)))
        opt.step()
        if bf16:
            with torch.no_grad():
                for w, p in zip(work.parameters(), master.parameters(), strict=True):
                    w.copy_(p)
    return master, norms


def full_params(engine: Any) -> dict[str, Tensor]:
    """Every rank: the whole fp32 master weights (gathered by DeepSpeed)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in engine.module.named_parameters()}


def update_errors(got: dict[str, Tensor], want: nn.Module, init: dict[str, Tensor]) -> dict[str, float]:
    """Per tensor: ||update_got - update_want|| / ||update_want|| (updates measured from ``init``)."""
    out = {}
    for name, p in want.named_parameters():
        expected = p.detach() - init[name]
        out[name] = float((got[name] - init[name] - expected).norm() / expected.norm().clamp_min(1e-30))
    return out


def gather_state(engine: Any, *, decoded: bool = False) -> dict[str, Tensor]:
    """Every rank: whole per-parameter master weights and optimizer states, from muonkit's partitions.

    Rebuilt from the flat partitions through each :class:`FlatPartition` (DeepSpeed's own
    ``safe_get_full_optimizer_state`` only sees the state of the first param group). ``decoded``:
    bf16 and 8-bit states as their fp32 values (:func:`muonkit.state_precision.decode`; 8-bit codes
    cannot travel over gloo), their scales left out.
    """
    from muonkit.state_checks import NONNEGATIVE
    from muonkit.state_precision import SCALE_SUFFIX, decode

    hybrid = engine.optimizer.optimizer
    strategy = hybrid.strategy
    out = {}
    for flat in strategy.partitions:
        layout = strategy.partition_of(flat)
        own = hybrid.state[flat]
        tensors = {"fp32": flat.detach()} | {
            k: decode(own, k, unsigned=k in NONNEGATIVE).float() if decoded else v
            for k, v in own.items()
            if isinstance(v, Tensor) and v.ndim > 0 and not (decoded and k.endswith(SCALE_SUFFIX))
        }
        for key, local in tensors.items():
            parts = [torch.empty_like(local) for _ in range(layout.world_size)]
            dist.all_gather(parts, local.contiguous())
            for param in layout.params:
                whole = torch.empty(param.numel, dtype=local.dtype)
                for piece in param.pieces:
                    seg = parts[piece.rank][piece.local_offset : piece.local_offset + piece.length]
                    whole[piece.param_offset : piece.param_offset + piece.length] = seg
                out[f"{param.name}:{key}"] = whole.view(param.shape)
    return out


def muon_matrices(model: nn.Module) -> int:
    return sum(1 for r in muonkit.explain(model).routes if r.algorithm == "muon")


def numel(model: nn.Module) -> int:
    return sum(math.prod(p.ds_shape if hasattr(p, "ds_shape") else p.shape) for p in model.parameters())

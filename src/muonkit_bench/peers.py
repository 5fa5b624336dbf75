"""The peers muonkit is compared with, behind one small interface (benchmarks only).

Every builder takes the model's muonkit param groups (so each method updates exactly the same
tensors with the same algorithm) and returns an object with ``step()``, ``zero_grad()`` and
``state``:

- ``adamw``: ``torch.optim.AdamW`` (foreach) on every tensor: the baseline.
- ``hybrid_muon`` / ``hybrid_muon_ns``: :class:`muonkit.HybridMuon` with its default Gram iteration /
  with the plain Newton-Schulz iteration torch.optim.Muon runs.
- ``torch_muon``: ``torch.optim.Muon`` on the Muon groups (2D only) + ``torch.optim.AdamW`` on the rest.
- ``torch_muon_compiled`` / ``adamw_compiled`` (``peers(compiled=True)``, ``bench step --compiled``):
  ``torch_muon`` and ``adamw`` with their ``step()`` under ``torch.compile``, as compiled training
  loops run them. They compile only where ``TORCH_COMPILE_DISABLE=0`` is set explicitly (else they,
  like DeepSpeed's compiled update, run eagerly: see :func:`_disable_compile_unless_asked`); the
  first steps compile, so ``bench step --warmup`` must cover them.
- ``deepspeed_standard`` / ``deepspeed_gram``: DeepSpeed's ``SingleDeviceMuonWithAuxAdam``
  (its single-device Muon with an inline Adam) with ``ns_method="standard"`` (Keller's 5 steps in
  bf16) or ``"gram"`` (Gram Newton-Schulz; fp16 where oneDNN has fp16, else fp32). Its
  coefficients, step count and Nesterov are fixed; it writes the Nesterov blend into ``p.grad``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

Groups = list[dict[str, Any]]


@dataclass(frozen=True)
class Peer:
    """A method to benchmark: how to build it and what it computes."""

    name: str
    build: Callable[[Groups], Any]
    notes: str


class TorchMuonAdamW:
    """``torch.optim.Muon`` on the Muon groups plus ``torch.optim.AdamW`` on the rest, one ``step()``."""

    def __init__(self, groups: Groups, *, lr: float = 0.02, adamw_lr: float = 3e-4, **muon: Any) -> None:
        matrices = [p for g in groups if g["algorithm"] == "muon" for p in g["params"]]
        others = [p for g in groups if g["algorithm"] != "muon" for p in g["params"]]
        muon.setdefault("adjust_lr_fn", "original")  # = Keller's sqrt(max(1, rows/cols))
        muon.setdefault("weight_decay", 0.0)
        self.muon = torch.optim.Muon(matrices, lr=lr, **muon)
        self.adamw = torch.optim.AdamW(others, lr=adamw_lr, betas=(0.9, 0.95), weight_decay=0.0, foreach=True)

    @property
    def state(self) -> dict[Tensor, Any]:
        return {**self.muon.state, **self.adamw.state}

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)


class CompiledStep:
    """Another peer with its ``step()`` under ``torch.compile`` (the same state and params); eager
    where :func:`compile_enabled` is False (not even importing the compiler: ~5 s)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._step = torch.compile(inner.step) if compile_enabled() else inner.step

    @property
    def state(self) -> Any:
        return self.inner.state

    def step(self) -> None:
        self._step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)


def compile_enabled() -> bool:
    """Whether the compiled peers really compile here (see :func:`_disable_compile_unless_asked`)."""
    return os.environ.get("TORCH_COMPILE_DISABLE", "1") == "0"


def adamw(groups: Groups, *, adamw_lr: float = 3e-4) -> torch.optim.Optimizer:
    params = [p for g in groups for p in g["params"]]
    return torch.optim.AdamW(params, lr=adamw_lr, betas=(0.9, 0.95), weight_decay=0.0, foreach=True)


def hybrid_muon(groups: Groups, *, lr: float = 0.02, adamw_lr: float = 3e-4, **muon: Any) -> torch.optim.Optimizer:
    import muonkit

    fresh = [{**g, "lr": lr, **muon} if g["algorithm"] == "muon" else {**g, "lr": adamw_lr} for g in groups]
    return muonkit.HybridMuon(fresh)  # the default nonfinite="skip" check included: what users get


def deepspeed_muon(groups: Groups, *, ns_method: str, lr: float = 0.02, adamw_lr: float = 3e-4) -> Any:
    """DeepSpeed 0.19.8's single-device Muon + inline Adam (imported lazily: deepspeed is optional)."""
    _disable_compile_unless_asked()
    try:
        from deepspeed.runtime.zero.muon.original_muon import SingleDeviceMuonWithAuxAdam
    except ImportError as e:
        raise ImportError(
            "the DeepSpeed peer needs deepspeed: pip install deepspeed (in a clone of muonkit: pip install -e '.[deepspeed]')"
        ) from e
    matrices = [p for g in groups if g["algorithm"] == "muon" for p in g["params"]]
    others = [p for g in groups if g["algorithm"] != "muon" for p in g["params"]]
    ds_groups: list[dict[str, Any]] = [
        {"params": matrices, "use_muon": True, "lr": lr, "momentum": 0.95, "weight_decay": 0.0, "ns_method": ns_method},
        {"params": others, "use_muon": False, "lr": adamw_lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0},
    ]
    return SingleDeviceMuonWithAuxAdam(ds_groups)


def deepspeed_ns_dtype(ns_method: str) -> str:
    """The dtype DeepSpeed's Newton-Schulz runs in on this machine (its own rule)."""
    _disable_compile_unless_asked()
    from deepspeed.runtime.zero.muon.original_muon import ns_compute_dtype

    return str(ns_compute_dtype(ns_method)).replace("torch.", "")


def _disable_compile_unless_asked() -> None:
    """DeepSpeed ``torch.compile``s its Muon update; the first compile takes 16-23 s on CPU.

    Unless ``TORCH_COMPILE_DISABLE=0`` is set explicitly, run it eagerly like every other method.
    """
    if os.environ.get("TORCH_COMPILE_DISABLE", "1") != "0":
        import torch._dynamo

        torch._dynamo.config.disable = True


def peers(*, deepspeed: bool = True, compiled: bool = False) -> dict[str, Peer]:
    """The comparable set: every Muon method with Keller's coefficients and 5 steps, Nesterov, bf16;
    with ``compiled``, also the peers whose ``step()`` runs under ``torch.compile``."""
    table = {
        "adamw": Peer("adamw", adamw, "torch.optim.AdamW foreach, all tensors"),
        "hybrid_muon": Peer(
            "hybrid_muon",
            lambda g: hybrid_muon(g, ns_coefficients="keller", ns_steps=5),
            "muonkit HybridMuon, keller x5, bf16, batched by shape, Gram where aspect >= 2 (default method)",
        ),
        "hybrid_muon_ns": Peer(
            "hybrid_muon_ns",
            lambda g: hybrid_muon(g, ns_coefficients="keller", ns_steps=5, ns_method="newton_schulz"),
            "muonkit HybridMuon, keller x5, bf16, batched by shape, plain Newton-Schulz (torch's iteration)",
        ),
        "hybrid_muon_pe": Peer(
            "hybrid_muon_pe",
            lambda g: hybrid_muon(g, ns_coefficients="polar_express", ns_steps=5),
            "muonkit HybridMuon default: polar_express x5, bf16, Gram where aspect >= 2",
        ),
        "torch_muon": Peer("torch_muon", TorchMuonAdamW, "torch.optim.Muon keller x5 bf16 + torch AdamW foreach"),
    }
    if compiled:
        how = "torch.compile'd step" if compile_enabled() else "step run eagerly (TORCH_COMPILE_DISABLE is not 0)"
        table["adamw_compiled"] = Peer(
            "adamw_compiled", lambda g: CompiledStep(adamw(g)), f"torch.optim.AdamW foreach, {how}"
        )
        table["torch_muon_compiled"] = Peer(
            "torch_muon_compiled",
            lambda g: CompiledStep(TorchMuonAdamW(g)),
            f"torch.optim.Muon keller x5 bf16 + torch AdamW foreach, {how}",
        )
    if deepspeed:
        for method in ("standard", "gram"):
            table[f"deepspeed_{method}"] = Peer(
                f"deepspeed_{method}",
                functools.partial(deepspeed_muon, ns_method=method),
                f"DeepSpeed SingleDeviceMuonWithAuxAdam ns_method={method!r} (keller x5, "
                f"{deepspeed_ns_dtype(method)} here) + inline per-tensor Adam; writes p.grad",
            )
    return table

"""The peers muonkit is compared with, behind one small interface (benchmarks only).

Every builder takes the model's muonkit param groups (so each method updates exactly the same
tensors with the same algorithm) and returns an object with ``step()``, ``zero_grad()`` and
``state``:

- ``adamw``: ``torch.optim.AdamW`` (foreach) on every tensor: the baseline.
- ``hybrid_muon`` / ``hybrid_muon_ns``: :class:`muonkit.HybridMuon` with its default Gram iteration /
  with the plain Newton-Schulz iteration torch.optim.Muon runs.
- ``torch_muon``: ``torch.optim.Muon`` on the Muon groups (2D only) + ``torch.optim.AdamW`` on the rest.
  It always runs Newton-Schulz in bf16; ``peers(ns_dtype="fp32")`` (``bench step --ns-dtype fp32``)
  runs torch's own iteration in fp32 instead (:func:`torch_muon_in_fp32`), so that the step can be
  compared with HybridMuon's in the same dtype.
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

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

Groups = list[dict[str, Any]]

NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""The Newton-Schulz dtypes ``peers(ns_dtype=)`` can impose on HybridMuon and torch.optim.Muon alike."""


@dataclass(frozen=True)
class Peer:
    """A method to benchmark: how to build it and what it computes."""

    name: str
    build: Callable[[Groups], Any]
    notes: str


class TorchMuonAdamW:
    """``torch.optim.Muon`` on the Muon groups plus ``torch.optim.AdamW`` on the rest, one ``step()``."""

    def __init__(
        self, groups: Groups, *, lr: float = 0.02, adamw_lr: float = 3e-4, ns_dtype: str = "bf16", **muon: Any
    ) -> None:
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"Invalid ns_dtype={ns_dtype!r}: torch.optim.Muon's iteration runs in {sorted(NS_DTYPES)}")
        self.fp32 = ns_dtype == "fp32"
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
        with torch_muon_in_fp32() if self.fp32 else contextlib.nullcontext():
            self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)


@contextlib.contextmanager
def torch_muon_in_fp32() -> Iterator[None]:
    """torch.optim.Muon's own iteration in the gradient's dtype (fp32 here) instead of bf16.

    ``torch.optim._muon._zeropower_via_newtonschulz`` casts the matrix with ``grad.bfloat16()``
    (its only cast) and runs every product in that dtype; while this is active that method is a
    ``clone()``, so the same code runs unchanged in fp32. For benchmarks only (it rebinds a
    ``torch.Tensor`` method for the duration of one ``step()``).
    """
    saved = torch.Tensor.bfloat16
    torch.Tensor.bfloat16 = torch.Tensor.clone  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.bfloat16 = saved  # type: ignore[method-assign]


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


def ns_options(ns_dtype: str | None) -> dict[str, Any]:
    """HybridMuon's keyword for a Newton-Schulz dtype of :data:`NS_DTYPES` (none for None: its own choice)."""
    if ns_dtype is not None and ns_dtype not in NS_DTYPES:
        raise ValueError(f"Invalid ns_dtype={ns_dtype!r}: must be one of {sorted(NS_DTYPES)} or None")
    return {} if ns_dtype is None else {"ns_dtype": NS_DTYPES[ns_dtype]}


def peers(*, deepspeed: bool = True, compiled: bool = False, ns_dtype: str | None = None) -> dict[str, Peer]:
    """The comparable set: every Muon method with Keller's coefficients and 5 steps, Nesterov;
    with ``compiled``, also the peers whose ``step()`` runs under ``torch.compile``.

    ``ns_dtype`` (``"bf16"`` or ``"fp32"``): the Newton-Schulz dtype of HybridMuon and
    torch.optim.Muon alike (a same-dtype comparison); None: each its own (HybridMuon bf16 where
    this machine multiplies bf16 fast, else fp32; torch.optim.Muon always bf16). DeepSpeed's Muon
    always picks its own.
    """
    ours = ns_options(ns_dtype)
    mine = "bf16 where fast, else fp32" if ns_dtype is None else ns_dtype
    torch_dtype = ns_dtype or "bf16"
    table = {
        "adamw": Peer("adamw", adamw, "torch.optim.AdamW foreach, all tensors"),
        "hybrid_muon": Peer(
            "hybrid_muon",
            lambda g: hybrid_muon(g, ns_coefficients="keller", ns_steps=5, **ours),
            f"muonkit HybridMuon, keller x5, {mine}, batched by shape, Gram where aspect >= 2 in fp32 (default method)",
        ),
        "hybrid_muon_ns": Peer(
            "hybrid_muon_ns",
            lambda g: hybrid_muon(g, ns_coefficients="keller", ns_steps=5, ns_method="newton_schulz", **ours),
            f"muonkit HybridMuon, keller x5, {mine}, batched by shape, plain Newton-Schulz (torch's iteration)",
        ),
        "hybrid_muon_pe": Peer(
            "hybrid_muon_pe",
            lambda g: hybrid_muon(g, ns_coefficients="polar_express", ns_steps=5, **ours),
            f"muonkit HybridMuon default: polar_express x5, {mine}, Gram where aspect >= 2 in fp32",
        ),
        "torch_muon": Peer(
            "torch_muon",
            lambda g: TorchMuonAdamW(g, ns_dtype=torch_dtype),
            f"torch.optim.Muon keller x5 {torch_dtype} + torch AdamW foreach",
        ),
    }
    if compiled:
        how = "torch.compile'd step" if compile_enabled() else "step run eagerly (TORCH_COMPILE_DISABLE is not 0)"
        table["adamw_compiled"] = Peer(
            "adamw_compiled", lambda g: CompiledStep(adamw(g)), f"torch.optim.AdamW foreach, {how}"
        )
        table["torch_muon_compiled"] = Peer(
            "torch_muon_compiled",
            lambda g: CompiledStep(TorchMuonAdamW(g, ns_dtype=torch_dtype)),
            f"torch.optim.Muon keller x5 {torch_dtype} + torch AdamW foreach, {how}",
        )
    if deepspeed:
        for method in ("standard", "gram"):
            table[f"deepspeed_{method}"] = Peer(
                f"deepspeed_{method}",
                functools.partial(deepspeed_muon, ns_method=method),
                f"DeepSpeed SingleDeviceMuonWithAuxAdam ns_method={method!r} (keller x5, "
                f"{deepspeed_ns_dtype(method)} here, its own choice) + inline per-tensor Adam; writes p.grad",
            )
    return table

"""HybridMuon against the plain float64 reference (tests/reference.py) over many steps.

One problem exercises every layout at once: wide and tall matrices, two same-shape matrices
(batched together), a GPT-2 Conv1D weight (transposed), MoE experts (3D), a conv filter
(flatten), a fused QKV split into GQA blocks, and AdamW params (a bias, an embedding, a scalar,
a gain with its own betas) with different step counts (one param misses every third gradient).
Gradients are closed-loop: G = (W - T) + noise_t, the same noise on both sides.

Tolerances, and why:
- params and Newton-Schulz in float64 (``ns_dtype=torch.float64``): 1e-10 absolute on every
  weight and state after 30 steps. Same math, different operation order and batching.
- fp32 params, ``ns_dtype=torch.float32``: 1e-4 relative to the distance travelled (fp32 rounding,
  ~1e-7 per op, accumulated over 30 steps of 5 Newton-Schulz iterations; measured 4.5e-6).
- the default Newton-Schulz dtype, forced to bf16 and to fp32 (tests/conftest.py): 3% relative to the distance travelled per tensor.
  One bf16 orthogonalization differs from float64 by ~1% per entry (8-bit mantissa); the
  closed loop carries those differences from step to step (measured: <= 0.93%).
- bf16 params (fp32 Newton-Schulz), against a reference that also stores its weights in bf16:
  6%. Steps of ~2e-3 per entry are below half a bf16 ulp of weights ~1 (3.9e-3), so which way
  each entry rounds decides a lot, and the two sides diverge once a rounding differs
  (measured: <= 3.7%).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import muonkit
import reference as ref
from muonkit.functional import orthogonalization_flops

F64 = torch.float64
STEPS = 30
ADJUST = ["keller", "match_adamw", "spectral", None]

# name: (shape, group index, layout as the reference sees it)
SPECS: dict[str, tuple[tuple[int, ...], int, str]] = {
    "wide": ((16, 40), 0, "matrix"),
    "tall": ((40, 16), 0, "matrix"),
    "same_a": ((24, 24), 0, "matrix"),
    "same_b": ((24, 24), 0, "matrix"),
    "experts": ((3, 20, 12), 0, "experts"),
    "conv": ((8, 4, 3, 3), 0, "flatten"),
    "conv1d": ((24, 48), 1, "transposed"),
    "qkv": ((32, 16), 2, "matrix"),
    "bias": ((40,), 3, "-"),
    "embedding": ((30, 16), 3, "-"),
    "scalar": ((), 3, "-"),
    "gain": ((12,), 4, "-"),
}
SOMETIMES_NO_GRAD = {"same_b", "gain"}  # no gradient on every third step


def _groups(nesterov: bool, adjust_lr: str | None) -> list[dict[str, Any]]:
    """Every hyperparameter spelled out (the reference reads the same dicts)."""
    muon = {"algorithm": "muon", "nesterov": nesterov, "adjust_lr": adjust_lr, "eps": 1e-7, "ns_steps": None}
    return [
        {**muon, "lr": 0.02, "momentum": 0.95, "weight_decay": 0.1, "ns_coefficients": "polar_express"},
        {**muon, "lr": 0.03, "momentum": 0.9, "weight_decay": 0.0, "ns_coefficients": "keller", "layout": "transposed"},
        {
            **muon,
            "lr": 0.01,
            "momentum": 0.8,
            "weight_decay": 0.05,
            "ns_coefficients": "you",
            "split_sizes": (16, 8, 8),
        },
        {"algorithm": "adamw", "lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01},
        {"algorithm": "adamw", "lr": 3e-3, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.0},
    ]


def _problem(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    init = {n: torch.randn(shape, generator=g, dtype=F64) * 0.5 for n, (shape, _, _) in SPECS.items()}
    target = {n: torch.randn(shape, generator=g, dtype=F64) for n, (shape, _, _) in SPECS.items()}
    noise = [
        {n: torch.randn(shape, generator=g, dtype=F64) for n, (shape, _, _) in SPECS.items()} for _ in range(STEPS)
    ]
    return init, target, noise


def _grad(name: str, w: torch.Tensor, step: int, target: dict, noise: list) -> torch.Tensor | None:
    if name in SOMETIMES_NO_GRAD and step % 3 == 2:
        return None
    return (w.to(F64) - target[name]) + 0.5 * noise[step][name]


def _reference(groups: list[dict[str, Any]], init: dict[str, torch.Tensor]) -> tuple[ref.ReferenceHybridMuon, list]:
    params = []
    for name, (_, gi, layout) in SPECS.items():
        hp = dict(groups[gi])
        if hp["algorithm"] == "muon":
            hp["schedule"], hp["norm_factor"] = ref.SCHEDULES[hp["ns_coefficients"]]
            hp["layout"] = layout
        params.append(ref.RefParam(init[name].clone(), hp["algorithm"], hp))
    return ref.ReferenceHybridMuon(params), list(SPECS)


def _run_both(
    *,
    nesterov: bool,
    adjust_lr: str | None,
    dtype: torch.dtype,
    ns_dtype: torch.dtype | None,
    ns_method: str = "gram",
    device: str = "cpu",
) -> tuple[dict[str, torch.nn.Parameter], muonkit.HybridMuon, ref.ReferenceHybridMuon, dict[str, torch.Tensor]]:
    """``STEPS`` steps of HybridMuon (params on ``device``) and of the float64 CPU reference."""
    init, target, noise = _problem()
    groups = _groups(nesterov, adjust_lr)
    params = {n: torch.nn.Parameter(init[n].to(device=device, dtype=dtype)) for n in SPECS}
    opt_groups = [{**g, "params": [params[n] for n, s in SPECS.items() if s[1] == gi]} for gi, g in enumerate(groups)]
    opt = muonkit.HybridMuon(opt_groups, ns_dtype=ns_dtype, ns_method=ns_method)
    reference, names = _reference(groups, init)
    for step in range(STEPS):
        for n, p in params.items():
            grad = _grad(n, p.detach().cpu(), step, target, noise)
            p.grad = None if grad is None else grad.to(device=device, dtype=dtype)
        opt.step()
        reference.step([_grad(n, rp.value, step, target, noise) for n, rp in zip(names, reference.params, strict=True)])
        if dtype == torch.bfloat16:  # the reference stores its weights in bf16 too
            for rp in reference.params:
                rp.value = rp.value.to(dtype).to(F64)
    return params, opt, reference, init


@pytest.mark.parametrize("adjust_lr", ADJUST)
@pytest.mark.parametrize("nesterov", [True, False])
def test_float64_matches_reference_over_many_steps(nesterov: bool, adjust_lr: str | None) -> None:
    params, opt, reference, _ = _run_both(nesterov=nesterov, adjust_lr=adjust_lr, dtype=F64, ns_dtype=F64)
    for (name, p), rp in zip(params.items(), reference.params, strict=True):
        torch.testing.assert_close(p.detach(), rp.value, rtol=0, atol=1e-10, msg=name)
        state = opt.state[p]
        for key, value in rp.state.items():
            expected = torch.tensor(float(value), dtype=torch.float32) if key == "step" else value
            torch.testing.assert_close(state[key], expected, rtol=0, atol=1e-10, msg=f"{name}.{key}")
        assert set(state) == set(rp.state), name


def _relative_errors(params: dict, reference: ref.ReferenceHybridMuon, init: dict) -> dict[str, float]:
    out = {}
    for (name, p), rp in zip(params.items(), reference.params, strict=True):
        travelled = torch.linalg.vector_norm(rp.value - init[name]).item()
        out[name] = torch.linalg.vector_norm(p.detach().cpu().to(F64) - rp.value).item() / travelled
    return out


@pytest.mark.parametrize("adjust_lr", ["keller", "match_adamw"])
def test_float32_matches_reference(adjust_lr: str) -> None:
    params, _, reference, init = _run_both(
        nesterov=True, adjust_lr=adjust_lr, dtype=torch.float32, ns_dtype=torch.float32
    )
    errors = _relative_errors(params, reference, init)
    assert max(errors.values()) <= 1e-4, errors


# 30 steps in bf16 against the float64 reference, relative to the distance travelled. The plain
# iteration stays within 3% (measured <= 0.93%); the default Gram iteration rounds its n x n
# Gram matrix to bf16 at every step, about twice the per-step rounding (measured <= 3.95%).
@pytest.mark.parametrize(("ns_method", "tolerance"), [("newton_schulz", 0.03), ("gram", 0.06)])
@pytest.mark.parametrize("nesterov", [True, False])
def test_default_bf16_newton_schulz_stays_close_to_reference(
    nesterov: bool, ns_method: str, tolerance: float, fast_bf16: bool
) -> None:
    """ns_dtype=None, as on a CPU with fast bf16 (bf16 Newton-Schulz) and without (fp32), on any CPU."""
    assert muonkit.functional.default_compute_dtype("cpu") == (torch.bfloat16 if fast_bf16 else torch.float32)
    params, opt, reference, init = _run_both(
        nesterov=nesterov, adjust_lr="keller", dtype=torch.float32, ns_dtype=None, ns_method=ns_method
    )
    errors = _relative_errors(params, reference, init)
    assert max(errors.values()) <= tolerance, errors
    assert all(opt.state[p]["momentum_buffer"].dtype == torch.float32 for n, p in params.items() if SPECS[n][1] < 3)


def test_bf16_params_keep_fp32_state_and_track_reference() -> None:
    """bf16 weights: updates go through fp32, states stay fp32; only bf16 storage rounding differs."""
    params, opt, reference, init = _run_both(
        nesterov=True, adjust_lr="keller", dtype=torch.bfloat16, ns_dtype=torch.float32
    )
    for p in params.values():
        assert p.dtype == torch.bfloat16
        assert all(v.dtype == torch.float32 for v in opt.state[p].values())
    errors = _relative_errors(params, reference, init)
    assert max(errors.values()) <= 0.06, errors


def test_same_shape_matrices_are_orthogonalized_in_one_batched_call(monkeypatch: pytest.MonkeyPatch) -> None:
    from muonkit.functional import muon as muon_module

    calls: list[tuple[int, ...]] = []
    real = muon_module.orthogonalize_resolved

    def spy(parts: list[torch.Tensor], **kwargs: Any) -> torch.Tensor:
        calls.append((sum(p.size(0) for p in parts), *parts[0].shape[1:]))
        return real(parts, **kwargs)

    monkeypatch.setattr(muon_module, "orthogonalize_resolved", spy)
    a, b = torch.nn.Parameter(torch.randn(8, 12)), torch.nn.Parameter(torch.randn(8, 12))
    experts, tall = torch.nn.Parameter(torch.randn(3, 8, 12)), torch.nn.Parameter(torch.randn(12, 8))
    qkv = torch.nn.Parameter(torch.randn(24, 12))
    opt = muonkit.HybridMuon(
        [{"params": [a, b, experts, tall], "algorithm": "muon"}, {"params": [qkv], "split_sizes": (8, 8, 8)}]
    )
    for p in (a, b, experts, tall, qkv):
        p.grad = torch.randn_like(p)
    opt.step()
    # group 0: the five 8x12 matrices (a, b and 3 experts) in one call, the 12x8 one alone;
    # group 1: the three 8x12 blocks of the QKV weight in one call.
    assert sorted(calls) == sorted([(5, 8, 12), (1, 12, 8), (3, 8, 12)])
    steps = 5
    assert opt.strategy.stats.matrices == 9
    assert opt.strategy.stats.flops == 8 * orthogonalization_flops(8, 12, steps) + orthogonalization_flops(12, 8, steps)


def test_plain_tensor_list_is_all_muon_with_defaults() -> None:
    w = torch.nn.Parameter(torch.randn(16, 32))
    opt = muonkit.HybridMuon([w])
    group = opt.param_groups[0]
    assert group["algorithm"] == "muon" and group["lr"] == 0.02 and group["momentum"] == 0.95
    assert group["nesterov"] is True and group["adjust_lr"] == "keller" and group["ns_coefficients"] == "polar_express"
    w.grad = torch.randn_like(w)
    before = w.detach().clone()
    opt.step()
    d = (before - w.detach()) / 0.02  # one step from zero momentum: D = orthogonalize((1-mu)G + mu*(1-mu)G)
    s = torch.linalg.svdvals(d.double())
    assert s.min() >= 0.8 and s.max() <= 1.2


def test_adamw_group_defaults() -> None:
    w, b = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))
    opt = muonkit.HybridMuon([{"params": [w]}, {"params": [b], "algorithm": "adamw"}], adamw_lr=1e-3)
    group = opt.param_groups[1]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (1e-3, (0.9, 0.95), 1e-8, 0.0)

"""NorMuon (``algorithm="normuon"``, arXiv 2510.05491) and cautious weight decay (``cautious_wd``,
arXiv 2510.12402) on one device, against deliberately simple float64 references.

The references loop over matrices and rows in plain Python and share nothing with the fast path
but :func:`muonkit.orthogonalize` (tested on its own). Everything runs in float64 (params, states
and Newton-Schulz), so the tolerance is 1e-12 relative to the distance a param travelled.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import muonkit
from muonkit.config import DEFAULTS
from muonkit.functional import lr_scale, orthogonalize
from muonkit.functional.matrices import MatrixLayout
from muonkit.functional.normuon import normuon_normalize

F64 = torch.float64
TOL = 1e-12
BETA1, BETA2, EPS, LR, WD = 0.95, 0.9, 1e-8, 0.05, 0.3

# (shape, group options): a matrix, a GPT-2 Conv1D, experts, a fused QKV, a conv, a tall matrix
CASES: list[tuple[tuple[int, ...], dict[str, Any]]] = [
    ((8, 12), {}),
    ((6, 10), {"layout": "transposed", "adjust_lr": "match_adamw"}),
    ((3, 5, 4), {}),
    ((12, 6), {"split_sizes": (4, 8), "adjust_lr": "spectral"}),
    ((4, 2, 3, 3), {}),
    ((16, 4), {"nesterov": False}),
    ((6, 12), {"split_sizes": (4,) * 3, "split_along": "cols"}),  # a per-head output projection
    ((12, 6), {"layout": "transposed", "split_sizes": (4, 8), "split_along": "cols", "adjust_lr": "match_adamw"}),
]


def _grad(shape: tuple[int, ...], step: int, k: int) -> Tensor:
    g = torch.Generator().manual_seed(100 * step + k)
    # rows of very different magnitudes: what NorMuon's row normalization is for
    rows = torch.logspace(-2, 1, shape[0], dtype=F64).reshape(-1, *[1] * (len(shape) - 1))
    return torch.randn(shape, generator=g, dtype=F64) * rows


def _initial(shape: tuple[int, ...], k: int) -> Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(7 + k), dtype=F64)


def _matrices(t: Tensor, layout: MatrixLayout) -> list[Tensor]:
    """Every matrix of ``t`` as an (rows, cols) view, in the order of NorMuon's row state."""
    count, rows, cols = layout.base_shape(t.shape)
    base = (t.mT if layout.resolved(t.ndim) == "transposed" else t).reshape(count, rows, cols)
    dim = 1 if layout.splits_cols else 0
    sizes = layout.split_sizes or (rows,)  # no split: whole rows
    return [block for k in range(count) for block in torch.split(base[k], list(sizes), dim=dim)]


def reference_normuon(
    w: Tensor, grads: list[Tensor], options: dict[str, Any], *, cautious: bool = False
) -> tuple[Tensor, Tensor]:
    """The paper's Algorithm 1 with the authors' Frobenius-preserving rescale, matrix by matrix."""
    layout = MatrixLayout(options.get("layout", "auto"), options.get("split_sizes"), options.get("split_along", "rows"))
    nesterov = options.get("nesterov", True)
    adjust = options.get("adjust_lr", "keller")
    w, m = w.clone(), torch.zeros_like(w)
    v = torch.zeros(sum(mat.size(0) for mat in _matrices(w, layout)), dtype=F64)  # one value per row of each block
    for g in grads:
        m = BETA1 * m + (1 - BETA1) * g
        u = (1 - BETA1) * g + BETA1 * m if nesterov else m
        direction = torch.zeros_like(w)
        offset = 0
        for mat, out in zip(_matrices(u, layout), _matrices(direction, layout), strict=True):
            o = orthogonalize(mat, dtype=F64, eps=EPS)
            o_hat = torch.empty_like(o)
            for r in range(o.size(0)):
                v[offset + r] = BETA2 * v[offset + r] + (1 - BETA2) * (o[r] ** 2).mean()
                o_hat[r] = o[r] / (v[offset + r].sqrt() + EPS)
            o_hat = o_hat * o.norm() / o_hat.norm()
            out.copy_(lr_scale(adjust, o.size(0), o.size(1)) * o_hat)
            offset += o.size(0)
        decay = torch.ones_like(w)
        if cautious:
            decay = ((direction * w) >= 0).to(F64)
        w = w - LR * WD * decay * w - LR * direction
    return w, v


def _normuon_opt(params: list[nn.Parameter], options: dict[str, Any], **kwargs: Any) -> muonkit.HybridMuon:
    group = {"params": params, "algorithm": "normuon", "beta2": BETA2, "eps": EPS, **options}
    return muonkit.HybridMuon([group], lr=LR, momentum=BETA1, weight_decay=WD, ns_dtype=F64, **kwargs)


@pytest.mark.parametrize("cautious", [False, True])
@pytest.mark.parametrize(("shape", "options"), CASES, ids=[str(c[0]) + str(sorted(c[1])) for c in CASES])
def test_normuon_matches_the_float64_reference(shape: tuple[int, ...], options: dict[str, Any], cautious: bool) -> None:
    grads = [_grad(shape, s, len(shape)) for s in range(4)]
    p = nn.Parameter(_initial(shape, 0))
    opt = _normuon_opt([p], {**options, "cautious_wd": cautious})
    for g in grads:
        p.grad = g.clone()
        opt.step()
    want, v = reference_normuon(_initial(shape, 0), grads, options, cautious=cautious)
    travelled = (want - _initial(shape, 0)).norm()
    assert (p.detach() - want).norm() <= TOL * travelled
    assert torch.allclose(opt.state[p]["row_exp_avg_sq"], v, rtol=1e-12, atol=0)


def test_normuon_differs_from_muon_and_balances_rows() -> None:
    """Not vacuous: with rows of very different gradient scales NorMuon's step differs from Muon's,
    and its rows' RMS are far more even than Muon's (the point of the method)."""
    shape = (16, 32)
    steps = {}
    for algorithm in ("muon", "normuon"):
        p = nn.Parameter(_initial(shape, 0))
        opt = muonkit.HybridMuon([{"params": [p], "algorithm": algorithm}], ns_dtype=F64, lr=1.0)
        for s in range(3):
            before = p.detach().clone()
            p.grad = _grad(shape, s, 0)
            opt.step()
        steps[algorithm] = p.detach() - before
    spread = {a: (d.square().mean(1).sqrt().max() / d.square().mean(1).sqrt().min()).item() for a, d in steps.items()}
    assert spread["normuon"] < 1.5 < spread["muon"], spread
    assert math.isclose(steps["normuon"].norm(), steps["muon"].norm(), rel_tol=0.3)  # norms alike, rows not


def test_normuon_normalize_keeps_the_frobenius_norm_and_is_pure() -> None:
    o = torch.randn(2, 5, 7, dtype=F64) * torch.tensor([1.0, 100.0], dtype=F64).view(2, 1, 1)
    v = torch.rand(2, 5, dtype=F64)
    o0, v0 = o.clone(), v.clone()
    o_hat, v_new = normuon_normalize(o, v, beta2=0.95, eps=1e-8)
    assert torch.equal(o, o0) and torch.equal(v, v0)
    assert torch.allclose(o_hat.norm(dim=(-2, -1)), o.norm(dim=(-2, -1)), rtol=1e-13)
    assert torch.allclose(v_new, 0.95 * v + 0.05 * o.square().mean(-1), rtol=1e-13)
    zero, v_zero = normuon_normalize(torch.zeros(3, 4), torch.zeros(3), beta2=0.5, eps=1e-8)
    assert torch.equal(zero, torch.zeros(3, 4)) and torch.equal(v_zero, torch.zeros(3))
    with pytest.raises(ValueError, match=r"v has shape \(4,\), the rows of o \(3,\)"):
        normuon_normalize(torch.zeros(3, 4), torch.zeros(4), beta2=0.5, eps=1e-8)


# ------------------------------------------------------------------ cautious weight decay


def _adamw_reference(w: Tensor, grads: list[Tensor], *, cautious: bool) -> Tensor:
    b1, b2, eps = 0.9, 0.95, 1e-8
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        u = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
        mask = (u * w >= 0).to(F64) if cautious else torch.ones_like(w)
        w = w - LR * (u + WD * mask * w)
    return w


@pytest.mark.parametrize("cautious", [False, True])
def test_adamw_cautious_wd_matches_the_float64_reference(cautious: bool) -> None:
    shape = (6, 5)
    grads = [_grad(shape, s, 3) for s in range(4)]
    p = nn.Parameter(_initial(shape, 1))
    group = {"params": [p], "algorithm": "adamw", "lr": LR, "weight_decay": WD, "cautious_wd": cautious}
    opt = muonkit.HybridMuon([group])
    for g in grads:
        p.grad = g.clone()
        opt.step()
    want = _adamw_reference(_initial(shape, 1), grads, cautious=cautious)
    assert (p.detach() - want).norm() <= TOL * (want - _initial(shape, 1)).norm()


@pytest.mark.parametrize("algorithm", ["muon", "normuon", "adamw"])
def test_cautious_wd_skips_decay_exactly_where_signs_disagree(algorithm: str) -> None:
    """One step from a weight whose signs disagree with the update on some entries: those entries
    move by the update alone, the others as with plain decay (bit for bit), and the two differ."""
    w0 = _initial((8, 8), 2)
    grad = _grad((8, 8), 0, 5)
    result = {}
    for cautious in (False, True):
        p = nn.Parameter(w0.clone())
        opt = muonkit.HybridMuon(
            [{"params": [p], "algorithm": algorithm, "weight_decay": WD, "cautious_wd": cautious}], ns_dtype=F64
        )
        p.grad = grad.clone()
        opt.step()
        result[cautious] = p.detach()
    no_decay = nn.Parameter(w0.clone())
    opt = muonkit.HybridMuon([{"params": [no_decay], "algorithm": algorithm, "weight_decay": 0.0}], ns_dtype=F64)
    no_decay.grad = grad.clone()
    opt.step()
    step = w0 - no_decay.detach()  # lr * u: same sign as the update u
    agree = step * w0 >= 0
    assert 0 < int(agree.sum()) < agree.numel(), "the case must have agreeing and disagreeing signs"
    assert torch.equal(result[True][agree], result[False][agree])
    assert torch.equal(result[True][~agree], no_decay.detach()[~agree])
    assert not torch.equal(result[True], result[False])


# ------------------------------------------------------------------ configuration and state


def test_defaults_and_keywords_fill_normuon_groups() -> None:
    p, q = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
    opt = muonkit.HybridMuon([{"params": [p], "algorithm": "normuon"}, {"params": [q], "algorithm": "muon"}])
    assert (opt.param_groups[0]["beta2"], opt.param_groups[0]["eps"]) == (DEFAULTS.normuon_beta2, DEFAULTS.normuon_eps)
    assert "beta2" not in opt.param_groups[1] and opt.param_groups[1]["eps"] == DEFAULTS.eps
    assert all(g["cautious_wd"] is False for g in opt.param_groups)
    opt = muonkit.HybridMuon(
        [{"params": [p], "algorithm": "normuon", "beta2": 0.5}], normuon_beta2=0.9, normuon_eps=1e-6, cautious_wd=True
    )
    group = opt.param_groups[0]
    assert (group["beta2"], group["eps"], group["cautious_wd"]) == (0.5, 1e-6, True)


@pytest.mark.parametrize(
    ("group", "message"),
    [
        ({"algorithm": "normuon", "beta2": 1.0}, r"Invalid beta2=1\.0: must be in \[0, 1\) in param group 0"),
        ({"algorithm": "normuon", "beta2": -0.1}, r"Invalid beta2=-0\.1: must be in \[0, 1\)"),
        ({"algorithm": "normuon", "beta2": "0.9"}, r"Invalid beta2='0\.9'"),
        ({"algorithm": "normuon", "eps": 0.0}, r"Invalid eps=0\.0: must be > 0"),
        ({"algorithm": "normuon", "eps": -1e-8}, r"Invalid eps=-1e-08"),
        ({"algorithm": "muon", "beta2": 0.9}, r"beta2 is NorMuon's; set algorithm='normuon'"),
        ({"algorithm": "adamw", "beta2": 0.9}, r"in an AdamW group: set betas=\(beta1, beta2\)"),
        ({"algorithm": "muon", "cautious_wd": "yes"}, r"Invalid cautious_wd='yes'"),
        ({"algorithm": "adamw", "cautious_wd": 1}, r"Invalid cautious_wd=1"),
        ({"algorithm": "NorMuon"}, r"Invalid algorithm='NorMuon'.*must be one of \('muon', 'normuon', 'adamw'\)"),
    ],
)
def test_bad_settings_raise_with_what_is_allowed(group: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        muonkit.HybridMuon([{"params": [nn.Parameter(torch.randn(4, 4))], **group}])


def test_bad_keywords_raise() -> None:
    p = nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match=r"Invalid beta2=1\.5"):
        muonkit.HybridMuon([{"params": [p], "algorithm": "normuon"}], normuon_beta2=1.5)
    with pytest.raises(ValueError, match=r"Invalid muon_algorithm='adamw': must be one of \('muon', 'normuon'\)"):
        muonkit.param_groups(nn.Linear(4, 4), muon_algorithm="adamw")
    with pytest.raises(ValueError, match=r"Unknown key 'beta2' in muon_options \('beta2' is a NorMuon setting\)"):
        muonkit.param_groups(nn.Linear(4, 4), muon_options={"beta2": 0.9})


def test_param_groups_routes_normuon_like_muon() -> None:
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8))
    muon = muonkit.param_groups(model)
    groups = muonkit.param_groups(model, muon_algorithm="normuon", muon_options={"beta2": 0.9, "cautious_wd": True})
    assert [g["param_names"] for g in groups] == [g["param_names"] for g in muon]
    assert [g["algorithm"] for g in groups] == [g["algorithm"].replace("muon", "normuon") for g in muon]
    matrices = [g for g in groups if g["algorithm"] == "normuon"]
    assert matrices and all(g["beta2"] == 0.9 and g["cautious_wd"] for g in matrices)
    muonkit.HybridMuon(groups)  # valid groups


def _trained(steps: int, opt: muonkit.HybridMuon, params: list[nn.Parameter], start: int = 0) -> None:
    for s in range(start, start + steps):
        for k, p in enumerate(params):
            p.grad = _grad(tuple(p.shape), s, k).to(p.dtype)
        opt.step()


def _model() -> list[nn.Parameter]:
    return [nn.Parameter(_initial(s, k).float()) for k, s in enumerate([(8, 6), (3, 4, 5), (12, 6)])]


def _opt(params: list[nn.Parameter]) -> muonkit.HybridMuon:
    return muonkit.HybridMuon(
        [
            {"params": params[:2], "algorithm": "normuon", "cautious_wd": True, "weight_decay": 0.1},
            {"params": params[2:], "algorithm": "normuon", "split_sizes": (4, 8)},
        ]
    )


def test_checkpoint_round_trip_resumes_bit_identically() -> None:
    straight = _model()
    opt = _opt(straight)
    _trained(4, opt, straight)
    resumed = _model()
    first = _opt(resumed)
    _trained(2, first, resumed)
    saved = first.state_dict()
    assert [tuple(s["row_exp_avg_sq"].shape) for s in saved["state"].values()] == [(8,), (12,), (12,)]
    second = _opt(resumed)
    second.load_state_dict(saved)
    _trained(2, second, resumed, start=2)
    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["row_exp_avg_sq"], second.state[b]["row_exp_avg_sq"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda v: v[:-1], r"row_exp_avg_sq of param 0 \(group 0\) has shape \(7,\), the param needs \(8,\)"),
        (lambda v: -v, r"row_exp_avg_sq of param 0 \(group 0\) has negative values"),
        (lambda v: v * float("nan"), r"row_exp_avg_sq of param 0 \(group 0\) has non-finite values"),
        (None, r"Saved state of param 0 \(group 0, normuon\) lacks \['row_exp_avg_sq'\]"),
    ],
)
def test_a_bad_saved_row_state_raises_and_changes_nothing(change: Any, message: str) -> None:
    params = _model()
    opt = _opt(params)
    _trained(1, opt, params)
    saved = opt.state_dict()
    state = saved["state"][0]
    if change is None:
        del state["row_exp_avg_sq"]
    else:
        state["row_exp_avg_sq"] = change(state["row_exp_avg_sq"])
    fresh = _opt(_model())
    with pytest.raises(ValueError, match=message):
        fresh.load_state_dict(saved)
    assert not fresh.state


def test_a_normuon_state_does_not_load_into_a_muon_group() -> None:
    params = _model()
    opt = _opt(params)
    _trained(1, opt, params)
    muon = muonkit.HybridMuon([{"params": _model()[:2], "algorithm": "muon"}, {"params": _model()[2:]}])
    with pytest.raises(ValueError, match=r"Param group 0 is 'muon' here but 'normuon' in the saved state"):
        muon.load_state_dict(opt.state_dict())


def test_make_optimizer_builds_normuon_groups_and_cautious_decay() -> None:
    from muonkit.integrations.transformers import make_optimizer

    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8))
    opt = make_optimizer(model, muon_algorithm="normuon", cautious_wd=True, beta2=0.9)
    by_algorithm = {g["algorithm"]: g for g in opt.param_groups}
    assert set(by_algorithm) == {"normuon", "adamw"}
    assert by_algorithm["normuon"]["beta2"] == 0.9 and by_algorithm["normuon"]["eps"] == DEFAULTS.normuon_eps
    assert all(g["cautious_wd"] is True for g in opt.param_groups)
    with pytest.raises(ValueError, match=r"Unknown key 'beta2' among make_optimizer's Muon options"):
        make_optimizer(model, beta2=0.9)


def _cautious_per_tensor(params: list[Tensor], updates: list[Tensor], factor: float | Tensor) -> None:
    """cautious_decay_ as it was, one tensor at a time: the bit-for-bit reference."""
    for w, u in zip(params, updates, strict=True):
        same = torch.sign(u) * torch.sign(w) >= 0
        w.copy_(torch.where(same, w * factor, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("rate", ["float", "tensor"])
def test_cautious_decay_is_foreach_and_bit_for_bit_the_per_tensor_form(dtype: torch.dtype, rate: str) -> None:
    """Over a list of several shapes and dtypes of updates, with zeros, -0.0 and infinities in the
    weights and updates: the same bits as the per-tensor form; and a fixed set of foreach ops,
    however many tensors (the per-tensor form issues a few ops per tensor)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from muonkit.functional import cautious_decay_

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.names.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    def case(n: int) -> tuple[list[Tensor], list[Tensor]]:
        gen = torch.Generator().manual_seed(n)
        params = [torch.randn(3 + i, 4, generator=gen).to(dtype) for i in range(n)]
        updates = [torch.randn(3 + i, 4, generator=gen).to(torch.float32 if i % 2 else dtype) for i in range(n)]
        specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf")])
        params[0][0], updates[0][0] = specials, specials.flip(0)
        params[0][1, :2], updates[0][1, :2] = 0.0, -1.0
        return params, updates

    lr = torch.tensor(0.25) if rate == "tensor" else 0.25
    for n in (1, 5):
        params, updates = case(n)
        want = [p.clone() for p in params]
        _cautious_per_tensor(want, updates, 1.0 - lr * 0.3)
        cautious_decay_(params, updates, lr=lr, weight_decay=0.3)
        for got, expected in zip(params, want, strict=True):
            assert got.dtype == dtype and torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    counts = {}
    for n in (2, 6):
        params, updates = case(n)
        updates = [u.to(dtype) for u in updates]
        with Ops() as ops:
            cautious_decay_(params, updates, lr=lr, weight_decay=0.3)
        casts = ops.names.count("aten._to_copy")  # bf16 weights: the multiplier is float32
        assert casts == (n if dtype == torch.bfloat16 else 0), ops.names
        counts[n] = [name for name in ops.names if name != "aten._to_copy"]
        factor_ops = ["aten.mul", "aten.rsub"] if rate == "tensor" else []  # 1 - lr*wd on the device
        assert counts[n][: len(factor_ops)] == factor_ops, ops.names
        assert all(name.startswith("aten._foreach_") for name in counts[n][len(factor_ops) :]), ops.names
    assert counts[2] == counts[6], counts

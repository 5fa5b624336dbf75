"""What the docs promise holds, or says exactly where it does not (issue 20 point 5).

- A rank-deficient input stays rank-deficient in fp32 and fp64 for the step counts stated
  (``RANK_KEPT_STEPS``), and is lifted to full rank beyond them, as stated.
- ``eps`` is bounded where every preset keeps its band; beyond, a ValueError names the band.
- The capturable step equals the plain one bit for bit on the CPU, 0-dim and bf16 params included.
- The docs' "group key" column (docs/optimizer.md) is the behaviour: every setting is accepted under its group key
  in the algorithms named, and raises with the right hint elsewhere; ``muonkit.Muon`` takes
  torch's ``adjust_lr_fn`` in a group.
- ``strategy=`` takes a Strategy (a TypeError naming it otherwise).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import muonkit
import spectra
from muonkit.config import DEFAULTS, GROUP_KEYS, SCHEDULER_KEYS
from muonkit.functional.coefficients import PRESETS, RANK_KEPT_STEPS
from muonkit.functional.validation import MAX_NS_EPS

OPTIMIZER_PAGE = Path(__file__).resolve().parents[2] / "docs" / "optimizer.md"  # the docs page of HybridMuon
F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16


# ---------------------------------------------------------------------------- rank-deficient inputs


def _low_rank(rows: int, cols: int, rank: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, rank, generator=g, dtype=F64) @ torch.randn(rank, cols, generator=g, dtype=F64)


RANK_INPUTS = [(16, 48, 4, 0), (48, 16, 1, 1), (32, 128, 8, 2)]  # the issue's rank-4 16x48 first


@pytest.mark.parametrize("method", ["newton_schulz", "gram"])
@pytest.mark.parametrize("dtype", [F32, F64], ids=str)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_a_rank_deficient_input_stays_rank_deficient_up_to_the_stated_steps(
    preset: str, dtype: torch.dtype, method: str
) -> None:
    """At RANK_KEPT_STEPS (10 fp32, 26 fp64) spurious singular values stay below 1e-2 (measured
    at most 9.4e-3), and the result does not depend on the input's scale beyond that."""
    steps = RANK_KEPT_STEPS[str(dtype).removeprefix("torch.")]
    for rows, cols, rank, seed in RANK_INPUTS:
        x = _low_rank(rows, cols, rank, seed).to(dtype)
        o = muonkit.orthogonalize(x, coefficients=preset, steps=steps, dtype=dtype, method=method)
        s = torch.linalg.svdvals(o.to(F64))
        assert s[rank:].max() < 1e-2, (rows, cols, rank, s[rank:].max().item())
        assert s[:rank].min() >= PRESETS[preset].band[0] - 0.01
        scaled = muonkit.orthogonalize(x * 1e-3, coefficients=preset, steps=steps, dtype=dtype, method=method)
        assert (o - scaled).abs().max() < 2e-2


@pytest.mark.parametrize(("dtype", "steps"), [(F32, 20), (F64, 50)], ids=["fp32", "fp64"])
def test_beyond_the_stated_steps_the_noise_is_lifted_as_the_docs_say(dtype: torch.dtype, steps: int) -> None:
    """The issue's case: rank-4 16x48, 16 of 16 singular values near 1 by 20 (fp32) / 50 (fp64) steps."""
    x = _low_rank(16, 48, 4, 0).to(dtype)
    s = torch.linalg.svdvals(muonkit.orthogonalize(x, steps=steps, dtype=dtype).to(F64))
    assert (s > 0.5).sum() == 16


def test_the_docs_state_the_rank_counts() -> None:
    text = " ".join(OPTIMIZER_PAGE.read_text().split())
    assert (
        f"rank-deficient input stays rank-deficient for up to {RANK_KEPT_STEPS['float32']} steps in fp32 and "
        f"{RANK_KEPT_STEPS['float64']} in fp64"
    ) in text


# ---------------------------------------------------------------------------- eps


@pytest.mark.parametrize("eps", [1e30, 0.5, 0.011, float(MAX_NS_EPS) * (1 + 1e-12)])
def test_an_eps_beyond_the_band_raises_naming_it(eps: float) -> None:
    band = f"must be in (0, {MAX_NS_EPS:g}]"
    with pytest.raises(ValueError, match="^" + re.escape(f"Invalid eps={eps!r}: {band}")):
        muonkit.orthogonalize(torch.randn(4, 8), eps=eps)
    with pytest.raises(ValueError, match=re.escape(f"Invalid eps={eps!r}: {band}") + r".* in param group 0$"):
        muonkit.HybridMuon([nn.Parameter(torch.randn(4, 8))], eps=eps)
    with pytest.raises(ValueError, match=re.escape(f"Invalid eps={eps!r}: {band}")):
        muonkit.HybridMuon([{"params": [nn.Parameter(torch.randn(4, 8))], "algorithm": "normuon"}], normuon_eps=eps)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_keeps_its_band_at_the_largest_eps(preset: str, dtype: torch.dtype) -> None:
    """At eps = 0.01 (and the default) every kept singular value of the hard inputs stays in the band."""
    lo, hi = PRESETS[preset].band
    _, batch = spectra.hard_batch(32, 128, 0)
    for eps in (1e-7, MAX_NS_EPS):
        out = muonkit.orthogonalize(batch, coefficients=preset, eps=eps, dtype=dtype)
        for x, o in zip(batch, out, strict=True):
            diag, _ = spectra.response(x, o, PRESETS[preset].min_relative)
            assert lo <= diag.min() and diag.max() <= hi, (eps, diag.min().item(), diag.max().item())


def test_an_adamw_eps_below_float32s_smallest_normal_raises() -> None:
    vector = nn.Parameter(torch.randn(3))
    with pytest.raises(
        ValueError,
        match=r"^Invalid eps=1e-40: must be >= 1\.175e-38: float32's smallest normal value; .* in param group 0$",
    ):
        muonkit.HybridMuon([{"params": [vector], "algorithm": "adamw", "eps": 1e-40}])
    muonkit.HybridMuon([{"params": [vector], "algorithm": "adamw", "eps": torch.finfo(F32).tiny}])


# ---------------------------------------------------------------------------- capturable


def _twin(capturable: bool, shapes: list[tuple[int, ...]], dtype: torch.dtype, hp: dict[str, Any], seed: int) -> list:
    torch.manual_seed(seed)
    params = [nn.Parameter(torch.randn(s).to(dtype)) for s in shapes]
    matrices = [p for p in params if p.ndim >= 2]
    others = [p for p in params if p.ndim < 2]
    groups = [{"params": others, "algorithm": "adamw", "lr": hp["lr"], "weight_decay": hp["wd"]}]
    if matrices:
        groups.append({"params": matrices, "algorithm": hp["algorithm"], "lr": hp["lr"], "weight_decay": hp["wd"]})
    opt = muonkit.HybridMuon(groups, nonfinite="unchecked", capturable=capturable, cautious_wd=hp["cautious"])
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(dtype)
        opt.step()
    return [p.detach().clone() for p in params] + [
        v.clone() for p in params for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.ndim > 0
    ]


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_the_capturable_step_of_a_0_dim_param_equals_the_plain_one(dtype: torch.dtype) -> None:
    """Was: 0-dim params differed by a few ulps at lr 1.0 (a 0-dim param with a 0-dim float64 rate
    tensor computes in float64; the plain step's numbers do not promote it)."""
    hp = {"lr": 1.0, "wd": 0.1, "cautious": False, "algorithm": "muon"}
    for seed in range(8):
        plain, captured = _twin(False, [()], dtype, hp, seed), _twin(True, [()], dtype, hp, seed)
        assert all(torch.equal(a, b) for a, b in zip(plain, captured, strict=True)), seed


@settings(max_examples=settings().max_examples * 2, deadline=None)
@given(
    shapes=st.lists(st.sampled_from([(), (1,), (5,), (4, 6), (2, 3, 4)]), min_size=1, max_size=3),
    dtype=st.sampled_from([F32, BF16, F64]),
    lr=st.sampled_from([1.0, 0.3, 0.02]),
    wd=st.sampled_from([0.0, 0.1, 0.5]),
    cautious=st.booleans(),
    algorithm=st.sampled_from(["muon", "normuon"]),
    seed=st.integers(0, 1000),
)
def test_fuzzed_capturable_twins_are_bit_identical_on_the_cpu(
    shapes: list[tuple[int, ...]], dtype: torch.dtype, lr: float, wd: float, cautious: bool, algorithm: str, seed: int
) -> None:
    hp = {"lr": lr, "wd": wd, "cautious": cautious, "algorithm": algorithm}
    plain, captured = _twin(False, shapes, dtype, hp, seed), _twin(True, shapes, dtype, hp, seed)
    assert all(torch.equal(a, b) for a, b in zip(plain, captured, strict=True))


# ---------------------------------------------------------------------------- group keys


def _group_key_column() -> dict[str, tuple[str | None, tuple[str, ...]]]:
    """``{argument: (group key or None, algorithms)}`` from the docs' HybridMuon table."""
    section = (
        OPTIMIZER_PAGE.read_text().split("### `muonkit.HybridMuon(params, **defaults)`", 1)[1].split("\n### ", 1)[0]
    )
    rows = re.findall(
        r"^\| `(\w+)`(?:, `\w+`)* \| `[^`]*`[^|]*\| (`(\w+)` \((.*?)\)|— \(optimizer\)) \|", section, re.M
    )
    return {name: (key or None, tuple(a.strip() for a in algos.split(","))) for name, _, key, algos in rows}


def _param(algorithm: str) -> nn.Parameter:
    return nn.Parameter(torch.randn(4, 6) if algorithm != "adamw" else torch.randn(6))


def test_the_group_key_column_covers_every_setting_and_every_group_key() -> None:
    column = _group_key_column()
    keywords = [k for k in DEFAULTS.__dataclass_fields__] + ["process_group"]
    assert sorted(column) == sorted(keywords)
    keys = {key for key, _ in column.values() if key}
    # algorithm and split_along are set per group by routing (param_groups), not optimizer keywords
    assert keys == set(GROUP_KEYS) - {"params", "param_names", "algorithm", "split_along", *SCHEDULER_KEYS}


@pytest.mark.parametrize("name", list(_group_key_column()))
def test_each_setting_is_a_group_key_where_the_docs_say_and_raises_with_a_hint_elsewhere(name: str) -> None:
    key, algorithms = _group_key_column()[name]
    value = getattr(DEFAULTS, name, None)
    if key is None:
        message = (
            f"({name} is an optimizer keyword, not a group key: HybridMuon(..., {name}=...) sets it for every group)"
        )
        with pytest.raises(ValueError, match=re.escape(message)):
            muonkit.HybridMuon([{"params": [_param("muon")], name: value}])
        return
    readers = {a for k, algos in _group_key_column().values() if k == key for a in algos}  # lr: every algorithm
    for algorithm in ("muon", "normuon", "adamw"):
        group = {"params": [_param(algorithm)], "algorithm": algorithm, key: value}
        if algorithm in algorithms:
            opt = muonkit.HybridMuon([group])
            assert opt.param_groups[0][key] == value
        elif algorithm not in readers:
            with pytest.raises(ValueError, match=rf"^Invalid (key '{key}'|{key}=).* in param group 0"):  # never read
                muonkit.HybridMuon([group])
        if name != key:  # a keyword that is another name in a group: the hint depends on the group
            wrong = {"params": [_param(algorithm)], "algorithm": algorithm, name: value}
            hint = (
                f" (did you mean {key!r}?)"
                if algorithm in algorithms
                else f" ({name} is HybridMuon's default for {algorithms[0]!r} groups, not a group key: a group with "
                f"algorithm={algorithms[0]!r} sets it as {key!r};"
            )
            with pytest.raises(ValueError, match=re.escape(f"Unknown key {name!r} in param group 0{hint}")):
                muonkit.HybridMuon([wrong])


@pytest.mark.parametrize(
    ("key", "hint"),
    [
        ("nonfinite", "(nonfinite is an optimizer keyword, not a group key: HybridMuon(..., nonfinite=...)"),
        ("adamw_lr", "(adamw_lr is HybridMuon's default for 'adamw' groups, not a group key:"),
        ("adamw_eps", "'eps' in a 'muon' group would set that group's own eps)"),
    ],
)
def test_the_issues_keys_in_a_muon_group_get_the_right_hint(key: str, hint: str) -> None:
    """Was: no hint for nonfinite; "did you mean 'lr'?" for adamw_lr and "'eps'?" for adamw_eps,
    which in a Muon group would set Muon's lr and Newton-Schulz eps."""
    with pytest.raises(ValueError, match=re.escape(hint)):
        muonkit.Muon([{"params": [_param("muon")], key: 1e-3}])


@pytest.mark.parametrize(
    ("value", "ours"),
    [("original", "keller"), ("match_rms_adamw", "match_adamw"), (None, "keller"), ("spectral", "spectral")],
)
def test_muon_takes_torchs_adjust_lr_fn_as_a_group_key(value: str | None, ours: str) -> None:
    weight, twin = nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.randn(8, 4))
    with torch.no_grad():
        twin.copy_(weight)
    opt = muonkit.Muon([{"params": [weight], "adjust_lr_fn": value}], lr=0.02)
    assert opt.param_groups[0]["adjust_lr"] == ours and "adjust_lr_fn" not in opt.param_groups[0]
    control = muonkit.Muon([twin], lr=0.02, adjust_lr_fn=value)
    for p in (weight, twin):
        p.grad = torch.ones_like(p)
    opt.step()
    control.step()
    assert torch.equal(weight, twin)
    opt.add_param_group({"params": [nn.Parameter(torch.randn(4, 4))], "adjust_lr_fn": value})
    assert opt.param_groups[1]["adjust_lr"] == ours
    with pytest.raises(ValueError, match=r"^Param group 2 has both adjust_lr_fn and adjust_lr"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(4, 4))], "adjust_lr_fn": value, "adjust_lr": ours})
    with pytest.raises(
        ValueError, match=r"^Unknown key 'adjust_lr_fn' in param group 0 \(did you mean 'adjust_lr'\?\)"
    ):
        muonkit.HybridMuon([{"params": [_param("muon")], "adjust_lr_fn": value}])  # HybridMuon is not torch's Muon


# ---------------------------------------------------------------------------- strategy


@pytest.mark.parametrize("strategy", ["single", 3, object()])
def test_a_strategy_that_is_not_one_raises_a_type_error_naming_what_it_takes(strategy: Any) -> None:
    message = f"Invalid strategy={strategy!r}: must be a muonkit.distributed.Strategy or None"
    with pytest.raises(TypeError, match="^" + re.escape(message)):
        muonkit.HybridMuon([nn.Parameter(torch.randn(4, 4))], strategy=strategy)
    opt = muonkit.HybridMuon([nn.Parameter(torch.randn(4, 4))])
    with pytest.raises(
        TypeError, match=re.escape(f"Invalid strategy={strategy!r}: must be a muonkit.distributed.Strategy,")
    ):
        opt.set_strategy(strategy)

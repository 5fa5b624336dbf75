"""``state_dtype="fp32" | "bf16" | "8bit"`` on one device: what is stored, that it trains like fp32,
the accelerator path's masked stores, conversion between precisions on load, and refusals of
stored forms no step could have written (muonkit.state_precision)."""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Any

import pytest
import torch
from torch import nn

import muonkit
from helpers import Tiny, tiny_loss
from muonkit.functional.quantize import CODE_DTYPE, dequantize_blockwise
from muonkit.testing import as_on_an_accelerator

PRECISIONS = ["fp32", "bf16", "8bit"]


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    for i in range(start, start + steps):
        opt.zero_grad()
        tiny_loss(model, i).backward()
        opt.step()


def _setup(
    state_dtype: str, *, algorithm: str = "muon", dtype: torch.dtype = torch.float32, **kw: Any
) -> tuple[Tiny, muonkit.HybridMuon]:
    torch.manual_seed(0)
    model = Tiny().to(dtype)
    opt = muonkit.HybridMuon(muonkit.param_groups(model, muon_algorithm=algorithm), state_dtype=state_dtype, **kw)
    return model, opt


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("algorithm", ["muon", "normuon"])
def test_what_each_precision_stores(algorithm: str) -> None:
    stored: dict[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]] = {}
    for precision in PRECISIONS:
        model, opt = _setup(precision, algorithm=algorithm)
        _train(model, opt, 2)
        up, bias = opt.state[model.up.weight], opt.state[model.up.bias]
        stored[precision] = {
            k: (v.dtype, tuple(v.shape)) for k, v in {**up, **{f"b.{k}": v for k, v in bias.items()}}.items()
        }
    fp32, bf16, q8 = (stored[p] for p in PRECISIONS)
    assert fp32["momentum_buffer"] == (torch.float32, (32, 16)) and "step" not in fp32
    assert bf16["momentum_buffer"] == (torch.bfloat16, (32, 16)) and bf16["step"] == (torch.float32, ())
    assert q8["momentum_buffer"] == (CODE_DTYPE, (32, 16)) and q8["momentum_buffer_scale"] == (torch.float32, (32, 1))
    assert bf16["b.exp_avg"] == (torch.bfloat16, (32,)) and bf16["b.exp_avg_sq"] == (torch.bfloat16, (32,))
    assert q8["b.exp_avg"] == (CODE_DTYPE, (32,)) and q8["b.exp_avg_sq_scale"] == (torch.float32, (1,))
    if algorithm == "normuon":
        assert fp32["row_exp_avg_sq"] == (torch.float32, (32,))
        assert bf16["row_exp_avg_sq"] == (torch.bfloat16, (32,))
        assert q8["row_exp_avg_sq"] == (CODE_DTYPE, (32,)) and q8["row_exp_avg_sq_scale"] == (torch.float32, (1,))


def _mean_loss(model: nn.Module) -> float:
    return sum(float(tiny_loss(model, j).detach()) for j in range(4)) / 4


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
@pytest.mark.parametrize("algorithm", ["muon", "normuon"])
def test_trains_like_fp32(precision: str, algorithm: str) -> None:
    """30 steps on four batches: the loss falls from ~3.0 to ~1.95 and ends within 0.3% of fp32 state's.
    (Params are not compared: Muon's orthogonalization of these small matrices amplifies any rounding
    difference, the accelerator path's fp32 one included, into a different but equally good trajectory.)"""
    losses = {}
    for p in ("fp32", precision):
        model, opt = _setup(p, algorithm=algorithm)
        first = _mean_loss(model)
        for i in range(30):
            opt.zero_grad()
            tiny_loss(model, i % 4).backward()
            opt.step()
        losses[p] = _mean_loss(model)
        assert losses[p] < first - 0.8
    assert abs(losses[precision] - losses["fp32"]) < 0.003 * losses["fp32"], losses


@pytest.mark.parametrize("codec", ["bf16", "8bit"])
@pytest.mark.parametrize("rows", [False, True])
def test_masked_stores_are_exact(codec: str, rows: bool) -> None:
    """The accelerator path stores through the device verdict: True stores what an unmasked store does,
    False leaves every stored bit (codes, scales, bf16 values) as it was."""
    from muonkit.distributed import SingleDeviceStrategy
    from muonkit.state_precision import CODECS

    store, strategy, p = CODECS[codec], SingleDeviceStrategy(), torch.zeros(6, 300)
    assert store is not None

    def write(own: dict[str, Any], value: torch.Tensor, ok: torch.Tensor | None) -> None:
        if rows:
            store.write_rows(own, "k", value.flatten(), unsigned=False, ok=ok)
        else:
            store.write(own, "k", value, p, strategy, ok=ok)

    def raw(own: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {k: v.view(torch.uint8).clone() if v.dtype == CODE_DTYPE else v.clone() for k, v in own.items()}

    first, second = torch.randn(6, 300), torch.randn(6, 300) * 3
    plain: dict[str, Any] = {"step": torch.tensor(4.0)}
    masked: dict[str, Any] = {"step": torch.tensor(4.0)}
    write(plain, first, None)
    write(masked, first, torch.tensor(True))
    assert raw(plain).keys() == raw(masked).keys()
    assert all(torch.equal(a, b) for a, b in zip(raw(plain).values(), raw(masked).values(), strict=True))
    before = raw(masked)
    write(masked, second, torch.tensor(False))
    assert all(torch.equal(a, b) for a, b in zip(before.values(), raw(masked).values(), strict=True))
    write(masked, second, torch.tensor(True))
    write(plain, second, None)
    assert all(torch.equal(a, b) for a, b in zip(raw(plain).values(), raw(masked).values(), strict=True))


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
@pytest.mark.parametrize("accelerator", [False, True])
def test_a_skipped_step_leaves_the_stored_state_unchanged(precision: str, accelerator: bool) -> None:
    model, opt = _setup(precision, algorithm="normuon")
    with as_on_an_accelerator() if accelerator else contextlib.nullcontext():
        _train(model, opt, 2)
        before = copy.deepcopy(opt.state_dict())
        opt.zero_grad()
        tiny_loss(model, 9).backward()
        model.up.weight.grad[0, 0] = float("nan")
        opt.step()
    assert opt.skipped_steps == 1
    after = opt.state_dict()
    for pid, own in before["state"].items():
        for key, value in own.items():
            new = after["state"][pid][key]
            same = (
                torch.equal(value.view(torch.uint8), new.view(torch.uint8))
                if value.dtype == CODE_DTYPE
                else torch.equal(value, new)
            )
            assert same, (pid, key)


def test_per_group_precision_and_clear_errors() -> None:
    model = Tiny()
    groups = muonkit.param_groups(model)
    for g in groups:
        g["state_dtype"] = "8bit" if g["algorithm"] == "muon" else "fp32"
    opt = muonkit.HybridMuon(groups)
    _train(model, opt, 1)
    assert opt.state[model.up.weight]["momentum_buffer"].dtype == CODE_DTYPE
    assert opt.state[model.up.bias]["exp_avg"].dtype == torch.float32
    with pytest.raises(ValueError, match=r"Invalid state_dtype='fp8': must be one of \('fp32', 'bf16', '8bit'\)"):
        muonkit.HybridMuon(muonkit.param_groups(Tiny()), state_dtype="fp8")
    with pytest.raises(ValueError, match=r"Invalid state_dtype=torch.bfloat16: must be one of"):
        muonkit.HybridMuon([{"params": [nn.Parameter(torch.randn(4, 4))], "state_dtype": torch.bfloat16}])


@pytest.mark.parametrize("saved", PRECISIONS)
@pytest.mark.parametrize("target", PRECISIONS)
def test_a_checkpoint_loads_into_another_precision(saved: str, target: str) -> None:
    """The optimizer's own state_dtype wins; saved states convert at their next step (decoded exactly)."""
    model, opt = _setup(saved, algorithm="normuon")
    _train(model, opt, 3)
    state = copy.deepcopy(opt.state_dict())
    model2, opt2 = _setup(target, algorithm="normuon")
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(state)
    assert all(g["state_dtype"] == target for g in opt2.param_groups)
    own = opt2.state[model2.up.weight]
    saved_momentum = own["momentum_buffer"].clone()
    if saved == "8bit":
        decoded = dequantize_blockwise(saved_momentum, own["momentum_buffer_scale"], signed=True)
    else:
        decoded = saved_momentum.float()
    # one more step in both: the converted run is the saved-precision run with its states decoded
    _train(model2, opt2, 1, start=3)
    after = opt2.state[model2.up.weight]
    expect = {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": CODE_DTYPE}[target]
    assert after["momentum_buffer"].dtype == expect
    assert ("momentum_buffer_scale" in after) == (target == "8bit")
    assert ("row_exp_avg_sq_scale" in after) == (target == "8bit")
    assert opt2.state[model2.up.bias]["exp_avg"].dtype == expect
    if target == "fp32":  # momentum = 0.95 * decoded + 0.05 * g exactly as an fp32 run from the decoded state
        g = model2.up.weight.grad
        assert torch.allclose(after["momentum_buffer"], decoded.lerp(g, 0.05), rtol=0, atol=1e-7)
    _train(model2, opt2, 2, start=4)
    assert all(torch.isfinite(p).all() for p in model2.parameters())


def _corrupt(state: dict[str, Any], change: str) -> None:
    own = next(v for v in state["state"].values() if "momentum_buffer_scale" in v)
    if change == "negative scale":
        own["momentum_buffer_scale"][0, 0] = -1.0
    elif change == "nan scale":
        own["momentum_buffer_scale"][0, 0] = float("nan")
    elif change == "missing scale":
        del own["momentum_buffer_scale"]
    elif change == "wrong scale shape":
        own["momentum_buffer_scale"] = own["momentum_buffer_scale"][:-1]
    elif change == "nan code":
        own["momentum_buffer"].view(torch.uint8)[0, 0] = 0x7F  # e4m3fn's NaN
    elif change == "stray scale":
        own["momentum_buffer"] = own["momentum_buffer"].float()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("negative scale", "negative, NaN or inf"),
        ("nan scale", "negative, NaN or inf"),
        ("missing scale", "block scales are missing"),
        ("wrong scale shape", "need float32 scales of shape"),
        ("nan code", "non-finite values"),
        ("stray scale", "not 8-bit codes, yet has scales"),
    ],
)
def test_corrupted_codes_and_scales_are_refused_and_change_nothing(change: str, message: str) -> None:
    model, opt = _setup("8bit")
    _train(model, opt, 2)
    state = copy.deepcopy(opt.state_dict())
    _corrupt(state, change)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(state)
    after = opt.state_dict()
    for pid, own in before["state"].items():
        for key, value in own.items():
            assert torch.equal(
                value.view(torch.uint8) if value.dtype == CODE_DTYPE else value,
                after["state"][pid][key].view(torch.uint8) if value.dtype == CODE_DTYPE else after["state"][pid][key],
            )


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
def test_state_dict_round_trip_resumes_bit_exactly(precision: str) -> None:
    model, opt = _setup(precision, algorithm="normuon")
    _train(model, opt, 3)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    _train(model, opt, 3, start=3)
    model2, opt2 = _setup(precision, algorithm="normuon")
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    _train(model2, opt2, 3, start=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True))


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
def test_fp64_and_bf16_params(precision: str) -> None:
    for dtype in (torch.float64, torch.bfloat16):
        model, opt = _setup(precision, dtype=dtype)
        _train(model, opt, 3)
        assert all(torch.isfinite(p.float()).all() for p in model.parameters())
        want = torch.bfloat16 if precision == "bf16" else CODE_DTYPE
        assert opt.state[model.up.weight]["momentum_buffer"].dtype == want


def test_stored_bytes_per_precision() -> None:
    """What the state holds, in bytes: bf16 half of fp32, 8-bit about a quarter (plus one fp32 scale per block)."""
    sizes = {}
    for precision in PRECISIONS:
        model, opt = _setup(precision)
        _train(model, opt, 1)
        sizes[precision] = sum(
            v.numel() * v.element_size() for own in opt.state.values() for k, v in own.items() if k != "step"
        )
    assert sizes["bf16"] * 2 == sizes["fp32"]
    assert (
        sizes["fp32"] / 4 < sizes["8bit"] < sizes["fp32"] / 4 * 1.6
    )  # Tiny's rows are short: a scale per 16-32 values
    assert math.isclose(
        sizes["fp32"],
        4
        * sum(
            p.numel() * (1 if p.ndim >= 2 and n not in ("embed.weight", "head.weight") else 2)
            for n, p in Tiny().named_parameters()
        ),
        rel_tol=0.5,
    )


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"cautious_wd": True, "weight_decay": 0.1},
        {"dtype": torch.bfloat16},
        {"capturable": True, "nonfinite": "unchecked"},
    ],
    ids=["plain", "cautious_wd", "bf16_params", "capturable"],
)
def test_adamw_batches_change_no_bit(precision: str, options: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """AdamW groups in bf16 / 8-bit step by batches of params (one batch's fp32 moments at a time),
    a larger param by slices of its rows: batches of one param, slices of one row (limit 1) or of
    two (limit 37: the 16-wide embedding and head) give the same params, stored states and step
    counts as one batch of all."""
    from muonkit import stages

    runs = []
    for limit in (1, 37, 1 << 22):
        monkeypatch.setattr(stages, "CODEC_BATCH_ELEMENTS", limit)
        model, opt = _setup(precision, **options)
        _train(model, opt, 3)
        runs.append((_params(model), copy.deepcopy(opt.state_dict()["state"])))
    *sliced, (pb, sb) = runs
    for pa, sa in sliced:
        assert all(torch.equal(pa[n], pb[n]) for n in pa)
        for pid, own in sa.items():
            assert own.keys() == sb[pid].keys()
            for key, value in own.items():
                _assert_same_bits(value, sb[pid][key])


def _assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == CODE_DTYPE else torch.equal(a, b)


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
def test_a_large_adamw_param_is_stepped_by_row_slices(precision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A param larger than a batch (a tied embedding) goes by slices of its rows: the step's transient
    memory is a slice's working moments, not the whole param's; and a state stored in another form
    (fp32 from a checkpoint) is converted whole at its first step, the same bits as without slices."""
    from muonkit import stages
    from muonkit.testing import LiveBytes

    def run(limit: int, state_dtype: str = precision) -> tuple[torch.Tensor, dict[Any, Any], int]:
        monkeypatch.setattr(stages, "CODEC_BATCH_ELEMENTS", limit)
        torch.manual_seed(0)
        emb = nn.Parameter(torch.randn(1024, 256))  # 262,144 values, 1 MiB in fp32
        opt = muonkit.HybridMuon([{"params": [emb], "algorithm": "adamw", "lr": 1e-3}], state_dtype=state_dtype)
        peaks = []
        for step in range(3):
            emb.grad = torch.randn(1024, 256, generator=torch.Generator().manual_seed(step))
            with LiveBytes() as live:
                opt.step()
            peaks.append(live.peak)
        return emb.detach().clone(), copy.deepcopy(opt.state_dict()), max(peaks[1:])

    whole_p, whole_s, whole_peak = run(1 << 22)
    sliced_p, sliced_s, sliced_peak = run(1 << 14)  # 64 rows a slice
    assert torch.equal(whole_p, sliced_p)
    for key, value in whole_s["state"][0].items():
        _assert_same_bits(value, sliced_s["state"][0][key])
    # whole: two fp32 moments of the param and AdamW's temporaries (~4 MiB); a slice's: 64 KiB each
    assert whole_peak > 2 * 2**20 and sliced_peak < whole_peak / 8, (whole_peak, sliced_peak)
    # an fp32 state loaded into a low-precision optimizer: converted whole, then sliced
    converted = []
    for limit in (1 << 22, 1 << 14):
        monkeypatch.setattr(stages, "CODEC_BATCH_ELEMENTS", limit)
        torch.manual_seed(0)
        emb = nn.Parameter(torch.randn(1024, 256))
        fp32 = muonkit.HybridMuon([{"params": [emb], "algorithm": "adamw", "lr": 1e-3}])
        emb.grad = torch.randn(1024, 256, generator=torch.Generator().manual_seed(9))
        fp32.step()
        opt = muonkit.HybridMuon([{"params": [emb], "algorithm": "adamw", "lr": 1e-3}], state_dtype=precision)
        opt.load_state_dict(fp32.state_dict())
        for step in range(2):
            emb.grad = torch.randn(1024, 256, generator=torch.Generator().manual_seed(step))
            opt.step()
        converted.append((emb.detach().clone(), copy.deepcopy(opt.state_dict()["state"][0])))
    (pa, sa), (pb, sb) = converted
    assert torch.equal(pa, pb) and sa.keys() == sb.keys()
    assert sa["exp_avg"].dtype == (torch.bfloat16 if precision == "bf16" else CODE_DTYPE)
    for key in sa:
        _assert_same_bits(sa[key], sb[key])


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
def test_capturable_step_stores_the_same_bits(precision: str) -> None:
    """A capturable step (rates and AdamW's step on the device, unchecked) with bf16 / 8-bit state equals the plain one."""
    runs = []
    for options in ({}, {"capturable": True, "nonfinite": "unchecked"}):
        model, opt = _setup(precision, **options)
        _train(model, opt, 3)
        runs.append(_params(model))
    assert all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])

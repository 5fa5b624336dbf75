"""The low-precision state codes (muonkit.functional.quantize) against a float64 reference.

8-bit: blockwise (<= 256 along the last dim) absmax scale and the nearest e4m3 code, signed (x) or
unsigned (sqrt x, never 0 for x > 0). bf16: stochastic rounding, unbiased, to a neighbour only.
Hard inputs: blocks mixing 30 orders of magnitude, fp32 extremes, subnormals, zero blocks,
zero-size and 0-dim tensors, partial last blocks, every input dtype.
"""

from __future__ import annotations

import pytest
import torch

from muonkit.functional.quantize import (
    BLOCK,
    CODE_DTYPE,
    block_shape,
    dequantize_blockwise,
    quantize_blockwise,
    round_bf16,
    salt_of,
)

E4M3 = torch.arange(256, dtype=torch.uint8).view(CODE_DTYPE).double()
E4M3 = torch.unique(E4M3[torch.isfinite(E4M3)])  # every finite code value, sorted (+-0 once)


def reference(x: torch.Tensor, *, signed: bool) -> torch.Tensor:
    """Float64 blockwise code: per block of <= 256 along the last dim, scale = absmax / 448 and each
    value's nearest e4m3 value of x / scale (unsigned: of sqrt(x), at least the smallest positive code)."""
    x64 = x.double().reshape(-1, x.shape[-1]) if x.dim() else x.double().reshape(1, 1)
    out = torch.empty_like(x64)
    smallest = E4M3[E4M3 > 0].min()
    for start in range(0, x64.shape[-1], BLOCK):
        block = x64[:, start : start + BLOCK]
        work = block if signed else block.sqrt()
        scale = work.abs().amax(dim=-1, keepdim=True) / 448
        y = torch.where(scale > 0, work / torch.where(scale > 0, scale, 1), 0)
        if not signed:
            y = torch.where(work > 0, y.clamp(min=smallest), y)
        nearest = E4M3[(y.unsqueeze(-1) - E4M3).abs().argmin(dim=-1)]
        decoded = nearest * scale
        out[:, start : start + BLOCK] = decoded if signed else decoded.square()
    return out.reshape(x.shape)


def hard_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    gauss = torch.randn(8, 700, generator=g)
    mixed = gauss * torch.logspace(-15, 15, 700).float()  # 30 orders of magnitude in each row
    heavy = torch.distributions.StudentT(2.0).sample((8, 512))
    low_rank = torch.randn(64, 1, generator=g) @ torch.randn(1, 300, generator=g)
    zero_rows = gauss.clone()
    zero_rows[2:5] = 0
    return {
        "gauss": gauss,
        "mixed": mixed,
        "heavy": heavy,
        "low_rank": low_rank,
        "huge": gauss * 1e37,
        "tiny": gauss * 1e-37,
        "subnormal": gauss * 1e-40,
        "zero_rows": zero_rows,
        "partial": torch.randn(3, 257, generator=g),
        "experts": torch.randn(2, 4, 300, generator=g),
        "vector": torch.randn(1000, generator=g),
    }


@pytest.mark.parametrize("name", list(hard_inputs()))
@pytest.mark.parametrize("signed", [True, False])
def test_matches_the_float64_reference(name: str, signed: bool) -> None:
    x = hard_inputs()[name]
    if not signed:
        x = x.abs()
    codes, scales = quantize_blockwise(x, signed=signed)
    assert codes.dtype == CODE_DTYPE and codes.shape == x.shape
    assert scales.dtype == torch.float32 and tuple(scales.shape) == block_shape(tuple(x.shape))
    ours = dequantize_blockwise(codes, scales, signed=signed).double()
    ref = reference(x, signed=signed)
    # the same code but where x / scale sits within fp32 rounding of a midpoint (then a neighbour)
    step = 2.0**-3 * ref.abs() + scales.double().amax() * 2.0**-9 * (1 if signed else scales.double().amax())
    if name == "subnormal":  # fp32 subnormal scales hold a few bits: only the bound, to within 1e-42
        assert bool(((ours - ref).abs() <= step + 1e-42).all())
        return
    close = (ours - ref).abs() <= 1e-6 * ref.abs() + 1e-45
    assert close.float().mean() > 0.995, f"{name}: {(~close).sum()} of {x.numel()} differ from the reference"
    assert bool(((ours - ref).abs() <= step + 1e-45).all())


@pytest.mark.parametrize("name", list(hard_inputs()))
def test_round_trip_error_bounds(name: str) -> None:
    """Signed: |x' - x| <= 2^-4 |x| (3 mantissa bits, to nearest) + 2^-10 scale (the subnormals'
    half spacing). Unsigned (sqrt code): the same bound on sqrt(x)."""
    x = hard_inputs()[name].float()
    blocks = x.reshape(-1, x.shape[-1])
    scale = (
        torch.cat(
            [
                blocks[:, s : s + BLOCK].abs().amax(-1, keepdim=True).expand(-1, min(BLOCK, x.shape[-1] - s))
                for s in range(0, x.shape[-1], BLOCK)
            ],
            dim=-1,
        )
        .reshape(x.shape)
        .double()
        / 448
    )
    y = dequantize_blockwise(*quantize_blockwise(x, signed=True), signed=True).double()
    assert bool(((y - x.double()).abs() <= 2.0**-4 * x.double().abs() + 2.0**-10 * scale * 1.0001).all())
    v = x.abs()
    root = dequantize_blockwise(*quantize_blockwise(v, signed=False), signed=False).double().sqrt()
    truth = v.double().sqrt()
    rscale = (
        torch.cat(
            [
                truth.reshape(-1, x.shape[-1])[:, s : s + BLOCK]
                .amax(-1, keepdim=True)
                .expand(-1, min(BLOCK, x.shape[-1] - s))
                for s in range(0, x.shape[-1], BLOCK)
            ],
            dim=-1,
        ).reshape(x.shape)
        / 448
    )
    assert bool(((root - truth).abs() <= 2.0**-4 * truth + 2.0**-9 * rscale * 1.0001).all())


def test_blocks_absmax_and_zeros_are_exact() -> None:
    x = torch.randn(4, 600)
    x[1] = 0
    codes, scales = quantize_blockwise(x, signed=True)
    y = dequantize_blockwise(codes, scales, signed=True)
    assert bool((y[1] == 0).all()) and bool((scales[1] == 0).all())
    top = x.abs().reshape(4, -1)[:, :256].amax(-1)
    assert torch.allclose(y.abs()[:, :256].amax(-1), top, rtol=2e-7, atol=0)


def test_unsigned_code_never_decodes_a_positive_value_to_zero() -> None:
    """A second moment decoded as 0 would make Adam's update m / eps: the smallest code is used instead."""
    v = torch.tensor([[1.0, 1e-30, 1e-20, 0.0, 1e-12]])
    back = dequantize_blockwise(*quantize_blockwise(v, signed=False), signed=False)
    assert bool((back[0, [0, 1, 2, 4]] > 0).all()) and back[0, 3] == 0
    assert bool((back >= v * 0.75).all())  # errs upwards (smaller Adam updates), never to zero


def test_zero_size_zero_dim_and_every_input_dtype() -> None:
    for shape in [(0, 5), (3, 0), (0,), ()]:
        x = torch.ones(shape)
        codes, scales = quantize_blockwise(x, signed=True)
        assert codes.shape == x.shape and tuple(scales.shape) == block_shape(tuple(x.shape))
        assert torch.equal(dequantize_blockwise(codes, scales, signed=True), x)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        x = (torch.randn(2, 300) * 3).to(dtype)
        y = dequantize_blockwise(*quantize_blockwise(x, signed=True), signed=True)
        assert y.dtype == torch.float32
        assert bool(((y.double() - x.double()).abs() <= 2.0**-4 * x.double().abs() + 1e-2).all())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_are_refused(bad: float) -> None:
    x = torch.randn(2, 10)
    x[1, 3] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_blockwise(x, signed=True)


def test_negative_values_are_refused_in_the_unsigned_code() -> None:
    with pytest.raises(ValueError, match="negative"):
        quantize_blockwise(torch.tensor([[1.0, -1e-9]]), signed=False)


def _neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and above each fp32 ``x`` in magnitude (float64 reference)."""
    down = (x.view(torch.int32) & -65536).view(torch.float32).double()  # toward zero
    ulp = torch.ldexp(torch.ones_like(down), torch.frexp(down.abs().clamp_min(1e-38))[1] - 8)
    return down, down + torch.sign(x.double()) * ulp


def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200_000, generator=g) * torch.logspace(-20, 20, 200_000)
    down, up = _neighbours(x)
    draws = torch.stack([round_bf16(x, salt_of(step)).double() for step in range(64)])
    assert bool(((draws == down) | (draws == up)).all())
    mean_error = ((draws.mean(0) - x.double()) / (up - down).abs().clamp_min(1e-300)).mean()
    rn_error = ((x.bfloat16().double() - x.double()) / (up - down).abs().clamp_min(1e-300)).mean()
    assert abs(float(mean_error)) < 2e-3, "stochastic rounding is biased"
    assert abs(float(rn_error)) < 0.01  # round to nearest is unbiased on such data too...
    # ...but not on an EMA whose step is below half an ulp: there it stalls, stochastic rounding does not
    target, m_rn, m_sr, seen = 1.004, torch.ones(1).bfloat16(), torch.ones(1).bfloat16(), []
    for step in range(4000):
        m_rn = (m_rn.float() * 0.95 + 0.05 * target).bfloat16()
        m_sr = round_bf16(m_sr.float() * 0.95 + 0.05 * target, salt_of(step))
        seen.append(float(m_sr))
    assert float(m_rn) == 1.0  # stalled
    assert abs(sum(seen[500:]) / len(seen[500:]) - target) < 1.5e-3


def _round_bf16_reference(value: float, salt: int) -> int:
    """The bf16 bits :func:`round_bf16` gives one finite fp32 ``value``, in Python integers (unsigned
    32-bit arithmetic): the hash of the value's bits and ``salt`` added below the kept mantissa."""
    import struct

    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    h = (bits ^ salt) & 0xFFFFFFFF
    h = (h * 0x7FEB352D) & 0xFFFFFFFF
    h ^= h >> 15
    h = (h * 0x846CA68B) & 0xFFFFFFFF
    rounded = ((bits + (h >> 16)) & 0xFFFFFFFF) & 0xFFFF0000
    top = 0x7F7F0000  # bf16's largest finite magnitude: a carry into the exponent's top is clamped
    if rounded & 0x7FFFFFFF > top:
        rounded = (rounded & 0x80000000) | top
    return rounded >> 16


@pytest.mark.parametrize("salt", [0, 12345, 0xFFFFFFF9, 0x80000005])
def test_stochastic_rounding_bits_are_the_hash(salt: int) -> None:
    """Every bit of round_bf16 against a pure-Python run of its hash (values over 60 decades,
    subnormals, the largest fp32 values, zeros): the stored bits a checkpoint resumes from."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3000, generator=g) * torch.logspace(-30, 30, 3000)
    x = torch.cat([x, torch.tensor([3.4028235e38, -3.4028235e38, 1e-45, -1e-45, 1.17e-38, 0.0, -0.0, 1.0])])
    got = round_bf16(x, salt).view(torch.int16).tolist()
    want = [_round_bf16_reference(v, salt) for v in x.tolist()]
    assert [b & 0xFFFF for b in got] == want


def test_stochastic_rounding_edges_and_tensor_salts() -> None:
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 3.39e38, -3.4e38, 0.0, -0.0, 1e-45, 1.0])
    y = round_bf16(x, 12345)
    assert y.dtype == torch.bfloat16
    assert y[0] == float("inf") and y[1] == -float("inf") and torch.isnan(y[2])
    assert bool(torch.isfinite(y[3:]).all()) and y[5] == 0 and y[8] == 1
    v = torch.randn(1000)
    step = torch.tensor(7.0)
    assert torch.equal(round_bf16(v, salt_of(step, "k")), round_bf16(v, salt_of(7, "k")))
    assert not torch.equal(round_bf16(v, salt_of(7, "k")), round_bf16(v, salt_of(8, "k")))

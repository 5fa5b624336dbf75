"""Newton-Schulz in bf16 and fp16 on the GPU, and the Gram iteration there, on hard inputs.

The inputs are the hard spectra of tests/spectra.py (condition 1e3-1e6, power laws, Cauchy,
clustered, low rank, rank 1) plus a Gaussian matrix; on CUDA at 256 x 1024, 1024 x 256 and
512 x 512 (GPT-2-like aspect ratios), in the CPU dry run at the sizes of tests/numerics/test_gram.py.

Checks and tolerances, and why:
- The preset's promised band (functional/coefficients.py), as tests/numerics/test_gram.py checks it on
  the CPU: f(s) in the band for every s >= min_relative * ||U||_F, every output singular value
  <= the band's top + 0.01 (half-precision rounding).
- Against the same iteration in float64 on the same input, along the kept singular directions:
  |f_half(s) - f_fp64(s)| <= 0.08 for bf16 (measured on the CPU in bf16: <= 0.037 at 64 x 256
  with Polar Express, <= 0.01 with keller and you; <= 0.007 at 256 x 1024) and <= 0.04 for fp16
  (3 more mantissa bits than bf16, but cuBLAS may reduce fp16 products in fp16:
  ``allow_fp16_reduced_precision_reduction``, on by default). Frobenius distances are
  meaningless on the rank-deficient inputs (rounding noise gets lifted into spurious singular
  values, see functional/coefficients.py), so the relative Frobenius error is held only on the
  rectangular Gaussian and 1/i spectra: bf16 <= 0.08 (measured on the CPU: 0.005-0.018 at
  64 x 256, 0.021-0.025 at 256 x 1024), fp16 <= 0.03. A broken half-precision path (overflow, a
  wrong transpose, a skipped step) misses these by order 1.
- Gram (fp32) on hard spectra for 5-100 steps, also with TF32 matrix products allowed (common in
  training scripts: ``torch.backends.cuda.matmul.allow_tf32 = True``), where fp32 products keep
  only 10 mantissa bits, as fp16: the restart schedule was measured in true fp32 only.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import muonkit
import spectra
from muonkit.functional.coefficients import PRESETS
from muonkit.functional.orthogonalize import uses_gram

F64 = torch.float64
RESPONSE_TOL = {torch.bfloat16: 0.08, torch.float16: 0.04}
FROBENIUS_TOL = {torch.bfloat16: 0.08, torch.float16: 0.03}
WELL_CONDITIONED = ("gaussian", "power_law_1")


def shapes(device: str) -> list[tuple[int, int]]:
    return [(256, 1024), (1024, 256), (512, 512)] if device == "cuda" else [(16, 80), (96, 24)]


@functools.cache
def hard(device: str) -> list[tuple[list[str], torch.Tensor, list[Any]]]:
    """Per shape: the spectra's names, the (B, rows, cols) float64 batch on ``device``, and each
    matrix's :func:`spectra.decompose` (a float64 SVD: computed once, read by every test)."""
    out = []
    for i, (rows, cols) in enumerate(shapes(device)):
        names, x = spectra.hard_batch(rows, cols, seed=20 + i)
        x = x.to(device)
        out.append((names, x, [spectra.decompose(xi) for xi in x]))
    return out


def half_dtype(name: str, device: str) -> torch.dtype:
    if name == "float16" and device != "cuda":
        pytest.skip("fp16 Newton-Schulz is GPU only (refused on the CPU)")
    return getattr(torch, name)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_half_precision_matches_float64_on_hard_spectra(device: str, dtype_name: str, preset: str) -> None:
    dtype = half_dtype(dtype_name, device)
    p = PRESETS[preset]
    (lo, hi) = p.band
    for names, x, svds in hard(device):
        want = muonkit.orthogonalize(x, coefficients=preset, dtype=F64)
        got = muonkit.orthogonalize(x.float(), coefficients=preset, dtype=dtype)
        assert got.device == x.device and got.dtype == torch.float32 and torch.isfinite(got).all()
        for name, xi, gi, wi, svd in zip(names, x, got, want, svds, strict=True):
            f_got, top = spectra.response(xi, gi, p.min_relative, svd=svd)
            f_want, _ = spectra.response(xi, wi, p.min_relative, svd=svd)
            where = (tuple(x.shape[1:]), name)
            assert lo <= f_got.min().item() and f_got.max().item() <= hi, (
                *where,
                f_got.min().item(),
                f_got.max().item(),
            )
            assert top <= hi + 0.01, (*where, top)
            gap = (f_got - f_want).abs().max().item()
            assert gap <= RESPONSE_TOL[dtype], (*where, gap)
            if name in WELL_CONDITIONED and xi.size(0) != xi.size(1):  # a square Gaussian is ill-conditioned
                rel = (torch.linalg.matrix_norm(gi.to(F64) - wi) / torch.linalg.matrix_norm(wi)).item()
                assert rel <= FROBENIUS_TOL[dtype], (*where, rel)


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_half_precision_gram_runs_the_plain_iteration(device: str, dtype_name: str) -> None:
    dtype = half_dtype(dtype_name, device)
    assert not uses_gram(256, 1024, method="gram", dtype=dtype)
    x = hard(device)[0][1]
    gram = muonkit.orthogonalize(x.float(), dtype=dtype, method="gram", steps=8)
    assert torch.equal(gram, muonkit.orthogonalize(x.float(), dtype=dtype, steps=8))


@pytest.fixture(params=[False, True], ids=["fp32", "tf32"])
def tf32(request: pytest.FixtureRequest, device: str) -> Iterator[bool]:
    """fp32 matrix products as they are, then with TF32 allowed (CUDA only; restored afterwards)."""
    allow = bool(request.param)
    if allow and device != "cuda":
        pytest.skip("TF32 is a CUDA matmul mode")
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allow
    try:
        yield allow
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("steps", [5, 6, 8, 12, 32, 100])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_gram_stays_in_the_band_on_hard_spectra(device: str, tf32: bool, preset: str, steps: int) -> None:
    """tests/numerics/test_gram.py's promise on the GPU: fp32 Gram (restarts every 4 steps) keeps f(s) in
    the band; a Gram iteration whose tracked R drifts leaves it within a few steps (inf from 12)."""
    p = PRESETS[preset]
    lo, hi = p.band
    for names, x, svds in hard(device):
        rows, cols = x.shape[-2:]
        if not uses_gram(rows, cols, method="gram", dtype=torch.float32):
            continue  # square: the plain iteration, covered above
        out = muonkit.orthogonalize(x.float(), coefficients=preset, steps=steps, dtype=torch.float32, method="gram")
        assert torch.isfinite(out).all()
        for name, xi, oi, svd in zip(names, x, out, svds, strict=True):
            diag, top = spectra.response(xi, oi, p.min_relative, svd=svd)
            where = (tuple(x.shape[1:]), name, "tf32" if tf32 else "fp32")
            assert lo <= diag.min().item() and diag.max().item() <= hi, (*where, diag.min().item(), diag.max().item())
            assert top <= hi + 0.01, (*where, top)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_gram_equals_standard_in_float64(device: str, preset: str) -> None:
    x = torch.randn(2, 64, 320, dtype=F64, generator=torch.Generator().manual_seed(0)).to(device)
    standard = muonkit.orthogonalize(x, coefficients=preset, dtype=F64)
    gram = muonkit.orthogonalize(x, coefficients=preset, dtype=F64, method="gram")
    torch.testing.assert_close(gram, standard, rtol=0, atol=1e-10)


def test_default_compute_dtype_on_cuda_is_bf16(cuda: str) -> None:
    """bf16 on every GPU that has it (all since Ampere), else fp32; never fp16."""
    want = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    assert muonkit.functional.default_compute_dtype(cuda) == want
    x = torch.randn(64, 256, device=cuda)
    assert torch.equal(muonkit.orthogonalize(x), muonkit.orthogonalize(x, dtype=want))

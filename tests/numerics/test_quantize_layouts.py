"""8-bit codes across layouts, on one process: blocks cut per shard, decoded with the cut that saved
them, and codes that do not fit their scales refused (what checkpoints across layouts rely on;
the distributed checks are tests/distributed/scenario_state_precision*.py)."""

from __future__ import annotations

import pytest
import torch

from muonkit.functional.quantize import BLOCK, blocks_consistent, dequantize_blockwise, quantize_blockwise
from muonkit.state_precision import decode_saved, local_scales


def _values(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[-1]).flip(0)
    x[..., : min(3, shape[-1])] = 0.0  # a row starting with zeros
    return x


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("shape", [(5, 600), (3, 256), (7,), (2, 3, 300), (4, 1)])
def test_every_write_fits_its_scales(shape: tuple[int, ...], signed: bool) -> None:
    x = _values(shape)
    x = x if signed else x.abs()
    codes, scales = quantize_blockwise(x, signed=signed)
    assert bool(blocks_consistent(codes, scales).all())
    zero_codes, zero_scales = quantize_blockwise(torch.zeros(shape), signed=signed)
    assert bool(blocks_consistent(zero_codes, zero_scales).all())


def _cut(x: torch.Tensor, n: int, *, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of ``x`` cut in ``n`` column pieces as a ``Shard`` of the last dim cuts it, each coded in its own
    blocks; the scales as ``block_state`` lays them out whole: ``(*lead, n, k)``."""
    pieces = list(torch.chunk(x, n, dim=-1)) + [x[..., :0]] * (n - len(torch.chunk(x, n, dim=-1)))
    k = -(-pieces[0].shape[-1] // BLOCK)
    codes, scales = [], torch.zeros((*x.shape[:-1], n, k))
    for i, piece in enumerate(pieces):
        c, s = quantize_blockwise(piece, signed=signed)
        codes.append(c)
        scales[..., i, : s.shape[-1]] = s
    return torch.cat(codes, dim=-1), scales


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize(("shape", "n"), [((5, 600), 2), ((5, 600), 4), ((3, 10), 4), ((7,), 2), ((2, 3, 300), 8)])
def test_decode_saved_reads_each_cut(shape: tuple[int, ...], n: int, signed: bool) -> None:
    x = _values(shape, seed=n)
    x = x if signed else x.abs()
    codes, scales = _cut(x, n, signed=signed)
    pieces = torch.chunk(x, n, dim=-1)
    expected = torch.cat(
        [dequantize_blockwise(*quantize_blockwise(p, signed=signed), signed=signed) for p in pieces], dim=-1
    )
    assert torch.equal(decode_saved(codes, scales, unsigned=not signed), expected)
    whole_codes, whole_scales = quantize_blockwise(x, signed=signed)
    assert torch.equal(
        decode_saved(whole_codes, whole_scales, unsigned=not signed),
        dequantize_blockwise(whole_codes, whole_scales, signed=signed),
    )


def test_decode_saved_reads_a_nested_cut() -> None:
    """(5, 10) cut 2 ways, then each half 2 ways (5 | 5, then 3 | 2 each), as two mesh dims sharding the
    columns cut them: not one even cut in 4 (3 3 3 1). Its scales say so: (5, 2, 2, 1)."""
    x = _values((5, 10), seed=3) + 1.0
    nested = [q for h in torch.chunk(x, 2, dim=-1) for q in torch.chunk(h, 2, dim=-1)]
    codes, scales = [], torch.zeros((5, 2, 2, 1))
    for i, piece in enumerate(nested):
        c, s = quantize_blockwise(piece, signed=True)
        codes.append(c)
        scales[:, i // 2, i % 2, :] = s
    expected = torch.cat([dequantize_blockwise(*quantize_blockwise(q, signed=True), signed=True) for q in nested], -1)
    assert torch.equal(decode_saved(torch.cat(codes, dim=-1), scales, unsigned=False), expected)


def test_codes_that_do_not_fit_their_scales_are_refused() -> None:
    codes, scales = _cut(_values((5, 600), seed=4), 2, signed=True)
    scales[1, 0, 0] = 0.0  # a zero scale only ever goes with zero codes
    with pytest.raises(ValueError, match="do not fit their scales"):
        decode_saved(codes, scales, unsigned=False)


def test_local_scales_reads_a_cut_layout() -> None:
    codes = torch.zeros((3, 300), dtype=torch.float8_e4m3fn)
    for cut in (torch.zeros(3, 1, 4), torch.zeros(3, 1, 1, 4)):  # cut by one mesh dim, by two
        assert local_scales(codes, cut).shape == (3, 2)
        local_scales(codes, cut).fill_(1.0)  # a view: writes reach the state
        assert cut[..., :2].eq(1.0).all() and cut[..., 2:].eq(0.0).all()
    assert local_scales(codes, torch.zeros(3, 5)).shape == (3, 2)


def test_a_state_dict_whose_codes_do_not_fit_is_refused() -> None:
    import muonkit

    p = torch.nn.Parameter(torch.randn(4, 300))
    opt = muonkit.HybridMuon([{"params": [p], "algorithm": "muon"}], state_dtype="8bit")
    p.grad = torch.randn(4, 300)
    opt.step()
    state = opt.state_dict()
    own = next(iter(state["state"].values()))
    own["momentum_buffer_scale"][0, 0] = 0.0  # a zero scale only ever goes with zero codes
    before = opt.state_dict()["state"][0]["momentum_buffer"].view(torch.uint8).clone()
    with pytest.raises(ValueError, match="does not fit its scales"):
        opt.load_state_dict(state)
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"].view(torch.uint8), before)

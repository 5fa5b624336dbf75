"""The optimizer step's scratch memory against the documented bound, measured (not timed).

Measured with :class:`muonkit.testing.live_bytes.LiveBytes` (peak bytes of the storages a block
allocates and holds) on the second step, when momentum exists. The bound, per chunk of ``E``
elements (:meth:`SingleDeviceStrategy.muon_chunks`), all fp32: the chunk's momentum updates
(``4E``), two copies for the iteration (``8E``) and per matrix four (Gram) or two (plain) ``m x m``
products of its short side ``m``; with ``nonfinite="skip"`` (the default) and a custom schedule
also every direction of the step until the all-or-nothing verdict (4 bytes per Muon element).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import muonkit
from muonkit.config import MuonConfig, group_config
from muonkit.distributed import SingleDeviceStrategy
from muonkit.distributed.single import CPU_CHUNK_ELEMENTS, default_chunk_elements
from muonkit.functional.orthogonalize import uses_gram
from muonkit.testing import LiveBytes, as_on_an_accelerator

F32 = 4
CUSTOM = [(3.4, -4.7, 2.0)]  # near Keller's, not a preset's schedule


def test_live_bytes_counts_what_a_block_allocates_and_holds() -> None:
    a = torch.randn(256, 256)  # 256 KiB, before the block: never counted
    with LiveBytes() as live:
        b = a * 2  # +256 KiB
        c = b @ b  # +256 KiB: 512 KiB
        del b  # 256 KiB
        d = c.mT + 1  # 512 KiB
        e = d[0]  # a view: nothing new
        del c, d
        assert live.live == 256 * 1024  # d's storage, alive through its view e
        a.mul_(2)  # in place on an old tensor: nothing new
        del e
        assert live.live == 0
    assert live.peak == 512 * 1024


def _params(shapes: list[tuple[int, int]], copies: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    params = []
    for shape in shapes * copies:
        p = torch.nn.Parameter(torch.randn(shape, generator=g))
        p.grad = torch.randn(shape, generator=g)
        params.append(p)
    return params


def _config(opt: muonkit.HybridMuon) -> MuonConfig:
    config = group_config(opt.param_groups[0], 0)  # the one Muon group's config, as step() builds it
    assert isinstance(config, MuonConfig)
    return config


def _bound(opt: muonkit.HybridMuon, params: list[torch.nn.Parameter], *, held: bool) -> int:
    """The documented scratch bound of one step, in bytes."""
    config = _config(opt)
    chunks = opt.strategy.muon_chunks(params, config)
    per_chunk = []
    for chunk in chunks:
        elements = sum(params[i].numel() for i in chunk)
        small = 0
        for i in chunk:
            m, n = sorted(params[i].shape)
            small += (4 if uses_gram(m, n, method="gram", dtype=torch.float32) else 2) * m * m
        per_chunk.append(F32 * (2 * elements + small) + (0 if held else F32 * elements))
    directions = F32 * sum(p.numel() for p in params) if held else 0
    return directions + max(per_chunk)


@pytest.mark.parametrize(
    ("nonfinite", "coefficients", "accelerator"),
    [
        ("unchecked", "polar_express", False),
        ("skip", "polar_express", False),  # the verdict read at once (free on the CPU), then streamed
        ("skip", "polar_express", True),  # streamed, every commit masked on the device
        ("skip", CUSTOM, False),  # a custom schedule: every direction held until the verdict
    ],
    ids=["unchecked", "skip", "skip-accelerator", "skip-custom"],
)
@pytest.mark.parametrize(
    ("shapes", "copies", "chunk"),
    [
        ([(96, 288)], 4, 2 * 96 * 288),  # aspect 3: Gram, two matrices per chunk
        ([(256, 64), (64, 64)], 3, None),  # tall (Gram) and square (plain), one chunk per shape
        ([(128, 128), (64, 320), (320, 64)], 2, 128 * 128),  # a chunk per matrix
    ],
)
def test_step_scratch_stays_within_the_documented_bound(
    nonfinite: str,
    coefficients: str | list[tuple[float, float, float]],
    accelerator: bool,
    shapes: list[tuple[int, int]],
    copies: int,
    chunk: int | None,
) -> None:
    """Before the fix: 5 iterates and 5 Gram products per chunk (e.g. 67.5 MiB where the bound is
    58.5 MiB on two GPT-2-124M layers, unchecked); before streaming, a checked step held every
    direction whatever its schedule."""
    params = _params(shapes, copies)
    opt = muonkit.HybridMuon(
        params,
        ns_dtype=torch.float32,
        nonfinite=nonfinite,
        ns_coefficients=coefficients,
        strategy=SingleDeviceStrategy(max_chunk_elements=chunk),
    )
    with as_on_an_accelerator() if accelerator else contextlib.nullcontext():
        opt.step()  # creates the momentum buffers (state, not scratch)
        with LiveBytes() as live:
            opt.step()
    bound = _bound(opt, params, held=coefficients == CUSTOM)
    assert live.peak <= bound * 1.01 + 4096, (live.peak, bound)
    # the bound is tight: the step does use most of it (a meter that counts nothing fails here)
    assert live.peak >= 0.8 * bound, (live.peak, bound)


def test_default_chunk_budget_by_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_chunk_elements("cpu") == CPU_CHUNK_ELEMENTS == 2**22

    class Props:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    assert default_chunk_elements("cuda:0") == 80 * 2**30 // 256  # 1/64 of the memory in fp32
    Props.total_memory = 2**30  # a small GPU never gets less than the CPU budget
    assert default_chunk_elements("cuda") == CPU_CHUNK_ELEMENTS


def test_chunks_follow_the_budget() -> None:
    params = _params([(64, 64)], 5)
    config = _config(muonkit.HybridMuon(params))
    assert SingleDeviceStrategy().muon_chunks(params, config) == [[0, 1, 2, 3, 4]]  # CPU: 2^22
    assert SingleDeviceStrategy(max_chunk_elements=2 * 64 * 64).muon_chunks(params, config) == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_bad_chunk_budget_is_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match=r"Invalid max_chunk_elements=.*: must be None or an int >= 1"):
        SingleDeviceStrategy(max_chunk_elements=bad)  # type: ignore[arg-type]

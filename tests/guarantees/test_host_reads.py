"""What a step asks of the device: blocking host reads and aten calls (kernel launches on a GPU).

Counted on CPU with :class:`muonkit.testing.op_counts.OpCounter`, which treats every tensor as a
device tensor except the AdamW step counters (host tensors in a GPU run too). A default step
reads the device once (the non-finite verdict, after every direction is launched), an unchecked
step never; on GPT-2's hidden shapes a step makes no more aten calls than torch.optim.Muon.
``count_ops`` counts muonkit's accelerator path (on the CPU itself muonkit reads where reads are
free); the results of both paths are compared here too.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import pytest
import torch

import muonkit
from muonkit.distributed import SingleDeviceStrategy
from muonkit.testing import (
    GPT2_SCALE,
    OpCounter,
    as_on_an_accelerator,
    count_ops,
    gpt2_hidden_params,
    step_tensors,
)


def _hybrid(nonfinite: str = "skip") -> tuple[torch.nn.Module, muonkit.HybridMuon]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.LayerNorm(40), torch.nn.Linear(40, 12))
    opt = muonkit.HybridMuon(muonkit.param_groups(net), nonfinite=nonfinite, weight_decay=0.1)
    return net, opt


def _grads(net: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in net.parameters():
        p.grad = torch.randn(p.shape, generator=g)


# ---------------------------------------------------------------- the counter itself


@pytest.mark.parametrize(
    ("name", "read"),
    [
        ("item", lambda x: x[0].item()),
        ("float", lambda x: float(x.sum())),
        ("bool", lambda x: bool(x.isfinite().all())),
        ("tolist", lambda x: x.tolist()),
        ("numpy", lambda x: np.asarray(x)),
        ("equal", lambda x: torch.equal(x, x)),
        ("nonzero", lambda x: x.nonzero()),
        ("masked_select", lambda x: torch.masked_select(x, x > 0)),
        ("boolean index", lambda x: x[x > 0]),
    ],
)
def test_the_counter_sees_one_read_per_host_read(name: str, read: object) -> None:
    x = torch.randn(5)
    counts = count_ops(lambda: read(x))  # type: ignore[operator]
    assert counts.reads == 1, (name, counts.reads_by_op)


def test_the_counter_counts_calls_and_no_read_for_device_work() -> None:
    xs = [torch.randn(3, 4) for _ in range(5)]
    counts = count_ops(lambda: (torch._foreach_mul_(xs, 2.0), xs[0] @ xs[1].mT, xs[2].t()))
    assert counts.reads == 0
    assert counts.calls == 4 and counts.views == 2  # _foreach_mul_ once for 5 tensors; mT and t are views
    assert counts.by_op["_foreach_mul_"] == 1


def test_the_counter_skips_host_tensors_and_restores_tolist() -> None:
    step, x = torch.tensor(3.0), torch.randn(4)
    tolist = torch.Tensor.tolist
    with OpCounter(host=[step]) as counts:
        step.item(), step.tolist(), x.sum().item()
        assert torch.Tensor.tolist is not tolist  # wrapped while counting
    assert counts.reads == 1 and counts.reads_by_op == {"_local_scalar_dense": 1}
    assert torch.Tensor.tolist is tolist
    net, opt = _hybrid()
    _grads(net, 0)
    opt.step()
    assert len(step_tensors(opt)) == sum(p.ndim < 2 for p in net.parameters())  # the AdamW params' steps


# ---------------------------------------------------------------- reads per step


@pytest.mark.parametrize(("nonfinite", "reads"), [("skip", 1), ("raise", 1), ("unchecked", 0)])
def test_a_step_reads_the_device_at_most_once(nonfinite: str, reads: int) -> None:
    net, opt = _hybrid(nonfinite)
    for seed in range(3):  # the first step (new states) and steady state
        _grads(net, seed)
        counts = count_ops(opt.step, host=lambda: step_tensors(opt))
        assert counts.reads == reads, counts.reads_by_op


def test_a_skipped_step_reads_once_too() -> None:
    """The verdict is exact on the device (max-abs): no second read to confirm it."""
    net, opt = _hybrid()
    _grads(net, 0)
    opt.step()
    _grads(net, 1)
    next(net.parameters()).grad[0, 0] = float("inf")  # type: ignore[index]
    before = [p.detach().clone() for p in net.parameters()]
    counts = count_ops(opt.step, host=lambda: step_tensors(opt))
    assert opt.skipped_steps == 1 and counts.reads == 1
    assert all(torch.equal(b, p) for b, p in zip(before, net.parameters(), strict=True))


@pytest.mark.parametrize("accelerator", [False, True], ids=["cpu", "accelerator"])
@pytest.mark.parametrize("scale", [1e30, 1e-30, 1e-40])
def test_finite_gradients_of_any_scale_step_alike_on_both_paths(accelerator: bool, scale: float) -> None:
    """A gradient whose sum of squares overflows or underflows fp32 is finite and steps: the same
    direction on the CPU path (fp32 norm, range check) and the accelerator path (fp64 norm)."""
    net, opt = _hybrid()
    _grads(net, 0)
    weight = net[0].weight
    reference = muonkit.orthogonalize(weight.grad, method="gram")  # type: ignore[arg-type]
    weight.grad = weight.grad * scale  # type: ignore[operator]
    before = weight.detach().clone()
    with as_on_an_accelerator() if accelerator else contextlib.nullcontext():
        opt.step()
    assert opt.skipped_steps == 0
    lr, scale_lr = opt.param_groups[0]["lr"], max(1.0, weight.shape[0] / weight.shape[1]) ** 0.5
    applied = (before * (1 - lr * 0.1) - weight.detach()) / (lr * scale_lr)
    # tolerance: fp32 rounding of the weights (~1e-7 relative to 0.1-sized values, over lr=0.02)
    torch.testing.assert_close(applied, reference, atol=2e-4, rtol=0)


# ---------------------------------------------------------------- calls per step


def _calls(build: object, layers: int = 6) -> int:
    params = gpt2_hidden_params(layers)
    opt = build(params)  # type: ignore[operator]
    opt.step()
    return count_ops(opt.step, host=lambda: step_tensors(opt)).calls


@pytest.mark.parametrize("nonfinite", ["skip", "unchecked"])
@pytest.mark.parametrize(
    ("ns_dtype", "ns_method"),
    [(torch.bfloat16, "gram"), (torch.float32, "newton_schulz"), (torch.float32, "gram")],
    ids=["bf16", "fp32-ns", "fp32-gram"],
)
def test_no_more_aten_calls_than_torch_muon_on_gpt2_shapes(
    nonfinite: str, ns_dtype: torch.dtype, ns_method: str
) -> None:
    """6 layers. bf16 is what a GPU computes in by default (plain Newton-Schulz, as torch's); fp32
    Gram (the CPU default) on the 15 of the 16 batches with aspect ratio >= 2, plain on the square one.
    Before the Gram step used ``S = b R + c R^2`` in fused ``a X + S X`` products (no ``a I`` added
    but at the first step), fp32 Gram made 787 (skip) and 818 (unchecked) calls to torch's 698.

    Chunked as on a GPU: 1/64 of an 80 GB GPU's memory in fp32 (``default_chunk_elements``), over
    8**2 as the matrices are; unchecked also as on the CPU (2**22 elements, over 8**2: ~16
    chunks). A checked step commits each chunk masked by the device verdict (a few more calls per
    chunk and per tensor), so CPU-sized chunks are not an accelerator's configuration there."""
    budget = 80 * 2**30 // 256 if nonfinite != "unchecked" else 2**22
    strategy = SingleDeviceStrategy(max_chunk_elements=budget // GPT2_SCALE**2)
    ours = _calls(
        lambda ps: muonkit.Muon(
            ps, lr=0.02, nonfinite=nonfinite, ns_dtype=ns_dtype, ns_method=ns_method, strategy=strategy
        )
    )
    assert ours <= _torch_muon_calls()


@functools.cache
def _torch_muon_calls() -> int:
    return _calls(lambda ps: torch.optim.Muon(ps, lr=0.02))

"""``capturable=True``: a step with no host read, equal to the plain step, compiled without recompiles.

A CUDA graph cannot be captured on the CPU machines the suite runs on; what it needs is checked
here instead: no op of the step reads a tensor's value back to the host (counted by
``muonkit.testing.op_counts`` on the path a GPU step takes), ``torch.compile(..., fullgraph=True)``
traces the whole step as one graph, and lr schedules write the group's tensors in place, so
nothing recompiles. Results are
compared with the plain step bit for bit: every operation of the capturable path rounds as its
plain counterpart does (see ``muon_apply_`` and ``adamw_``).

``make test`` sets ``TORCH_COMPILE_DISABLE=1``, which torch reads at import into
``torch._dynamo.config.disable`` and checks at every call of a compiled function: the compile
tests switch it off for themselves (``_compiling``), so they compile in CI too.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch._dynamo.testing
from torch import Tensor, nn

import muonkit
from muonkit.distributed import Strategy
from muonkit.testing import as_on_an_accelerator, count_ops


@contextmanager
def _compiling() -> Iterator[None]:
    """torch.compile on, whatever TORCH_COMPILE_DISABLE says, and a fresh dynamo cache."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(disable=False):
        yield
    torch._dynamo.reset()


def _model(dtype: torch.dtype) -> list[nn.Parameter]:
    shapes = [(16, 40), (3, 8, 8), (40,), (5, 7)]  # a matrix, 3 experts, a vector, a small AdamW matrix
    return [nn.Parameter(torch.randn(s, dtype=dtype)) for s in shapes]


def _optimizer(params: list[nn.Parameter], *, capturable: bool, **options: Any) -> muonkit.HybridMuon:
    groups = [
        {"params": params[:2], "algorithm": "muon", "weight_decay": 0.1},
        {"params": params[2:], "algorithm": "adamw", "weight_decay": 0.01},
    ]
    dtype = params[0].dtype
    return muonkit.HybridMuon(groups, nonfinite="unchecked", capturable=capturable, ns_dtype=dtype, **options)


def _train(
    dtype: torch.dtype,
    *,
    capturable: bool,
    steps: int = 6,
    compile_step: Callable[[muonkit.HybridMuon], Callable[[], Any]] | None = None,
    run: Callable[[Callable[[], Any]], Any] | None = None,
    **options: Any,
) -> tuple[list[nn.Parameter], muonkit.HybridMuon]:
    """``steps`` steps under a cosine lr schedule; the last AdamW param has no gradient at the first
    step (so its step count differs from its neighbour's). From the third step on, the step is
    ``compile_step(opt)``; each step is called by ``run`` if given."""
    torch.manual_seed(0)
    params = _model(dtype)
    opt = _optimizer(params, capturable=capturable, **options)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    g = torch.Generator().manual_seed(1)
    step: Callable[[], Any] = opt.step
    for i in range(steps):
        if compile_step is not None and i == 2:  # two eager steps create every state (as before a CUDA graph capture)
            step = compile_step(opt)
        for j, p in enumerate(params):
            p.grad = None if (i, j) == (0, 3) else torch.randn(p.shape, generator=g, dtype=dtype)
        step() if run is None else run(step)
        schedule.step()
    return params, opt


def _assert_same(
    a: tuple[list[nn.Parameter], muonkit.HybridMuon], b: tuple[list[nn.Parameter], muonkit.HybridMuon]
) -> None:
    (params_a, opt_a), (params_b, opt_b) = a, b
    for pa, pb in zip(params_a, params_b, strict=True):
        assert torch.equal(pa, pb)
        state_a, state_b = opt_a.state[pa], opt_b.state[pb]
        assert state_a.keys() == state_b.keys()
        for key in state_a:  # the step counters sit on different devices in general: compare values
            assert torch.equal(state_a[key].cpu(), state_b[key].cpu()), key
    for ga, gb in zip(opt_a.param_groups, opt_b.param_groups, strict=True):
        assert float(ga["lr"]) == float(gb["lr"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_capturable_step_equals_the_plain_step_bit_for_bit(dtype: torch.dtype) -> None:
    plain = _train(dtype, capturable=False)
    captured = _train(dtype, capturable=True)
    _assert_same(plain, captured)
    assert float(plain[1].param_groups[0]["lr"]) != 0.02  # the schedule moved the lr
    assert plain[1].state[plain[0][3]]["step"] == 5 and plain[1].state[plain[0][2]]["step"] == 6


def test_capturable_groups_hold_device_tensors() -> None:
    params, opt = _train(torch.float32, capturable=True, steps=2)
    for group in opt.param_groups:
        for key in ("lr", "weight_decay"):
            value = group[key]
            assert isinstance(value, Tensor) and value.ndim == 0 and value.dtype == torch.float64
            assert value.device == params[0].device
    assert opt.param_groups[1]["weight_decay"].item() == 0.01
    assert isinstance(opt.state[params[2]]["step"], Tensor)


def test_capturable_step_reads_nothing_on_the_host() -> None:
    """Counted on the path a GPU step takes (``count_ops`` runs it; on the CPU itself the
    normalization reads its range where a read waits for nothing): no read at all, the AdamW
    step counters included (they live on the device), with results equal to the plain step's
    there too. The plain step reads its CPU step counters (and in general its verdict)."""
    reads: list[dict[str, int]] = []
    captured = _train(torch.float32, capturable=True, run=lambda f: reads.append(count_ops(f).reads_by_op))
    assert reads == [{}] * 6
    plain_reads: list[int] = []
    plain = _train(torch.float32, capturable=False, run=lambda f: plain_reads.append(count_ops(f).reads))
    assert all(n > 0 for n in plain_reads)  # the counter sees reads where there are some
    _assert_same(plain, captured)


def test_a_number_written_into_the_group_is_copied_into_its_tensor() -> None:
    """Custom code (not a torch scheduler) that assigns a float: copied in place at the next step."""
    params, opt = _train(torch.float32, capturable=True, steps=1)
    for p in params:
        p.grad = torch.randn_like(p)
    reference = copy.deepcopy(opt)
    for p, twin in zip(params, [p for g in reference.param_groups for p in g["params"]], strict=True):
        twin.grad = p.grad.clone()
    reference.param_groups[0]["lr"].fill_(0.5)
    held = opt.param_groups[0]["lr"]
    opt.param_groups[0]["lr"] = 0.5
    opt.step()
    reference.step()
    assert opt.param_groups[0]["lr"] is held and held.item() == 0.5
    assert all(map(torch.equal, opt.param_groups[0]["params"], reference.param_groups[0]["params"]))
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match=r"Invalid lr \(param group 0\)=-1.0: must be >= 0"):
        opt.step()
    assert held.item() == 0.5


def test_compiled_capturable_step_is_one_graph_without_recompiles() -> None:
    """The lr changes at every step (cosine schedule): the step compiles once, as one graph.

    The step is compiled from the optimizer class's ``step``: ``opt.step`` is wrapped by the lr
    scheduler (the wrapper records the call), a frame dynamo never traces, so
    ``torch.compile(opt.step)`` runs that wrapper eagerly and compiles the step under it (the same
    graph), but cannot be ``fullgraph=True``.
    """
    counter = torch._dynamo.testing.CompileCounter()

    def compile_step(opt: muonkit.HybridMuon) -> Callable[[], Any]:
        return torch.compile(functools.partial(type(opt).step, opt), backend=counter, fullgraph=True)

    with _compiling():
        compiled = _train(torch.float32, capturable=True, compile_step=compile_step)
    assert counter.frame_count == 1  # 4 compiled steps, 4 different lrs
    assert counter.op_count > 50  # the step's ops are in the graph
    calls = itertools.count()

    def run(step: Callable[[], Any]) -> None:  # from step 3 on, the read-free path compiled steps take
        with as_on_an_accelerator() if next(calls) >= 2 else contextlib.nullcontext():
            step()

    _assert_same(_train(torch.float32, capturable=False, run=run), compiled)


def test_state_dict_round_trips_between_capturable_and_plain() -> None:
    """Capturable -> plain -> capturable: values carried, rates loaded into the held tensors."""
    params, opt = _train(torch.float32, capturable=True, steps=2)
    plain = _optimizer(copy.deepcopy(params), capturable=False)
    plain.load_state_dict(opt.state_dict())
    assert [type(g["lr"]) for g in plain.param_groups] == [float, float]
    twin = copy.deepcopy(params)
    back = _optimizer(twin, capturable=True)
    held = back.param_groups[1]["lr"]
    back.load_state_dict(plain.state_dict())
    assert back.param_groups[1]["lr"] is held and held.item() == float(opt.param_groups[1]["lr"])
    assert back.state[twin[2]]["step"].device == twin[2].device
    for optimizer, ps in ((opt, params), (back, twin)):
        for group in optimizer.param_groups:
            group["lr"].fill_(0.01)
        for p in ps:
            p.grad = torch.ones_like(p)
        optimizer.step()
    _assert_same((params, opt), (twin, back))


def test_muon_takes_capturable() -> None:
    p = nn.Parameter(torch.randn(8, 16))
    opt = muonkit.Muon([p], capturable=True, nonfinite="unchecked")
    p.grad = torch.randn_like(p)
    opt.step()
    assert isinstance(opt.param_groups[0]["lr"], Tensor)


class _Elsewhere(Strategy):
    """Any strategy other than the single-device one (distributed ones need a process group)."""

    name = "elsewhere"

    def directions(self, params: list[Tensor], updates: list[Tensor], config: Any) -> list[Tensor]:
        raise AssertionError("never reached")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"capturable": 1}, r"Invalid capturable=1: must be True or False"),
        ({"capturable": True}, r"capturable=True needs nonfinite='unchecked', got nonfinite='skip'"),
        (
            {"capturable": True, "nonfinite": "raise"},
            r"capturable=True needs nonfinite='unchecked', got nonfinite='raise'",
        ),
        (
            {"capturable": True, "nonfinite": "unchecked", "strategy": "elsewhere"},
            r"capturable=True runs on one device only \(SingleDeviceStrategy\), but the strategy is _Elsewhere",
        ),
    ],
)
def test_capturable_refuses_what_it_cannot_honor(options: dict[str, Any], message: str) -> None:
    if options.get("strategy") == "elsewhere":
        options = {**options, "strategy": _Elsewhere()}
    with pytest.raises(ValueError, match=message):
        muonkit.HybridMuon([nn.Parameter(torch.randn(4, 4))], **options)


def test_capturable_refuses_a_strategy_set_later_before_changing_anything() -> None:
    p = nn.Parameter(torch.randn(4, 4))
    opt = muonkit.HybridMuon([p], capturable=True, nonfinite="unchecked")
    opt.set_strategy(_Elsewhere())
    p.grad = torch.randn_like(p)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="runs on one device only"):
        opt.step()
    assert torch.equal(p, before) and not opt.state


def test_capturable_refuses_a_group_on_two_devices() -> None:
    params = [nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4, device="meta"))]
    with pytest.raises(ValueError, match=r"Param group 0 has params on 2 devices \(cpu, meta\)"):
        muonkit.HybridMuon(params, capturable=True, nonfinite="unchecked")


def test_capturable_as_a_group_key_names_the_keyword() -> None:
    with pytest.raises(ValueError, match=r"capturable is an optimizer keyword, not a group key"):
        muonkit.HybridMuon([{"params": [nn.Parameter(torch.randn(4, 4))], "capturable": True}])


# ------------------------------------------------------------------ ns_compile


def test_ns_compile_runs_the_iteration_compiled_with_the_eager_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ns_compile=True``: Newton-Schulz through ``torch.compile(..., fullgraph=True)``, the same
    result as eager. Compiled here with dynamo's eager backend (the graph capture, no codegen):
    inductor builds C++ on CPU, ~80 s on a CI machine; it is measured by
    ``muonkit_bench.capturable``, with the same bit-for-bit result."""
    counter = torch._dynamo.testing.CompileCounter()
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", functools.partial(compile_, backend=counter))
    iteration = importlib.import_module("muonkit.functional.orthogonalize").compiled_iteration
    iteration.cache_clear()
    try:
        with _compiling():
            eager = _train(torch.float32, capturable=False, steps=2)
            compiled = _train(torch.float32, capturable=False, steps=2, ns_compile=True)
    finally:
        iteration.cache_clear()
    assert counter.frame_count == 2  # (16, 40) runs the Gram iteration, the (8, 8) experts the plain one
    _assert_same(eager, compiled)


def test_ns_compile_is_checked() -> None:
    with pytest.raises(ValueError, match=r"Invalid ns_compile='yes': must be True or False in param group 0"):
        muonkit.HybridMuon([nn.Parameter(torch.randn(4, 4))], ns_compile="yes")

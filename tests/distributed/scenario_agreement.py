"""Ranks must agree: settings that differ across ranks raise on every rank before anything changes,
the check costs no extra collective, every host-made tensor a collective gets is placed by
``collectives.flag_device``, and zero-size params step as a no-op under DDP, FSDP2 and ZeRO.

Layouts: ``ddp`` (replicated), ``fsdp`` (DTensor, Shard(0)) and ``zero`` (a ZeroStrategy bound to
a hand-made ZeRO-1/2 flat partition, as DeepSpeed hands one to the optimizer). Zero-size params
are compared with the single-device optimizer bit for bit (see scenario_optimizer for why that
is exact).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from common import (
    ZOO,
    ParamSpec,
    build,
    build_module,
    differences,
    differences_to,
    full,
    group_dicts,
    set_grads,
    snapshot,
    train_beside_single,
    zero_partition,
)
from harness import Context, check
from torch import nn

import muonkit
from muonkit.distributed import collectives
from muonkit.testing import as_on_an_accelerator, count_ops, step_tensors

LAYOUTS = ("ddp", "fsdp", "zero")
ZERO_SHAPES = [(6, 5), (0, 8), (4, 4), (8, 0), (3, 4)]  # straddling and zero-size params


def _zero(ctx: Context, **kwargs: Any) -> tuple[list[nn.Parameter], muonkit.HybridMuon]:
    """A HybridMuon stepping this rank's flat partition of ZERO_SHAPES, as under DeepSpeed ZeRO-1/2."""
    return zero_partition(ZERO_SHAPES, rank=ctx.rank, world_size=ctx.world_size, **kwargs)


def _build(layout: str, ctx: Context, **kwargs: Any) -> tuple[list[nn.Parameter], muonkit.HybridMuon]:
    return _zero(ctx, **kwargs) if layout == "zero" else build(layout, ZOO, **kwargs)


def _grads(layout: str, params: list[nn.Parameter], step: int) -> None:
    if layout == "zero":
        params[0].grad = torch.randn(params[0].shape, generator=torch.Generator().manual_seed(step))
    else:
        set_grads(params, ZOO, step)


def _raises(fn: Callable[[], Any], error: type[Exception], *parts: str) -> str:
    try:
        fn()
    except error as e:
        missing = [p for p in parts if p not in str(e)]
        assert not missing, f"{missing} not in: {e}"
        return str(e)
    raise AssertionError(f"no {error.__name__} (expected one naming {parts})")


def _unchanged(params: list[nn.Parameter], opt: muonkit.HybridMuon, before: list[torch.Tensor]) -> None:
    assert not opt.state, "states were created before the error"
    for i, (p, b) in enumerate(zip(params, before, strict=True)):
        assert torch.equal(full(p.detach()), b), f"param {i} changed before the error"


@check(2, 4)
def a_setting_differing_on_one_rank_raises_everywhere_before_any_change(ctx: Context) -> None:
    last = ctx.rank == ctx.world_size - 1
    cases: list[tuple[str, Callable[[muonkit.HybridMuon], None], list[str]]] = [
        ("lr", lambda o: o.param_groups[0].update(lr=0.01 if last else 0.02), ["param group 0 lr (here 0.0"]),
        ("eps", lambda o: o.param_groups[-1].update(eps=1e-6 if last else 1e-8), ["eps (here"]),
        ("betas", lambda o: o.param_groups[-1].update(betas=(0.9, 0.99 if last else 0.95)), ["beta2 (here 0.9"]),
        ("ns_steps", lambda o: o.param_groups[0].update(ns_steps=4 if last else None), ["ns_steps (here"]),
        ("nonfinite", lambda o: setattr(o, "nonfinite", "raise" if last else "skip"), ["nonfinite (here '"]),
    ]
    for layout in LAYOUTS:
        for what, change, parts in cases:
            if layout == "zero" and what in ("eps", "betas"):
                continue  # one Muon group only
            params, opt = _build(layout, ctx)
            _grads(layout, params, 0)
            before = [full(p.detach()).clone() for p in params]
            change(opt)
            message = _raises(opt.step, ValueError, "settings differ across ranks", *parts)
            assert message.count("(here") == 1, f"{layout} {what}: only {what} differs: {message}"
            _unchanged(params, opt, before)


@check(2, 4)
def param_groups_differing_raise_everywhere(ctx: Context) -> None:
    last = ctx.rank == ctx.world_size - 1
    for layout in ("ddp", "fsdp"):
        zoo = [ParamSpec("muon", (16, 17)) if last and i == 0 else s for i, s in enumerate(ZOO)]
        params, opt = build(layout, zoo)
        set_grads(params, zoo, 0)
        _raises(opt.step, ValueError, "param groups (algorithms, param shapes and dtypes) differ across ranks")
        # one more group on one rank: a different param count still gives the clean error, no crash
        params, opt = build(layout, ZOO)
        if last:
            opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))], "algorithm": "adamw"})
        set_grads(params, ZOO, 0)
        _raises(opt.step, ValueError, "param groups (algorithms, param shapes and dtypes) differ across ranks")


@contextmanager
def _spy_all_reduce() -> Iterator[list[torch.Tensor]]:
    calls: list[torch.Tensor] = []
    original = dist.all_reduce

    def spy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(tensor)
        return original(tensor, *args, **kwargs)

    dist.all_reduce = spy
    try:
        yield calls
    finally:
        dist.all_reduce = original


@check(2, 4)
def identical_settings_pass_with_a_scheduler_and_one_small_all_reduce_each(ctx: Context) -> None:
    for layout in LAYOUTS:
        # the agreement (+ the gradients' verdict before the commits and the directions' guard after)
        for nonfinite, per_step in (("skip", 3), ("unchecked", 1)):
            params, opt = _build(layout, ctx, nonfinite=nonfinite)
            scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
            for step in range(3):
                _grads(layout, params, step)
                with _spy_all_reduce() as calls:
                    opt.step()
                scheduler.step()
                assert len(calls) == per_step, f"{layout} {nonfinite}: {len(calls)} all_reduces in a step"
                assert all(t.numel() <= 1024 for t in calls), [t.numel() for t in calls]


@check(2, 4)
def every_flag_reduction_is_where_the_backend_reduces(ctx: Context) -> None:
    """The agreement (host data) on the CPU; the verdicts where the flags are, if the backend reduces
    there, else on flag_device (here gloo: the CPU either way)."""
    for layout in LAYOUTS:
        params, opt = _build(layout, ctx)
        for step in range(2):
            _grads(layout, params, step)
            with _spy_all_reduce() as calls:
                opt.step()
            group = opt.strategy.comm.group  # type: ignore[attr-defined]
            assert len(calls) == 3, f"{layout}: {len(calls)} all_reduces"
            assert all(t.device == collectives.flag_device(group) for t in calls), [t.device for t in calls]


@check(2, 4)
def a_step_reads_the_device_once_and_unchecked_never(ctx: Context) -> None:
    """The agreement (settings, which params have gradients) is host data, reduced on the host: a
    default step's one blocking read is the non-finite verdict, an unchecked step reads nothing
    (counted as on a GPU: every tensor but host memory is a device tensor). The first step is not
    counted: it cuts the params into pieces with index arithmetic on CPU tensors (arange, the
    mesh's rank table), host tensors in a device run too that the counter cannot tell apart here."""
    for layout in LAYOUTS:
        for nonfinite, reads in (("skip", 1), ("raise", 1), ("unchecked", 0)):
            params, opt = _build(layout, ctx, nonfinite=nonfinite)
            for step in range(3):
                _grads(layout, params, step)
                if step == 0:  # builds the layouts from the meshes' rank tables: CPU tensors in any run
                    opt.step()
                    continue
                counts = count_ops(opt.step, host=functools.partial(step_tensors, opt))
                assert counts.reads == reads, (layout, nonfinite, step, counts.reads_by_op)


@check(2, 4)
def the_masked_step_of_an_accelerator_equals_its_unchecked_step_and_skips_on_every_rank(ctx: Context) -> None:
    """Counted as on a GPU (every commit masked by the gradients' verdict, on the device): the same
    params as the unchecked step bit for bit, and an inf on the last rank only skips the step on
    every rank with nothing changed."""
    for layout in LAYOUTS:
        results = []
        for nonfinite in ("unchecked", "skip"):
            params, opt = _build(layout, ctx, nonfinite=nonfinite)
            with as_on_an_accelerator():
                for step in range(3):
                    _grads(layout, params, step)
                    opt.step()
                if nonfinite == "skip":
                    _grads(layout, params, 3)
                    if ctx.rank == ctx.world_size - 1:  # this rank's own part (a DTensor op would be collective)
                        local = [
                            getattr(p.grad, "to_local", lambda g=p.grad: g)() for p in params if p.grad is not None
                        ]
                        next(g for g in local if g.numel() > 0).view(-1)[0] = math.inf
                    before = [full(p.detach()).clone() for p in params]
                    opt.step()
                    assert opt.skipped_steps == 1, (layout, opt.skipped_steps)
                    assert all(torch.equal(b, full(p.detach())) for b, p in zip(before, params, strict=True)), layout
            results.append([full(p.detach()).clone() for p in params])
        assert all(torch.equal(a, b) for a, b in zip(*results, strict=True)), layout


@check(2, 4)
def a_backend_without_cpu_tensors_gets_a_gloo_group_for_the_agreement(ctx: Context) -> None:
    """As beside an NCCL-only group: the agreement goes through a gloo group over the same ranks,
    made once, and still makes every rank raise on a disagreement."""
    original = collectives.reduces_cpu
    collectives.reduces_cpu = lambda group: False
    try:
        for layout in ("ddp", "fsdp"):
            params, opt = _build(layout, ctx)
            for step in range(2):
                _grads(layout, params, step)
                opt.step()
            comm = opt.strategy.comm  # type: ignore[attr-defined]
            host = comm.host_group
            assert host is not comm.group and host is comm.host_group, layout
            assert dist.get_backend(host) == "gloo" and dist.get_world_size(host) == ctx.world_size, layout
            assert dist.get_process_group_ranks(host) == dist.get_process_group_ranks(comm.group or dist.group.WORLD)
            params, opt = _build(layout, ctx)
            _grads(layout, params, 0)
            opt.param_groups[0]["lr"] = 0.01 if ctx.rank == ctx.world_size - 1 else 0.02
            _raises(opt.step, ValueError, "settings differ across ranks", "param group 0 lr (here 0.0")
    finally:
        collectives.reduces_cpu = original


ZERO_SIZE_ZOO = [
    ParamSpec("muon", (0, 8)),
    ParamSpec("muon", (8, 0)),
    ParamSpec("muon", (3, 0, 8)),  # experts of no rows
    ParamSpec("muon", (0, 4, 4)),  # no experts, next to a whole (4, 4) matrix
    ParamSpec("muon", (4, 4)),
    ParamSpec("muon", (16, 16)),
    ParamSpec("muon_t", (0, 6)),
    ParamSpec("muon_split", (12, 0)),  # blocks (4, 0) and (8, 0)
    ParamSpec("adamw", (0,)),
    ParamSpec("adamw", (0, 3)),
    ParamSpec("adamw", (5,)),
]


@check(1, 2, 4)
def zero_size_params_step_as_a_no_op(ctx: Context) -> None:
    for layout in ("ddp", "fsdp"):
        params, opt, problems = train_beside_single(layout, ZERO_SIZE_ZOO, 3)
        assert not problems, f"{layout}: " + "\n".join(problems)
        for p, spec in zip(params, ZERO_SIZE_ZOO, strict=True):
            for key, value in opt.state[p].items():
                if key != "step":
                    assert tuple(value.shape) == spec.shape, f"{layout}: {key} {tuple(value.shape)} for {spec.shape}"
        # state_dict round trip: a fresh optimizer loads it and steps exactly like the original
        fresh_params, fresh = build(layout, ZERO_SIZE_ZOO)
        for p, q in zip(params, fresh_params, strict=True):
            q.data.copy_(p.data)
        fresh.load_state_dict(opt.state_dict())
        set_grads(params, ZERO_SIZE_ZOO, 3)
        set_grads(fresh_params, ZERO_SIZE_ZOO, 3)
        opt.step()
        fresh.step()
        problems = differences_to(snapshot(fresh_params, fresh), snapshot(params, opt))
        assert not problems, f"{layout} after load_state_dict: " + "\n".join(problems)


@check(2, 4)
def fully_shard_zero_size_params_step_and_init_their_state(ctx: Context) -> None:
    """FSDP2 shards a zero-size param as (0, 0) (or (0, ...)) on every rank, not by torch.chunk.
    Its own backward cannot reduce-scatter one yet (torch 2.13: "_chunk_cat expects non-empty
    tensor"), but gradients in its layout (``zeros_like``) must step, as DCP's ``get_state_dict``
    does on a fresh optimizer (one zero-gradient, zero-lr step on every param)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    for initialize in (True, False):
        _, module = build_module("fsdp", ZERO_SIZE_ZOO)
        params = list(module.parameters())
        opt = muonkit.HybridMuon(group_dicts(params, ZERO_SIZE_ZOO))
        if initialize:
            get_state_dict(module, opt)
            assert len(opt.state) == len(params), f"{len(opt.state)} states for {len(params)} params"
            continue
        ref_params, ref_opt = build("single", ZERO_SIZE_ZOO)
        for step in range(2):
            set_grads(params, ZERO_SIZE_ZOO, step)
            set_grads(ref_params, ZERO_SIZE_ZOO, step)
            for p in params:
                if p.numel() == 0:
                    p.grad = torch.zeros_like(p)  # FSDP2's layout of it
            opt.step()
            ref_opt.step()
        # full_tensor() cannot gather FSDP2's (0, 0) shards (torch 2.13): the empty ones by shape
        kept = [i for i, p in enumerate(params) if p.numel()]
        problems = differences(
            [params[i] for i in kept], opt, [ref_params[i] for i in kept], ref_opt, [ZERO_SIZE_ZOO[i] for i in kept]
        )
        assert not problems, "\n".join(problems)
        for p, spec in zip(params, ZERO_SIZE_ZOO, strict=True):
            shapes = {k: tuple(v.shape) for k, v in opt.state[p].items() if k != "step"}
            assert shapes and set(shapes.values()) == {spec.shape}, (spec.shape, shapes)

"""8-bit and bf16 optimizer state (``state_dtype``) on every layout against the same state_dtype on one device.

Each check builds a layout with plain torch APIs (DDP's replicated params with a process group,
FSDP2 ``Shard(0)``, ``Shard(1)`` as ``fully_shard(shard_placement_fn=...)`` lays it out, and the
N-D meshes of :mod:`mesh_placements`: HSDP, TP colwise/rowwise, FSDP2 + TP, EP), steps it
``STEPS`` times beside the one-device control with the same ``state_dtype`` on the same
gradients, and compares per param:

- **blocks the same** (no placement shards the param's last dim: every rank's blocks of 256 are
  the whole tensor's): every stored state entry bit for bit (8-bit codes as uint8 bits, their
  scales, bf16 values, ``step``), AdamW params bit for bit, Muon params within
  :data:`common.MUON_REL_TOL` of their distance (batched products, as at fp32). NorMuon's row
  moments come from the orthogonalized matrices: within that tolerance, decoded.
- **last dim sharded** (FSDP2 on dim 1, TP rowwise, a 1-D param under any FSDP2): each rank cuts
  its own blocks, so 8-bit codes and scales differ from one device's. Decoded states within
  :data:`STATE_TOL` of their norm and params within :data:`PARAM_TOL` of their distance (why
  those numbers: their docstrings). bf16 is still bit for bit: its rounding hashes each value's
  bits with the step, not its position.

Measured maxima are written to ``metrics_rank0.json`` in the launch's output directory (the
report quotes them).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import torch
from common import MUON_REL_TOL, ParamSpec, initial, set_grads
from harness import Context, check
from precision_common import local_of, max_abs, rel_diff, state_keys, whole_bits, whole_decoded
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import muonkit
from muonkit.functional.orthogonalize import default_compute_dtype
from muonkit.state_precision import local_scales

STEPS = 3
STATE_DTYPES = ("8bit", "bf16")
STATE_TOL = 0.125
"""Decoded 8-bit states whose blocks differ, ``||state - control|| / ||control||``: each run codes a
value within 2^-4 of itself (3 mantissa bits, round to nearest; 2^-3 for a second moment, coded
as its square root), in other blocks, and the momentum each run orthogonalizes carries its own
error into the next step's state. Measured <= 8.4e-2 (NorMuon's row moments, FSDP2 dim 1 at
4 ranks; exp_avg_sq 8.0e-2 at 8 ranks, momentum 4.5e-2). A bug (another param's state, a block
misplaced, a step lost) moves a state by ~100%."""
ROWS_TOL = 1e-3
"""NorMuon's row moments where the blocks are the same: the orthogonalized matrices differ by the
batched products' rounding (:data:`common.MUON_REL_TOL`, 1e-4 of a param's distance), which the
8-bit code may round to a neighbouring code (2^-4) in a few values: measured 0 here."""
PARAM_TOL = 0.15
"""Params whose 8-bit blocks differ, ``||p - control|| / ||control - initial||`` after ``STEPS``: the
momentum each run orthogonalizes differs by the two codes' errors, and Newton-Schulz amplifies a
small matrix's weak directions. Measured <= 7.8e-2 (Muon, FSDP2 dim 1 at 2 ranks; AdamW <= 1.6e-2).
A step skipped or applied twice moves a param by 1/STEPS = 33%."""


# ------------------------------------------------------------------ which layouts keep one device's blocks


def blocks_kept(p: Tensor) -> bool:
    """True where every rank's blocks along the last dim are the whole tensor's (it is not sharded)."""
    if not isinstance(p, DTensor) or p.dim() == 0:
        return True
    last = p.dim() - 1
    return not any(isinstance(pl, Shard | _StridedShard) and pl.dim in (last, -1) for pl in p.placements)


def _params(model_or_params: Any) -> list[tuple[str, Tensor]]:
    if isinstance(model_or_params, nn.Module):
        return list(model_or_params.named_parameters())
    return [(f"p{i}", p) for i, p in enumerate(model_or_params)]


def compare(
    params: Any,
    opt: muonkit.HybridMuon,
    ref_params: Any,
    ref_opt: muonkit.HybridMuon,
    initial_params: dict[str, Tensor],
    algorithms: dict[str, str],
    metrics: dict[str, float],
) -> list[str]:
    """What differs from the control (see the module docstring; collective). ``metrics``: the
    largest measured differences, by kind."""
    from mesh_placements import full

    muon_tol = MUON_REL_TOL[default_compute_dtype("cpu")]
    problems: list[str] = []
    refs = dict(_params(ref_params))

    def note(kind: str, value: float) -> None:
        metrics[kind] = max(metrics.get(kind, 0.0), value)

    for name, p in _params(params):
        r = refs[name]
        kept = blocks_kept(p)
        algorithm = algorithms[name]
        mine, ref = full(p.detach()).float(), r.detach().float()
        start = initial_params[name].float()
        travelled = torch.linalg.vector_norm((ref - start).double()).item()
        rel = 0.0 if torch.equal(mine, ref) else torch.linalg.vector_norm((mine - ref).double()).item() / travelled
        exact = kept and algorithm == "adamw"
        tol = 0.0 if exact else (max(muon_tol, 0.1 if p.dtype == torch.bfloat16 else 0.0) if kept else PARAM_TOL)
        note(f"param {'kept' if kept else 'sharded-last'} {algorithm}", rel)
        if rel > tol:
            problems.append(f"{name}: param {rel:.3e} of its distance from the control's (tolerance {tol})")
        own, ref_own = opt.state.get(p, {}), ref_opt.state.get(r, {})
        if sorted(own) != sorted(ref_own):
            problems.append(f"{name}: state keys {sorted(own)}, the control's {sorted(ref_own)}")
            continue
        for key in state_keys(ref_own):
            rows = key.startswith("row_")
            decoded, ref_decoded = whole_decoded(own, key, p), whole_decoded(ref_own, key, r)
            drift = rel_diff(decoded, ref_decoded)
            note(f"state {'kept' if kept else 'sharded-last'} {key}", drift)
            if rows:  # NorMuon's row moments: from the orthogonalized matrices (of a momentum coded alike or not)
                row_tol = ROWS_TOL if kept else STATE_TOL
                if drift > row_tol:
                    problems.append(f"{name}.{key}: decoded {drift:.3e} from the control's (> {row_tol})")
                continue
            stored = own[key]
            bitwise = kept or stored.dtype != torch.float8_e4m3fn
            if bitwise:
                entries = [key, key + "_scale"] if key + "_scale" in ref_own else [key]
                for entry in entries:
                    a, b = whole_bits(own[entry]), whole_bits(ref_own[entry])
                    if a.shape != b.shape or not torch.equal(a, b):
                        diff = max_abs(a.float(), b.float()) if a.shape == b.shape else float("nan")
                        problems.append(f"{name}.{entry}: not bit-identical to the control's (max |diff| {diff:.3e})")
            elif drift > STATE_TOL:
                problems.append(f"{name}.{key}: decoded {drift:.3e} of its norm from the control's (> {STATE_TOL})")
    return problems


def _check_local_states(opt: muonkit.HybridMuon, params: Sequence[Tensor]) -> list[str]:
    """Every 8-bit state's local scales have one value per local block (what the codec reads)."""
    problems = []
    for p in params:
        own = opt.state.get(p, {})
        for key, value in own.items():
            if isinstance(value, Tensor) and value.dtype == torch.float8_e4m3fn:
                codes, stored = local_of(value), local_of(own[key + "_scale"])
                scales = local_scales(codes, stored)
                want = (*codes.shape[:-1], -(-codes.shape[-1] // 256)) if codes.dim() else (1,)
                if codes.numel() and tuple(scales.shape) != want:
                    problems.append(f"{key}: local codes {tuple(codes.shape)}, scales {tuple(stored.shape)}")
    return problems


def _record(ctx: Context, label: str, metrics: dict[str, float]) -> None:
    if ctx.rank != 0:
        return
    path = ctx.out_dir / "metrics_rank0.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[label] = metrics
    path.write_text(json.dumps(data, indent=1, sort_keys=True))


def _run(
    ctx: Context, label: str, make: Callable[[str], tuple[Any, Any, Any, Any, Callable[[Any, int], None]]]
) -> None:
    """Step the layout beside the control for each state dtype; compare."""
    problems = []
    for state_dtype in STATE_DTYPES:
        params, opt, ref_params, ref_opt, grads = make(state_dtype)
        initial_params = {n: p.detach().clone().float() for n, p in _params(ref_params)}
        algorithms = {
            n: g["algorithm"]
            for g in ref_opt.param_groups
            for n, p in _params(ref_params)
            if any(p is q for q in g["params"])
        }
        for step in range(STEPS):
            grads(params, step)
            grads(ref_params, step)
            opt.step()
            ref_opt.step()
        metrics: dict[str, float] = {}
        where = f"{label} W={ctx.world_size} state_dtype={state_dtype}"
        problems += [
            f"{where}: {m}" for m in compare(params, opt, ref_params, ref_opt, initial_params, algorithms, metrics)
        ]
        problems += [f"{where}: {m}" for m in _check_local_states(opt, [p for _, p in _params(params)])]
        _record(ctx, f"{label}/W{ctx.world_size}/{state_dtype}", metrics)
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------ zoo layouts (1-D mesh, DDP)

ZOO: list[ParamSpec] = [
    ParamSpec("muon", (16, 16)),
    ParamSpec("muon", (6, 600)),  # 3 blocks per row (256, 256, 88); Shard(1) over 2: 300 columns, 2 blocks
    ParamSpec("muon", (7, 5)),  # rows do not divide
    ParamSpec("muon", (3, 10)),  # W=4: a rank holds no rows
    ParamSpec("muon", (3, 6, 300)),  # experts: dim 1 sharded by Shard(1), the last dim kept
    ParamSpec("muon", (8, 8), skip_steps=(1,)),
    ParamSpec("muon", (12, 8), dtype=torch.bfloat16),
    ParamSpec("adamw", (7,)),  # 1-D: FSDP2's Shard(0) is its last dim
    ParamSpec("adamw", (5, 520)),
    ParamSpec("adamw", (2, 3, 4)),
]
NORMUON_ZOO: list[ParamSpec] = [
    ParamSpec("normuon", (16, 16)),
    ParamSpec("normuon", (8, 300)),
    ParamSpec("normuon", (7, 5)),
    ParamSpec("adamw_cautious", (10, 4)),
]


def _zoo_make(layout: str, zoo: list[ParamSpec]) -> Callable[[str], tuple[Any, ...]]:
    from common import build

    def grads(params: Any, step: int) -> None:
        set_grads(params, zoo, step)

    def make(state_dtype: str) -> tuple[Any, ...]:
        params, opt = build(layout, zoo, state_dtype=state_dtype)
        ref_params, ref_opt = build("single", zoo, state_dtype=state_dtype)
        for i, spec in enumerate(zoo):  # the control's initial values are the layout's
            assert torch.equal(ref_params[i].detach(), initial(i, spec))
        return params, opt, ref_params, ref_opt, grads

    return make


@check(2, 4, 8)
def ddp_low_precision_states_match_one_device(ctx: Context) -> None:
    _run(ctx, "ddp", _zoo_make("ddp", ZOO))


@check(2, 4, 8)
def fsdp2_dim0_low_precision_states_match_one_device(ctx: Context) -> None:
    _run(ctx, "fsdp-dim0", _zoo_make("fsdp", ZOO))


@check(2, 4, 8)
def fsdp2_dim1_low_precision_states_match_one_device(ctx: Context) -> None:
    _run(ctx, "fsdp-dim1", _zoo_make("columns", ZOO))


@check(2, 4)
def row_sliced_adamw_states_match_one_device(ctx: Context) -> None:
    """AdamW params stepped by slices of their local rows (a batch limit of 100 values: the (5, 520)
    matrix one row at a time, its 8-bit scales sliced with it, also where FSDP2 shards its last dim)."""
    from muonkit import stages

    saved, batches, slices = stages.CODEC_BATCH_ELEMENTS, stages._batches, []

    def counted(*args: Any, **kwargs: Any) -> Any:
        for batch in batches(*args, **kwargs):
            slices.extend(rows for _, rows in batch if rows is not None)
            yield batch

    stages.CODEC_BATCH_ELEMENTS, stages._batches = 100, counted
    try:
        _run(ctx, "fsdp-dim0-sliced", _zoo_make("fsdp", ZOO))
        _run(ctx, "fsdp-dim1-sliced", _zoo_make("columns", ZOO))
    finally:
        stages.CODEC_BATCH_ELEMENTS, stages._batches = saved, batches
    assert slices, "no param was stepped by row slices"


@check(2, 4)
def normuon_fsdp2_dim1_low_precision_states_match_one_device(ctx: Context) -> None:
    _run(ctx, "normuon-fsdp-dim1", _zoo_make("columns", NORMUON_ZOO))


@check(2)
def normuon_fsdp2_dim0_low_precision_states_match_one_device(ctx: Context) -> None:
    _run(ctx, "normuon-fsdp-dim0", _zoo_make("fsdp", NORMUON_ZOO))


# ------------------------------------------------------------------ N-D meshes (mesh_placements)


class WideNet(nn.Module):
    """:class:`mesh_placements.MeshNet` and a wide matrix and bias (rows of 3 blocks)."""

    def __init__(self, seed: int = 0) -> None:
        from mesh_placements import MeshNet

        super().__init__()
        self.net = MeshNet(seed)
        torch.manual_seed(seed + 1)
        self.wide = nn.Linear(600, 6)


def mesh_build(kind: str, world_size: int, state_dtype: str, *, seed: int = 0) -> tuple[nn.Module, muonkit.HybridMuon]:
    """:class:`WideNet` laid out by :func:`mesh_placements.apply_placement` (the wide layer as the dense
    params around it) and ``HybridMuon(param_groups(model), state_dtype=...)`` on it."""
    from mesh_placements import RULES, apply_placement

    model = WideNet(seed)
    apply_placement(model.net, kind, world_size)
    if kind != "single":
        mesh = model.net.norm.weight.device_mesh
        if kind == "tp":
            from torch.distributed.tensor import distribute_module

            distribute_module(model.wide, mesh)
        else:
            from torch.distributed.fsdp import fully_shard

            fully_shard(model.wide, mesh=mesh)
    kwargs: dict[str, Any] = {"state_dtype": state_dtype}
    if kind == "single":
        kwargs["strategy"] = muonkit.distributed.SingleDeviceStrategy()
    groups = muonkit.param_groups(model, weight_decay=0.01, adamw_lr=1e-2, adamw_weight_decay=0.1, rules=RULES)
    return model, muonkit.HybridMuon(groups, **kwargs)


def _mesh_make(layout: str, world_size: int) -> Callable[[str], tuple[Any, ...]]:
    from mesh_placements import set_grads as mesh_grads

    def make(state_dtype: str) -> tuple[Any, ...]:
        model, opt = mesh_build(layout, world_size, state_dtype)
        ref, ref_opt = mesh_build("single", world_size, state_dtype)
        return model, opt, ref, ref_opt, mesh_grads

    return make


@check(4)
def hsdp_low_precision_states_match_one_device(ctx: Context) -> None:
    _run(ctx, "hsdp", _mesh_make("hsdp", ctx.world_size))


@check(4)
def tp_low_precision_states_match_one_device(ctx: Context) -> None:
    _run(ctx, "tp", _mesh_make("tp", ctx.world_size))


@check(4)
def fsdp2_tp_low_precision_states_match_one_device(ctx: Context) -> None:
    _run(ctx, "fsdp+tp", _mesh_make("fsdp_tp", ctx.world_size))


@check(4)
def ep_low_precision_states_match_one_device(ctx: Context) -> None:
    _run(ctx, "ep", _mesh_make("ep", ctx.world_size))


@check(4)
def ep_fsdp_low_precision_states_match_one_device(ctx: Context) -> None:
    _run(ctx, "ep+fsdp-dim1", _mesh_make("ep_fsdp", ctx.world_size))


@check(8)
def hsdp_tp_low_precision_states_match_one_device(ctx: Context) -> None:
    _run(ctx, "hsdp+tp", _mesh_make("hsdp_tp", ctx.world_size))


@check(8)
def ep_tp_low_precision_states_match_one_device(ctx: Context) -> None:
    _run(ctx, "ep+tp", _mesh_make("ep_tp", ctx.world_size))

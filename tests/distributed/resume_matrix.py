"""The resume-fidelity matrix: every way to save and resume x the params' gradients at load time
x a fresh or used optimizer, on one layout (one device, DDP, FSDP2, HSDP, FSDP2 + TP, TP).

The uninterrupted run: :class:`mesh_placements.MeshNet` with Muon, NorMuon and AdamW groups takes
``SAVE_AT`` steps on injected gradients (``late.weight`` and ``norm.bias`` get none before the
save, so the checkpoint holds no state for them), is saved through every path, and goes on to
``STEPS``. A resumed run builds the model again with other initial values and other learning
rates, and an optimizer that is fresh or used (it stepped on other gradients: it has states the
checkpoint lacks and lacks states the checkpoint holds), leaves the params' gradients None, zero
or set, loads, and must then

- hold the saved params, learning rates and states bit for bit, with the same state entries;
- hold the same gradients as before the load (the same tensors, the same values);
- after the same ``STEPS - SAVE_AT`` steps, equal the uninterrupted run bit for bit (same layout
  and world size: the same arithmetic).

A checkpoint with one state entry removed or corrupted (:data:`CORRUPTIONS`) must be refused with
a ``ValueError`` naming the entry, changing nothing (params, states, learning rates, gradients).

Paths (:data:`PATHS`):

- ``state_dict``: ``opt.state_dict()`` and ``model.state_dict()`` through ``torch.save`` /
  ``torch.load(weights_only=True)``, one file per rank (the optimizer loads first);
- ``save_checkpoint``: :mod:`muonkit.distributed.checkpoint`;
- ``dcp``: torch's recipe by hand (``get_state_dict``, ``dcp.save`` / ``dcp.load``,
  ``set_state_dict``). It reads the states the optimizer has when it is called, so it cannot
  resume this run in any cell; what it does instead is pinned in :data:`DCP_OUTCOMES` (the
  docs/checkpoints.md says so and points to ``load_checkpoint``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from common import mismatch
from mesh_placements import MeshNet, apply_placement, full, set_grads
from mesh_placements import groups as mesh_groups
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

import muonkit
from muonkit.distributed.checkpoint import load_checkpoint, save_checkpoint

PATHS = ("state_dict", "save_checkpoint", "dcp")
GRADS = ("none", "zero", "set")
OPTIMIZERS = ("fresh", "used")
CELLS = [(g, o) for o in OPTIMIZERS for g in GRADS]
SAVE_AT, STEPS = 3, 6
NO_GRAD = {"late.weight": (0, 1, 2), "norm.bias": (0, 1, 2)}  # no state in the checkpoint: must stay absent
USED_STEPS = (100, 101)
USED_NO_GRAD = {"mlp.down.weight": USED_STEPS, "head.weight": USED_STEPS}  # the used optimizer lacks their states
LOAD_STEP = 50  # the gradients a resumed run holds when it loads ("zero", "set")
NORMUON = ("mlp.up.weight", "experts.w_uneven")

DCP_OUTCOMES = {
    # torch's recipe by hand: get_state_dict asks only for the states the optimizer has, after
    # creating every param's state with a zero-lr step when the optimizer is fresh and no param
    # has a gradient. So: states the checkpoint lacks (late.weight) are asked for and DCP raises;
    # with gradients a fresh optimizer asks for none and silently loads no state at all.
    ("none", "fresh"): "raises",
    ("zero", "fresh"): "loads no state",
    ("set", "fresh"): "loads no state",
    ("none", "used"): "raises",
    ("zero", "used"): "raises",
    ("set", "used"): "raises",
}


# ------------------------------------------------------------------ the runs


def groups(model: nn.Module) -> list[dict[str, Any]]:
    """:func:`mesh_placements.groups`, with :data:`NORMUON`'s matrices moved to NorMuon groups (row moments)."""
    out = []
    for group in mesh_groups(model):
        names = group["param_names"]
        if group["algorithm"] != "muon" or not set(names) & set(NORMUON):
            out.append(group)
            continue
        for algorithm, chosen in (("muon", False), ("normuon", True)):
            picked = [i for i, n in enumerate(names) if (n in NORMUON) == chosen]
            if picked:
                params = [group["params"][i] for i in picked]
                out.append(
                    {**group, "algorithm": algorithm, "params": params, "param_names": [names[i] for i in picked]}
                )
    return out


def build(layout: str, world_size: int, *, seed: int) -> tuple[nn.Module, nn.Module, muonkit.HybridMuon]:
    """(what the user checkpoints, the module holding the params, its optimizer) on ``layout``."""
    module = apply_placement(MeshNet(seed), "single" if layout == "ddp" else layout, world_size)
    kwargs: dict[str, Any] = {}
    if layout == "single":
        kwargs["strategy"] = muonkit.distributed.SingleDeviceStrategy()
    elif layout == "ddp":
        kwargs["process_group"] = dist.group.WORLD
    opt = muonkit.HybridMuon(groups(module), **kwargs)
    if layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module), module, opt
    return module, module, opt


def steps(
    module: nn.Module, opt: muonkit.HybridMuon, which: Any, no_grad: dict[str, tuple[int, ...]] = NO_GRAD
) -> None:
    for step in which:
        set_grads(module, step, no_grad)
        opt.step()


def rates(opt: torch.optim.Optimizer) -> list[float]:
    return [float(g["lr"]) for g in opt.param_groups]


Held = dict[str, Tensor]


def held(module: nn.Module, opt: torch.optim.Optimizer) -> Held:
    """Copies of this rank's part of every param and state, by ``name:key`` (no communication: a
    resumed run is compared with the uninterrupted one on the same layout, rank by rank)."""
    out = {}
    for name, p in module.named_parameters():
        out[f"{name}:param"] = _local(p.detach()).clone()
        for key, value in sorted(opt.state.get(p, {}).items()):
            out[f"{name}:{key}"] = _local(value).clone() if isinstance(value, Tensor) else torch.tensor(value)
    return out


def held_differences(mine: Held, expected: Held) -> list[str]:
    """Entries that are not bit-identical, or present in one and not the other."""
    problems = [f"entries only in one: {sorted(set(mine) ^ set(expected))}"] if mine.keys() != expected.keys() else []
    for key, value in expected.items():
        why = mismatch(mine[key], value) if key in mine else None
        problems += [] if why is None else [f"{key}: {why}"]
    return problems


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class Run:
    """The uninterrupted run: what this rank held when it saved, and after ``STEPS``."""

    saved: Held
    saved_rates: list[float]
    final: Held


def uninterrupted(layout: str, world_size: int, root: Path, corruptions: tuple[str, ...] = ()) -> Run:
    """Train, save through every path (and ``corruptions``' checkpoints) at ``SAVE_AT``, go on to ``STEPS``."""
    wrapped, module, opt = build(layout, world_size, seed=0)
    steps(module, opt, range(SAVE_AT))
    saved = held(module, opt)
    for path in PATHS:
        SAVE[path](root / path, wrapped, module, opt)
    for name in corruptions:
        with corrupted(module, opt, name):
            save_checkpoint(bad_checkpoint(root, name), model=wrapped, optimizer=opt)
    steps(module, opt, range(SAVE_AT, STEPS))
    return Run(saved, rates(opt), held(module, opt))


# ------------------------------------------------------------------ the paths


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _save_state_dict(where: Path, wrapped: nn.Module, module: nn.Module, opt: torch.optim.Optimizer) -> None:
    where.mkdir(parents=True, exist_ok=True)
    torch.save({"model": module.state_dict(), "optimizer": opt.state_dict()}, where / f"rank{_rank()}.pt")


def _load_state_dict(where: Path, wrapped: nn.Module, module: nn.Module, opt: torch.optim.Optimizer) -> None:
    saved = torch.load(where / f"rank{_rank()}.pt", weights_only=True)
    opt.load_state_dict(saved["optimizer"])
    module.load_state_dict(saved["model"])


def _save_dcp(where: Path, wrapped: nn.Module, module: nn.Module, opt: torch.optim.Optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(wrapped, opt)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=where)


def _load_dcp(where: Path, wrapped: nn.Module, module: nn.Module, opt: torch.optim.Optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(wrapped, opt)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=where)
    set_state_dict(wrapped, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _save_checkpoint(where: Path, wrapped: nn.Module, module: nn.Module, opt: torch.optim.Optimizer) -> None:
    save_checkpoint(where, model=wrapped, optimizer=opt)


def _load_checkpoint(where: Path, wrapped: nn.Module, module: nn.Module, opt: torch.optim.Optimizer) -> None:
    load_checkpoint(where, model=wrapped, optimizer=opt)


Io = Callable[[Path, nn.Module, nn.Module, torch.optim.Optimizer], None]
SAVE: dict[str, Io] = {"state_dict": _save_state_dict, "save_checkpoint": _save_checkpoint, "dcp": _save_dcp}
LOAD: dict[str, Io] = {"state_dict": _load_state_dict, "save_checkpoint": _load_checkpoint, "dcp": _load_dcp}


# ------------------------------------------------------------------ resuming


def resumed(layout: str, world_size: int, *, optimizer: str) -> tuple[nn.Module, nn.Module, muonkit.HybridMuon]:
    """A fresh or used optimizer on a model with other initial values and other learning rates."""
    wrapped, module, opt = build(layout, world_size, seed=7)
    if optimizer == "used":
        steps(module, opt, USED_STEPS, USED_NO_GRAD)
    for group in opt.param_groups:
        group["lr"] = group["lr"] * 0.5
    return wrapped, module, opt


def hold_grads(module: nn.Module, opt: torch.optim.Optimizer, grads: str) -> None:
    """The params' gradients when the run loads: None, zero (``zero_grad(set_to_none=False)``) or set."""
    if grads == "none":
        opt.zero_grad(set_to_none=True)
        return
    set_grads(module, LOAD_STEP, {})
    if grads == "zero":
        opt.zero_grad(set_to_none=False)


def grads_of(module: nn.Module) -> list[tuple[str, Tensor | None, Tensor | None]]:
    """Every param's gradient tensor and a copy of this rank's part of it."""
    return [(n, p.grad, None if p.grad is None else _local(p.grad).clone()) for n, p in module.named_parameters()]


def grad_differences(module: nn.Module, before: list[tuple[str, Tensor | None, Tensor | None]]) -> list[str]:
    problems = []
    for (name, tensor, value), (_, now, now_value) in zip(before, grads_of(module), strict=True):
        if now is not tensor:
            problems.append(
                f"{name}: the gradient tensor was replaced ({type(tensor).__name__} -> {type(now).__name__})"
            )
        elif value is not None and not torch.equal(value, now_value):
            problems.append(f"{name}: the gradient's values changed")
    return problems


def resume_cell(run: Run, layout: str, world_size: int, root: Path, path: str, grads: str, optimizer: str) -> list[str]:
    """Resume through ``path`` in one cell; what differs from the uninterrupted run (nothing: [])."""
    wrapped, module, opt = resumed(layout, world_size, optimizer=optimizer)
    hold_grads(module, opt, grads)
    before = grads_of(module)
    LOAD[path](root / path, wrapped, module, opt)
    problems = grad_differences(module, before)
    problems += [f"as loaded: {p}" for p in held_differences(held(module, opt), run.saved)]
    if rates(opt) != run.saved_rates:
        problems.append(f"learning rates {rates(opt)}, saved {run.saved_rates}")
    steps(module, opt, range(SAVE_AT, STEPS))
    problems += [f"step {STEPS}: {p}" for p in held_differences(held(module, opt), run.final)]
    return problems


def dcp_outcome(layout: str, world_size: int, root: Path, grads: str, optimizer: str) -> str:
    """What torch's recipe by hand does in one cell (see :data:`DCP_OUTCOMES`)."""
    from torch.distributed.checkpoint.api import CheckpointException

    wrapped, module, opt = resumed(layout, world_size, optimizer=optimizer)
    hold_grads(module, opt, grads)
    try:
        LOAD["dcp"](root / "dcp", wrapped, module, opt)
    except (Exception, CheckpointException):
        return "raises"
    return "loads no state" if not opt.state else "loads"


def matrix(
    run: Run, layout: str, world_size: int, root: Path, paths: tuple[str, ...] = PATHS, cells: Any = CELLS
) -> list[str]:
    """Every cell of ``paths`` x ``cells`` (gradients, optimizer); the problems, each naming its cell."""
    problems = []
    for path in paths:
        for grads, optimizer in cells:
            cell = f"{layout} {path} grads={grads} {optimizer}"
            if path == "dcp":
                got = dcp_outcome(layout, world_size, root, grads, optimizer)
                if got != DCP_OUTCOMES[(grads, optimizer)]:
                    problems.append(f"{cell}: {got}, expected {DCP_OUTCOMES[(grads, optimizer)]}")
                continue
            problems += [f"{cell}: {p}" for p in resume_cell(run, layout, world_size, root, path, grads, optimizer)]
    return problems


# ------------------------------------------------------------------ corrupted checkpoints


def _poison(value: float) -> Callable[[Tensor], Tensor]:
    """The first element of the whole tensor set to ``value``: in a sharded state only the ranks
    holding that element see it (collective for a DTensor)."""

    def edit(t: Tensor) -> Tensor:
        whole = full(t).clone()
        whole.view(-1)[0] = value
        if isinstance(t, DTensor):
            return distribute_tensor(whole, t.device_mesh, t.placements, src_data_rank=None)
        return whole

    return edit


def _reshaped(t: Tensor) -> Tensor:
    return torch.zeros(3, 3)


CORRUPTIONS: dict[str, tuple[str, str, Callable[[Tensor], Tensor] | None]] = {
    # name: (param, state key, edit; None removes the entry)
    "exp_avg_sq removed": ("embed.weight", "exp_avg_sq", None),
    "step removed": ("norm.weight", "step", None),
    "row moments removed": ("mlp.up.weight", "row_exp_avg_sq", None),
    "momentum NaN": ("attn.proj.weight", "momentum_buffer", _poison(math.nan)),
    "exp_avg inf": ("head.weight", "exp_avg", _poison(math.inf)),
    "exp_avg_sq negative": ("embed.weight", "exp_avg_sq", _poison(-1e-3)),
    "row moments NaN": ("experts.w_uneven", "row_exp_avg_sq", _poison(math.nan)),
    "momentum wrong shape": ("attn.qkv.weight", "momentum_buffer", _reshaped),
    "exp_avg_sq wrong shape": ("router.weight", "exp_avg_sq", _reshaped),
}
SHARDED_CORRUPTIONS = (
    "exp_avg_sq removed",
    "momentum NaN",
    "exp_avg_sq negative",
    "row moments NaN",
    "momentum wrong shape",
)
"""On sharded layouts: one of each kind (the values checked rank by rank, in one shard)."""


def bad_checkpoint(root: Path, name: str) -> Path:
    return root / f"bad_{name.replace(' ', '_')}"


def _param(module: nn.Module, name: str) -> Tensor:
    return dict(module.named_parameters())[name]


@contextmanager
def corrupted(module: nn.Module, opt: torch.optim.Optimizer, name: str) -> Iterator[None]:
    """``opt``'s state with one entry removed or corrupted, for the duration (to save it)."""
    param, key, edit = CORRUPTIONS[name]
    state = opt.state[_param(module, param)]
    good = state.pop(key)
    if edit is not None:
        state[key] = edit(good)
    try:
        yield
    finally:
        state[key] = good


def corrupt_state_dict(module: nn.Module, opt: torch.optim.Optimizer, saved: dict[str, Any], name: str) -> None:
    """The same corruption in a loaded ``opt.state_dict()`` (keyed by param index)."""
    param, key, edit = CORRUPTIONS[name]
    target = _param(module, param)
    pid = next(i for i, p in enumerate(p for g in opt.param_groups for p in g["params"]) if p is target)
    entry = saved["optimizer"]["state"][pid]
    good = entry.pop(key)
    if edit is not None:
        entry[key] = edit(good)


def refusals(
    layout: str,
    world_size: int,
    root: Path,
    paths: tuple[str, ...] = ("state_dict", "save_checkpoint"),
    corruptions: tuple[str, ...] = tuple(CORRUPTIONS),
) -> list[str]:
    """Every corruption through ``paths`` into a fresh and a used optimizer (params holding gradients):
    each must raise a ValueError naming the entry and change nothing."""
    problems = []
    for optimizer in OPTIMIZERS:
        wrapped, module, opt = resumed(layout, world_size, optimizer=optimizer)
        hold_grads(module, opt, "set")
        before, before_rates, before_grads = held(module, opt), rates(opt), grads_of(module)
        for path in paths:
            for name in corruptions:
                param, key, _ = CORRUPTIONS[name]
                cell = f"{layout} {path} {optimizer}, {name} ({param}):"
                try:
                    if path == "state_dict":
                        saved = torch.load(root / "state_dict" / f"rank{_rank()}.pt", weights_only=True)
                        corrupt_state_dict(module, opt, saved, name)
                        opt.load_state_dict(saved["optimizer"])
                    else:
                        load_checkpoint(bad_checkpoint(root, name), model=wrapped, optimizer=opt)
                    problems.append(f"{cell} accepted")
                except ValueError as e:
                    if key not in str(e):
                        problems.append(f"{cell} the error does not name {key!r}: {e}")
                problems += [f"{cell} changed {p}" for p in held_differences(held(module, opt), before)]
                problems += [f"{cell} changed {p}" for p in grad_differences(module, before_grads)]
                if rates(opt) != before_rates:
                    problems.append(f"{cell} changed the learning rates")
    return problems


# ------------------------------------------------------------------ a save before the first step


def save_before_the_first_step(layout: str, world_size: int, root: Path) -> list[str]:
    """A checkpoint of an optimizer that never stepped (params without gradients) holds no state,
    saving it changes nothing, and a run resumed from it equals the run that never saved."""
    wrapped, module, opt = build(layout, world_size, seed=0)
    save_checkpoint(root / "first", model=wrapped, optimizer=opt)
    problems = [f"saving stepped the optimizer: it has {len(opt.state)} states"] if opt.state else []
    steps(module, opt, range(STEPS))
    _, never_saved, plain = build(layout, world_size, seed=0)
    steps(never_saved, plain, range(STEPS))
    expected = held(never_saved, plain)
    problems += [f"the run that saved: {p}" for p in held_differences(held(module, opt), expected)]
    wrapped, module, opt = resumed(layout, world_size, optimizer="fresh")
    hold_grads(module, opt, "set")
    load_checkpoint(root / "first", model=wrapped, optimizer=opt)
    problems += [f"loaded {len(opt.state)} states from a checkpoint without any"] if opt.state else []
    steps(module, opt, range(STEPS))
    problems += [f"the resumed run: {p}" for p in held_differences(held(module, opt), expected)]
    return problems

"""DCP checkpoints of 8-bit and bf16 optimizer state across layouts, world sizes and state precisions.

The 2-rank launch trains FSDP2 ``Shard(0)``, DDP and FSDP2 ``Shard(1)`` with ``state_dtype="8bit"``
(and FSDP2 with ``"bf16"``, and with ``"fp32"`` for the conversion), saves after ``SAVE_AT`` steps
(``muonkit.distributed.checkpoint.save_checkpoint``) and goes on to ``STEPS``, keeping its params
and states. The 4-rank and 1-rank launches load those checkpoints into fresh models and
optimizers on other layouts (other initial values: everything must come from the checkpoint),
check what they loaded and take the same steps on the same gradients:

- where the saving and the loading layout cut the same blocks (a param whose last dim neither
  shards: every 2-D param under DDP, FSDP2 dim 0 and one device), states load and step bit for
  bit, AdamW params bit for bit, Muon params within the batched-products tolerance;
- where they do not (1-D params under FSDP2 at another world size, any param under FSDP2 dim 1),
  the load decodes the saved blocks and codes the values in this layout's: decoded states within
  :data:`scenario_state_precision.STATE_TOL`, params within its ``PARAM_TOL``;
- precision conversion: an 8-bit checkpoint loads into an fp32 optimizer (as saved, converted to
  fp32 by the next step) and an fp32 checkpoint into an 8-bit one (coded by the next step): the
  runs go on within those tolerances of the uninterrupted ones;
- a checkpoint whose codes do not fit its scales (another cut of the columns than any layout
  makes, or corrupted) is refused with a ``ValueError`` naming the entry, nothing loaded.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from common import MUON_REL_TOL, ParamSpec, group_dicts, initial, set_grads
from harness import Context, check
from precision_common import rel_diff, state_keys, whole_bits, whole_decoded
from scenario_state_precision import PARAM_TOL, ROWS_TOL, STATE_TOL, blocks_kept, mesh_build
from torch import Tensor, nn
from torch.distributed.tensor import Shard

import muonkit
from muonkit.distributed.checkpoint import load_checkpoint, save_checkpoint
from muonkit.functional.orthogonalize import default_compute_dtype
from muonkit.functional.quantize import SCALE_SUFFIX

SAVE_AT, STEPS = 2, 4
ZOO: list[ParamSpec] = [
    ParamSpec("muon", (16, 16)),
    ParamSpec("muon", (6, 600)),  # 3 blocks a row; Shard(1) over 2: 2 blocks of 300 columns
    ParamSpec("muon", (7, 5)),
    ParamSpec("muon", (3, 10)),  # W=4: a rank holds no rows
    ParamSpec("muon", (3, 6, 300)),
    ParamSpec("muon", (8, 8), skip_steps=(1,)),
    ParamSpec("adamw", (7,)),  # 1-D: FSDP2 cuts its last dim, W=2 -> 4 recodes it
    ParamSpec("adamw", (5, 520)),
    ParamSpec("adamw", (2, 3, 4)),
    ParamSpec("normuon", (8, 300)),  # row moments (whole on every rank) and a momentum
    ParamSpec("muon", (6, 6), skip_steps=(0, 1)),  # no state in the checkpoint: stays absent
    ParamSpec("adamw", (6,), skip_steps=(0, 1)),
]


class Net(nn.Module):
    def __init__(self, seed_offset: int = 0) -> None:
        super().__init__()
        self.params = nn.ParameterList([nn.Parameter(initial(i + seed_offset, s)) for i, s in enumerate(ZOO)])


def build(layout: str, state_dtype: str, *, seed_offset: int = 0) -> tuple[nn.Module, nn.Module, muonkit.HybridMuon]:
    """(what is checkpointed, the module holding the params, the optimizer): ``fsdp`` (dim 0), ``cols``
    (FSDP2 dim 1 via ``shard_placement_fn``), ``nested`` (4 ranks: every param's last dim sharded by
    both dims of a 2x2 mesh, ``distribute_tensor``), ``ddp`` or ``single``."""
    from torch.distributed.fsdp import fully_shard

    module = Net(seed_offset)
    wrapped: nn.Module = module
    kwargs: dict[str, Any] = {"state_dtype": state_dtype}
    if layout == "fsdp":
        fully_shard(module)
    elif layout == "cols":
        width = dist.get_world_size()  # FSDP2 shards dim 1 only evenly
        fully_shard(module, shard_placement_fn=lambda p: Shard(1 if p.ndim >= 2 and p.shape[1] % width == 0 else 0))
    elif layout == "nested":  # the columns cut by both dims of a 2x2 mesh (5 | 5, then 3 | 2 each...)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import distribute_tensor

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        for i, p in enumerate(list(module.params)):
            cut = Shard(p.ndim - 1)
            module.params[i] = nn.Parameter(distribute_tensor(p.data, mesh, [cut, cut], src_data_rank=None))
    elif layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(module)
        kwargs["process_group"] = dist.group.WORLD
    else:
        kwargs["strategy"] = muonkit.distributed.SingleDeviceStrategy()
    return wrapped, module, muonkit.HybridMuon(group_dicts(list(module.parameters()), ZOO), **kwargs)


def _steps(module: nn.Module, opt: muonkit.HybridMuon, steps: range) -> None:
    for step in steps:
        set_grads(list(module.parameters()), ZOO, step)
        opt.step()


def snapshot(module: nn.Module, opt: muonkit.HybridMuon) -> dict[str, Any]:
    """Whole params, decoded states and stored bits, and which params keep one device's blocks (collective)."""
    from mesh_placements import full

    out: dict[str, Any] = {}
    for i, p in enumerate(module.parameters()):
        out[f"{i}:param"] = full(p.detach()).clone()
        out[f"{i}:kept"] = blocks_kept(p)
        own = opt.state.get(p, {})
        for key in state_keys(own):
            out[f"{i}:{key}"] = whole_decoded(own, key, p).clone()
            out[f"{i}:{key}:dtype"] = str(own[key].dtype)
            if not key.startswith("row_"):
                out[f"{i}:{key}:bits"] = whole_bits(own[key]).clone()
                if key + SCALE_SUFFIX in own:
                    out[f"{i}:{key}:scale"] = whole_bits(own[key + SCALE_SUFFIX]).clone()
    return out


def differences(
    mine: dict[str, Any],
    expected: dict[str, Any],
    *,
    same_layout: bool = False,
    precise: bool = True,
    params: list[tuple[Tensor, str]] | None = None,
) -> list[str]:
    """What differs (see the module docstring): params whose blocks both runs keep whole (or every
    param, ``same_layout``: the same blocks on both sides) bit for bit; ``precise``: False where the
    two runs stored their states in other precisions (tolerances only). ``params``: each param's
    initial value and algorithm (default: :data:`ZOO`'s)."""
    muon_tol = MUON_REL_TOL[default_compute_dtype("cpu")]
    problems = []
    state_names = {k.rsplit(":", 1)[0] for k in expected if k.endswith(":dtype")}
    mine_names = {k.rsplit(":", 1)[0] for k in mine if k.endswith(":dtype")}
    if state_names != mine_names:
        problems.append(f"states {sorted(mine_names ^ state_names)} only on one side")
    if params is None:
        params = [(initial(i, s), group_dicts([torch.zeros(1)], [s])[0]["algorithm"]) for i, s in enumerate(ZOO)]
    for i, (first, algorithm) in enumerate(params):
        same = precise and (same_layout or (mine[f"{i}:kept"] and expected[f"{i}:kept"]))
        a, b = mine[f"{i}:param"].double(), expected[f"{i}:param"].double()
        start = first.double()
        travelled = torch.linalg.vector_norm(b - start).item()
        rel = 0.0 if torch.equal(a, b) else torch.linalg.vector_norm(a - b).item() / max(travelled, 1e-30)
        tol = (0.0 if algorithm == "adamw" else muon_tol) if same else PARAM_TOL
        if rel > tol:
            problems.append(f"param {i} {tuple(b.shape)}: {rel:.3e} of its distance (tolerance {tol})")
        for name in sorted(n for n in state_names & mine_names if n.startswith(f"{i}:")):
            key = name.split(":")[1]
            drift = rel_diff(mine[name], expected[name])
            rows = key.startswith("row_")
            bound = (ROWS_TOL if rows else 0.0) if same else STATE_TOL
            if drift > bound:
                problems.append(f"{name}: decoded {drift:.3e} of its norm from the expected (> {bound})")
            for part in (":bits", ":scale"):
                if not (same and not rows and name + part in expected):
                    continue
                if name + part not in mine or not torch.equal(mine[name + part], expected[name + part]):
                    problems.append(f"{name}{part}: not bit-identical")
    return problems


def _save_run(ctx: Context, layout: str, state_dtype: str, tag: str) -> None:
    wrapped, module, opt = build(layout, state_dtype)
    _steps(module, opt, range(SAVE_AT))
    saved = snapshot(module, opt)
    save_checkpoint(ctx.shared / f"prec_{tag}", model=wrapped, optimizer=opt)
    _steps(module, opt, range(SAVE_AT, STEPS))
    final = snapshot(module, opt)
    if ctx.rank == 0:
        torch.save((saved, final), ctx.shared / f"prec_{tag}.pt")
    dist.barrier()


def _resume(
    ctx: Context,
    layout: str,
    state_dtype: str,
    tag: str,
    *,
    precise: bool = True,
    same_layout: bool = False,
    expect_dtype: str | None = None,
) -> None:
    """Load ``prec_{tag}`` into a fresh ``layout``; check it as loaded and after the remaining steps."""
    wrapped, module, opt = build(layout, state_dtype, seed_offset=7)
    load_checkpoint(ctx.shared / f"prec_{tag}", model=wrapped, optimizer=opt)
    saved, final = torch.load(ctx.shared / f"prec_{tag}.pt")
    where = f"{layout} ({state_dtype}) at W={ctx.world_size} from prec_{tag}"
    problems = [f"as loaded: {p}" for p in differences(snapshot(module, opt), saved, same_layout=same_layout)]
    _steps(module, opt, range(SAVE_AT, STEPS))
    after = snapshot(module, opt)
    problems += [f"step {STEPS}: {p}" for p in differences(after, final, precise=precise, same_layout=same_layout)]
    if expect_dtype is not None:
        wrong = sorted(k for k, v in after.items() if k.endswith(":dtype") and ":step" not in k and v != expect_dtype)
        problems += [f"step {STEPS}: not converted to {expect_dtype}: {wrong}"] if wrong else []
    assert not problems, f"{where}:\n" + "\n".join(problems)


# ------------------------------------------------------------------ 2 ranks: save, and reload at 2


@check(2)
def state_dtype_checkpoints_save_at_2(ctx: Context) -> None:
    _save_run(ctx, "fsdp", "8bit", "fsdp_8bit")
    _save_run(ctx, "ddp", "8bit", "ddp_8bit")
    _save_run(ctx, "cols", "8bit", "cols_8bit")
    _save_run(ctx, "fsdp", "bf16", "fsdp_bf16")
    _save_run(ctx, "fsdp", "fp32", "fsdp_fp32")


@check(2)
def eight_bit_fsdp2_dim1_resumes_on_its_own_layout_bit_for_bit(ctx: Context) -> None:
    _resume(ctx, "cols", "8bit", "cols_8bit", same_layout=True)


@check(2)
def eight_bit_checkpoint_converts_to_fp32_and_back(ctx: Context) -> None:
    _resume(ctx, "fsdp", "fp32", "fsdp_8bit", precise=False, expect_dtype="torch.float32")
    _resume(ctx, "fsdp", "8bit", "fsdp_fp32", precise=False, expect_dtype="torch.float8_e4m3fn")


# ------------------------------------------------------------------ 4 ranks


@check(4)
def eight_bit_fsdp2_2_resumes_on_fsdp2_4(ctx: Context) -> None:
    _resume(ctx, "fsdp", "8bit", "fsdp_8bit")


@check(4)
def eight_bit_ddp_2_resumes_on_fsdp2_4(ctx: Context) -> None:
    _resume(ctx, "fsdp", "8bit", "ddp_8bit")


@check(4)
def eight_bit_fsdp2_dim1_2_resumes_on_dim1_4_and_dim0_4(ctx: Context) -> None:
    _resume(ctx, "cols", "8bit", "cols_8bit")
    _resume(ctx, "fsdp", "8bit", "cols_8bit")


@check(4)
def bf16_fsdp2_2_resumes_on_fsdp2_dim1_4(ctx: Context) -> None:
    _resume(ctx, "cols", "bf16", "fsdp_bf16")


@check(4)
def eight_bit_codes_cut_otherwise_are_refused(ctx: Context) -> None:
    """A checkpoint whose codes do not fit their scales (other blocks' scales: what another cut of
    the columns, or a corruption, leaves) is refused on a layout that reads it as saved (FSDP2 dim
    0) and on one that recodes it (dim 1), naming the entry; nothing is loaded. Built from a real
    checkpoint: loaded, the first scale of each row of param 7's exp_avg zeroed (its codes are not
    zeros: a zero scale only ever goes with zero codes), saved again."""
    wrapped, module, opt = build("fsdp", "8bit", seed_offset=7)
    load_checkpoint(ctx.shared / "prec_fsdp_8bit", model=wrapped, optimizer=opt)
    p = list(module.parameters())[7]
    own = opt.state[p]
    local = own["exp_avg_scale"].to_local()
    if local.numel():
        local[..., 0] = 0.0
    save_checkpoint(ctx.shared / "prec_misfit", model=wrapped, optimizer=opt)
    for layout in ("fsdp", "cols"):
        wrapped, module, opt = build(layout, "8bit", seed_offset=7)
        before = [p.detach().to_local().clone() for p in module.parameters()]
        try:
            load_checkpoint(ctx.shared / "prec_misfit", model=wrapped, optimizer=opt)
        except ValueError as e:
            assert "exp_avg" in str(e) and ("do not fit" in str(e) or "does not fit" in str(e)), str(e)
        else:
            raise AssertionError(f"{layout}: a checkpoint whose codes do not fit their scales was loaded")
        assert not opt.state, f"{layout}: state loaded from a refused checkpoint"
        assert all(torch.equal(a, p.detach().to_local()) for a, p in zip(before, module.parameters(), strict=True))


@check(4)
def eight_bit_nested_column_cut_saves_and_resumes_on_other_layouts(ctx: Context) -> None:
    """Scales of columns cut by two mesh dims, ``(*lead, 2, 2, k)``: decoded with that nested cut (not
    one even cut in 4) by FSDP2 dim 1 and dim 0 at 4 ranks here, and by one device (W=1)."""
    _save_run(ctx, "nested", "8bit", "nested_8bit")
    _resume(ctx, "cols", "8bit", "nested_8bit")
    _resume(ctx, "fsdp", "8bit", "nested_8bit")


# ------------------------------------------------------------------ N-D meshes: TP row-wise scales through DCP


def _mesh_params(world_size: int) -> list[tuple[Tensor, str]]:
    """Each param's initial value (the seed-0 model) and algorithm, in ``parameters()`` order."""
    model, opt = mesh_build("single", world_size, "8bit")
    algorithm = {id(p): g["algorithm"] for g in opt.param_groups for p in g["params"]}
    return [(p.detach().clone(), algorithm[id(p)]) for p in model.parameters()]


def _mesh_steps(model: nn.Module, opt: muonkit.HybridMuon, steps: range) -> None:
    from mesh_placements import set_grads as mesh_grads

    for step in steps:
        mesh_grads(model, step)
        opt.step()


@check(4)
def eight_bit_fsdp2_tp_2x2_saves_and_fsdp2_4_resumes(ctx: Context) -> None:
    """FSDP2 + TP (row-wise params: scales ``(rows, 2, k)`` placed ``(Shard(0), Shard(1))``) saves at 4
    ranks; FSDP2 over 4 resumes here (row-wise params recoded, the rest as saved), one device at W=1."""
    model, opt = mesh_build("fsdp_tp", ctx.world_size, "8bit")
    _mesh_steps(model, opt, range(SAVE_AT))
    saved = snapshot(model, opt)
    save_checkpoint(ctx.shared / "prec_fsdp_tp_8bit", model=model, optimizer=opt)
    _mesh_steps(model, opt, range(SAVE_AT, STEPS))
    final = snapshot(model, opt)
    if ctx.rank == 0:
        torch.save((saved, final), ctx.shared / "prec_fsdp_tp_8bit.pt")
    dist.barrier()
    _mesh_resume(ctx, "fsdp")


def _mesh_resume(ctx: Context, layout: str) -> None:
    model, opt = mesh_build(layout, ctx.world_size, "8bit", seed=7)
    load_checkpoint(ctx.shared / "prec_fsdp_tp_8bit", model=model, optimizer=opt)
    saved, final = torch.load(ctx.shared / "prec_fsdp_tp_8bit.pt")
    params = _mesh_params(ctx.world_size)
    problems = [f"as loaded: {p}" for p in differences(snapshot(model, opt), saved, params=params)]
    _mesh_steps(model, opt, range(SAVE_AT, STEPS))
    problems += [f"step {STEPS}: {p}" for p in differences(snapshot(model, opt), final, params=params)]
    assert not problems, f"{layout} at W={ctx.world_size} from prec_fsdp_tp_8bit:\n" + "\n".join(problems)


# ------------------------------------------------------------------ 1 rank


@check(1)
def eight_bit_fsdp2_tp_checkpoint_resumes_on_one_device(ctx: Context) -> None:
    _mesh_resume(ctx, "single")


@check(1)
def eight_bit_nested_column_cut_resumes_on_one_device(ctx: Context) -> None:
    _resume(ctx, "single", "8bit", "nested_8bit")


@check(1)
def eight_bit_fsdp2_2_resumes_on_one_device(ctx: Context) -> None:
    _resume(ctx, "single", "8bit", "fsdp_8bit")


@check(1)
def eight_bit_fsdp2_dim1_2_resumes_on_one_device(ctx: Context) -> None:
    _resume(ctx, "single", "8bit", "cols_8bit")


@check(1)
def eight_bit_fsdp2_2_loads_into_fp32_on_one_device(ctx: Context) -> None:
    _resume(ctx, "single", "fp32", "fsdp_8bit", precise=False, expect_dtype="torch.float32")

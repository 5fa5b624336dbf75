"""Shared pieces of the distributed scenarios: a param zoo with every edge case, grads, comparisons.

How a distributed run is compared with the single-device control on the same gradients:

- momentum, AdamW params and every optimizer state: **bit-identical**. They are elementwise fp32
  arithmetic on the same values, whatever slice of a tensor a rank holds.
- Muon params: within a tolerance relative to the distance each param travelled,
  ``||p - control||_F <= tol * ||control - initial||_F``. Each matrix is orthogonalized from the
  same fp32 values (normalized from a contiguous copy, so not even the memory order differs), but
  the batched matrix products are free to round a matrix differently depending on which other
  matrices share its batch, and the owners' batches differ from one device's. Measured: torch's
  kernel against an exact-then-rounded one moves the zoo's params by <= 6.7e-6 (fp32 Newton-
  Schulz) and <= 9.4e-4 (bf16) of their distance after 4 steps; the tolerances (1e-4, 2e-2) leave
  >10x margin and stay >10x below the smallest error a distribution bug makes (a step skipped or
  applied twice: 1/3 of the distance; no lr shape scale: 11-67% here; another matrix's result:
  ~100%). A bf16 param adds its storage rounding, which such a difference can flip (2^-8 of the
  weight, ~1% of its distance here, for each flipped entry): 10%.
- Ranks must agree bit for bit (every rank applies the same shared results), checked separately.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

import muonkit
from muonkit.functional.matrices import MatrixLayout
from muonkit.functional.orthogonalize import default_compute_dtype


def dim0_sizes(n: int, world_size: int) -> list[int]:
    """Rows of a ``Shard(0)`` tensor on each rank (``torch.chunk`` rule), e.g. 5 rows on 4 ranks: 2, 2, 1, 0."""
    chunk = -(-n // world_size)
    return [max(0, min(chunk, n - r * chunk)) for r in range(world_size)]


@dataclass(frozen=True)
class ParamSpec:
    group: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    skip_steps: tuple[int, ...] = ()  # steps on which this param has no gradient (on every rank)


# Options of each group: layouts, split_sizes, lr-scale conventions and NS dtypes that change
# how matrices are cut, scaled and sent.
GROUPS: dict[str, dict[str, Any]] = {
    "muon": {"algorithm": "muon", "weight_decay": 0.01},
    "muon_t": {"algorithm": "muon", "layout": "transposed", "adjust_lr": "match_adamw"},
    "muon_split": {"algorithm": "muon", "split_sizes": (4, 8), "adjust_lr": "spectral"},
    "muon_t_split": {"algorithm": "muon", "layout": "transposed", "split_sizes": (4, 8)},
    "muon_fp32": {"algorithm": "muon", "ns_dtype": torch.float32, "nesterov": False},
    # per-head output projections: each head's block of columns its own matrix (split_along="cols")
    "muon_heads": {"algorithm": "muon", "split_sizes": (4, 4, 4), "split_along": "cols"},
    "muon_t_heads": {"algorithm": "muon", "layout": "transposed", "split_sizes": (4, 4), "split_along": "cols"},
    "adamw": {"algorithm": "adamw", "weight_decay": 0.1},
    # NorMuon and cautious weight decay (NORMUON_ZOO)
    "normuon": {"algorithm": "normuon", "weight_decay": 0.01, "cautious_wd": True},
    "normuon_t_split": {"algorithm": "normuon", "layout": "transposed", "split_sizes": (4, 8), "beta2": 0.9},
    "normuon_heads": {
        "algorithm": "normuon",
        "split_sizes": (4, 4, 4),
        "split_along": "cols",
        "adjust_lr": "match_adamw",
    },
    "normuon_split": {
        "algorithm": "normuon",
        "split_sizes": (4, 8),
        "adjust_lr": "match_adamw",
        "ns_dtype": torch.float32,
    },
    "adamw_cautious": {"algorithm": "adamw", "weight_decay": 0.1, "cautious_wd": True},
}
MATRIX_ALGORITHMS = ("muon", "normuon")

ZOO: list[ParamSpec] = [
    ParamSpec("muon", (16, 16)),
    ParamSpec("muon", (16, 16)),
    ParamSpec("muon", (16, 16)),  # three of a shape: one batch, uneven owners at W=2
    ParamSpec("muon", (8, 24)),
    ParamSpec("muon", (24, 8)),
    ParamSpec("muon", (7, 5)),  # rows do not divide by 2 or 4
    ParamSpec("muon", (3, 10)),  # W=4: one rank holds no rows
    ParamSpec("muon", (1, 6)),  # all rows on one rank
    ParamSpec("muon", (3, 6, 4)),  # MoE experts; W=4: one rank holds no expert
    ParamSpec("muon", (5, 4, 6)),
    ParamSpec("muon", (4, 2, 3, 3)),  # conv, flattened to (4, 18)
    ParamSpec("muon", (8, 8), skip_steps=(1,)),  # no gradient on step 1
    ParamSpec("muon", (12, 8), dtype=torch.bfloat16),
    ParamSpec("muon_t", (6, 10)),  # GPT-2 Conv1D: the matrix is (10, 6)
    ParamSpec("muon_t", (9, 5)),
    ParamSpec("muon_split", (12, 6)),  # fused QKV: blocks of 4 and 8 rows
    ParamSpec("muon_split", (3, 12, 4)),  # experts with split blocks
    ParamSpec("muon_t_split", (6, 12)),  # transposed and split: blocks along dim 1
    ParamSpec("muon_fp32", (16, 16)),
    ParamSpec("muon_fp32", (5, 7)),
    ParamSpec("muon_heads", (10, 12)),  # 3 heads of 4 columns; W=4: rows 3, 3, 3, 1
    ParamSpec("muon_heads", (2, 5, 12)),  # experts, each cut into heads
    ParamSpec("muon_t_heads", (8, 6)),  # GPT-2 Conv1D: the matrix (6, 8), heads along dim 0
    ParamSpec("adamw", (7,)),
    ParamSpec("adamw", (3,)),
    ParamSpec("adamw", (10, 4)),
    ParamSpec("adamw", (5,), skip_steps=(1,)),
    ParamSpec("adamw", (2, 3, 4)),
]

NORMUON_ZOO: list[ParamSpec] = [
    ParamSpec("normuon", (16, 16)),
    ParamSpec("normuon", (16, 16)),
    ParamSpec("normuon", (8, 24)),
    ParamSpec("normuon", (7, 5)),  # rows and columns that do not divide by 2
    ParamSpec("normuon", (1, 6)),  # all rows on one rank
    ParamSpec("normuon", (3, 6, 4)),  # experts: statistics per expert
    ParamSpec("normuon", (4, 2, 3, 3)),  # conv, flattened to (4, 18)
    ParamSpec("normuon", (8, 8), skip_steps=(1,)),
    ParamSpec("normuon", (12, 8), dtype=torch.bfloat16),
    ParamSpec("normuon_t_split", (6, 12)),  # transposed, split: rows are storage columns
    ParamSpec("normuon_split", (12, 6)),  # fused QKV: statistics per block
    ParamSpec("normuon_split", (3, 12, 4)),
    ParamSpec("normuon_heads", (10, 12)),  # statistics per head: one row vector per column block
    ParamSpec("adamw_cautious", (7,)),
    ParamSpec("adamw_cautious", (10, 4)),
]


def initial(i: int, spec: ParamSpec) -> Tensor:
    g = torch.Generator().manual_seed(10_000 + i)
    return (torch.randn(spec.shape, generator=g) * 0.5).to(spec.dtype)


def gradient(i: int, spec: ParamSpec, step: int) -> Tensor | None:
    """The global (already averaged) gradient of param i at a step: the same on every rank."""
    if step in spec.skip_steps:
        return None
    g = torch.Generator().manual_seed(1000 * step + i)
    scale = 10.0 ** ((i % 5) - 2)  # magnitudes from 1e-2 to 1e2
    return (torch.randn(spec.shape, generator=g) * scale).to(spec.dtype)


def group_dicts(params: Sequence[Tensor], zoo: Sequence[ParamSpec]) -> list[dict[str, Any]]:
    groups: dict[str, list[Tensor]] = {}
    for p, spec in zip(params, zoo, strict=True):
        groups.setdefault(spec.group, []).append(p)
    return [{"params": ps, **GROUPS[name]} for name, ps in groups.items()]


def matrix_count(zoo: Sequence[ParamSpec], step: int) -> int:
    """How many matrices a step orthogonalizes (over all ranks): each expert and each split block counts."""
    total = 0
    for spec in zoo:
        options = GROUPS[spec.group]
        if options["algorithm"] not in MATRIX_ALGORITHMS or step in spec.skip_steps:
            continue
        layout = MatrixLayout(
            options.get("layout", "auto"), options.get("split_sizes"), options.get("split_along", "rows")
        )
        total += sum(b.count for b in layout.blocks(spec.shape))
    return total


def mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def shard(t: Tensor, device_mesh: Any, placements: Sequence[Any] | None = None) -> Tensor:
    """The DTensor Shard(0) (or ``placements``) of a tensor every rank holds whole (no communication)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(t, device_mesh, placements or [Shard(0)], src_data_rank=None)


def full(t: Tensor) -> Tensor:
    """The whole tensor (all-gathers a DTensor; every rank must call this in the same order)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def build(layout: str, zoo: Sequence[ParamSpec], **kwargs: Any) -> tuple[list[nn.Parameter], muonkit.HybridMuon]:
    """Params and optimizer: 'single' (no communication), 'ddp' (replicated), 'fsdp' (DTensor
    ``Shard(0)``) or 'columns' (DTensor ``Shard(1)`` where the tensor has columns: every row cut
    across ranks, as tensor parallelism's row-wise layout does)."""
    from torch.distributed.tensor import Shard

    device_mesh = mesh() if layout in ("fsdp", "columns") else None
    params = []
    for i, spec in enumerate(zoo):
        t = initial(i, spec)
        placements = [Shard(1 if layout == "columns" and t.ndim >= 2 else 0)]
        params.append(nn.Parameter(shard(t, device_mesh, placements) if device_mesh is not None else t))
    if layout == "single":
        kwargs.setdefault("strategy", muonkit.distributed.SingleDeviceStrategy())
    elif layout == "ddp":
        kwargs.setdefault("process_group", dist.group.WORLD)
    return params, muonkit.HybridMuon(group_dicts(params, zoo), **kwargs)


def zero_partition(
    shapes: Sequence[tuple[int, ...]], *, rank: int, world_size: int, process_group: Any = None, **kwargs: Any
) -> tuple[list[nn.Parameter], muonkit.HybridMuon]:
    """A HybridMuon stepping this rank's flat partition of params of ``shapes``, as under DeepSpeed
    ZeRO-1/2 (a ZeroStrategy over ``process_group``, default the whole world)."""
    from muonkit.distributed.zero import ZeroStrategy
    from muonkit.distributed.zero_partition import contiguous_partition

    numels = [math.prod(s) for s in shapes]
    layout = contiguous_partition(
        names=[f"p{i}" for i in range(len(shapes))],
        shapes=list(shapes),
        offsets=[sum(numels[:i]) for i in range(len(numels))],
        partition_size=math.ceil(sum(numels) / world_size),
        world_size=world_size,
    )
    params = [nn.Parameter(torch.zeros(s)) for s in shapes]
    single = muonkit.distributed.SingleDeviceStrategy()
    opt = muonkit.HybridMuon([{"params": params, "algorithm": "muon"}], strategy=single, **kwargs)
    flat = nn.Parameter(torch.randn(layout.numel, generator=torch.Generator().manual_seed(rank)))
    opt.param_groups[0]["params"] = [flat]  # what DeepSpeed does once the engine exists
    strategy = ZeroStrategy(process_group=process_group)
    strategy.bind(flat, layout)
    opt.set_strategy(strategy)
    return [flat], opt


def set_grads(params: Sequence[nn.Parameter], zoo: Sequence[ParamSpec], step: int) -> None:
    for i, (p, spec) in enumerate(zip(params, zoo, strict=True)):
        g = gradient(i, spec, step)
        if g is None:
            p.grad = None
        elif hasattr(p, "device_mesh"):
            p.grad = shard(g, p.device_mesh, p.placements)
        else:
            p.grad = g


MUON_REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # by Newton-Schulz dtype; see the docstring
STORAGE_REL_TOL = {torch.bfloat16: 0.1}  # by param dtype


def muon_tolerance(spec: ParamSpec) -> float | None:
    """Relative tolerance of a param against the control (None: must be bit-identical)."""
    options = GROUPS[spec.group]
    if options["algorithm"] not in MATRIX_ALGORITHMS:
        return None
    ns_dtype = options.get("ns_dtype") or default_compute_dtype("cpu")  # forced by the harness, not the CPU
    return max(MUON_REL_TOL[ns_dtype], STORAGE_REL_TOL.get(spec.dtype, 0.0))


def mismatch(a: Any, b: Tensor, *, initial: Tensor | None = None, tol: float | None = None) -> str | None:
    """Why ``a`` does not match ``b``: not bit-identical, or (with ``tol``) farther from ``b`` than
    ``tol`` times the distance ``b`` travelled from ``initial``; None if it matches."""
    if not isinstance(a, Tensor) or a.shape != b.shape or a.dtype != b.dtype:
        return f"{a!r:.80} vs {b!r:.80}"
    if torch.equal(a, b):
        return None
    err = (a.double() - b.double()).abs().max().item()
    if tol is None or initial is None:
        return f"{tuple(a.shape)}: max |diff| {err:.3e} (must be bit-identical)"
    travelled = torch.linalg.vector_norm(b.double() - initial.double()).item()
    assert travelled > 0, "the param did not move: the comparison would prove nothing"
    rel = torch.linalg.vector_norm(a.double() - b.double()).item() / travelled
    return None if rel <= tol else f"{tuple(a.shape)}: ||diff|| = {rel:.3e} of the distance travelled > {tol}"


def differences(
    params: Sequence[Tensor],
    opt: torch.optim.Optimizer,
    ref_params: Sequence[Tensor],
    ref_opt: torch.optim.Optimizer,
    zoo: Sequence[ParamSpec],
) -> list[str]:
    """Every param and state tensor that does not match the reference (see the module docstring)."""
    problems = []
    for i, (p, r, spec) in enumerate(zip(params, ref_params, zoo, strict=True)):
        why = mismatch(full(p.detach()), r.detach(), initial=initial(i, spec), tol=muon_tolerance(spec))
        problems += [] if why is None else [f"param {i} param: {why}"]
        for key, value in ref_opt.state[r].items():
            mine = opt.state[p].get(key)
            # NorMuon's row moments come from the orthogonalized matrices: batched products' tolerance
            start, tol = (torch.zeros_like(value), muon_tolerance(spec)) if key == "row_exp_avg_sq" else (None, None)
            why = mismatch(full(mine) if isinstance(mine, Tensor) else mine, value, initial=start, tol=tol)
            problems += [] if why is None else [f"param {i} {key}: {why}"]
    return problems


def train_beside_single(
    layout: str, zoo: Sequence[ParamSpec], steps: int
) -> tuple[list[nn.Parameter], muonkit.HybridMuon, list[str]]:
    """``steps`` steps of ``layout`` and of the single-device control on the same gradients:
    the layout's params and optimizer, and the :func:`differences` between the two."""
    params, opt = build(layout, zoo)
    ref_params, ref_opt = build("single", zoo)
    for step in range(steps):
        set_grads(params, zoo, step)
        set_grads(ref_params, zoo, step)
        opt.step()
        ref_opt.step()
    return params, opt, differences(params, opt, ref_params, ref_opt, zoo)


def rank_differences(params: Sequence[Tensor]) -> list[str]:
    """The params (whole on every rank) that are not bit-identical on all ranks (collective)."""
    flat = torch.cat([p.detach().float().reshape(-1) for p in params])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return [f"rank {r} holds different params than rank 0" for r, t in enumerate(gathered) if not torch.equal(t, flat)]


def all_sum(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


class ZooModule(nn.Module):
    """A module that only holds the zoo's params (gradients are injected, never computed)."""

    def __init__(self, zoo: Sequence[ParamSpec], *, seed_offset: int = 0) -> None:
        super().__init__()
        self.params = nn.ParameterList([nn.Parameter(initial(i + seed_offset, s)) for i, s in enumerate(zoo)])


def build_module(layout: str, zoo: Sequence[ParamSpec], *, seed_offset: int = 0) -> tuple[nn.Module, nn.Module]:
    """(what the user checkpoints, the module holding the params): DDP-wrapped, fully_shard-ed or plain."""
    module = ZooModule(zoo, seed_offset=seed_offset)
    if layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module), module
    if layout == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(module)
    return module, module


def snapshot(params: Sequence[Tensor], opt: torch.optim.Optimizer) -> list[dict[str, Tensor]]:
    """Copies of the whole params and states (collective for DTensors)."""
    out = []
    for p in params:
        entry = {"param": full(p.detach()).clone()}
        for key, value in sorted(opt.state[p].items()):
            entry[key] = full(value).clone()
        out.append(entry)
    return out


def differences_to(
    mine: list[dict[str, Tensor]], expected: list[dict[str, Tensor]], zoo: Sequence[ParamSpec] | None = None
) -> list[str]:
    """Snapshots that differ: bit for bit, or (given the ``zoo`` they come from, for runs whose
    matrices were batched differently) Muon params within :func:`muon_tolerance`."""
    problems = []
    for i, (a, b) in enumerate(zip(mine, expected, strict=True)):
        if sorted(a) != sorted(b):
            problems.append(f"param {i}: keys {sorted(a)} vs {sorted(b)}")
            continue
        for key in b:
            start, tol = (initial(i, zoo[i]), muon_tolerance(zoo[i])) if zoo and key == "param" else (None, None)
            if zoo and key == "row_exp_avg_sq":  # NorMuon's row moments: from the orthogonalized matrices
                start, tol = torch.zeros_like(b[key]), muon_tolerance(zoo[i])
            why = mismatch(a[key], b[key], initial=start, tol=tol)
            problems += [] if why is None else [f"param {i} {key}: {why}"]
    return problems

"""The layouts of ``muonkit bench dist``, built with plain torch APIs, and the per-replica baseline.

Every layout wraps the same benchmark GPT (:mod:`muonkit_bench.model`; for ``ep`` its MLPs
become mixtures of experts with the same parameter count) on ``W`` ranks:

==========  ==============================  ==========================================================
layout      mesh                            how it is built
==========  ==============================  ==========================================================
ddp         none (W ranks)                  ``DistributedDataParallel(model)``
fsdp2       ``(W,)``                        ``fully_shard`` on every block and the root
hsdp        ``("replicate", "shard")``      ``fully_shard(..., mesh=mesh)`` on the 2-D mesh:
            ``= (2, W/2)``                  ``(Replicate(), Shard(0))``
fsdp2-tp    ``("dp", "tp") = (W/2, 2)``     ``parallelize_module`` on ``mesh["tp"]``: ``c_attn``,
                                            ``mlp.c_fc``, ``lm_head`` Colwise, both ``c_proj`` and
                                            the embeddings Rowwise, LayerNorms replicated; then
                                            ``fully_shard`` on ``mesh["dp"]``: every tensor on the
                                            2-D mesh (``(_StridedShard(0), Shard(0))`` for Colwise,
                                            ``(Shard(0), Shard(1))`` for Rowwise)
ep          ``("dp", "ep") = (W/2, 2)``     3-D expert stacks ``distribute_tensor(..., Shard(0))``
                                            over ``mesh["ep"]``, then ``fully_shard`` of the experts
                                            on ``mesh["dp"]`` on their dim 1; every other tensor
                                            ``fully_shard`` on the 2-D mesh (HSDP: replicated
                                            over ``dp``, sharded over ``ep``)
==========  ==============================  ==========================================================

:class:`ReplicaMuon` is the baseline of HSDP in torchtitan and dion: every replica group
orthogonalizes over its own shard sub-mesh, so each matrix is orthogonalized once per replica.
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["MESH_LAYOUTS", "ReplicaMuon", "build_layout", "check_world_size", "placements"]

# 2-D layouts: mesh dim names and the size of the fixed axis (the other gets W / 2)
MESH_LAYOUTS: dict[str, tuple[str, str]] = {
    "hsdp": ("replicate", "shard"),
    "fsdp2-tp": ("dp", "tp"),
    "ep": ("dp", "ep"),
}
NUM_EXPERTS = 4


def check_world_size(layouts: list[str], world_sizes: list[int]) -> str | None:
    """None if every 2-D layout fits every world size, else what is wrong and what is allowed."""
    meshed = [layout for layout in layouts if layout in MESH_LAYOUTS]
    bad = [w for w in world_sizes if w < 4 or w % 2]
    if meshed and bad:
        return (
            f"layouts {meshed} build 2-D meshes of 2 x W/2 ranks; --world-sizes {bad} do not fit: "
            "use even world sizes >= 4 (e.g. --world-sizes 4 8)"
        )
    return None


def mesh_shape(layout: str, world_size: int) -> tuple[int, int]:
    return (2, world_size // 2) if layout == "hsdp" else (world_size // 2, 2)


# ---------------------------------------------------------------------------------------- model


class Experts(nn.Module):
    """``E`` GELU MLPs stored as 3-D stacks ``w_fc (E, H, C)``, ``w_proj (E, C, H)``.

    Dense routing (every token through every expert, weighted by the gate): the forward is exact
    under expert parallelism with one all-gather of the tokens and one reduce-scatter of the
    outputs over the ``ep`` group, which is all the benchmark needs (its subject is the optimizer).
    """

    def __init__(self, n_embd: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.w_fc = nn.Parameter(torch.randn(num_experts, hidden, n_embd) * 0.02)
        self.w_proj = nn.Parameter(torch.randn(num_experts, n_embd, hidden) * 0.02)

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        w_fc: Any = self.w_fc
        w_proj: Any = self.w_proj
        if hasattr(w_fc, "to_local"):  # DTensor over "ep": this rank's experts only
            group = _ep_group(w_fc)
            first = torch.distributed.get_rank(group) * w_fc.to_local().size(0)
            w_fc, w_proj = w_fc.to_local(), w_proj.to_local()
            gate = gate[..., first : first + w_fc.size(0)]
        h = F.gelu(torch.einsum("btc,ehc->beth", x, w_fc))
        return torch.einsum("beth,ech,bte->btc", h, w_proj, gate)


def _ep_group(w: Any) -> Any:
    """The process group of the ``ep`` mesh dim of an expert stack (FSDP2 may leave it on ``(dp, ep)``)."""
    mesh = w.device_mesh
    return mesh["ep"].get_group() if mesh.ndim > 1 else mesh.get_group()


class MoE(nn.Module):
    """A router (``gate``, AdamW) and :class:`Experts` (Muon, each expert its own matrix)."""

    def __init__(self, n_embd: int, num_experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(n_embd, num_experts, bias=False)
        self.experts = Experts(n_embd, 4 * n_embd // num_experts, num_experts)

    def forward(self, x: Tensor) -> Tensor:
        w = self.experts.w_fc
        group = _ep_group(w) if hasattr(w, "device_mesh") else None
        if group is not None:
            from torch.distributed import _functional_collectives as funcol

            x = funcol.all_gather_tensor_autograd(x, gather_dim=0, group=group)
        y = self.experts(x, torch.softmax(self.gate(x), dim=-1))
        if group is not None:
            y = funcol.reduce_scatter_tensor_autograd(y, "sum", scatter_dim=0, group=group)
        return y


def build_model(layout: str, args: argparse.Namespace) -> nn.Module:
    from muonkit_bench.model import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd
    )
    model = GPT(config)
    if layout == "ep":
        for block in model.blocks:
            block.mlp = MoE(config.n_embd, NUM_EXPERTS)
    return model


# ---------------------------------------------------------------------------------------- layouts


def build_layout(layout: str, model: nn.Module, world_size: int) -> tuple[Any, Any]:
    """Wrap ``model`` for ``layout`` on ``world_size`` ranks; returns ``(wrapped, mesh or None)``."""
    if layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model), None
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if layout == "fsdp2":
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block)
        return fully_shard(model), None
    mesh = init_device_mesh("cpu", mesh_shape(layout, world_size), mesh_dim_names=MESH_LAYOUTS[layout])
    if layout == "hsdp":
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh), mesh
    if layout == "fsdp2-tp":
        _tensor_parallel(model, mesh["tp"])
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh["dp"])
        return fully_shard(model, mesh=mesh["dp"]), mesh
    if layout == "ep":
        _expert_parallel(model, mesh)
        return fully_shard(model, mesh=mesh), mesh
    raise ValueError(f"Invalid layout {layout!r}: must be one of ddp, fsdp2, {', '.join(MESH_LAYOUTS)}")


def _tensor_parallel(model: nn.Module, tp_mesh: Any) -> None:
    """Megatron-style TP of the whole model (as torchtitan does), so that every tensor lies on the
    2-D mesh after ``fully_shard``: QKV and MLP-in column-parallel, both projections row-parallel,
    the embeddings row-parallel (vocabulary / positions sharded), the head column-parallel, and the
    LayerNorms replicated over ``tp`` (:func:`distribute_module`).

    ``c_attn`` gathers its output (``output_layouts=Replicate()``) so the fused Q, K, V split of
    the benchmark GPT's attention stays unchanged; the weights are sharded as in any TP plan.
    """
    from torch.distributed.tensor import Replicate, distribute_module
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    gathered = Replicate()
    parallelize_module(
        model,
        tp_mesh,
        {
            "wte": RowwiseParallel(input_layouts=gathered, output_layouts=gathered),
            "wpe": RowwiseParallel(input_layouts=gathered, output_layouts=gathered),
            "lm_head": ColwiseParallel(output_layouts=gathered),
        },
    )
    plan = {
        "attn.c_attn": ColwiseParallel(output_layouts=gathered),
        "attn.c_proj": RowwiseParallel(input_layouts=gathered),
        "mlp.c_fc": ColwiseParallel(),
        "mlp.c_proj": RowwiseParallel(),
    }
    for block in model.blocks:  # type: ignore[union-attr]
        parallelize_module(block, tp_mesh, plan)
    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            inputs: Any = _replicated_inputs  # torch's stub types input_fn as returning None
            distribute_module(module, tp_mesh, input_fn=inputs, output_fn=_local_output)


def _replicated_inputs(module: nn.Module, inputs: tuple[Any, ...], mesh: Any) -> tuple[Any, ...]:
    from torch.distributed.tensor import DTensor, Replicate

    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)


def _local_output(module: nn.Module, output: Any, mesh: Any) -> Any:
    return output.to_local()


def _expert_parallel(model: nn.Module, mesh: Any) -> None:
    """Expert stacks ``Shard(0)`` over ``ep``, then FSDP over ``dp`` on their dim 1."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    for block in model.blocks:  # type: ignore[union-attr]
        experts = block.mlp.experts
        for name in ("w_fc", "w_proj"):
            full = getattr(experts, name).detach()
            setattr(experts, name, nn.Parameter(distribute_tensor(full, mesh["ep"], [Shard(0)])))
        fully_shard(experts, mesh=mesh["dp"], shard_placement_fn=lambda p: Shard(1))
        fully_shard(block, mesh=mesh)


def placements(model: nn.Module, groups: list[dict[str, Any]]) -> dict[str, int]:
    """``"mesh dims: placements" -> count`` of the Muon params (what the optimizer is handed)."""
    muon = {id(p) for g in groups if g.get("algorithm") == "muon" for p in g["params"]}
    found: Counter[str] = Counter()
    for param in model.parameters():
        p: Any = param
        if id(p) not in muon:
            continue
        if hasattr(p, "device_mesh"):
            mesh = p.device_mesh
            names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
            axes = ", ".join(f"{n}={k}" for n, k in zip(names, mesh.shape, strict=True))
            found[f"{p.ndim}-D on ({axes}): ({', '.join(str(x) for x in p.placements)})"] += 1
        else:
            found[f"{p.ndim}-D plain tensor"] += 1
    return dict(found)


# ---------------------------------------------------------------------------------------- baseline


class ReplicaMuon:
    """HybridMuon as torchtitan and dion run it under HSDP: once per replica group.

    The params are ``(Replicate(), Shard(0))`` DTensors on a ``("replicate", "shard")`` mesh.
    Each one is viewed, sharing storage, as a ``Shard(0)`` DTensor on this rank's ``shard``
    sub-mesh (:meth:`DTensor.from_local`), and a 1-D :class:`muonkit.HybridMuon` steps those
    views: every replica group assembles and orthogonalizes every matrix over its own sub-mesh,
    so the Newton-Schulz work of the whole mesh is the single-device total times the number of
    replicas. Same result as one HybridMuon over the whole mesh (the replicas hold the same
    gradients), more FLOPs.
    """

    def __init__(self, groups: list[dict[str, Any]], mesh: Any, **options: Any) -> None:
        import muonkit

        self.mesh = mesh["shard"]
        self._pairs: list[tuple[Any, Any]] = []
        views = []
        for group in groups:
            views.append({**group, "params": [self._view(p) for p in group["params"]]})
        self.opt = muonkit.HybridMuon(views, **options)
        self.strategy = self.opt.strategy

    def _view(self, param: Any) -> Tensor:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if tuple(param.placements) != (Replicate(), Shard(0)):
            raise ValueError(f"ReplicaMuon needs HSDP params (Replicate(), Shard(0)); got {param.placements}")
        local = param.to_local()
        view: Any = nn.Parameter(
            DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride())
        )
        assert view.to_local().data_ptr() == local.data_ptr() or local.numel() == 0  # shares storage
        self._pairs.append((param, view))
        return view

    @property
    def state(self) -> Any:
        return self.opt.state

    def step(self) -> None:
        from torch.distributed.tensor import DTensor, Shard

        for param, view in self._pairs:
            grad: Any = param.grad
            view.grad = None if grad is None else DTensor.from_local(
                grad.to_local(), self.mesh, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride()
            )  # fmt: skip
        self.opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param, view in self._pairs:
            param.grad = None
            view.grad = None

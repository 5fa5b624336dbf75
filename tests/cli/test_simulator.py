"""The plan simulator (``muonkit plan``): its shapes, meshes and placements against transformers and
torch, its per-rank figures against the executor's own counters, and the command.

Planning identity and growth at thousands of ranks: ``tests/distributed/test_plan_identity.py``
and ``tests/distributed/test_plan_growth.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from muonkit.cli import main
from muonkit.distributed.split_plan import NEVER, SplitPolicy
from muonkit.simulator.host import _Simulated
from muonkit.simulator.meshes import parse_mesh
from muonkit.simulator.models import (
    DEEPSEEK_TP_PLAN,
    GPT2,
    GPT2_TP_PLAN,
    KIMI_K2,
    LLAMA_70B,
    LLAMA_TP_PLAN,
    bundled,
    from_config,
    shapes_of,
)
from muonkit.simulator.simulate import per_rank, plan_stage, simulate

SMALL = {
    "gpt2": ({**GPT2, "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 100}, GPT2_TP_PLAN),
    "llama": (
        {**LLAMA_70B, "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 100},
        LLAMA_TP_PLAN,
    ),
    "kimi-k2": (
        {**KIMI_K2, "num_hidden_layers": 3, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
         "n_routed_experts": 8, "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
         "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
         "vocab_size": 100},
        DEEPSEEK_TP_PLAN,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SMALL))
def test_bundled_shapes_are_what_transformers_and_the_routing_give(name: str, tmp_path: Path) -> None:
    """Small versions of the bundled families: the same Muon matrices (names, shapes, layouts,
    blocks, TP dims where transformers has a plan) and parameter counts."""
    pytest.importorskip("transformers")
    config, plan = SMALL[name]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    ours, theirs = shapes_of(name, config, plan), from_config(path)
    fields = [(m.name, m.shape, m.layout, m.layer) for m in ours.matrices]
    assert fields == [(m.name, m.shape, m.layout, m.layer) for m in theirs.matrices]
    if name != "gpt2":  # transformers ships no TP plan for GPT-2 (ours is Megatron's split)
        assert [m.tp_dim for m in ours.matrices] == [m.tp_dim for m in theirs.matrices]
    assert any(m.tp_dim is not None for m in ours.matrices)
    assert (ours.params, ours.active, ours.layers, ours.experts) == (
        theirs.params,
        theirs.active,
        theirs.layers,
        theirs.experts,
    )


def test_bundled_models_have_their_public_sizes() -> None:
    assert round(bundled("llama-70b").params / 1e9, 1) == 70.6  # Llama 3 70B: 70.6B
    assert round(bundled("kimi-k2").params / 1e12, 2) == 1.03  # Kimi K2: 1.04T with its MTP layer
    assert round(bundled("deepseek-v3").params / 1e9) == 671  # DeepSeek-V3: 671B (+14B MTP)
    assert round(bundled("kimi-k2").active / 1e9) == 32  # 32B activated
    assert bundled("gpt2").muon_numel == 12 * (768 * 2304 + 768 * 768 + 2 * 768 * 3072)


@pytest.mark.parametrize(
    ("text", "world", "described"),
    [
        ("fsdp=4096", 4096, "fsdp=4096"),
        ("hsdp=512x8", 4096, "hsdp=512x8"),
        ("ep=64,fsdp=64", 4096, "ep=64,fsdp=64"),
        ("fsdp=512, tp=8", 4096, "tp=8,fsdp=512"),
        ("pp=8,ep=32,fsdp=16", 4096, "pp=8,ep=32,fsdp=16"),
        ("ddp=8", 8, "ddp=8"),
    ],
)
def test_meshes_parse(text: str, world: int, described: str) -> None:
    spec = parse_mesh(text)
    assert (spec.world_size, spec.describe()) == (world, described)
    assert parse_mesh(spec.describe()) == spec


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("fsdp=8,hsdp=2x4", "exactly one of fsdp=, hsdp=, ddp="),
        ("tp=2", "exactly one of fsdp=, hsdp=, ddp="),
        ("ep=4,hsdp=2x2", "tp and ep not together"),
        ("tp=2,ep=2,fsdp=2", "tp and ep not together"),
        ("fsdp=0", "must be a positive integer"),
        ("hsdp=8", r"hsdp=RxS \(R replicas of S-way sharding"),
        ("cp=2,fsdp=2", "entry 'cp=2'"),
    ],
)
def test_meshes_out_of_reach_say_what_is_read(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_mesh(text)


PLACEMENTS = """
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore
from muonkit.distributed.dtensor_placement import mesh_group, rank_boxes
from muonkit.simulator.meshes import parse_mesh
from muonkit.simulator.models import Matrix

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
EXPERTS = int(__import__("sys").argv[1])

def model():
    m = nn.Module()
    m.up, m.down, m.plain = nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False), nn.Linear(8, 8, bias=False)
    m.experts = nn.Module()
    m.experts.w = nn.Parameter(torch.zeros(EXPERTS, 12, 8))
    return m

def matrices():
    return {"up.weight": Matrix("up.weight", (16, 8), "matrix", tp_dim=0),
            "down.weight": Matrix("down.weight", (8, 16), "matrix", tp_dim=1),
            "plain.weight": Matrix("plain.weight", (8, 8), "matrix"),
            "experts.w": Matrix("experts.w", (EXPERTS, 12, 8), "experts")}

def check(text, build):
    m, spec = model(), parse_mesh(text)
    meshes = build(m)
    group = mesh_group(meshes)
    for name, p in m.named_parameters():
        placements, ranks = spec.placement(matrices()[name], EXPERTS)
        assert group.boxes(p) == rank_boxes(p.shape, placements, ranks), (text, name, p.placements, placements)
    print("ok", text)

def fsdp(m):
    mesh = init_device_mesh("cpu", (8,))
    fully_shard(m, mesh=mesh)
    return [mesh]

def hsdp(m):
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
    fully_shard(m, mesh=mesh)
    return [mesh]

def tp(m):
    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(m, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    m.experts.w = nn.Parameter(distribute_tensor(m.experts.w.data, mesh["tp"], [Shard(1)]))  # colwise experts
    fully_shard(m, mesh=mesh["dp"])
    return [mesh["dp"], mesh]

def ep(m):  # torchtitan: experts Shard(0) on ep, FSDP2 on the rest of the data-parallel ranks
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp_mod_ep", "ep"))
    m.experts.w = nn.Parameter(distribute_tensor(m.experts.w.data, mesh["ep"], [Shard(0)]))
    fsdp_dim = Shard(1) if 8 > EXPERTS else Shard(0)
    fully_shard(m.experts, mesh=mesh["dp_mod_ep"], shard_placement_fn=lambda p: fsdp_dim)
    flat = mesh._flatten("dp")
    fully_shard(m, mesh=flat)
    return [flat, mesh]

for text, build in [("fsdp=8", fsdp), ("hsdp=2x4", hsdp), ("tp=2,fsdp=4", tp), ("ep=4,fsdp=2", ep)]:
    if text == "tp=2,fsdp=4":
        matrices_ = matrices
        def matrices():
            out = matrices_()
            out["experts.w"] = Matrix("experts.w", (EXPERTS, 12, 8), "experts", tp_dim=1)
            return out
    check(text, build)
"""


@pytest.mark.parametrize("experts", [4, 16])
def test_placements_are_those_torch_gives(experts: int) -> None:
    """fully_shard, parallelize_module and torchtitan's expert parallelism on a fake 8-rank group
    (a process of its own): every rank's box of every param equals the simulator's (experts:
    ``Shard(1)`` under FSDP2 when fsdp x ep exceeds them, else ``_StridedShard``)."""
    done = subprocess.run([sys.executable, "-c", PLACEMENTS, str(experts)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("ok ") == 4


@pytest.mark.parametrize("forced", [None, SplitPolicy(threshold=0, parts=4)], ids=["default", "split"])
def test_per_rank_figures_are_what_the_executor_sends(forced: SplitPolicy | None) -> None:
    """Each rank's bytes in the simulation equal what the executor (stubbed collectives) counts
    sending, split jobs' sums and gathers too; Newton-Schulz FLOPs add up to every job's once (a
    split job's: its members' shares, at least the whole job's)."""
    from muonkit.simulator.host import _locals, host_step

    model = shapes_of("small", *SMALL["kimi-k2"])
    for mesh in ("ep=4,fsdp=2", "tp=2,hsdp=2x2", "fsdp=8"):
        stage = plan_stage(model, parse_mesh(mesh), 0, policy=forced)
        splits = [s for g in stage.groups for s in g.plan.splits]
        assert bool(splits) == (forced is not None), mesh
        flops, sent, received, _ = per_rank(stage, 8)
        whole = sum(c for g in stage.groups for j, c in enumerate(g.costs) if g.plan.owners[j] >= 0)
        assert sum(flops) == pytest.approx(whole + sum(sum(s.flops) for s in splits))
        assert sum(sent) == sum(received) > 0
        for rank in range(8):
            strategy = _Simulated(rank, 8)
            for group in stage.groups:
                updates = _locals(group, rank)
                strategy.run(group.plan, updates, updates, group.config)
            assert strategy.stats.bytes_sent == sent[rank], (mesh, rank)
        members = sorted({r for s in splits for r in s.ranks})
        for rank in members[:1]:  # a member's host work runs (its shard's iteration left out of it)
            measured = host_step(stage, rank, repeats=1)
            assert 0 < measured["step_s"] < 5, measured


def test_a_split_balances_llama_70b_where_ranks_outnumber_its_matrices() -> None:
    """Issue 21's target, on a stand-in small enough for CI: Llama-70B's shapes, 4 of its 80 layers
    (28 Muon matrices) at W=256 ranks: 9.1 ranks per matrix, the whole model at 4,096 has 7.3.
    Busiest rank / mean <= 1.5 with splits (measured 1.13), far above it without (17.0)."""
    model = shapes_of("Llama-70B, 4 layers", {**LLAMA_70B, "num_hidden_layers": 4}, LLAMA_TP_PLAN)
    mesh = parse_mesh("fsdp=256")
    balanced = simulate(model, mesh, host=False).to_dict()
    alone = simulate(model, mesh, host=False, split=NEVER).to_dict()
    assert balanced["ns_busiest_over_mean"] <= 1.5
    assert alone["ns_busiest_over_mean"] > 5
    assert balanced["ns_flops_mean"] == pytest.approx(alone["ns_flops_mean"], rel=0.2)  # shares, not repeats


def test_plan_prints_a_row_per_mesh_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "gpt2", "--mesh", "fsdp=4", "--mesh", "ddp=2", "--tokens", "1024", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| GPT-2 | fsdp=4 | 4 | 48 | 192 |" in printed and "| GPT-2 | ddp=2 | 2 | 48 | 96 |" in printed
    assert "Overhead at 1,024 tokens per step" in printed
    rows = json.loads(out.read_text())
    assert [r["mesh"] for r in rows] == ["fsdp=4", "ddp=2"]
    assert rows[0]["ns_flops_mean"] * 4 == pytest.approx(rows[1]["ns_flops_mean"] * 2)  # same total work
    assert rows[0]["host"]["step_s"] > 0 and rows[0]["estimate"]["overhead"] > 0


def test_plan_refuses_what_it_cannot_read() -> None:
    with pytest.raises(SystemExit, match="Invalid model='gpt3'"):
        main(["plan", "gpt3"])
    with pytest.raises(SystemExit, match="exactly one of fsdp=, hsdp=, ddp="):
        main(["plan", "gpt2", "--mesh", "tp=2"])


def test_simulating_an_unsupported_model_type_names_the_fix() -> None:
    with pytest.raises(ValueError, match="No built-in shapes for model_type='mixtral'"):
        shapes_of("x", {"model_type": "mixtral"}, {})
    assert simulate(bundled("gpt2"), parse_mesh("fsdp=2"), host=False).jobs == 48

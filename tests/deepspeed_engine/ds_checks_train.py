"""DeepSpeed ZeRO-1/2/3 with muonkit on 2 CPU ranks: equivalence, exactly-once, traffic, checkpoints.

Every training check runs 3 optimizer steps of 2 accumulated micro-batches per rank with
``gradient_clipping: 1.0`` (active: the raw norm is ~2.7) and weight decay, and compares with the
single-device reference of :mod:`ds_common`. Tolerances (relative error of each tensor's total
update, and of DeepSpeed's reported gradient norm against the raw norm):

* fp32: 1e-4 (Newton-Schulz in float64 on both sides; only fp32 summation order differs;
  measured: 3e-6);
* bf16 with fp32 gradient accumulation and communication: 1e-3 after ONE optimizer step (bf16
  forward/backward is identical on both sides; the rest is fp32 order). bf16 checks stop after
  one step because the comparison is chaotic beyond it: a 1e-7 difference in the fp32 master
  weights flips the bf16 rounding of a few weights, and Newton-Schulz amplifies small singular
  directions of the gradient (slope ~3.4 per step, ~450x over 5 steps), so after 3 steps the same
  code gave 2e-4 or 1.8e-2 depending on a 5e-6 change of lr on both sides. Multi-step momentum and
  accumulation are held to 1e-4 by the fp32 checks;
* bf16 with DeepSpeed's defaults (bf16 accumulation and reduction): gradients are rounded to
  bf16 before they are summed, so 0.15 on each Muon matrix (measured: 0.08), 1e-2 on the norm
  (measured: 5e-4). AdamW tensors are not held to it under bf16 defaults: Adam divides
  each element by its own magnitude, so bf16 rounding flips the sign of tiny embedding-row
  gradients (they are checked tightly above). A clip applied to orthogonalized updates,
  Newton-Schulz per micro-batch or a skipped Muon update each miss by order 1.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from ds_common import (
    NORMUON_OPTIONS,
    OPTIONS,
    Net,
    config,
    full_params,
    muon_matrices,
    numel,
    reference,
    train,
    update_errors,
)
from ds_resume import refuses_corrupted_checkpoints, resume_bit_identically
from ds_worker import Context, check, quiet_deepspeed

import muonkit

STEPS = 3
NORMUON_STAGES = (1, 3)


def _initialize(cfg: dict[str, Any], *, zero_init: bool = False, **kwargs: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    quiet_deepspeed()
    import deepspeed

    from muonkit.integrations import deepspeed as mk_ds

    torch.manual_seed(0)
    if zero_init:
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = Net()
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            init = {n: p.detach().clone() for n, p in model.named_parameters()}
    else:
        model = Net()
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, *_ = mk_ds.initialize(model=model, config=cfg, **kwargs)
    return engine, {n: t.float() for n, t in init.items()}


def _equivalent(
    stage: int,
    *,
    bf16: bool,
    fp32_accumulation: bool,
    tol: float,
    norm_tol: float,
    muon_only: bool = False,
    zero: dict[str, Any] | None = None,
    read_module: bool = False,
    steps: int | None = None,
    normuon: bool = False,
    **kw: Any,
) -> Any:
    steps = steps or (1 if bf16 else STEPS)
    cfg = config(stage, bf16=bf16, fp32_accumulation=fp32_accumulation)
    cfg["zero_optimization"].update(zero or {})
    if normuon:
        cfg["optimizer"]["params"].update(NORMUON_OPTIONS)
    engine, init = _initialize(cfg, **kw)
    if bf16:  # DeepSpeed's fp32 master weights start from the bf16 model
        init = {n: t.to(torch.bfloat16).float() for n, t in init.items()}
    strategy = engine.optimizer.optimizer.strategy
    norms = train(engine, steps)
    want, want_norms = reference(init, steps, world=dist.get_world_size(), bf16=bf16, normuon=normuon)
    for got, expected in zip(norms, want_norms, strict=True):  # DeepSpeed clips by the raw accumulated norm
        assert abs(got - expected) <= norm_tol * expected, f"grad norm {got} vs raw {expected}"
    # read_module: at fp32 ZeRO-1/2 the module holds the gathered fp32 weights themselves
    module = {n: p.detach().clone() for n, p in engine.module.named_parameters()} if read_module else None
    errors = update_errors(module or full_params(engine), want, init)
    if muon_only:
        muon = {r.name for r in muonkit.explain(want).routes if r.algorithm == "muon"}
        errors = {k: v for k, v in errors.items() if k in muon}
    worst = max(errors, key=errors.__getitem__)
    gaps = max(abs(g - w) / w for g, w in zip(norms, want_norms, strict=True))
    print(
        f"stage {stage} bf16={bf16} fp32_acc={fp32_accumulation}: update error {errors[worst]:.2e} ({worst}), norm {gaps:.1e}"
    )
    assert errors[worst] <= tol, f"{worst}: relative update error {errors[worst]:.2e} > {tol} ({errors})"
    total = torch.tensor([strategy.stats.matrices])
    dist.all_reduce(total)
    expected = steps * muon_matrices(want)  # once per matrix per optimizer step, never per micro-batch
    assert total.item() == expected, f"{total.item()} orthogonalizations in {steps} steps, expected {expected}"
    return engine


def _assert_split_matrix(engine: Any) -> None:
    strategy = engine.optimizer.optimizer.strategy
    hybrid = engine.optimizer.optimizer
    muon = [g for g in hybrid.param_groups if g["algorithm"] in ("muon", "normuon")]
    flat = muon[0]["params"][0] if muon[0]["params"] else strategy.partitions[-1]
    layout = strategy.partition_of(flat)
    assert any(len(p.pieces) > 1 for p in layout.params), "the test model must have a matrix cut by a partition"


@check
def zero1_fp32_matches_single_device(ctx: Context) -> None:
    engine = _equivalent(1, bf16=False, fp32_accumulation=False, tol=1e-4, norm_tol=1e-5)
    _assert_split_matrix(engine)


@check
def zero2_fp32_matches_single_device(ctx: Context) -> None:
    engine = _equivalent(2, bf16=False, fp32_accumulation=False, tol=1e-4, norm_tol=1e-5)
    _assert_split_matrix(engine)


@check
def zero3_fp32_matches_single_device(ctx: Context) -> None:
    _equivalent(3, bf16=False, fp32_accumulation=False, tol=1e-4, norm_tol=1e-5)


@check
def zero1_zero3_normuon_cautious_wd_match_single_device(ctx: Context) -> None:
    """NorMuon (row moments of matrices whole in a partition and of one a partition boundary cuts,
    many params per flat partition) and cautious weight decay from the DeepSpeed config's muonkit
    params equal one device's; at ZeRO-3 every matrix is cut."""
    for stage in NORMUON_STAGES:
        engine = _equivalent(stage, bf16=False, fp32_accumulation=False, tol=1e-4, norm_tol=1e-5, normuon=True)
        hybrid = engine.optimizer.optimizer
        algorithms = {(g["algorithm"], g["cautious_wd"]) for g in hybrid.param_groups}
        assert algorithms == {("normuon", True), ("adamw", True)}, algorithms
        assert all(
            "row_exp_avg_sq" in hybrid.state[p]
            for g in hybrid.param_groups
            if g["algorithm"] == "normuon"
            for p in g["params"]
        )
        if stage == 1:
            _assert_split_matrix(engine)


@check
def zero1_bf16_fp32_accumulation_matches(ctx: Context) -> None:
    engine = _equivalent(1, bf16=True, fp32_accumulation=True, tol=1e-3, norm_tol=1e-4)
    assert type(engine.optimizer).__name__ == "BF16_Optimizer"


@check
def zero2_bf16_fp32_accumulation_matches(ctx: Context) -> None:
    _equivalent(2, bf16=True, fp32_accumulation=True, tol=1e-3, norm_tol=1e-4)


@check
def zero3_bf16_fp32_accumulation_matches(ctx: Context) -> None:
    _equivalent(3, bf16=True, fp32_accumulation=True, tol=1e-3, norm_tol=1e-4)


@check
def zero1_bf16_defaults_match(ctx: Context) -> None:
    engine = _equivalent(1, bf16=True, fp32_accumulation=False, tol=0.15, norm_tol=0.01, muon_only=True)
    assert type(engine.optimizer).__name__ == "DeepSpeedZeroOptimizer"


@check
def zero3_bf16_defaults_match(ctx: Context) -> None:
    _equivalent(3, bf16=True, fp32_accumulation=False, tol=0.15, norm_tol=0.01, muon_only=True)


@check
def zero3_zero_init_routes_by_ds_shape(ctx: Context) -> None:
    engine = _equivalent(3, bf16=False, fp32_accumulation=False, tol=1e-4, norm_tol=1e-5, zero_init=True)
    hybrid = engine.optimizer.optimizer
    names = [n for g in hybrid.param_groups if g["algorithm"] == "muon" for n in g["param_names"]]
    assert len(names) == 9 and all(n.endswith(("attn.weight", "fc1.weight", "fc2.weight")) for n in names), names


@check
def zero2_round_robin_gradients_match(ctx: Context) -> None:
    # round_robin_gradients reorders each flat group by rank: the layout must follow DeepSpeed's order.
    # DeepSpeed's safe_get_full_fp32_param returns wrong slices in this mode (with its own AdamW too).
    rr = {"round_robin_gradients": True}
    engine = _equivalent(2, bf16=False, fp32_accumulation=False, tol=1e-4, norm_tol=1e-5, zero=rr, read_module=True)
    _assert_split_matrix(engine)


@check
def zero3_sub_groups_match(ctx: Context) -> None:
    # sub_group_size below a group's partition: DeepSpeed steps each sub-group on its own
    engine = _equivalent(3, bf16=False, fp32_accumulation=False, tol=1e-4, norm_tol=1e-5, zero={"sub_group_size": 4000})
    assert len(engine.optimizer.optimizer.strategy.partitions) > 2


@check
def zero3_traffic_within_3x_gradient_bytes(ctx: Context) -> None:
    engine, _ = _initialize(config(3, bf16=True))
    strategy = engine.optimizer.optimizer.strategy
    train(engine, STEPS)
    per_step = strategy.stats.bytes_sent / STEPS
    gradient_bytes = numel(engine.module) * 2  # one bf16 gradient of the whole model
    assert 0 < per_step <= 3 * gradient_bytes, (per_step, gradient_bytes)


@check
def schedulers_keep_group_lrs_distinct(ctx: Context) -> None:
    warm = {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear"}}
    engine, _ = _initialize(config(2, scheduler=warm))
    train(engine, 2)
    lrs = {g["algorithm"]: g["lr"] for g in engine.optimizer.param_groups}
    assert abs(lrs["muon"] / lrs["adamw"] - 0.02 / 3e-3) < 1e-9, lrs
    lam = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)  # noqa: E731
    engine, _ = _initialize(config(1), lr_scheduler=lam)
    train(engine, 2)
    lrs = {g["algorithm"]: g["lr"] for g in engine.optimizer.param_groups}
    assert abs(lrs["muon"] - 0.02 * 0.25) < 1e-12 and abs(lrs["adamw"] - 3e-3 * 0.25) < 1e-12, lrs


@check
def unsupported_configurations_fail_at_initialize(ctx: Context) -> None:
    from muonkit.integrations.deepspeed import UnsupportedConfiguration

    cases = {
        "stage=0": config(0),
        "offload_optimizer": config(2) | {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
        "offload_param": config(3) | {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
        "zero_hpz_partition_size": config(3) | {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}},
        "elastic_checkpoint": config(2) | {"zero_optimization": {"stage": 2, "elastic_checkpoint": True}},
        "fp16 on CPU": config(2) | {"fp16": {"enabled": True}},
        "warmup_max_lr": config(2, scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3}}),
        "OneCycle": config(2, scheduler={"type": "OneCycle", "params": {"cycle_max_lr": 1e-3}}),
        "load_universal": config(2, checkpoint={"load_universal": True}),
    }
    for what, cfg in cases.items():
        try:
            _initialize(cfg)
        except UnsupportedConfiguration as e:
            assert what in str(e), f"{what}: {e}"
        else:
            raise AssertionError(f"{what} must raise UnsupportedConfiguration")


@check
def unset_optimizer_never_silently_steps(ctx: Context) -> None:
    quiet_deepspeed()
    import deepspeed

    from muonkit.integrations.deepspeed import hybrid_muon

    model = Net()
    cfg = config(2)
    del cfg["optimizer"]
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=hybrid_muon(model), config=cfg | {"zero_allow_untested_optimizer": True}
    )
    try:
        train(engine, 1)
    except RuntimeError as e:
        assert "never set up" in str(e), e
    else:
        raise AssertionError("a HybridMuon DeepSpeed never bound must refuse to step")


@check
def install_after_plain_deepspeed_initialize(ctx: Context) -> None:
    quiet_deepspeed()
    import deepspeed

    from muonkit.integrations.deepspeed import hybrid_muon, install

    model = Net()
    cfg = config(3)
    del cfg["optimizer"]
    optimizer = hybrid_muon(model, OPTIONS)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=cfg | {"zero_allow_untested_optimizer": True}
    )
    strategy = install(engine)
    train(engine, 2)
    total = torch.tensor([strategy.stats.matrices])
    dist.all_reduce(total)
    assert total.item() == 2 * 9, total.item()
    assert engine.load_checkpoint.__wrapped__ is not None  # install(engine) also guards checkpoint loading


# The resume-fidelity rows of DeepSpeed (ds_resume): fresh, used and converted resumes, and refusals.


@check
def zero1_checkpoint_resumes_bit_identically(ctx: Context) -> None:
    resume_bit_identically(ctx, 1, "zero1", _initialize)


@check
def zero2_bf16_checkpoint_resumes_bit_identically(ctx: Context) -> None:
    resume_bit_identically(ctx, 2, "zero2_bf16", _initialize, bf16=True)


@check
def bf16_optimizer_checkpoint_resumes_bit_identically(ctx: Context) -> None:
    resume_bit_identically(ctx, 1, "bf16_optimizer", _initialize, bf16=True, fp32_accumulation=True)


@check
def zero3_checkpoint_resumes_bit_identically(ctx: Context) -> None:
    resume_bit_identically(ctx, 3, "zero3", _initialize)


@check
def zero1_and_zero3_refuse_corrupted_checkpoints(ctx: Context) -> None:
    refuses_corrupted_checkpoints(ctx, 1, "zero1", _initialize)
    refuses_corrupted_checkpoints(ctx, 3, "zero3", _initialize)


@check
def qk_clip_rescales_the_master_partitions_at_zero_1_2_and_3(ctx: Context) -> None:
    """fp32 ZeRO-1, 2 and 3 equal one device, master and module weights (bf16 runs the same copy of
    the master into the module)."""
    from ds_qk_clip import zero_run_equals_one_device

    for stage in (1, 2, 3):
        zero_run_equals_one_device(stage)

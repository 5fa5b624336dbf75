"""The Hugging Face Trainer and accelerate at 2 (and 4) gloo ranks with HybridMuon.

- DDP under torchrun (``MuonTrainer``): ``make_optimizer`` hands HybridMuon the world group, so
  each matrix is orthogonalized once across ranks and every rank applies the same update. Checked:
  the strategy, the exactly-once count, bit-identical params on both ranks, a finite loss.
- FSDP2 through the Trainer (``fsdp_config={"version": 2}``) and through accelerate's ``prepare``
  with an optimizer built before: the strategy is chosen at the first step from the DTensors
  accelerate swapped in; the Trainer run equals native ``fully_shard`` bit for bit and resumes
  from its checkpoint.
- Models sharded at load time by ``from_pretrained(..., distributed_config=...)``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from harness import Context, check
from torch import Tensor

STEPS = 3


@check(2)
def muon_trainer_under_ddp(ctx: Context) -> None:
    import transformers

    from muonkit.integrations.transformers import MuonTrainer, model_from_config

    torch.manual_seed(0)
    config = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}  # fmt: skip
    model = model_from_config(config, device="cpu")
    data = [
        {"input_ids": x, "labels": x}
        for x in torch.randint(0, 128, (32, 16), generator=torch.Generator().manual_seed(1))
    ]
    args = transformers.TrainingArguments(
        output_dir=str(ctx.out_dir / "hf"), max_steps=STEPS, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, learning_rate=1e-3, weight_decay=0.01, report_to="none",
        save_strategy="steps", save_steps=2, use_cpu=True, logging_steps=1, seed=0, ddp_backend="gloo",
    )  # fmt: skip
    trainer = MuonTrainer(model=model, args=args, train_dataset=data)
    trainer.train()

    assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel), type(trainer.model_wrapped)
    optimizer = trainer.optimizer
    while hasattr(optimizer, "optimizer"):  # accelerate's AcceleratedOptimizer
        optimizer = optimizer.optimizer
    assert optimizer.strategy.name == "replicated", optimizer.strategy.name
    matrices = sum(
        p.shape[0] if p.ndim == 3 else 1
        for g in optimizer.param_groups
        if g["algorithm"] == "muon"
        for p in g["params"]
    )
    total = torch.tensor([optimizer.strategy.stats.matrices])
    dist.all_reduce(total)
    assert total.item() == STEPS * matrices, (total.item(), STEPS, matrices)

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], g) for g in gathered[1:]), "params differ across ranks"
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses))), losses

    # Resume from the step-2 checkpoint in a fresh Trainer: the same last step, bit for bit.
    torch.manual_seed(0)
    resumed = MuonTrainer(model=model_from_config(config, device="cpu"), args=args, train_dataset=data)
    resumed.train(resume_from_checkpoint=str(ctx.out_dir / "hf" / "checkpoint-2"))
    differ = _state_differences(resumed, trainer)
    assert not differ, differ


FSDP_STEPS = 4
CONFIG = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
          "tie_word_embeddings": False}  # fmt: skip


def _qwen() -> Any:
    from muonkit.integrations.transformers import model_from_config

    torch.manual_seed(0)
    return model_from_config(CONFIG, device="cpu")


def _fsdp2_args(ctx: Context, name: str, **kw: Any) -> Any:
    import transformers

    defaults = dict(
        output_dir=str(ctx.out_dir / name), max_steps=FSDP_STEPS, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, learning_rate=1e-3, weight_decay=0.01, lr_scheduler_type="constant",
        max_grad_norm=1.0, report_to="none", save_strategy="steps", save_steps=2, use_cpu=True, logging_steps=1,
        seed=0, data_seed=0, ddp_backend="gloo", disable_tqdm=True,
        fsdp=True, fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"],
                     "state_dict_type": "SHARDED_STATE_DICT"},
    )  # fmt: skip
    return transformers.TrainingArguments(**{**defaults, **kw})


def _recording_trainer() -> type:
    """MuonTrainer that records each micro-batch, its token count and its loss (to replay them natively)."""
    from muonkit.integrations.transformers import MuonTrainer

    class Recording(MuonTrainer):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.seen: list[tuple[dict[str, Tensor], Any, float]] = []

        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            _force_fsdp_on_cpu(self)

        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None):  # type: ignore[no-untyped-def]
            batch = {k: v.clone() for k, v in inputs.items()}
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            value = loss[0] if return_outputs else loss
            self.seen.append((batch, num_items_in_batch, float(value.detach())))
            return loss

    return Recording


def _force_fsdp_on_cpu(trainer: Any) -> None:
    """Run accelerate's real FSDP2 path on CPU ranks.

    accelerate 1.15 turns FSDP on only for accelerator devices: on ``MULTI_CPU`` it drops the
    Trainer's FSDP plugin without a word and trains with DDP. Everything FSDP2 does (``prepare``
    swapping the optimizer's params for DTensors, the sharded forward and backward, checkpoint
    save and load) runs on CPU with gloo once the state says FSDP, as it does on GPUs.
    """
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    assert state.distributed_type == DistributedType.MULTI_CPU, state.distributed_type
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
    trainer.is_fsdp_enabled = True


def _data() -> list[dict[str, Tensor]]:
    ids = torch.randint(0, 128, (64, 16), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": x, "labels": x} for x in ids]


def _full_weights(model: Any) -> dict[str, Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def _muon_matrices(optimizer: Any) -> int:
    return sum(
        p.shape[0] if p.ndim == 3 else 1
        for g in optimizer.param_groups
        if g["algorithm"] == "muon"
        for p in g["params"]
    )


def _inner(optimizer: Any) -> Any:
    while hasattr(optimizer, "optimizer"):  # accelerate's AcceleratedOptimizer
        optimizer = optimizer.optimizer
    return optimizer


@check(2)
def muon_trainer_under_accelerate_fsdp2_equals_native_fully_shard(ctx: Context) -> None:
    """Trainer + accelerate FSDP2 (the optimizer is built before accelerate swaps the params for
    DTensors) trains exactly as native ``fully_shard`` + HybridMuon on the same micro-batches, and
    resuming from its checkpoint through the Trainer lands on the same weights."""
    from torch.distributed.fsdp import fully_shard

    from muonkit.integrations.transformers import make_optimizer

    recording = _recording_trainer()
    trainer = recording(model=_qwen(), args=_fsdp2_args(ctx, "fsdp2"), train_dataset=_data())
    trainer.train()
    optimizer = _inner(trainer.optimizer)
    assert all(type(p).__name__ == "DTensor" for g in optimizer.param_groups for p in g["params"]), [
        type(p) for g in optimizer.param_groups for p in g["params"]
    ]
    assert optimizer.strategy.name == "fsdp2", optimizer.strategy.name
    total = torch.tensor([optimizer.strategy.stats.matrices])
    dist.all_reduce(total)
    assert total.item() == FSDP_STEPS * _muon_matrices(optimizer), (total.item(), _muon_matrices(optimizer))
    trained = _full_weights(trainer.model)
    initial = _full_weights(_qwen())
    assert all(not torch.equal(trained[n], initial[n]) for n in trained), "a param did not train"
    seen = trainer.seen
    assert len(seen) == FSDP_STEPS * 2, len(seen)

    # The same micro-batches through native fully_shard + HybridMuon, the Trainer's loss arithmetic.
    model = _qwen()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    native = make_optimizer(model, trainer.args)  # process_group=WORLD by itself: checked against the mesh
    losses = []
    for step in range(FSDP_STEPS):
        for batch, items, _ in seen[2 * step : 2 * step + 2]:
            loss = model(**batch, num_items_in_batch=items).loss * ctx.world_size
            losses.append(float(loss.detach()))
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        native.step()
        native.zero_grad()
    assert native.strategy.name == "fsdp2", native.strategy.name
    recorded = [loss for _, _, loss in seen]
    assert losses == recorded, (losses, recorded)
    reached = _full_weights(model)
    moved = {n: (trained[n] - reached[n]).abs().max().item() for n in trained}
    assert all(d == 0.0 for d in moved.values()), moved

    # Resume from the step-2 checkpoint through the Trainer: the same last two steps.
    resumed = recording(model=_qwen(), args=_fsdp2_args(ctx, "fsdp2"), train_dataset=_data())
    resumed.train(resume_from_checkpoint=str(ctx.out_dir / "fsdp2" / "checkpoint-2"))
    assert [loss for _, _, loss in resumed.seen] == recorded[4:], ([x for *_, x in resumed.seen], recorded[4:])
    again = _full_weights(resumed.model)
    moved = {n: (trained[n] - again[n]).abs().max().item() for n in trained}
    assert all(d == 0.0 for d in moved.values()), moved
    differ = _state_differences(resumed, trainer)
    assert not differ, differ


def _state_differences(resumed: Any, uninterrupted: Any) -> list[str]:
    """Params and optimizer states (whole) of two Trainers that are not bit-identical (collective)."""
    from torch.distributed.tensor import DTensor

    def whole(t: Tensor) -> Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    def held(trainer: Any) -> dict[str, Tensor]:
        opt = _inner(trainer.optimizer)
        out = {}
        for name, p in trainer.model.named_parameters():
            out[f"{name}:param"] = whole(p.detach())
            out |= {f"{name}:{k}": whole(v) for k, v in sorted(opt.state.get(p, {}).items())}
        return out

    mine, theirs = held(resumed), held(uninterrupted)
    if mine.keys() != theirs.keys():
        return [f"entries only in one: {sorted(mine.keys() ^ theirs.keys())}"]
    return [k for k in theirs if not torch.equal(mine[k], theirs[k])]


def _built_before_torch_distributed(build: Any) -> Any:
    """``build()`` as if torch.distributed were not initialized yet (under ``accelerate launch`` /
    ``torchrun`` an optimizer built before ``Accelerator()`` sees no process group)."""
    initialized = dist.is_initialized
    dist.is_initialized = lambda: False  # type: ignore[assignment]
    try:
        return build()
    finally:
        dist.is_initialized = initialized  # type: ignore[assignment]


def _accelerator(fsdp2: bool) -> Any:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    AcceleratorState._reset_state(reset_partial_state=True)  # the Trainers before left theirs
    accelerator = Accelerator(cpu=True)
    if fsdp2:  # as in _force_fsdp_on_cpu: accelerate turns FSDP on only for accelerator devices
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, transformer_cls_names_to_wrap="Qwen2DecoderLayer")
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
    return accelerator


@check(2)
def accelerate_prepare_after_the_optimizer_picks_the_strategy_at_the_first_step(ctx: Context) -> None:
    """An optimizer built before ``Accelerator()`` (no process group yet), then ``prepare``d with
    FSDP2: every matrix is orthogonalized once over the ranks (before, every rank did every one)."""
    import muonkit

    model = _qwen()
    opt = _built_before_torch_distributed(lambda: muonkit.HybridMuon(muonkit.param_groups(model)))
    accelerator = _accelerator(fsdp2=True)
    model, prepared = accelerator.prepare(model, opt)
    data = _data()
    steps = 3
    for step in range(steps):
        batch = data[step * ctx.world_size + ctx.rank]
        loss = model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss
        accelerator.backward(loss)
        prepared.step()
        prepared.zero_grad()
    assert opt.strategy.name == "fsdp2", opt.strategy.name
    total = torch.tensor([opt.strategy.stats.matrices])
    dist.all_reduce(total)
    assert total.item() == steps * _muon_matrices(opt), (total.item(), steps, _muon_matrices(opt))
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


@check(2)
def accelerate_ddp_without_a_process_group_trains_as_replicas(ctx: Context) -> None:
    """accelerate's DDP with HybridMuon built as its README shows (no ``process_group=``), before
    or after ``Accelerator()``: every rank holds the same plain params, so the first step takes them
    for DDP replicas; each matrix is orthogonalized once per step over the ranks and the run equals
    one with ``process_group=WORLD`` bit for bit (before, the first step raised)."""
    import muonkit

    def run(build: Any) -> tuple[Any, list[Tensor]]:
        model = _qwen()
        opt = build(model)
        accelerator = _accelerator(fsdp2=False)
        model, prepared = accelerator.prepare(model, opt)
        assert isinstance(model, torch.nn.parallel.DistributedDataParallel), type(model)
        data = _data()
        for step in range(2):
            batch = data[step * ctx.world_size + ctx.rank]
            accelerator.backward(model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss)
            prepared.step()
            prepared.zero_grad()
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
        return opt, [p.detach().clone() for p in model.parameters()]

    explicit_opt, explicit = run(lambda m: muonkit.HybridMuon(muonkit.param_groups(m), process_group=dist.group.WORLD))
    before = _built_before_torch_distributed
    for name, build in (
        ("built before Accelerator()", lambda m: before(lambda: muonkit.HybridMuon(muonkit.param_groups(m)))),
        ("built after it", lambda m: muonkit.HybridMuon(muonkit.param_groups(m))),
    ):
        opt, params = run(build)
        assert opt.strategy.name == "replicated", (name, opt.strategy.name)
        total = torch.tensor([opt.strategy.stats.matrices])
        dist.all_reduce(total)
        assert total.item() == 2 * _muon_matrices(opt), (name, total.item(), _muon_matrices(opt))
        assert all(torch.equal(a, b) for a, b in zip(explicit, params, strict=True)), f"{name}: differs from WORLD"
    assert explicit_opt.strategy.name == "replicated"


# ---------------------------------------------------------------------------------------------
# Models sharded at load time: from_pretrained(..., distributed_config=DistributedConfig(...))


def _pretrained(ctx: Context, kind: str, **sizes: int) -> Any:
    """A tiny random model saved by rank 0 and loaded on every rank with ``distributed_config``."""
    import transformers
    from transformers.distributed.configuration_utils import DistributedConfig

    path = ctx.out_dir / f"tiny_{kind}"
    if ctx.rank == 0 and not path.exists():
        torch.manual_seed(0)
        moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "decoder_sparse_step": 1}
        config = {k: v for k, v in CONFIG.items() if k != "model_type"} | (moe if kind == "qwen3_moe" else {})
        transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(kind, **config)
        ).save_pretrained(path)
    dist.barrier()
    return transformers.AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(**sizes))


def _train_sharded_at_load(ctx: Context, kind: str, **sizes: int) -> None:
    """MuonTrainer on a model sharded by from_pretrained: each Muon matrix orthogonalized exactly
    once over the whole mesh, whole params identical on every rank, a finite loss."""
    model = _pretrained(ctx, kind, **sizes)
    from accelerate.parallelism_config import ParallelismConfig

    # With tp_size > 1 the Trainer hands accelerate a ParallelismConfig, which accelerate 1.15
    # refuses on CPU ranks (MULTI_CPU) before anything trains; its check is lifted here so the
    # Trainer's real path runs on gloo as it does on GPUs.
    validate = ParallelismConfig._validate_accelerator
    ParallelismConfig._validate_accelerator = lambda self, accelerator: None  # type: ignore[method-assign]
    try:
        _train_loaded(ctx, model, kind, sizes)
    finally:
        ParallelismConfig._validate_accelerator = validate  # type: ignore[method-assign]


def _train_loaded(ctx: Context, model: Any, kind: str, sizes: dict[str, int]) -> None:
    from torch.distributed.tensor import DTensor

    from muonkit.integrations.transformers import MuonTrainer

    args = _fsdp2_args(ctx, f"loaded_{kind}_{'_'.join(f'{k}{v}' for k, v in sizes.items())}", fsdp=False,
                       fsdp_config=None, save_strategy="no", max_steps=3)  # fmt: skip
    trainer = MuonTrainer(model=model, args=args, train_dataset=_data())
    trainer.train()
    optimizer = _inner(trainer.optimizer)
    muon = [p for g in optimizer.param_groups if g["algorithm"] == "muon" for p in g["params"]]
    assert all(isinstance(p, DTensor) for p in muon), [type(p).__name__ for p in muon]
    total = torch.tensor([optimizer.strategy.stats.matrices])
    dist.all_reduce(total)
    assert total.item() == 3 * _muon_matrices(optimizer), (total.item(), _muon_matrices(optimizer))
    flat = torch.cat(
        [(p.full_tensor() if isinstance(p, DTensor) else p).detach().reshape(-1) for p in model.parameters()]
    )
    gathered = [torch.empty_like(flat) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], g) for g in gathered[1:]), "whole params differ across ranks"
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses))), losses


@check(2)
def muon_trainer_on_a_model_loaded_with_fsdp_size_2(ctx: Context) -> None:
    """DistributedConfig(fsdp_size=2): every param a DTensor Shard(0) on a 1-D "fsdp" mesh."""
    _train_sharded_at_load(ctx, "qwen2", fsdp_size=2)


@check(2)
def muon_trainer_on_a_model_loaded_with_tp_size_2(ctx: Context) -> None:
    """DistributedConfig(tp_size=2): a 1-D "tp" mesh, Shard(0) (colwise) and Shard(1) (rowwise
    o_proj, down_proj) DTensors, and plain replicated norms."""
    _train_sharded_at_load(ctx, "qwen2", tp_size=2)


@check(2)
def muon_trainer_on_a_moe_model_loaded_with_ep_size_2(ctx: Context) -> None:
    """DistributedConfig(ep_size=2, fsdp_size=2) on a tiny Qwen3-MoE: 3-D expert stacks."""
    _train_sharded_at_load(ctx, "qwen3_moe", ep_size=2, fsdp_size=2)


@check(4)
def muon_trainer_on_a_model_loaded_with_tp_2_fsdp_2(ctx: Context) -> None:
    """DistributedConfig(tp_size=2, fsdp_size=2): a 2-D ("fsdp", "tp") mesh."""
    _train_sharded_at_load(ctx, "qwen2", tp_size=2, fsdp_size=2)


@check(4)
def muon_trainer_on_a_model_loaded_with_hsdp_2x2(ctx: Context) -> None:
    """DistributedConfig(dp_replicate_size=2, fsdp_size=2): HSDP on a 2-D mesh."""
    _train_sharded_at_load(ctx, "qwen2", dp_replicate_size=2, fsdp_size=2)

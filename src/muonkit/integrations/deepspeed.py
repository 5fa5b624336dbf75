"""DeepSpeed ZeRO-1/2/3 with muonkit as the client optimizer.

Change the config's optimizer section and one call::

    # "optimizer": {"type": "muonkit.HybridMuon", "params": {"lr": 0.02, "adamw_lr": 3e-4}}
    from muonkit.integrations import deepspeed as mk_ds
    engine, optimizer, _, scheduler = mk_ds.initialize(model=model, config="ds_config.json")
    for batch in loader:
        engine.backward(engine(batch))
        engine.step()

:func:`initialize` takes :func:`deepspeed.initialize`'s arguments and returns what it returns. It
routes the model with :func:`muonkit.param_groups` (hidden matrices to Muon; embeddings, heads,
norms, biases, routers to AdamW), builds :class:`muonkit.HybridMuon` from the config's ``params``
(keys in :mod:`muonkit.integrations.deepspeed_config`), removes the optimizer section, sets
``"zero_allow_untested_optimizer": true`` and calls ``deepspeed.initialize``. DeepSpeed then
does what it does for any client optimizer (gradient reduction, accumulation, loss scaling and
clipping on the raw gradients) and :func:`install` teaches the optimizer DeepSpeed's flat
partitions (:class:`muonkit.distributed.zero.ZeroStrategy`), so each matrix is orthogonalized
once per step, on one rank. Configurations muonkit cannot serve raise
:class:`UnsupportedConfiguration` here, before anything trains.

With the Hugging Face Trainer (which calls ``deepspeed.initialize`` itself), use
:func:`trainer_setup`.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from muonkit.config import MuonConfig
from muonkit.distributed.base import Strategy
from muonkit.distributed.zero import ZeroStrategy
from muonkit.distributed.zero_partition import FlatPartition, contiguous_partition, per_param_partition
from muonkit.integrations.deepspeed_checkpoint import guard_load_checkpoint
from muonkit.integrations.deepspeed_config import (
    MuonkitOptions,
    UnsupportedConfiguration,
    check_supported,
    load_config,
    split_config,
)
from muonkit.optimizer import HybridMuon
from muonkit.param_groups import param_groups

__all__ = ["UnsupportedConfiguration", "hybrid_muon", "initialize", "install", "trainer_setup"]

logger = logging.getLogger(__name__)
DEFAULT_PORT = 29500


def _deepspeed() -> Any:
    try:
        import deepspeed
    except ImportError as e:
        raise ImportError(
            "muonkit's DeepSpeed integration needs deepspeed: pip install deepspeed (the deepspeed extra; in a clone of muonkit: pip install -e '.[deepspeed]')"
        ) from e
    return deepspeed


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: HybridMuon | None = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = DEFAULT_PORT,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[..., Any] | None = None,
    config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    mesh_param: Any = None,
    config_params: str | os.PathLike[str] | Mapping[str, Any] | None = None,
) -> tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize`` with muonkit's HybridMuon; returns ``(engine, optimizer, dataloader, lr_scheduler)``.

    The config (``config``, ``config_params`` or ``args.deepspeed_config``) names
    ``"muonkit.HybridMuon"`` in its optimizer section, or has none and ``optimizer`` is a
    HybridMuon from :func:`hybrid_muon`. ``model_parameters`` (tensors) restricts training to
    those parameters. Raises :class:`UnsupportedConfiguration` for ZeRO stage 0, optimizer or
    parameter offload, ZeRO++, elastic or universal checkpoints, fp16 on CPU, tensor or pipeline
    parallelism, MoE expert groups, and schedulers that set one absolute lr for every group.
    """
    deepspeed = _deepspeed()
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.pipe.module import PipelineModule

    if model is None:
        raise ValueError("initialize requires a model")
    source = config if config is not None else config_params
    ds_config, options = split_config(load_config(source, args=args))
    deepspeed.init_distributed(
        dist_backend=get_accelerator().communication_backend_name(),
        distributed_port=distributed_port,
        dist_init_required=dist_init_required,
    )
    parsed = DeepSpeedConfig(copy.deepcopy(ds_config), mpu)
    check_supported(
        parsed, mpu=mpu, pipeline=isinstance(model, PipelineModule), accelerator=get_accelerator().device_name()
    )
    chosen = list(model_parameters) if model_parameters is not None else None
    optimizer = _optimizer(model, optimizer, chosen, options)
    engine, ds_optimizer, loader, scheduler = deepspeed.initialize(
        args=_without_config(args),
        model=model,
        optimizer=optimizer,
        model_parameters=chosen,
        training_data=training_data,
        lr_scheduler=lr_scheduler,
        distributed_port=distributed_port,
        mpu=mpu,
        dist_init_required=dist_init_required,
        collate_fn=collate_fn,
        config=ds_config,
        mesh_param=mesh_param,
    )
    install(engine)
    return engine, ds_optimizer, loader, scheduler


def hybrid_muon(model: nn.Module, params: Mapping[str, Any] | None = None, **kwargs: Any) -> HybridMuon:
    """A HybridMuon for ``model``, to be handed to DeepSpeed, from the config's optimizer ``params``.

    Its strategy stays unset until :func:`install` sees the engine (a step before that raises).
    """
    options = MuonkitOptions.from_params({**(params or {}), **kwargs})
    return _build(model, options, None)


def _optimizer(
    model: nn.Module, optimizer: HybridMuon | None, chosen: list[Any] | None, options: MuonkitOptions | None
) -> HybridMuon:
    if optimizer is not None:
        if not isinstance(optimizer, HybridMuon):
            raise TypeError(f"optimizer must be a muonkit.HybridMuon, got {type(optimizer).__name__}")
        if options is not None:
            raise ValueError("Pass either optimizer= or an optimizer section in the config, not both")
        return optimizer
    if options is None:
        raise ValueError(
            'The DeepSpeed config has no optimizer section: add "optimizer": {"type": "muonkit.HybridMuon", '
            '"params": {...}} or pass optimizer=muonkit.integrations.deepspeed.hybrid_muon(model, ...)'
        )
    return _build(model, options, chosen)


def _build(model: nn.Module, options: MuonkitOptions, chosen: list[Any] | None) -> HybridMuon:
    groups = param_groups(model, **options.param_groups_kwargs())
    if chosen is not None:
        keep = {id(p) for item in chosen for p in (item["params"] if isinstance(item, Mapping) else [item])}
        for group in groups:
            pairs = [(p, n) for p, n in zip(group["params"], group["param_names"], strict=True) if id(p) in keep]
            group["params"], group["param_names"] = [p for p, _ in pairs], [n for _, n in pairs]
        groups = [g for g in groups if g["params"]]
    for p in model.parameters():
        if getattr(p, "use_muon", False):  # a tag left by DeepSpeed's own Muon switches on its code paths
            setattr(p, "use_muon", False)  # noqa: B010
    return HybridMuon(groups, strategy=_Unbound(), **options.optimizer_kwargs())


def _without_config(args: Any) -> Any:
    if args is None or getattr(args, "deepspeed_config", None) is None:
        return args
    args = copy.copy(args)
    args.deepspeed_config = None  # the config travels as config=, with the optimizer section removed
    return args


class _Unbound(Strategy):
    """Placeholder until :func:`install` knows DeepSpeed's partitions: refuses to step."""

    name = "deepspeed-unbound"

    def whole_shapes(self, param: Tensor) -> list[tuple[int, ...]]:
        del param  # a flat partition DeepSpeed loads a checkpoint into before install(): not known yet
        return []

    def check_params(self, params: list[Tensor]) -> None:
        del params
        raise RuntimeError(_NOT_SET_UP)

    def directions(
        self,
        params: list[Tensor],
        updates: list[Tensor],
        config: MuonConfig,
        *,
        states: list[list[Tensor]] | None = None,
    ) -> list[Tensor]:
        del params, updates, config, states
        raise RuntimeError(_NOT_SET_UP)


_NOT_SET_UP = (
    "This HybridMuon was built for DeepSpeed but never set up: create the engine with "
    "muonkit.integrations.deepspeed.initialize, or call muonkit.integrations.deepspeed.install(engine) "
    "right after deepspeed.initialize"
)


# ---------------------------------------------------------------------------------------------
# install: read DeepSpeed's partitions


def install(engine_or_optimizer: Any) -> ZeroStrategy:
    """Bind the HybridMuon inside a DeepSpeed engine (or ZeRO optimizer) to DeepSpeed's partitions.

    Accepts the engine, its ``optimizer`` (the ZeRO wrapper) or accelerate's wrapper of that.
    Given the engine, also makes ``engine.load_checkpoint`` refuse a checkpoint saved at another
    world size with the conversion command (see :mod:`muonkit.integrations.deepspeed_checkpoint`).
    Returns the installed :class:`ZeroStrategy`.
    """
    chain, obj = [], engine_or_optimizer
    while not isinstance(obj, HybridMuon):
        chain.append(obj)
        obj = getattr(obj, "optimizer", None)
        if obj is None or len(chain) > 4:
            raise TypeError(f"No muonkit.HybridMuon inside {type(engine_or_optimizer).__name__}")
    zero = chain[-1] if chain else None
    group, partitions = _read_partitions(zero)
    strategy = ZeroStrategy(process_group=group)
    for flat, partition in partitions:
        strategy.bind(flat, partition)
    obj.set_strategy(strategy)
    if hasattr(engine_or_optimizer, "load_checkpoint") and hasattr(engine_or_optimizer, "dp_world_size"):
        guard_load_checkpoint(engine_or_optimizer)
    logger.info(
        "muonkit: %s with %d flat partitions over %d ranks", type(zero).__name__, len(partitions), strategy.world_size
    )
    return strategy


def _read_partitions(zero: Any) -> tuple[Any, list[tuple[Tensor, FlatPartition]]]:
    kind = type(zero).__name__
    readers = {"DeepSpeedZeroOptimizer": _zero12, "BF16_Optimizer": _bf16, "DeepSpeedZeroOptimizer_Stage3": _zero3}
    if kind not in readers:
        raise UnsupportedConfiguration(
            f"muonkit + DeepSpeed: the optimizer wrapper {kind} is not supported (muonkit drives DeepSpeedZeroOptimizer, "
            "BF16_Optimizer and DeepSpeedZeroOptimizer_Stage3: ZeRO stages 1-3 without offload, ZenFlow or SuperOffload)"
        )
    return readers[kind](zero)


def _one_group(groups: Iterable[Any]) -> Any:
    unique = {id(g): g for g in groups}
    if len(unique) != 1:
        raise UnsupportedConfiguration(
            "muonkit + DeepSpeed: param groups on different data-parallel groups (MoE expert parallelism) are not "
            "supported"
        )
    return next(iter(unique.values()))


def _names(zero: Any, params: list[Any], group: int) -> list[str]:
    names = getattr(zero, "param_names", None) or {}
    return [names.get(p, f"group{group}.param{j}") for j, p in enumerate(params)]


def _world(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group)


def _zero12(zero: Any) -> tuple[Any, list[tuple[Tensor, FlatPartition]]]:
    group = _one_group(zero.real_dp_process_group)
    world, out = _world(group), []
    for i, flat in enumerate(zero.single_partition_of_fp32_groups):
        params = zero.round_robin_bit16_groups[i]
        partition = contiguous_partition(
            names=_names(zero, params, i),
            shapes=[tuple(meta.shape) for meta in zero.round_robin_bit16_meta[i]],
            offsets=zero.round_robin_bit16_offsets[i],
            partition_size=zero.partition_size[i],
            world_size=world,
        )
        out.append((flat, partition))
    return group, out


def _bf16(zero: Any) -> tuple[Any, list[tuple[Tensor, FlatPartition]]]:
    group = _one_group(zero.real_dp_process_group)
    world, out = _world(group), []
    for i, flat in enumerate(zero.fp32_groups_flat_partition):
        params = zero.bf16_groups[i]
        offsets = [sum(p.numel() for p in params[:j]) for j in range(len(params))]
        partition = contiguous_partition(
            names=_names(zero, params, i),
            shapes=[tuple(p.shape) for p in params],
            offsets=offsets,
            partition_size=zero.bf16_groups_flat[i].numel() // world,
            world_size=world,
        )
        out.append((flat, partition))
    return group, out


def _zero3(zero: Any) -> tuple[Any, list[tuple[Tensor, FlatPartition]]]:
    group = _one_group(zero.sub_group_process_groups)
    world, out = _world(group), []
    for i, flat in enumerate(zero.fp32_partitioned_groups_flat):
        params = zero.fp16_groups[i]
        for p in params:  # the partition below is DeepSpeed's partitioning rule; check it holds
            if p.partition_numel() != math.ceil(p.ds_numel / world):
                raise UnsupportedConfiguration(
                    f"muonkit + DeepSpeed: ZeRO-3 partition of {p.ds_numel} elements has {p.partition_numel()} on "
                    f"this rank, expected ceil(numel/{world}); this partitioning is not supported"
                )
        partition = per_param_partition(
            names=_names(zero, params, i), shapes=[tuple(p.ds_shape) for p in params], world_size=world
        )
        out.append((flat, partition))
    return group, out


# ---------------------------------------------------------------------------------------------
# Hugging Face Trainer


@dataclass
class TrainerSetup:
    """What the Trainer needs: ``Trainer(..., **setup.trainer_kwargs())`` and ``TrainingArguments(deepspeed=setup.deepspeed)``."""

    deepspeed: dict[str, Any]
    """The DeepSpeed config without its optimizer section (for ``TrainingArguments(deepspeed=...)``)."""
    optimizer_cls_and_kwargs: tuple[type, dict[str, Any]]
    callbacks: list[Any] = field(default_factory=list)

    def trainer_kwargs(self) -> dict[str, Any]:
        return {"optimizer_cls_and_kwargs": self.optimizer_cls_and_kwargs, "callbacks": list(self.callbacks)}


class HybridMuonFactory:
    """Trainer optimizer factory: ``HybridMuonFactory()(model, **params)`` -> HybridMuon for DeepSpeed."""

    def __call__(self, model: nn.Module, **params: Any) -> HybridMuon:
        return hybrid_muon(model, params)


def trainer_setup(config: str | os.PathLike[str] | Mapping[str, Any]) -> TrainerSetup:
    """Run muonkit under the Hugging Face Trainer with DeepSpeed.

    The Trainer creates the DeepSpeed engine itself (through accelerate), so muonkit enters in two
    places: an optimizer factory (``optimizer_cls_and_kwargs``; the Trainer's
    ``optimizers=(opt, None)`` is discarded when DeepSpeed is on) and a callback that binds the
    optimizer to DeepSpeed's partitions when training begins::

        setup = muonkit.integrations.deepspeed.trainer_setup("ds_config.json")
        args = TrainingArguments(..., deepspeed=setup.deepspeed)
        trainer = Trainer(model=model, args=args, train_dataset=data, **setup.trainer_kwargs())

    Give explicit batch sizes in the config (``"train_micro_batch_size_per_gpu": 8``, not "auto").
    """
    raw = load_config(config)
    ds_config, options = split_config(raw)
    if options is None:
        raise ValueError('trainer_setup needs a config with "optimizer": {"type": "muonkit.HybridMuon", ...}')
    params = dict(raw["optimizer"].get("params") or {})
    return TrainerSetup(ds_config, (HybridMuonFactory, params), [_install_callback()])


def _install_callback() -> Any:
    try:
        from transformers import TrainerCallback
    except ImportError as e:
        raise ImportError(
            "trainer_setup needs transformers: pip install transformers accelerate (the hf extra; in a clone of muonkit: pip install -e '.[hf]')"
        ) from e

    class InstallMuonkit(TrainerCallback):
        """Binds HybridMuon to DeepSpeed's partitions once the Trainer has built the engine."""

        def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
            if optimizer is None:
                raise RuntimeError("muonkit: the Trainer passed no optimizer to on_train_begin")
            install(optimizer)

    return InstallMuonkit()

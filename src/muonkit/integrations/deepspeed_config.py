"""The muonkit section of a DeepSpeed config, and the configurations muonkit cannot serve.

A DeepSpeed config selects muonkit in its ``optimizer`` section::

    "optimizer": {
        "type": "muonkit.HybridMuon",
        "params": {"lr": 0.02, "adamw_lr": 3e-4, "weight_decay": 0.01}
    }

:func:`muonkit.integrations.deepspeed.initialize` takes that section out (DeepSpeed does not
know the type), builds :class:`muonkit.HybridMuon` from it and hands DeepSpeed the rest with
``"zero_allow_untested_optimizer": true``. The keys of ``params`` (all optional) are the fields of
:class:`MuonkitOptions`: every keyword of :class:`muonkit.HybridMuon` a JSON config can carry
(:class:`muonkit.defaults.Defaults`, with its default and meaning), ``ns_dtype`` by name, and
the routing's ``muon_algorithm``, ``split_qkv``, ``per_head`` (with ``heads``, ``head_dim``) and
``rules``; the docs' table of them (docs/stacks/deepspeed.md) is
generated from these fields (``python -m muonkit._doc_tables``).

The routing is :func:`muonkit.param_groups` (by module structure, printable with
:func:`muonkit.explain`); ``rules`` are regular expressions on parameter names, checked first.
``layout`` and ``split_sizes`` are routing's, decided per
tensor (``split_qkv``, ``rules``); those, ``capturable`` (single-device only), ``process_group`` and
``strategy`` (DeepSpeed's) are refused with the reason (:data:`_NOT_HERE`).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from muonkit.defaults import Defaults, with_default_fields

__all__ = [
    "MUONKIT_TYPES",
    "MuonkitOptions",
    "UnsupportedConfiguration",
    "check_scheduler",
    "check_supported",
    "load_config",
    "split_config",
]

MUONKIT_TYPES = ("muonkit", "muonkit.hybridmuon")
"""Accepted values of ``optimizer.type`` (case-insensitive)."""

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}
_DTYPES |= {"float64": torch.float64, "fp64": torch.float64}


_NOT_HERE = {
    "learning_rate": "HF's learning_rate is AdamW's lr: adamw_lr; Muon's is lr",
    "layout": "layout: routing decides each tensor's (muonkit.explain shows it); override with rules",
    "split_sizes": "split_sizes: routing decides them; split_qkv cuts fused QKV projections into Q, K, V, "
    "per_head attention projections by head",
    "capturable": "capturable: a single-device option; DeepSpeed steps ZeRO partitions with collectives",
    "process_group": "process_group: DeepSpeed's",
    "strategy": "strategy: DeepSpeed's",
    "algorithm": "algorithm: the hidden matrices' is muon_algorithm ('muon' or 'normuon'), the rest's AdamW",
    "beta2": "beta2: NorMuon's is normuon_beta2, AdamW's is betas[1]",
}
"""Why a :class:`muonkit.HybridMuon` keyword or group key is not an ``optimizer.params`` key."""


class UnsupportedConfiguration(ValueError):
    """A DeepSpeed configuration muonkit cannot serve correctly; raised before training starts."""


@dataclass(frozen=True)
@with_default_fields(leave_out=_NOT_HERE)
class MuonkitOptions:
    """The ``optimizer.params`` of a muonkit DeepSpeed config: a field per :class:`muonkit.HybridMuon`
    keyword a JSON config can carry (:class:`muonkit.defaults.Defaults`' fields but :data:`_NOT_HERE`,
    added by :func:`~muonkit.defaults.with_default_fields`), then the routing's."""

    ns_dtype: str | None = field(
        default=None, metadata={"what": '"bfloat16", "float32", "float64"; null = bf16 where fast (never fp16 on CPU)'}
    )  # DEFAULTS.ns_dtype, by name
    muon_algorithm: str = field(
        default="muon", metadata={"what": 'the hidden matrices\' algorithm: "muon" or "normuon"'}
    )
    split_qkv: bool = field(default=False, metadata={"what": "orthogonalize fused QKV projections as Q, K, V blocks"})
    per_head: bool = field(
        default=False, metadata={"what": "orthogonalize attention projections per head (muonkit.per_head)"}
    )
    heads: int | None = field(default=None, metadata={"what": "per_head: the head count; null = read from the model"})
    head_dim: int | None = field(default=None, metadata={"what": "per_head: the head size; null = read from the model"})
    rules: Any = field(
        default_factory=list, metadata={"what": 'routing overrides: [[pattern, "muon" or "adamw"], ...], checked first'}
    )

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> MuonkitOptions:
        params = dict(params or {})
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(params) - set(known))
        if unknown:
            hints = [_NOT_HERE[k] for k in unknown if k in _NOT_HERE]
            hint = f" ({'; '.join(hints)})" if hints else ""
            raise ValueError(f"Invalid muonkit optimizer params {unknown}{hint}: the allowed keys are {known}")
        auto = sorted(k for k, v in params.items() if isinstance(v, str) and v == "auto")
        if auto:
            raise ValueError(
                f"Invalid muonkit optimizer params {auto} = 'auto': muonkit takes explicit values. The HF Trainer "
                "fills 'auto' from TrainingArguments, and its learning_rate is an AdamW lr: Muon's lr is not HF's "
                'learning_rate (that one belongs in adamw_lr). Write e.g. "lr": 0.02, "adamw_lr": 3e-4, and run the '
                "Trainer with muonkit.integrations.deepspeed.trainer_setup(config), which removes this section before "
                "HF checks it against TrainingArguments"
            )
        if "betas" in params:
            params["betas"] = tuple(params["betas"])
        dtype = params.get("ns_dtype")
        if dtype is not None and dtype not in _DTYPES:
            raise ValueError(f"Invalid ns_dtype={dtype!r}: must be null or one of {sorted(_DTYPES)}")
        rules = params.get("rules", [])
        params["rules"] = dict(rules) if isinstance(rules, Mapping) else [tuple(r) for r in rules]
        return cls(**params)

    def param_groups_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :func:`muonkit.param_groups`: the routing only (the hyperparameters
        are the optimizer's defaults, :meth:`optimizer_kwargs`)."""
        return {
            "rules": self.rules or None,
            "split_qkv": self.split_qkv,
            "per_head": self.per_head,
            "heads": self.heads,
            "head_dim": self.head_dim,
            "muon_algorithm": self.muon_algorithm,
        }

    def optimizer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :class:`muonkit.HybridMuon` (its defaults for every group): every
        field that is one of its keywords, ``ns_dtype`` as the dtype it names."""
        kwargs = {f.name: getattr(self, f.name) for f in fields(self) if f.name in _KEYWORDS}
        kwargs["ns_dtype"] = None if self.ns_dtype is None else _DTYPES[self.ns_dtype]
        return kwargs


_KEYWORDS = frozenset(f.name for f in fields(Defaults))
"""The fields of :class:`MuonkitOptions` that are :class:`muonkit.HybridMuon` keywords."""


def load_config(config: str | os.PathLike[str] | Mapping[str, Any] | None, *, args: Any = None) -> dict[str, Any]:
    """A private deep copy of the DeepSpeed config: a dict, a JSON file, or ``args.deepspeed_config``."""
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is None:
        raise ValueError("No DeepSpeed config: pass config= (a dict or a JSON path) or args.deepspeed_config")
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    with open(os.fspath(config)) as f:
        return dict(json.load(f))


def split_config(config: Mapping[str, Any]) -> tuple[dict[str, Any], MuonkitOptions | None]:
    """``(config for DeepSpeed, muonkit options)``: the muonkit optimizer section moved out.

    Returns ``options=None`` when the config has no optimizer section (the caller passes its own
    :class:`muonkit.HybridMuon`). Another optimizer type raises: this entry point is for muonkit.
    """
    ds_config = copy.deepcopy(dict(config))
    section = ds_config.pop("optimizer", None)
    ds_config["zero_allow_untested_optimizer"] = True
    if section is None:
        return ds_config, None
    kind = str(section.get("type", "")).lower()
    if kind not in MUONKIT_TYPES:
        raise ValueError(
            f"Invalid optimizer.type={section.get('type')!r}: muonkit.integrations.deepspeed.initialize needs "
            f"'muonkit.HybridMuon' (or no optimizer section and optimizer=HybridMuon(...)); for another optimizer "
            "call deepspeed.initialize directly"
        )
    return ds_config, MuonkitOptions.from_params(section.get("params"))


_ABSOLUTE_LR_KEYS = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr"),
    "WarmupDecayLR": ("warmup_min_lr", "warmup_max_lr"),
    "LRRangeTest": ("lr_range_test_min_lr",),
}


def check_supported(ds: Any, *, mpu: Any, pipeline: bool, accelerator: str) -> None:
    """Raise :class:`UnsupportedConfiguration` for what muonkit cannot serve (``ds``: a parsed DeepSpeedConfig).

    Each of these would otherwise train with a wrong update or fail deep inside DeepSpeed.
    """
    zero = ds.zero_config
    _require(ds.zero_optimization_stage in (1, 2, 3), "zero_optimization.stage=0 (no ZeRO)",
             "muonkit drives DeepSpeed's ZeRO partitions; use stage 1, 2 or 3, or torch DDP with "
             "HybridMuon(process_group=...) without DeepSpeed")  # fmt: skip
    for name in ("offload_optimizer", "offload_param"):
        device = getattr(getattr(zero, name, None), "device", None)
        _require(device in (None, "none") or getattr(device, "value", device) == "none", f"zero_optimization.{name}",
                 "offloaded optimizer steps run on CPU copies through DeepSpeed's own CPU optimizers; muonkit does "
                 "not drive that path yet")  # fmt: skip
    _require(getattr(zero, "zenflow", None) is None, "zero_optimization.zenflow", "ZenFlow reorders the optimizer step")
    plus = {
        "zero_hpz_partition_size": getattr(zero, "zero_hpz_partition_size", 1) > 1,
        "zero_quantized_weights": bool(getattr(zero, "zero_quantized_weights", False)),
        "zero_quantized_gradients": bool(getattr(zero, "zero_quantized_gradients", False)),
    }
    for key, used in plus.items():
        _require(not used, f"zero_optimization.{key} (ZeRO++)",
                 "these change how parameters are partitioned and are not covered by muonkit's tests")  # fmt: skip
    _require(not getattr(zero, "elastic_checkpoint", False), "zero_optimization.elastic_checkpoint",
             "DeepSpeed's elastic format assumes every param group has the same state keys (Muon keeps "
             "momentum_buffer, AdamW exp_avg/exp_avg_sq); to change the world size convert the checkpoint "
             "with 'muonkit convert-deepspeed'")  # fmt: skip
    _require(not getattr(ds, "load_universal_checkpoint", False), "checkpoint.load_universal",
             "universal checkpoints carry only Adam's exp_avg/exp_avg_sq; use 'muonkit convert-deepspeed'")  # fmt: skip
    _require(not (ds.float16_config.enabled and accelerator == "cpu"), "fp16 on CPU",
             "fp16 matrix products are ~1000x slower than bf16 on CPUs; use \"bf16\": {\"enabled\": true}")  # fmt: skip
    autotp = (getattr(ds, "tensor_parallel_config", None) and getattr(ds.tensor_parallel_config, "autotp_size", 0)) or 0
    _require(mpu is None and autotp <= 1, "tensor parallelism (mpu or tensor_parallel.autotp_size > 1)",
             "each rank holds a slice of every matrix; orthogonalizing slices is not Muon")  # fmt: skip
    _require(not pipeline, "pipeline parallelism (PipelineModule)", "not covered by muonkit's tests")
    check_scheduler(ds.scheduler_name, ds.scheduler_params or {})


def check_scheduler(name: str | None, params: Mapping[str, Any]) -> None:
    """DeepSpeed schedulers that would give every param group the same absolute lr are refused.

    ``WarmupCosineLR`` and torch's schedulers scale each group from its own lr and are fine, as are
    ``WarmupLR``/``WarmupDecayLR`` without ``warmup_max_lr`` (each group then warms up to its own
    lr) and with ``warmup_min_lr`` 0. ``OneCycle`` also cycles the momentum of every group.
    """
    if name == "OneCycle":
        raise UnsupportedConfiguration(
            "muonkit + DeepSpeed: scheduler OneCycle is not supported: it sets one absolute lr and one momentum "
            "for every param group (Muon and AdamW need their own); use WarmupCosineLR or a torch scheduler"
        )
    for key in _ABSOLUTE_LR_KEYS.get(name or "", ()):
        value = params.get(key)  # absent: WarmupLR uses each group's lr and 0; LRRangeTest uses 1e-3 for all
        absent_ok = name != "LRRangeTest"
        if (value is None and absent_ok) or isinstance(value, (list, tuple)) or (key == "warmup_min_lr" and value == 0):
            continue
        raise UnsupportedConfiguration(
            f"muonkit + DeepSpeed: scheduler {name} with {key}={value!r} is not supported: one absolute lr would "
            "replace both the Muon lr and the AdamW lr. Leave warmup_max_lr out (each group then warms up to "
            "its own lr, set in the optimizer params), keep warmup_min_lr at 0, or use WarmupCosineLR"
        )


def _require(ok: bool, what: str, why: str) -> None:
    if not ok:
        raise UnsupportedConfiguration(f"muonkit + DeepSpeed: {what} is not supported: {why}")

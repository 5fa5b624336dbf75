"""Hugging Face transformers: HybridMuon under ``transformers.Trainer``, and models from configs.

Two ways to train with HybridMuon, both honouring the ``TrainingArguments`` (the AdamW groups
take ``learning_rate``, ``adam_beta1/2``, ``adam_epsilon`` and ``weight_decay``; the Trainer's lr
scheduler scales every group from its own base lr; gradient accumulation, clipping and
``resume_from_checkpoint`` work unchanged; so do DDP under ``torchrun`` and FSDP2 through
``fsdp=True, fsdp_config={"version": 2, "state_dict_type": "SHARDED_STATE_DICT"}``: ``fsdp=True``,
as the string form (``fsdp="full_shard"``) is deprecated, and sharded checkpoints, as the default
full state dict crashes at the first save)::

    from muonkit.integrations.transformers import MuonTrainer, make_optimizer

    trainer = MuonTrainer(model=model, args=args, train_dataset=ds)                 # a Trainer subclass
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      optimizers=(make_optimizer(model, args), None))               # or a plain Trainer

Muon groups keep HybridMuon's own lr (``muon_lr``, with Keller's shape scaling) unless told
otherwise; pass ``adjust_lr="match_adamw", muon_lr=args.learning_rate`` to give the Muon groups
AdamW's lr as Moonlight does.

:func:`model_from_config` builds a model from a ``config.json`` on the meta device (no weights, no
downloads): what :func:`muonkit.explain` and ``muonkit bench memory`` need.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any, cast

import torch
from torch import nn

from muonkit.config import MATRIX_KEYS, MUON_KEYS, RULE_KEYS, check_group_keys
from muonkit.defaults import DEFAULTS, Defaults
from muonkit.distributed import world_size
from muonkit.optimizer import HybridMuon
from muonkit.param_groups import no_decay_on_vectors, param_groups
from muonkit.qk_clip import QKClip
from muonkit.routing import RuleLike

__all__ = ["MuonSFTTrainer", "MuonTrainer", "make_optimizer", "model_from_config"]  # noqa: F822 (module __getattr__)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "muonkit's Hugging Face integration needs transformers: pip install transformers accelerate (the hf extra; in a clone of muonkit: pip install -e '.[hf]')"
        ) from e
    return transformers


def model_from_config(config: str | os.PathLike[str] | Mapping[str, Any], *, device: str = "meta") -> nn.Module:
    """Build a causal-LM (or base) model from a ``config.json`` path or dict, on ``device``.

    On the meta device no memory is allocated: a 16B-parameter model is built in seconds, which is
    all :func:`muonkit.explain` and the memory benchmark need.
    """
    transformers = _transformers()
    if isinstance(config, Mapping):
        data = dict(config)
    else:
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            data = json.load(f)
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise ValueError("config has no 'model_type'; expected a Hugging Face config.json")
    for key in ("auto_map", "architectures", "transformers_version", "quantization_config"):
        data.pop(key, None)
    for key in [k for k in data if k.startswith("_")]:  # "_name_or_path", our "_source" notes
        data.pop(key)
    cfg = transformers.AutoConfig.for_model(model_type, **data)
    with torch.device(device):
        try:
            return transformers.AutoModelForCausalLM.from_config(cfg)
        except ValueError:
            return transformers.AutoModel.from_config(cfg)


def make_optimizer(
    model: nn.Module,
    args: Any | None = None,
    *,
    muon_lr: float = DEFAULTS.lr,
    adamw_lr: float | None = None,
    weight_decay: float | None = None,
    rules: Sequence[RuleLike] | Mapping[str, str] | None = None,
    split_qkv: bool = False,
    per_head: bool = False,
    heads: int | None = None,
    head_dim: int | None = None,
    process_group: Any | None = None,
    muon_algorithm: str = "muon",
    cautious_wd: bool = DEFAULTS.cautious_wd,
    state_dtype: str = DEFAULTS.state_dtype,
    **muon_options: Any,
) -> HybridMuon:
    """A :class:`muonkit.HybridMuon` for ``model`` with the settings of ``args`` (``TrainingArguments``).

    - AdamW groups: lr ``adamw_lr`` (default ``args.learning_rate``, else HybridMuon's), betas
      ``(args.adam_beta1, args.adam_beta2)``, eps ``args.adam_epsilon``; weight decay
      ``weight_decay`` (default ``args.weight_decay``) on their >= 2D tensors (embeddings, heads)
      and none on biases and norm gains, as the Trainer's own optimizer does.
    - Muon groups: lr ``muon_lr``, the same weight decay, and any ``muon_options``
      (``adjust_lr``, ``ns_coefficients``, ``momentum``...; an unknown one is an error).
      ``muon_algorithm`` names their update rule (:data:`muonkit.functional.rules.RULES`; the
      rule's own keys among ``muon_options``, else HybridMuon's defaults for that rule).
    - ``cautious_wd``: cautious weight decay on every group (every update rule and AdamW).
    - ``state_dtype``: how every group keeps its states (``"fp32"``, ``"bf16"``, ``"8bit"``:
      :mod:`muonkit.state_precision`).
    - ``split_qkv``, ``per_head`` (``heads``, ``head_dim``): how attention projections are cut
      (:func:`muonkit.param_groups`).
    - Any other keyword of :class:`muonkit.HybridMuon` among ``muon_options`` that is not a Muon
      group key (``nonfinite``, ``betas``, a rule's keywords...: :class:`muonkit.defaults.Defaults`)
      is passed to it, over what ``args`` says.

    Pass it as ``Trainer(..., optimizers=(make_optimizer(model, args), None))``.

    Under ``torchrun`` the Trainer wraps the model in DDP, so when torch.distributed runs at world
    size > 1 the optimizer gets ``process_group=WORLD`` (each matrix orthogonalized once across
    ranks, identical updates everywhere) unless ``process_group`` says otherwise. Under the
    Trainer's FSDP2 mode (``fsdp=True, fsdp_config={"version": 2, "state_dict_type":
    "SHARDED_STATE_DICT"}``; version 2 is transformers 5's default; without sharded checkpoints the
    first save crashes) accelerate
    swaps the parameters for DTensors after the optimizer is built; HybridMuon chooses its strategy
    at the first step, so it shards its work over their mesh (the group is checked against it).
    FSDP1 is refused. The Trainer's DeepSpeed mode needs
    :func:`muonkit.integrations.deepspeed.trainer_setup` instead.
    """
    _check_trainer_mode(args)
    keywords = {k: muon_options.pop(k) for k in [k for k in muon_options if k in _KEYWORDS]}
    allowed = RULE_KEYS.get(muon_algorithm, MUON_KEYS)
    check_group_keys(muon_options, " among make_optimizer's Muon options", allowed=allowed, algorithm=muon_algorithm)
    if process_group is None and world_size() > 1:
        process_group = torch.distributed.group.WORLD
    wd = weight_decay if weight_decay is not None else float(getattr(args, "weight_decay", DEFAULTS.weight_decay))
    if adamw_lr is None:
        adamw_lr = float(getattr(args, "learning_rate", DEFAULTS.adamw_lr))
    adamw: dict[str, Any] = {}
    if args is not None:
        adamw = {"betas": (float(args.adam_beta1), float(args.adam_beta2)), "adamw_eps": float(args.adam_epsilon)}
    groups = param_groups(
        model,
        rules=rules,
        split_qkv=split_qkv,
        per_head=per_head,
        heads=heads,
        head_dim=head_dim,
        muon_algorithm=muon_algorithm,
        muon_options=muon_options,
    )
    settings = {
        "lr": muon_lr,
        "weight_decay": wd,
        "adamw_lr": adamw_lr,
        "adamw_weight_decay": wd,
        "cautious_wd": cautious_wd,
        "state_dtype": state_dtype,
    }
    return HybridMuon(no_decay_on_vectors(groups), process_group=process_group, **{**settings, **adamw, **keywords})


_KEYWORDS = frozenset(f.name for f in fields(Defaults)) - set(MATRIX_KEYS)
"""HybridMuon's keywords that are no group key of an update rule: passed to the optimizer, not the groups."""


def _check_trainer_mode(args: Any | None) -> None:
    """Refuse the Trainer modes in which an optimizer built here would not be the one that steps."""
    if args is None:
        return
    if getattr(args, "deepspeed", None):
        raise ValueError(
            "TrainingArguments has deepspeed set: the Trainer then builds the optimizer itself and would "
            "discard this one. Use setup = muonkit.integrations.deepspeed.trainer_setup(config) and "
            "Trainer(..., args=TrainingArguments(..., deepspeed=setup.deepspeed), **setup.trainer_kwargs()). "
            "The config's optimizer params take Muon's lr, which is not HF's learning_rate (that one is AdamW's: "
            "adamw_lr); never 'auto'"
        )
    if getattr(args, "fsdp", None):
        config = getattr(args, "fsdp_config", None) or {}
        version = config.get("version", config.get("fsdp_version", 2)) if isinstance(config, Mapping) else 2
        if str(version) != "2":
            raise NotImplementedError(
                f"TrainingArguments has fsdp={args.fsdp!r} with fsdp_config version {version!r} (FSDP1): FSDP1 "
                "flattens the parameters into 1-D buffers, so no matrix would be found for Muon. Use FSDP2: "
                'fsdp=True, fsdp_config={"version": 2, "state_dict_type": "SHARDED_STATE_DICT"} (version 2 is the '
                "default in transformers 5; the sharded state dict keeps the first save from crashing), whose "
                "DTensor params HybridMuon shards its work over at the first step."
            )


def _make_muon_trainer() -> type:
    trainer_cls: Any = _transformers().Trainer

    class MuonTrainer(trainer_cls):
        """``transformers.Trainer`` that trains with :class:`muonkit.HybridMuon`.

        ``muon_options`` are the keyword arguments of :func:`make_optimizer` (``muon_lr``,
        ``adamw_lr``, ``adjust_lr``, ``rules``...). Everything else is the Trainer's.

        ``qk_clip``: QK-Clip after every optimizer step (:class:`muonkit.QKClip`): ``True`` for the
        defaults, a mapping of its keyword arguments (``{"threshold": 50.0, "alpha": 0.5}``), or a
        ``QKClip`` already built on the model. Built here (before the first forward, so a bad
        setting fails before training) and attached to the optimizer when the Trainer creates it;
        each training log then carries ``qk_clip_max_logit``, the largest attention logit (any
        layer, head, rank) of the steps since the previous log. Available as ``trainer.qk_clip``.
        """

        def __init__(
            self,
            *args: Any,
            muon_options: Mapping[str, Any] | None = None,
            qk_clip: bool | Mapping[str, Any] | QKClip | None = None,
            **kwargs: Any,
        ) -> None:
            self.muon_options = dict(muon_options or {})
            super().__init__(*args, **kwargs)
            self.qk_clip = _qk_clip_of(qk_clip, self.model)
            self._qk_clip_peak = -math.inf

        def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
            optimizer = self._create_optimizer(model)
            if self.qk_clip is not None and not getattr(optimizer, "_muonkit_qk_clip_attached", False):
                self.qk_clip.attach(optimizer)
                optimizer.register_step_post_hook(lambda *_: self._record_qk_clip_peak())
                optimizer._muonkit_qk_clip_attached = True  # type: ignore[attr-defined]
            return optimizer

        def _record_qk_clip_peak(self) -> None:
            assert self.qk_clip is not None
            self._qk_clip_peak = max(self._qk_clip_peak, self.qk_clip.last_max_logit)

        def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
            if self.qk_clip is not None and "loss" in logs and self._qk_clip_peak > -math.inf:
                logs = {**logs, "qk_clip_max_logit": self._qk_clip_peak}
                self._qk_clip_peak = -math.inf
            super().log(logs, *args, **kwargs)

        def _create_optimizer(self, model: nn.Module | None) -> torch.optim.Optimizer:
            if getattr(self, "optimizer_cls_and_kwargs", None) is not None:
                # An explicit factory wins, e.g. muonkit.integrations.deepspeed.trainer_setup's.
                return cast(torch.optim.Optimizer, super().create_optimizer(model))
            optimizer: torch.optim.Optimizer | None = getattr(self, "optimizer", None)
            if optimizer is None:
                optimizer = make_optimizer(model if model is not None else self.model, self.args, **self.muon_options)
                self.optimizer = optimizer
            return optimizer

    return MuonTrainer


def _make_muon_sft_trainer() -> type:
    try:
        from trl import SFTTrainer
    except ImportError as e:
        raise ImportError("muonkit.integrations.transformers.MuonSFTTrainer needs TRL: pip install trl") from e
    muon_trainer: Any = globals()["MuonTrainer"] if "MuonTrainer" in globals() else __getattr__("MuonTrainer")

    class MuonSFTTrainer(muon_trainer, SFTTrainer):
        """TRL's ``SFTTrainer`` that trains with :class:`muonkit.HybridMuon` (``MuonTrainer``'s
        ``muon_options`` and ``qk_clip``; everything else is the SFTTrainer's).

        The optimizer is built when training starts, from the model as ``SFTTrainer`` left it: with
        ``peft_config=`` that is the PEFT model, so the LoRA adapters train. (An optimizer built
        beforehand and passed in ``optimizers=`` holds the base weights PEFT then freezes: it finds
        no gradient, warns for a few steps and then raises.)::

            from muonkit.integrations.transformers import MuonSFTTrainer

            trainer = MuonSFTTrainer(model=model, args=sft_config, train_dataset=ds, peft_config=lora)
            trainer.train()
        """

    return MuonSFTTrainer


def _qk_clip_of(setting: bool | Mapping[str, Any] | QKClip | None, model: nn.Module) -> QKClip | None:
    if setting is None or setting is False:
        return None
    if isinstance(setting, QKClip):
        return setting
    if setting is True:
        return QKClip(model)
    if isinstance(setting, Mapping):
        return QKClip(model, **setting)
    raise TypeError(
        f"Invalid qk_clip={setting!r}: must be True, a mapping of muonkit.QKClip keyword arguments, or a QKClip"
    )


def __getattr__(name: str) -> Any:
    # MuonTrainer subclasses transformers.Trainer: built on first use so that importing this module
    # (for model_from_config) does not import the Trainer machinery.
    if name == "MuonTrainer":
        cls = _make_muon_trainer()
        globals()["MuonTrainer"] = cls
        return cls
    if name == "MuonSFTTrainer":  # the same for TRL's SFTTrainer (imports trl)
        cls = _make_muon_sft_trainer()
        globals()["MuonSFTTrainer"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

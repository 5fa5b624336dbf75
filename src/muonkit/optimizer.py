"""HybridMuon: one ``torch.optim.Optimizer``, Muon or AdamW chosen per param group.

The optimizer validates, keeps state and orchestrates; each concern has its own module:

- :mod:`muonkit.config`: every group's hyperparameters, validated into typed configs;
- :mod:`muonkit.group_checks`: the groups, params and gradients; :mod:`muonkit.state_checks`:
  a state dict before it loads;
- :mod:`muonkit.strategy_choice`: the distribution strategy, picked once, at the first ``step()``,
  by :func:`muonkit.distributed.select_strategy`; :mod:`muonkit.capturable`: device-held rates;
- the stages of a step: :mod:`muonkit.stages` (Muon's directions and commit, AdamW's step);
  whether it applies: the strategy's guard (:mod:`muonkit.distributed.guard`);
- the math in :mod:`muonkit.functional`; :class:`muonkit.Muon` (torch's signature) in
  :mod:`muonkit.torch_muon`.

The whole behaviour, with the reasons for the defaults: ``docs/optimizer.md``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import fields
from typing import Any, Literal, cast

import torch
from torch import Tensor
from torch.optim import Optimizer

from muonkit import capturable as rates_on_device
from muonkit._compat import requires_torch_for_params
from muonkit.config import (
    MATRIX_ALGORITHMS,
    OPTIMIZER_KEYWORDS,
    AdamWConfig,
    MuonConfig,
    check_group_keys,
    check_read_keys,
    group_config,
    plain_hyperparameters,
)
from muonkit.defaults import DEFAULTS, Defaults
from muonkit.distributed import Strategy, world_size
from muonkit.distributed.guard import Guard, Verdict
from muonkit.functional.rules import RULES, rule_keywords
from muonkit.group_checks import (
    GroupConfigs,
    check_gradients_arrive,
    check_keywords,
    check_muon_params,
    checked_work,
    default_algorithm,
    tensors_and_names,
    warn_one_cycle_max_lr,
)
from muonkit.stages import MuonChunk, Rates, adamw_step, commit_batches, commit_muon, muon_chunks
from muonkit.state_checks import check_state_dict, saved_skipped_steps
from muonkit.state_precision import loaded
from muonkit.strategy_choice import (
    agree_before_refusing,
    check_process_group,
    check_strategy,
    choose_strategy,
    placement_before_choice,
    refuse_copy,
)

NonFinite = Literal["skip", "raise", "unchecked"]
NONFINITE_CHOICES: tuple[str, ...] = ("skip", "raise", "unchecked")

_PICKLED = {
    "_strategy", "_process_group", "_built_distributed", "skipped_steps", "_adamw_defaults",
    *(f"_{name}_defaults" for name in RULES), "_held_rates",
    *(f.name for f in fields(Defaults) if f.name in OPTIMIZER_KEYWORDS),
}  # fmt: skip
"""What ``copy.deepcopy`` and pickle keep of ours, besides torch's defaults, state and groups: the
optimizer-wide keywords (``nonfinite``, ``capturable``: attributes of the same name) and our state."""


class HybridMuon(Optimizer):
    r"""Muon for hidden matrices, AdamW for everything else, in one optimizer.

    Each param group has an ``algorithm`` (``"muon"``, another update rule of
    :mod:`muonkit.functional.rules`, or ``"adamw"``) and may override any
    hyperparameter under its group key. Muon groups, for a weight ``W`` with gradient ``G``::

        M <- momentum*M + (1 - momentum)*G              # fp32 buffer, never touches p.grad
        U <- G.lerp(M, momentum) if nesterov else M
        W <- W*(1 - lr*weight_decay) - lr*scale(rows, cols)*orthogonalize(U)

    AdamW groups follow ``torch.optim.AdamW`` exactly, with fp32 states. Whether a step applies
    (``nonfinite``), the capturable step, when the strategy is chosen, copies and checkpoints,
    and why each default: ``docs/optimizer.md``.

    Args:
        params: param groups (dicts with ``"algorithm"``) or an iterable of tensors (all >= 2D,
            then all Muon); tensors may come as ``(name, tensor)`` pairs
            (``model.named_parameters()``), whose names are kept in ``param_names`` as in torch.
        lr, momentum, nesterov, ns_coefficients, ns_steps, eps, weight_decay, adjust_lr: Muon
            defaults; ``ns_coefficients`` is ``"polar_express"``, ``"keller"``, ``"you"`` or a
            sequence of ``(a, b, c)``; ``adjust_lr`` is ``"keller"``, ``"match_adamw"``,
            ``"spectral"`` or None.
        layout, split_sizes: how tensors become matrices (:class:`muonkit.functional.MatrixLayout`);
            ``split_sizes`` splits each matrix along its rows (fused QKV).
        ns_dtype: compute dtype of Newton-Schulz (default: bf16 where fast, else fp32).
        ns_method: ``"gram"`` (default: the Gram iteration where the aspect ratio is >= 2 and the
            compute dtype is fp32/fp64) or ``"newton_schulz"`` (always on ``X``, as torch).
        adamw_lr, betas, adamw_eps, adamw_weight_decay: AdamW defaults.
        rule_keywords: each update rule's defaults for its groups (``{rule}_{key}=``, e.g. a
            rule's ``beta2``: :class:`muonkit.functional.update_rule.Hyperparameter`), listed
            with their defaults in :class:`muonkit.defaults.Defaults`.
        cautious_wd: default of every group's ``cautious_wd``: decay only the entries whose
            update and weight agree in sign (:func:`muonkit.functional.cautious_decay_`).
        nonfinite: ``"skip"`` (default), ``"raise"`` or ``"unchecked"``: what a non-finite (or
            overflowing) gradient or Muon update does (:mod:`muonkit.distributed.guard`).
        state_dtype: default of every group's ``state_dtype``: ``"fp32"`` (default), ``"bf16"``
            (stochastically rounded) or ``"8bit"`` (blockwise fp8 codes and scales), how Muon's
            momentum, an update rule's states and AdamW's moments are kept between steps
            (:mod:`muonkit.state_precision`). Loading a checkpoint keeps this setting and
            converts the saved states at their next step.
        capturable: a step with no host read, for ``torch.compile`` and CUDA graphs; needs
            ``nonfinite="unchecked"`` and one device (:mod:`muonkit.capturable`).
        ns_compile: run the Newton-Schulz iteration through ``torch.compile``.
        process_group: for DDP, the process group the gradients are averaged over. Left out at
            world size > 1 with plain params, the first ``step()`` (on every rank) takes them for
            replicas over every rank if every rank holds the same param shapes, and checks every
            step that their gradients agree (accelerate's and Lightning's DDP); pipeline stages
            and per-rank models are refused there (:func:`muonkit.distributed.select_strategy`).
        strategy: an explicit :class:`muonkit.distributed.Strategy` (advanced).

    Example::

        opt = muonkit.HybridMuon(muonkit.param_groups(model), lr=0.02, adamw_lr=3e-4)
        loss.backward()
        opt.step()
        opt.zero_grad()
    """

    _for_a_model = "muonkit.param_groups(model)"
    """What to pass instead of a model, or of a group that mixes matrices and vectors."""
    capturable = False
    """Whether the step is capturable; the class default serves optimizers pickled before the option."""
    _validated: GroupConfigs | None = None
    _schedules_checked = False  # warn_one_cycle_max_lr ran (at the first step)
    _steps_without_gradients = 0  # in a row, up to this step (not copied: a copy starts counting afresh)
    """The groups' validated configs of the last step."""

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float = DEFAULTS.lr,
        momentum: float = DEFAULTS.momentum,
        nesterov: bool = DEFAULTS.nesterov,
        ns_coefficients: str | Sequence[Sequence[float]] = DEFAULTS.ns_coefficients,
        ns_steps: int | None = DEFAULTS.ns_steps,
        eps: float = DEFAULTS.eps,
        weight_decay: float = DEFAULTS.weight_decay,
        adjust_lr: str | None = DEFAULTS.adjust_lr,
        layout: str = DEFAULTS.layout,
        split_sizes: Sequence[int] | None = DEFAULTS.split_sizes,
        ns_dtype: torch.dtype | None = DEFAULTS.ns_dtype,
        ns_method: str = DEFAULTS.ns_method,
        adamw_lr: float = DEFAULTS.adamw_lr,
        betas: tuple[float, float] = DEFAULTS.betas,
        adamw_eps: float = DEFAULTS.adamw_eps,
        adamw_weight_decay: float = DEFAULTS.adamw_weight_decay,
        cautious_wd: bool = DEFAULTS.cautious_wd,
        nonfinite: NonFinite = DEFAULTS.nonfinite,
        state_dtype: str = DEFAULTS.state_dtype,
        capturable: bool = DEFAULTS.capturable,
        ns_compile: bool = DEFAULTS.ns_compile,
        process_group: Any | None = None,
        strategy: Strategy | None = None,
        **unknown: Any,  # only to answer torch's keywords (adjust_lr_fn=, foreach=...) with a hint
    ) -> None:
        rule_values = {k: unknown.pop(k, getattr(DEFAULTS, k)) for k in rule_keywords()}
        if unknown:
            check_keywords(type(self).__name__, unknown, tuple(inspect.signature(HybridMuon.__init__).parameters)[2:-1])
        if isinstance(params, torch.nn.Module):
            raise TypeError(
                f"{type(self).__name__} takes param groups or tensors, not a model ({type(params).__name__}): "
                f"pass {self._for_a_model}"
            )
        if nonfinite not in NONFINITE_CHOICES:
            raise ValueError(f"Invalid nonfinite={nonfinite!r}: must be one of {NONFINITE_CHOICES}")
        check_strategy(strategy)
        rates_on_device.check_capturable(capturable, nonfinite, process_group, strategy)
        check_process_group(process_group, strategy)
        self.nonfinite = nonfinite
        self.capturable = capturable
        self._held_rates: list[dict[str, Tensor]] = []  # capturable: each group's lr and weight decay tensors
        self.skipped_steps = 0
        self._adamw_defaults = plain_hyperparameters(
            {"lr": adamw_lr, "betas": betas, "eps": adamw_eps, "weight_decay": adamw_weight_decay}
        )
        for keyword, (rule, h) in rule_keywords().items():  # self._{rule}_defaults: {key: value}
            own = self.__dict__.setdefault(f"_{rule.name}_defaults", {})
            own.update(plain_hyperparameters({h.key: rule_values[keyword]}))
        if isinstance(split_sizes, Sequence) and not isinstance(split_sizes, str):
            split_sizes = tuple(split_sizes)  # anything else is refused with the group's message
        defaults = {
            "algorithm": None, "lr": lr, "momentum": momentum, "nesterov": nesterov,
            "ns_coefficients": ns_coefficients, "ns_steps": ns_steps, "eps": eps,
            "weight_decay": weight_decay, "adjust_lr": adjust_lr, "layout": layout,
            "split_sizes": split_sizes, "ns_dtype": ns_dtype, "ns_method": ns_method, "ns_compile": ns_compile,
            "betas": betas, "cautious_wd": cautious_wd, "state_dtype": state_dtype,
        }  # fmt: skip
        super().__init__(params, plain_hyperparameters(defaults))
        requires_torch_for_params(p for g in self.param_groups for p in g["params"])
        self._strategy: Strategy | None = strategy
        self._process_group = process_group
        self._built_distributed = world_size() > 1  # for the hint when that changed before the first step

    # ------------------------------------------------------------------ strategy

    @property
    def strategy(self) -> Strategy:
        """The distribution strategy; chosen from the params held now the first time it is needed."""
        if self._strategy is None:
            self._strategy = self._choose_strategy()
        return self._strategy

    def set_strategy(self, strategy: Strategy) -> None:
        """Replace the distribution strategy (before training, or right after loading a checkpoint).

        For engines that rewrite the param groups after the optimizer is built (DeepSpeed ZeRO
        hands ``step()`` flat partitions): :mod:`muonkit.integrations.deepspeed` calls this once
        the engine exists. Existing states must already be laid out as ``strategy.local`` expects.
        """
        check_strategy(strategy, required=True)
        self._strategy = strategy

    def _choose_strategy(self, *, compare_ranks: bool = False) -> Strategy:
        params = self._all_params()
        return choose_strategy(
            params, process_group=self._process_group, built_distributed=self._built_distributed,
            compare_ranks=compare_ranks,
        )  # fmt: skip

    def _strategy_for_step(self, configs: list[MuonConfig | AdamWConfig]) -> Strategy:
        if self._strategy is None:
            try:  # every rank steps: plain params may be compared across ranks (strategy_choice)
                self._strategy = self._choose_strategy(compare_ranks=True)
            except ValueError:  # join the other ranks' agreement first, so that every rank raises
                agree_before_refusing(
                    self._all_params(),
                    process_group=self._process_group,
                    groups=self.param_groups,
                    configs=configs,
                    nonfinite=self.nonfinite,
                )
                raise
        return self._strategy

    def _all_params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    # ------------------------------------------------------------------ groups

    def _mixed_group_advice(self) -> str:
        return f"give it algorithm='adamw', or pass {self._for_a_model}"

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; it is validated completely before anything changes.

        ``params`` may hold ``(name, tensor)`` pairs, as torch.optim accepts since 2.6; the names
        become the group's ``param_names``.
        """
        index = len(self.param_groups)
        if not isinstance(param_group, Mapping):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        if "params" not in param_group:
            raise ValueError(f"Param group {index} has no 'params'")
        check_group_keys(param_group, f" in param group {index}")
        group = dict(param_group)
        params, names = tensors_and_names(group["params"], index)
        group["params"] = params  # a generator is consumed here: hand torch the list
        if names is not None:
            group["param_names"] = names
        if any(p.is_complex() for p in params):
            raise ValueError(f"Param group {index} has a complex tensor: complex params are not supported")
        if "algorithm" not in group or group["algorithm"] is None:
            group["algorithm"] = default_algorithm(params, index, advice=self._mixed_group_advice())
        own = getattr(self, f"_{group['algorithm']}_defaults", {}) if isinstance(group["algorithm"], str) else {}
        for key, value in own.items():
            group.setdefault(key, value)
        filled = {**self.defaults, **group}
        config = group_config(filled, index)
        check_read_keys(group, index, defaults=self.defaults)
        if filled["algorithm"] in MATRIX_ALGORITHMS:
            check_muon_params(params, cast(MuonConfig, config), index)
        if self.capturable:
            rates_on_device.check_one_device(params, index)
        super().add_param_group(plain_hyperparameters(group))
        if self.capturable:
            self._held_rates.append({})
            rates_on_device.hold_rates(self.param_groups[-1], index, self._held_rates[index])

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimization step on every group; returns the closure's loss if given.

        All or nothing: whatever is wrong with the groups, params, gradients or states raises
        before anything changes, and unless ``nonfinite="unchecked"`` every update is computed
        and checked (on every rank) before any is applied.

        Distributed, an error raised on one rank only (out of memory, a bug) reaches every rank:
        the ranks waiting for this one raise :class:`~muonkit.distributed.collectives.RankFailedError`
        within about a second, and the process group is left out of step: restart from the last
        checkpoint (:mod:`muonkit.distributed.collectives`).
        """
        self._step_wrote = False
        try:
            return self._step(closure)
        except BaseException as error:
            if self._strategy is not None:
                self._strategy.guard.step_failed(error, applied=self._step_wrote)
            raise

    def _step(self, closure: Callable[[], Any] | None) -> Any:
        """The stages of :meth:`step` (which tells the other ranks when it raises); whether the step
        applies is its guard's (:mod:`muonkit.distributed.guard`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        configs = self._group_configs()
        guard, work = self._checked_work(configs)
        verdict = guard.before(self, work, configs, self._directions(configs, work))
        if verdict.applies:
            deferred = self._commit(configs, work, verdict)
            if guard.outcome(self, verdict):
                for params, config, rates in deferred:
                    self._adamw_step(params, config, rates)
        guard.end()
        return loss

    def _group_configs(self) -> list[MuonConfig | AdamWConfig]:
        """Every group's validated config (validated again only where its values changed,
        :class:`~muonkit.group_checks.GroupConfigs`); capturable, the group's rate tensors are not read.

        A number written into a capturable group's ``lr`` or ``weight_decay`` since the last step
        is checked and copied into the group's tensor first (:func:`muonkit.capturable.hold_rates`).
        """
        if self._validated is None:  # not copied or pickled: made again after either
            self._validated = GroupConfigs()
        validated = self._validated
        if not self.capturable:
            return [validated(g, i) for i, g in enumerate(self.param_groups)]
        configs = []
        for i, group in enumerate(self.param_groups):
            rates_on_device.hold_rates(group, i, self._held_rates[i])
            configs.append(validated(rates_on_device.unread(group), i))
        return configs

    def _checked_work(self, configs: list[MuonConfig | AdamWConfig]) -> tuple[Guard, list[list[Tensor]]]:
        """The strategy's guard (the strategy chosen at the first step) and the params each group
        steps, after every check a step could otherwise fail halfway."""
        if not self._schedules_checked:  # once: lr schedulers are built before the first step
            self._schedules_checked = True
            warn_one_cycle_max_lr(self.param_groups, configs)
        strategy = self._strategy_for_step(configs)
        if self.capturable:
            rates_on_device.check_capturable_strategy(strategy)
        guard = strategy.guard
        guard.align_grads([p for g in self.param_groups for p in g["params"] if p.grad is not None])
        work = checked_work(self.param_groups, configs, strategy=strategy, state=self.state)
        self._steps_without_gradients = 0 if any(work) else self._steps_without_gradients + 1
        if self._steps_without_gradients:
            check_gradients_arrive(self.param_groups, run=self._steps_without_gradients)
        return guard, work

    def _directions(
        self, configs: list[MuonConfig | AdamWConfig], work: list[list[Tensor]]
    ) -> list[Iterable[MuonChunk]]:
        """Each group's Muon chunks, computed as they are iterated (none for AdamW groups)."""
        return [
            muon_chunks(params, config, strategy=self.strategy, state=self.state)
            if isinstance(config, MuonConfig)
            else []
            for config, params in zip(configs, work, strict=True)
        ]

    def _commit(
        self, configs: list[MuonConfig | AdamWConfig], work: list[list[Tensor]], verdict: Verdict[MuonChunk]
    ) -> list[tuple[list[Tensor], AdamWConfig, Rates]]:
        """Apply every Muon chunk, and the AdamW groups unless they wait for the verdict (returned)."""
        deferred = []
        if self.capturable:  # the groups' device tensors, never read here
            rates: list[Rates] = [(g["lr"], g["weight_decay"]) for g in self.param_groups]
        else:
            rates = [(c.lr, c.weight_decay) for c in configs]
        for config, params, pending, rate in zip(configs, work, verdict.chunks, rates, strict=True):
            if isinstance(config, MuonConfig):
                for batch in commit_batches(pending):
                    commit_muon(
                        batch, config, rate, verdict.stream, strategy=self.strategy, state=self.state, wrote=self._wrote
                    )
            elif verdict.defers_adamw:
                deferred.append((params, cast(AdamWConfig, config), rate))
            else:
                self._adamw_step(params, cast(AdamWConfig, config), rate)
        return deferred

    def _adamw_step(self, params: list[Tensor], config: AdamWConfig, rates: Rates) -> None:
        adamw_step(
            params,
            config,
            rates,
            strategy=self.strategy,
            state=self.state,
            capturable=self.capturable,
            wrote=self._wrote,
        )

    def _wrote(self) -> None:
        """The step writes a state or param from now on (a failure then leaves it partly applied)."""
        self._step_wrote = True

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's state dict, plus ``skipped_steps`` (steps skipped for a non-finite gradient)."""
        state = super().state_dict()
        state["skipped_steps"] = self.skipped_steps
        return state

    def __getstate__(self) -> dict[str, Any]:
        """What ``copy.deepcopy`` and pickle keep: torch's defaults, state and groups, and ours."""
        refuse_copy(self._strategy, process_group=self._process_group, params=self._all_params())
        return {**super().__getstate__(), **{k: v for k, v in self.__dict__.items() if k in _PICKLED}}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state; a state that does not fit these param groups raises and changes nothing.

        Saved hyperparameters replace the current ones; a key the checkpoint lacks (saved before
        that option existed) keeps its current value. States are copied, never aliasing
        ``state_dict``; momentum and moments stay fp32 for low-precision params. State saved by
        ``torch.optim.AdamW`` (for AdamW groups) or ``torch.optim.Muon`` (for Muon groups) loads
        where it maps cleanly (:mod:`muonkit.foreign_state`); other optimizers' state, and state
        values that would wreck the next step (non-finite, negative ``exp_avg_sq``), raise.
        """
        whole_shapes, local = placement_before_choice(self._strategy)
        state_dict = check_state_dict(state_dict, self.param_groups, whole_shapes=whole_shapes, local=local)
        skipped = saved_skipped_steps(state_dict, default=self.skipped_steps)
        current = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        saved = state_dict["state"]
        ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        super().load_state_dict(dict(state_dict))
        self.skipped_steps = skipped
        for index, (group, before) in enumerate(zip(self.param_groups, current, strict=True)):
            for key, value in before.items():
                group.setdefault(key, value)
            group["state_dtype"] = before["state_dtype"]  # how this optimizer stores: saved states convert
            if self.capturable:
                rates_on_device.hold_rates(group, index, self._held_rates[index], adopt=False)
            else:  # a capturable optimizer's rate tensors load as numbers where these were numbers
                rates_on_device.numbers_again(group, before)
        # torch casts float states to the param dtype and keeps the caller's tensors; redo both.
        for pid, p in zip(ids, self._all_params(), strict=True):
            own = saved.get(pid, {})
            if not own:
                continue
            self.state[p] = loaded(own, p)  # 8-bit and bf16 states as saved (state_precision)
            if "step" in own:
                device = p.device if self.capturable else "cpu"
                self.state[p]["step"] = torch.tensor(float(own["step"]), dtype=torch.float32, device=device)


def _signature_with_rule_keywords(init: Callable[..., None]) -> inspect.Signature:
    """``init``'s signature with each update rule's keywords (popped from ``**unknown``) among its
    keyword-only parameters, before ``cautious_wd``, with their :data:`DEFAULTS` values."""
    signature = inspect.signature(init)
    params = list(signature.parameters.values())
    at = [p.name for p in params].index("cautious_wd")
    added = [
        inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=getattr(DEFAULTS, k), annotation=type(h.default))
        for k, (_, h) in rule_keywords().items()
    ]
    return signature.replace(parameters=params[:at] + added + params[at:])


HybridMuon.__init__.__signature__ = _signature_with_rule_keywords(HybridMuon.__init__)  # type: ignore[attr-defined]

__all__ = ["NONFINITE_CHOICES", "HybridMuon"]

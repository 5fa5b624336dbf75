"""HybridMuon: one ``torch.optim.Optimizer``, Muon or AdamW chosen per param group.

The optimizer validates, keeps state and orchestrates; the math lives in
:mod:`muonkit.functional` and everything about where tensors live in the strategy picked once, at
the first ``step()``, by :func:`muonkit.distributed.select_strategy`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import math
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import Tensor
from torch.optim import Optimizer

from muonkit.config import (
    DEFAULTS,
    MATRIX_ALGORITHMS,
    TORCH_ADJUST_LR,
    TORCH_MUON_DEFAULTS,
    AdamWConfig,
    MuonConfig,
    check_group_keys,
    check_read_keys,
    group_config,
    key_hint,
    plain_hyperparameters,
)
from muonkit.distributed import SingleDeviceStrategy, Strategy, select_strategy, world_size
from muonkit.distributed.agreement import settings_of
from muonkit.distributed.failure import every_rank
from muonkit.foreign_state import muonkit_group
from muonkit.functional.adamw import adamw_
from muonkit.functional.coefficients import is_preset_schedule
from muonkit.functional.muon import momentum_, momentum_masked_, muon_apply_, muon_apply_masked_, muon_update
from muonkit.functional.normuon import normuon_rows
from muonkit.functional.orthogonalize import host_read_waits
from muonkit.functional.validation import nonneg
from muonkit.limits import GroupLimits, exp_avg_limit, within_flags, within_on_host, work_dtype
from muonkit.shapes import full_shape

logger = logging.getLogger(__name__)

NonFinite = Literal["skip", "raise", "unchecked"]
NONFINITE_CHOICES: tuple[str, ...] = ("skip", "raise", "unchecked")
_STATE_KEYS = {
    "muon": ("momentum_buffer",),
    "normuon": ("momentum_buffer", "row_exp_avg_sq"),
    "adamw": ("exp_avg", "exp_avg_sq", "step"),
}
_ROWS = "row_exp_avg_sq"
"""NorMuon's state: one value per matrix row of the whole param (see :mod:`muonkit.functional.normuon`)."""


class HybridMuon(Optimizer):
    r"""Muon for hidden matrices, AdamW for everything else, in one optimizer.

    Each param group has ``algorithm="muon"`` or ``algorithm="adamw"`` and may override any
    hyperparameter. Build the groups with :func:`muonkit.param_groups`, which routes a model by its
    structure::

        opt = muonkit.HybridMuon(muonkit.param_groups(model), lr=0.02, adamw_lr=3e-4)

    Muon groups, for a weight ``W`` with gradient ``G`` (``rows x cols``, PyTorch layout)::

        M <- momentum*M + (1 - momentum)*G              # fp32 buffer, never touches p.grad
        U <- G.lerp(M, momentum) if nesterov else M
        O <- orthogonalize(U)                            # Newton-Schulz, batched by shape
        W <- W*(1 - lr*weight_decay) - lr*scale(rows, cols)*O

    AdamW groups follow ``torch.optim.AdamW`` exactly, with fp32 states.

    Defaults and why: ``lr=0.02`` with ``adjust_lr="keller"`` and ``momentum=0.95`` is the
    setting Keller Jordan tuned on NanoGPT and that trains small and mid-size transformers out of
    the box; ``ns_coefficients="polar_express"`` reaches a tighter singular-value band than
    Keller's tuple in the same 5 steps (see :mod:`muonkit.functional.coefficients`);
    ``weight_decay=0`` as in Keller's runs (set 0.01-0.1 for long runs). AdamW groups default
    to ``adamw_lr=3e-4``, ``betas=(0.9, 0.95)`` (the usual LLM setting) and no weight decay (they
    hold embeddings, norms and biases, which are normally not decayed). To reuse AdamW's lr and
    weight decay for the Muon groups, pass ``adjust_lr="match_adamw"`` and the AdamW values.

    Hyperparameters are Python numbers, numpy scalars, ``Decimal`` values or one-element tensors
    (stored as Python numbers, tensors as given); integers (``ns_steps``, ``split_sizes``) must
    be ints, Python or numpy. A group key the optimizer does not know is an error.

    torch's lr schedulers scale each group from its own lr. Those that cycle momentum
    (``OneCycleLR``, ``CyclicLR`` with ``cycle_momentum=True``) write ``betas[0]`` of every group,
    since the optimizer has ``betas``; a Muon group they mark (``base_momentum``) steps with that
    value as its ``momentum``, so both algorithms follow the cycle.

    A ``copy.deepcopy`` or pickle of the optimizer keeps everything (hyperparameters, states,
    ``nonfinite``, ``skipped_steps``, the strategy) and steps exactly like the original. Only a
    single-device optimizer can be copied: a distributed strategy holds a process group, which
    cannot be; save ``state_dict()`` instead.

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
        ns_method: ``"gram"`` (default) iterates on the small Gram matrix ``X X^T`` wherever the
            aspect ratio is >= 2 and the compute dtype is fp32/fp64 (the same polynomial, fewer
            FLOPs; figures in BENCHMARKS.md; bf16/fp16 always run the plain iteration) and
            runs the plain iteration on squarer matrices; ``"newton_schulz"`` always iterates on
            ``X`` (what torch.optim.Muon does).
        adamw_lr, betas, adamw_eps, adamw_weight_decay: AdamW defaults.
        normuon_beta2, normuon_eps: the ``beta2`` and ``eps`` of ``algorithm="normuon"`` groups
            (NorMuon, arXiv 2510.05491: Muon whose orthogonalized update is normalized per row
            by an EMA of its mean square, then rescaled to its Frobenius norm; see
            :mod:`muonkit.functional.normuon`). NorMuon groups are routed and stepped like Muon
            groups, with one more fp32 state, ``row_exp_avg_sq`` (one value per matrix row).
        cautious_wd: default of every group's ``cautious_wd`` (Muon, NorMuon and AdamW): decay
            only the entries whose update and weight agree in sign (arXiv 2510.12402;
            :func:`muonkit.functional.cautious_decay_`).
        nonfinite: what a non-finite gradient or Muon update (direction after orthogonalization,
            e.g. from a diverging Newton-Schulz schedule) does. ``"skip"`` (default): the whole
            step is skipped on every group and rank, a warning is logged and ``skipped_steps``
            counts it. A finite gradient so large that the step would overflow its state (or,
            in groups whose settings could overflow a param, a param at its dtype's edge)
            counts as non-finite (:mod:`muonkit.limits`), so every state a step writes loads;
            costs one norm pass over the gradients and directions and one blocking
            read of the device per step (the verdict, read after all of the step's Muon updates
            are launched; on the CPU reads wait for nothing; distributed strategies check that
            ranks agree on the host and read nothing more). With a preset's schedule each chunk
            is applied as it is computed, masked on the device by the gradients' verdict; with
            a custom ``ns_coefficients`` schedule (which may diverge) every Muon direction is
            held until the verdict (one fp32 copy of the local Muon params). ``"raise"``:
            ``FloatingPointError`` before anything changes. ``"unchecked"``: no check and no
            read; each chunk is applied as soon as it is computed (a gradient above the limits
            may then leave inf in the state, which ``load_state_dict`` refuses).
        capturable: a step with no host read, for ``torch.compile`` of the whole step and CUDA
            graphs (see "Capturable step" below). Needs ``nonfinite="unchecked"`` and one device
            (the single-device strategy).
        ns_compile: run the Newton-Schulz iteration through ``torch.compile`` (Muon default; it
            runs eagerly under ``TORCH_COMPILE_DISABLE=1``).
        process_group: for DDP, the process group the gradients are averaged over.
        strategy: an explicit :class:`muonkit.distributed.Strategy` (advanced).

    Capturable step: with ``capturable=True`` each group's ``lr`` and ``weight_decay`` are 0-dim
    float64 tensors on its params' device (as in ``torch.optim.Adam(capturable=True)``), AdamW's
    ``step`` counters live on that device and its bias corrections are computed there, so
    ``step()`` reads nothing back from an accelerator (on the CPU, where a read waits for nothing,
    the normalization checks its range as in the plain step; a compiled step never reads) and a
    compiled or captured step reads the current values: an lr schedule recompiles nothing. torch's lr schedulers write a tensor ``lr`` in place
    (``fill_``); a number assigned to ``group["lr"]`` is checked and copied into the group's
    tensor at the next step (refused during a CUDA graph capture; under ``torch.compile`` it
    recompiles). Values written into the tensors are not checked (that would read them). Results
    equal the plain step's, bit for bit on CPU (0-dim params included). Non-finite checks read a verdict on the host,
    hence ``nonfinite="unchecked"``; check gradients before the step instead (e.g.
    ``torch.amp.GradScaler``). Distributed strategies run collectives with host-side bookkeeping
    and are refused. ``torch.compile(opt.step)`` compiles the step as one graph; an lr
    scheduler wraps ``opt.step`` in a function dynamo does not trace, so for ``fullgraph=True``
    compile ``functools.partial(type(opt).step, opt)``. Run an eager step first (it creates the
    states; with CUDA graphs, as torch's recipe says, a few on a side stream) and load
    checkpoints before compiling or capturing. Strategy counters (``opt.strategy.stats``) are
    not updated by a compiled step.

    The strategy (:attr:`strategy`) is chosen from the params the optimizer holds when it is first
    needed: the first ``step()`` (or the first read of ``opt.strategy``), not at construction.
    Engines that swap the params after the optimizer is built (accelerate's FSDP2 ``prepare``
    replaces them with DTensors) therefore get the strategy of the params that really step;
    ``process_group`` is checked against their layout then, and a layout HybridMuon cannot tell
    (plain tensors at world size > 1 without ``process_group``) raises there, naming what to pass.
    An explicit ``strategy`` is used as given.
    """

    _for_a_model = "muonkit.param_groups(model)"
    """What to pass instead of a model, or of a group that mixes matrices and vectors."""
    capturable = False
    """Whether the step is capturable; the class default serves optimizers pickled before the option."""

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
        normuon_beta2: float = DEFAULTS.normuon_beta2,
        normuon_eps: float = DEFAULTS.normuon_eps,
        cautious_wd: bool = DEFAULTS.cautious_wd,
        nonfinite: NonFinite = DEFAULTS.nonfinite,
        capturable: bool = DEFAULTS.capturable,
        ns_compile: bool = DEFAULTS.ns_compile,
        process_group: Any | None = None,
        strategy: Strategy | None = None,
        **unknown: Any,  # only to answer torch's keywords (adjust_lr_fn=, foreach=...) with a hint
    ) -> None:
        _check_keywords(type(self).__name__, unknown)
        if isinstance(params, torch.nn.Module):
            raise TypeError(
                f"{type(self).__name__} takes param groups or tensors, not a model ({type(params).__name__}): "
                f"pass {self._for_a_model}"
            )
        if nonfinite not in NONFINITE_CHOICES:
            raise ValueError(f"Invalid nonfinite={nonfinite!r}: must be one of {NONFINITE_CHOICES}")
        _check_strategy(strategy)
        _check_capturable(capturable, nonfinite, process_group, strategy)
        if process_group is not None and strategy is None and not _distributed_initialized():
            raise ValueError(
                "process_group= was given but torch.distributed is not initialized: call "
                "torch.distributed.init_process_group first (build the optimizer after it, e.g. after Accelerator())"
            )
        self.nonfinite = nonfinite
        self.capturable = capturable
        self._held_rates: list[dict[str, Tensor]] = []  # capturable: each group's lr and weight decay tensors
        self.skipped_steps = 0
        self._adamw_defaults = plain_hyperparameters(
            {"lr": adamw_lr, "betas": betas, "eps": adamw_eps, "weight_decay": adamw_weight_decay}
        )
        self._normuon_defaults = plain_hyperparameters({"beta2": normuon_beta2, "eps": normuon_eps})
        if isinstance(split_sizes, Sequence) and not isinstance(split_sizes, str):
            split_sizes = tuple(split_sizes)  # anything else is refused with the group's message
        defaults = {
            "algorithm": None, "lr": lr, "momentum": momentum, "nesterov": nesterov,
            "ns_coefficients": ns_coefficients, "ns_steps": ns_steps, "eps": eps,
            "weight_decay": weight_decay, "adjust_lr": adjust_lr, "layout": layout,
            "split_sizes": split_sizes, "ns_dtype": ns_dtype, "ns_method": ns_method, "ns_compile": ns_compile,
            "betas": betas, "cautious_wd": cautious_wd,
        }  # fmt: skip
        super().__init__(params, plain_hyperparameters(defaults))
        self._strategy: Strategy | None = strategy
        self._process_group = process_group
        self._built_distributed = world_size() > 1  # for the hint when that changed before the first step

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
        _check_strategy(strategy, required=True)
        self._strategy = strategy

    def _strategy_for_step(self, has_grad: list[bool], settings: Callable[[], Sequence[Any]]) -> Strategy:
        if self._strategy is None:
            try:
                self._strategy = self._choose_strategy()
            except ValueError:
                self._agree_before_refusing(has_grad, settings)
                raise
        return self._strategy

    def _agree_before_refusing(self, has_grad: list[bool], settings: Callable[[], Sequence[Any]]) -> None:
        """Join the other ranks' agreement before refusing a mix of DTensor and plain params.

        Ranks whose params differ (one holds a plain tensor beside the DTensors) choose differently:
        those that chose wait in their strategy's agreement collective. A strategy for the DTensors
        alone joins it, so that every rank raises the agreement's error instead of hanging; where
        all ranks hold the same mix, the agreement passes and every rank refuses it alike.
        """
        params = self._all_params()
        sharded = _dtensors(params)
        if not sharded or len(sharded) == len(params):
            return
        try:
            probe = select_strategy(sharded, process_group=self._process_group)
        except (ValueError, NotImplementedError):
            return  # the DTensors alone are refused too: on every rank that holds them
        probe.check_participation(has_grad, settings)

    def _all_params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _choose_strategy(self) -> Strategy:
        params = self._all_params()
        try:
            return select_strategy(params, process_group=self._process_group)
        except ValueError as e:
            if self._built_distributed or self._process_group is not None or _dtensors(params):
                raise
            raise ValueError(
                f"{e} This HybridMuon was built before torch.distributed was initialized (e.g. before "
                "accelerate's Accelerator()): build it afterwards with process_group=torch.distributed.group.WORLD, "
                "or call opt.set_strategy(muonkit.distributed.ReplicatedStrategy(torch.distributed.group.WORLD)) "
                "before the first step."
            ) from None

    def _layout(self) -> tuple[Callable[[Tensor], list[tuple[int, ...]]], Callable[[Tensor], Tensor]]:
        """``whole_shapes`` and ``local`` of the strategy, without choosing it if it is not chosen yet.

        Before the first step (``load_state_dict`` right after construction, as accelerate's
        ``prepare`` does before it swaps the params), choosing would fix the strategy for params
        that may not be the ones that step. Every automatic strategy reads a param the same way:
        its full shape, and a DTensor's local shard.
        """
        if self._strategy is not None:
            return self._strategy.whole_shapes, self._strategy.local
        return (lambda p: [full_shape(p)]), _local_view

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
        params, names = _tensors_and_names(group["params"], index)
        group["params"] = params  # a generator is consumed here: hand torch the list
        if names is not None:
            group["param_names"] = names
        if any(p.is_complex() for p in params):
            raise ValueError(f"Param group {index} has a complex tensor: complex params are not supported")
        if "algorithm" not in group or group["algorithm"] is None:
            group["algorithm"] = _default_algorithm(params, index, advice=self._mixed_group_advice())
        own = {"adamw": self._adamw_defaults, "normuon": self._normuon_defaults}.get(group["algorithm"], {})
        for key, value in own.items():
            group.setdefault(key, value)
        filled = {**self.defaults, **group}
        group_config(filled, index)
        check_read_keys(group, index, defaults=self.defaults)
        if filled["algorithm"] in MATRIX_ALGORITHMS:
            _check_muon_params(params, filled, index)
        if self.capturable:
            _check_one_device(params, index)
        super().add_param_group(plain_hyperparameters(group))
        if self.capturable:
            self._held_rates.append({})
            self._hold_rates(self.param_groups[-1], index)

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimization step on every group; returns the closure's loss if given.

        All or nothing: whatever is wrong with the groups, params, gradients or states raises
        before anything changes, and unless ``nonfinite="unchecked"`` every update is computed
        and checked (on every rank) before any is applied.

        Distributed, an error raised on one rank only (out of memory, a bug) reaches every rank:
        the ranks waiting for this one raise :class:`~muonkit.distributed.failure.RankFailedError`
        within about a second, and the process group is left out of step: restart from the last
        checkpoint (:mod:`muonkit.distributed.failure`).
        """
        self._step_wrote = False
        try:
            return self._step(closure)
        except BaseException as error:
            if self._strategy is not None:
                self._strategy.step_failed(error, applied=self._step_wrote)
            raise

    def _step(self, closure: Callable[[], Any] | None) -> Any:
        """The body of :meth:`step` (which tells the other ranks when it raises)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        configs = self._group_configs()
        has_grad = [p.grad is not None for g in self.param_groups for p in g["params"]]
        settings = functools.partial(settings_of, configs, self.param_groups, nonfinite=self.nonfinite)
        strategy = self._strategy_for_step(has_grad, settings)  # chosen at the first step
        if self.capturable:
            _check_capturable_strategy(strategy)
        strategy.align_grads([p for g in self.param_groups for p in g["params"] if p.grad is not None])
        work = self._checked_work(configs)
        if not any(work):
            _warn_no_gradients(self.param_groups)
        strategy.check_participation(has_grad, settings)
        chunks: list[Iterable[_MuonChunk]] = [
            self._muon_chunks(params, config) if isinstance(config, MuonConfig) else []
            for config, params in zip(configs, work, strict=True)
        ]
        stream: _Stream | None = None
        if self.nonfinite != "unchecked" and all(_bounded(c) for c in configs if isinstance(c, MuonConfig)):
            # Streamed: with the presets' schedules a direction is finite wherever its momentum
            # update is, so the verdict is the gradients' (on every rank), known before any
            # direction; each chunk is applied as it comes (the scratch memory of one chunk),
            # masked on the device by that verdict (where reads wait for the device) and by its own
            # directions' finiteness (a guard). The one blocking read comes after every Muon
            # update is launched; AdamW, which keeps its step counts on the host, follows it.
            stream = self._stream(work, configs)
            if stream is None:  # decided on the host: skip
                strategy.end_step()
                return loss
        elif self.nonfinite != "unchecked":
            # Held (a custom schedule, which may diverge): every direction is computed and held
            # before the verdict, so a non-finite one anywhere leaves everything untouched.
            chunks = [list(c) for c in chunks]
            if not self._finite_or_skip(work, configs, cast(list[list[_MuonChunk]], chunks)):
                strategy.end_step()
                return loss
        after: list[tuple[list[Tensor], AdamWConfig, tuple[float | Tensor, float | Tensor]]] = []
        for config, params, pending, rates in zip(configs, work, chunks, self._rates(configs), strict=True):
            if isinstance(config, MuonConfig):
                for batch in _commit_batches(pending):
                    self._commit_muon(batch, config, rates, stream)
            elif stream is not None and stream.mask is not None:
                after.append((params, cast(AdamWConfig, config), rates))
            else:
                self._adamw_step(params, cast(AdamWConfig, config), rates)
        if stream is not None and not self._stream_outcome(stream):
            strategy.end_step()
            return loss
        for params, adamw, rates in after:
            self._adamw_step(params, adamw, rates)
        strategy.end_step()
        return loss

    def _group_configs(self) -> list[MuonConfig | AdamWConfig]:
        """Every group's validated config; capturable, the group's rate tensors are not read.

        A number written into a capturable group's ``lr`` or ``weight_decay`` since the last step
        is checked and copied into the group's tensor first (:meth:`_hold_rates`).
        """
        if not self.capturable:
            return [group_config(g, i) for i, g in enumerate(self.param_groups)]
        configs = []
        for i, group in enumerate(self.param_groups):
            self._hold_rates(group, i)
            configs.append(group_config(self._unread(group), i))
        return configs

    def _unread(self, group: dict[str, Any]) -> dict[str, Any]:
        """``group`` for validation; capturable, with placeholders for the rate tensors (never used)."""
        return {**group, **dict.fromkeys(_RATES, 0.0)} if self.capturable else group

    def _rates(self, configs: list[MuonConfig | AdamWConfig]) -> list[tuple[float | Tensor, float | Tensor]]:
        """Each group's ``(lr, weight_decay)``: numbers, or capturable, its device tensors."""
        if self.capturable:
            return [(g["lr"], g["weight_decay"]) for g in self.param_groups]
        return [(c.lr, c.weight_decay) for c in configs]

    def _hold_rates(self, group: dict[str, Any], index: int, *, adopt: bool = True) -> None:
        """Make ``group``'s ``lr`` and ``weight_decay`` its persistent 0-dim device tensors (capturable).

        A tensor already on the params' device in the rate dtype is adopted as it is (torch's lr
        schedulers ``fill_`` it), unless ``adopt=False`` (a loaded state); any other value is
        checked, then copied in place into the tensor the group held before (the one a compiled or
        captured step reads), made at the first call.
        """
        if not group["params"]:
            return
        device = group["params"][0].device
        dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
        held = self._held_rates[index]
        for key in _RATES:
            value = group[key]
            fits = isinstance(value, Tensor) and value.ndim == 0 and value.device == device and value.dtype == dtype
            if isinstance(value, Tensor) and (value is held.get(key) or (adopt and fits)):
                held[key] = value
                continue
            number = nonneg(f"{key} (param group {index})", value)
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"Param group {index}'s {key} is {value!r}, not the group's tensor, while a CUDA graph is captured: "
                    f"the graph would keep this value forever. Write it in place (group[{key!r}].fill_(x), as torch's lr "
                    "schedulers do) before capturing"
                )
            if key not in held or held[key].device != device or held[key].dtype != dtype:
                held[key] = torch.zeros((), dtype=dtype, device=device)
            held[key].fill_(number)
            group[key] = held[key]

    def _checked_work(self, configs: list[MuonConfig | AdamWConfig]) -> list[list[Tensor]]:
        """The params each group steps, after every check a step could otherwise fail halfway."""
        work = [self._params_with_grad(g) for g in self.param_groups]
        for i, (config, group, params) in enumerate(zip(configs, self.param_groups, work, strict=True)):
            if isinstance(config, MuonConfig):
                if params:
                    self.strategy.check_params(params)
                shapes = [s for p in group["params"] for s in self.strategy.whole_shapes(p)]
                _check_muon_params(group["params"], self._unread(group), i, shapes=shapes, hint=_SWAPPED_PARAMS)
            for p in params:
                _check_state_fits(self.state.get(p, {}), p, self.strategy.local, i)
        return work

    def _params_with_grad(self, group: Mapping[str, Any]) -> list[Tensor]:
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            grad = cast(Tensor, p.grad)
            if grad.layout != torch.strided:  # COO, CSR, ...: all sparse layouts
                raise RuntimeError(
                    "HybridMuon does not support sparse gradients; use torch.optim.SparseAdam for those params"
                )
            if p.is_complex() or grad.is_complex():
                raise RuntimeError("HybridMuon does not support complex params or gradients")
        return params

    def _finite_or_skip(
        self, work: list[list[Tensor]], configs: list[MuonConfig | AdamWConfig], chunks: list[list[_MuonChunk]]
    ) -> bool:
        """Whether to apply the step: every gradient within its limit (:meth:`_checked_inputs`) and
        every Muon direction finite, on every rank.

        One agreement for both (one tiny all-reduce when distributed) and, on accelerators, one
        blocking read: the verdict is computed on the device (:func:`~muonkit.limits.within_flags`)
        and read once.
        """
        inputs, limits = self._checked_inputs(work, configs)
        if not inputs:
            return True
        directions = [d for group in chunks for chunk in group for d in chunk.directions]
        flags = within_flags([inputs, directions], [limits, _finite_limits(directions)])
        grads_ok, updates_ok = self.strategy.all_true(flags)
        return self._verdict(grads_ok, updates_ok)

    def _checked_inputs(
        self, work: list[list[Tensor]], configs: list[MuonConfig | AdamWConfig]
    ) -> tuple[list[Tensor], list[float]]:
        """The tensors a checked step's verdict compares, and their limits (:mod:`muonkit.limits`):
        every local gradient, and the local params of groups whose settings could overflow one."""
        local, inputs, limits = self.strategy.local, [], []
        for config, params in zip(configs, work, strict=True):
            group = GroupLimits(config)
            for p in params:
                grad = local(cast(Tensor, p.grad))
                inputs.append(grad)
                limits.append(group.gradient(state_dtype=self._state_dtype(p), grad_dtype=grad.dtype))
            for p in params:
                shapes = self.strategy.whole_shapes(p) if isinstance(config, MuonConfig) else []
                limit = group.param(shapes=shapes, param_dtype=p.dtype)
                if limit is not None:
                    inputs.append(local(p))
                    limits.append(limit)
        return inputs, limits

    def _stream(self, work: list[list[Tensor]], configs: list[MuonConfig | AdamWConfig]) -> _Stream | None:
        """The streamed step's verdict on the gradients, on every rank (no read where reads wait).

        Where reads are free (the CPU) it is read now: a non-finite gradient (or one above its
        limit) skips (or raises) before anything is computed, and None is returned on a skip.
        Elsewhere it stays on the device as the mask of every Muon commit, and
        :meth:`_stream_outcome` reads it.
        """
        inputs, limits = self._checked_inputs(work, configs)
        if not inputs:
            return _Stream()
        start = self.strategy.reduce_flags(within_flags([inputs], [limits]))  # [gradients within, values agree]
        if host_read_waits(start.device):
            return _Stream(start=start, mask=start.all(), finite=torch.ones((), dtype=torch.bool, device=start.device))
        grads_ok, values_ok = start.tolist()
        if not values_ok:
            raise self.strategy.values_error()
        return _Stream(bad_chunks=0) if self._verdict(grads_ok, True) else None

    def _stream_outcome(self, stream: _Stream) -> bool:
        """Read the streamed step's verdict (its one blocking read, after every Muon update is
        launched); undo a skipped step's new states; whether to go on with AdamW."""
        if stream.mask is None:  # decided on the host
            if stream.bad_chunks is None:  # no gradients: nothing was checked, nothing to agree on
                return True
            finite = self.strategy.reduce_flags(torch.tensor([stream.bad_chunks == 0])).tolist()[0]  # free read
            grads_ok = values_ok = True
        else:
            start, finite_flag = cast(Tensor, stream.start), cast(Tensor, stream.finite)
            end = self.strategy.reduce_flags(finite_flag.reshape(1))
            grads_ok, values_ok, finite, _ = torch.cat([start, end.to(start.device)]).tolist()
        if not (grads_ok and values_ok):
            for p in stream.created:  # masked: only the states the step made are left to undo
                self.state.pop(p, None)
            if not values_ok:
                raise self.strategy.values_error()
            return self._verdict(False, True)
        if not finite:
            error = RuntimeError(
                "A Muon direction was non-finite although every gradient was finite (a non-finite momentum "
                "buffer, or a bug): the step was applied except to the matrices of those directions; the "
                "optimizer state is suspect, restore the last checkpoint"
            )
            raise every_rank(error)  # from the verdict every rank shares
        return True

    def _verdict(self, grads_ok: bool, updates_ok: bool) -> bool:
        """Whether to apply the step; on a non-finite gradient or update, raise or count and log the skip.

        ``grads_ok`` is False also for a finite gradient (or param) above its limit, which would
        overflow the step's state or params (:mod:`muonkit.limits`); on an accelerator the one
        read of the verdict cannot tell which, so neither message does."""
        if grads_ok and updates_ok:
            return True
        what = "gradient" if not grads_ok else "Muon update from finite gradients"
        if self.nonfinite == "raise":  # from the verdict every rank shares: raised alike on every rank
            raise every_rank(
                FloatingPointError(
                    f"non-finite {what} (inf or nan{_OVERFLOW if not grads_ok else ''}); nothing was updated"
                )
            )
        self.skipped_steps += 1
        what = "gradient (or one so large the step would overflow)" if not grads_ok else what
        logger.warning("Skipping optimizer step: non-finite %s (skipped so far: %d)", what, self.skipped_steps)
        return False

    def _state_dtype(self, p: Tensor) -> torch.dtype:
        return p.dtype if p.dtype in (torch.float32, torch.float64) else torch.float32

    def _muon_chunks(self, params: list[Tensor], config: MuonConfig) -> Iterator[_MuonChunk]:
        """The directions of ``params``, chunk by chunk, computed without changing any state.

        Chunks (one matrix shape at a time on one device) bound the scratch memory of computing
        them (updates, compute batch) to that of the largest chunk, not of every matrix.
        """
        if not params:
            return
        local = self.strategy.local
        for chunk in self.strategy.muon_chunks(params, config):
            group = [params[i] for i in chunk]
            buffers = [self._momentum_buffer(p) for p in group]
            grads = [local(cast(Tensor, p.grad)) for p in group]
            updates = muon_update(  # the whole chunk in one foreach call
                [local(b) for b in buffers], grads, momentum=config.momentum, nesterov=config.nesterov
            )
            if config.normuon:
                rows = [self._row_moments(p, config).clone() for p in group]  # the strategy writes the new ones
                directions = self.strategy.directions(group, updates, config, rows=rows)
            else:
                rows, directions = None, self.strategy.directions(group, updates, config)
            del updates
            yield _MuonChunk(group, buffers, directions, rows)

    def _momentum_buffer(self, p: Tensor) -> Tensor:
        """``p``'s momentum buffer, or a new zero one (stored only when the step commits)."""
        buffer = self.state.get(p, {}).get("momentum_buffer")
        return self.strategy.new_state(p, self._state_dtype(p)) if buffer is None else buffer

    def _row_moments(self, p: Tensor, config: MuonConfig) -> Tensor:
        """``p``'s NorMuon row moments, or new zero ones (stored only when the step commits): one
        value per matrix row of each whole tensor ``p`` stands for, on every rank."""
        rows = self.state.get(p, {}).get(_ROWS)
        if rows is None:
            count = _row_count(p, whole_shapes=self.strategy.whole_shapes, layout=config.layout) or 0
            rows = torch.zeros(count, dtype=self._state_dtype(p), device=p.device)
        return rows

    def _commit_muon(
        self,
        chunks: Sequence[_MuonChunk],
        config: MuonConfig,
        rates: tuple[float | Tensor, float | Tensor],
        stream: _Stream | None = None,
    ) -> None:
        """Store and advance the momentum the directions were computed from, then apply them.

        Every chunk given is committed by the same few ``_foreach`` calls (see :func:`_commit_batches`).
        In a streamed step (``stream``) the chunk's directions are checked first: on the host where
        reads are free (a non-finite one leaves the chunk unapplied), else on the device, where
        the commit is masked by the step's verdict and that check.
        """
        local = self.strategy.local
        params = [p for chunk in chunks for p in chunk.params]
        buffers = [b for chunk in chunks for b in chunk.buffers]
        directions = [d for chunk in chunks for d in chunk.directions]
        ok = None if stream is None else stream.check(directions)
        if ok is False:
            for chunk in chunks:
                chunk.directions.clear()
            return
        self._step_wrote = True
        if stream is not None:
            stream.created += [p for p in params if p not in self.state]
        for p, buffer in zip(params, buffers, strict=True):
            self.state[p]["momentum_buffer"] = buffer
        for chunk in chunks:
            if chunk.rows is not None:
                for p, rows in zip(chunk.params, chunk.rows, strict=True):
                    old = self.state[p].get(_ROWS)
                    if isinstance(ok, Tensor):  # masked: the old moments (or zeros) unless ok
                        rows = torch.where(ok, rows, torch.zeros_like(rows) if old is None else old)
                    self.state[p][_ROWS] = rows
        grads = [local(cast(Tensor, p.grad)) for p in params]
        if isinstance(ok, Tensor):
            momentum_masked_([local(b) for b in buffers], grads, momentum=config.momentum, ok=ok)
            muon_apply_masked_(
                [local(p) for p in params],
                directions,
                ok=ok,
                lr=rates[0],
                weight_decay=rates[1],
                cautious_wd=config.cautious_wd,
            )
        else:
            momentum_([local(b) for b in buffers], grads, momentum=config.momentum)
            muon_apply_(
                [local(p) for p in params],
                directions,
                lr=rates[0],
                weight_decay=rates[1],
                cautious_wd=config.cautious_wd,
            )
        for chunk in chunks:
            chunk.directions.clear()  # free them now, not when the next chunk replaces this one

    def _adamw_step(
        self, params: list[Tensor], config: AdamWConfig, rates: tuple[float | Tensor, float | Tensor]
    ) -> None:
        if not params:
            return
        self._step_wrote = True
        local = self.strategy.local
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if self.capturable else "cpu")
                state["exp_avg"] = self.strategy.new_state(p, self._state_dtype(p))
                state["exp_avg_sq"] = self.strategy.new_state(p, self._state_dtype(p))
            exp_avgs.append(local(state["exp_avg"]))
            exp_avg_sqs.append(local(state["exp_avg_sq"]))
            steps.append(state["step"])
        adamw_(
            [local(p) for p in params],
            [local(cast(Tensor, p.grad)) for p in params],
            exp_avgs,
            exp_avg_sqs,
            steps,
            lr=rates[0],
            beta1=config.beta1,
            beta2=config.beta2,
            eps=config.eps,
            weight_decay=rates[1],
            cautious_wd=config.cautious_wd,
        )

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's state dict, plus ``skipped_steps`` (steps skipped for a non-finite gradient)."""
        state = super().state_dict()
        state["skipped_steps"] = self.skipped_steps
        return state

    def __getstate__(self) -> dict[str, Any]:
        """What ``copy.deepcopy`` and pickle keep: torch's defaults, state and groups, and ours."""
        if self._strategy is None:  # not chosen yet: distributed for sure with a group or DTensor params
            distributed = self._process_group is not None or bool(_dtensors(self._all_params()))
            name = "chosen from process_group= or DTensor params" if distributed else ""
        else:
            name = "" if isinstance(self._strategy, SingleDeviceStrategy) else type(self._strategy).__name__
        if name:
            raise TypeError(
                f"Cannot copy or pickle a HybridMuon with strategy {name}: only a "
                "single-device optimizer can be copied (a distributed strategy holds process groups). Save "
                "opt.state_dict() (or use muonkit.distributed.checkpoint) and load it into a new optimizer"
            )
        extra = {
            "_strategy", "_process_group", "_built_distributed", "nonfinite", "skipped_steps", "_adamw_defaults",
            "_normuon_defaults", "capturable", "_held_rates",
        }  # fmt: skip
        return {**super().__getstate__(), **{k: v for k, v in self.__dict__.items() if k in extra}}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state; a state that does not fit these param groups raises and changes nothing.

        Saved hyperparameters replace the current ones; a key the checkpoint lacks (saved before
        that option existed) keeps its current value. States are copied, never aliasing
        ``state_dict``; momentum and moments stay fp32 for low-precision params. State saved by
        ``torch.optim.AdamW`` (for AdamW groups) or ``torch.optim.Muon`` (for Muon groups) loads
        where it maps cleanly (:mod:`muonkit.foreign_state`); other optimizers' state, and state
        values that would wreck the next step (non-finite, negative ``exp_avg_sq``), raise.
        """
        state_dict = self._check_state_dict(state_dict)
        skipped = _saved_skipped_steps(state_dict, default=self.skipped_steps)
        current = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        saved = state_dict["state"]
        ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        super().load_state_dict(dict(state_dict))
        self.skipped_steps = skipped
        for index, (group, before) in enumerate(zip(self.param_groups, current, strict=True)):
            for key, value in before.items():
                group.setdefault(key, value)
            if self.capturable:
                self._hold_rates(group, index, adopt=False)
            else:  # a capturable optimizer's rate tensors load as numbers where these were numbers
                for key in _RATES:
                    if isinstance(group[key], Tensor) and not isinstance(before[key], Tensor):
                        group[key] = float(group[key])
        # torch casts float states to the param dtype and keeps the caller's tensors; redo both.
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(ids, params, strict=True):
            for key, value in saved.get(pid, {}).items():
                if key == "step":
                    device = p.device if self.capturable else "cpu"
                    self.state[p][key] = torch.tensor(float(value), dtype=torch.float32, device=device)
                elif isinstance(value, Tensor):
                    self.state[p][key] = value.to(device=p.device, dtype=self._state_dtype(p), copy=True)

    def _check_state_dict(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """Validate ``state_dict`` against these groups; returns it with muonkit's group keys."""
        if (
            not isinstance(state_dict, Mapping)
            or not isinstance(state_dict.get("state"), Mapping)
            or not isinstance(state_dict.get("param_groups"), Sequence)
        ):
            raise ValueError("Invalid optimizer state: expected a dict with 'state' and 'param_groups'")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"Optimizer state has {len(saved_groups)} param groups, this optimizer has {len(self.param_groups)}"
            )
        index = 0
        groups: list[dict[str, Any]] = []
        whole_shapes, local = self._layout()
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups, strict=True)):
            if not isinstance(saved, Mapping) or not isinstance(saved.get("params"), Sequence):
                raise ValueError(f"Invalid optimizer state: param group {gi} has no 'params' list")
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"Param group {gi} has {len(group['params'])} params, the saved state has {len(saved['params'])}"
                )
            saved = muonkit_group(saved, group["algorithm"], gi)
            groups.append(saved)
            algorithm = saved["algorithm"]
            if algorithm != group["algorithm"]:
                raise ValueError(
                    f"Param group {gi} is {group['algorithm']!r} here but {algorithm!r} in the saved state"
                )
            merged = {**group, **{k: v for k, v in saved.items() if k != "params"}}  # as load_state_dict will
            config = group_config(merged, gi)
            rows = None
            if isinstance(config, MuonConfig):
                shapes = [s for p in group["params"] for s in whole_shapes(p)]
                _check_muon_params(group["params"], merged, gi, shapes=shapes, hint=_SWAPPED_PARAMS)
                rows = functools.partial(_row_count, whole_shapes=whole_shapes, layout=config.layout)
            for p, pid in zip(group["params"], saved["params"], strict=True):
                state = state_dict["state"].get(pid)
                _check_param_state(state, p, algorithm, gi, index, local=local, rows=rows, config=config)
                index += 1
        return {**state_dict, "param_groups": groups}


@dataclass
class _MuonChunk:
    """One chunk of a Muon step, computed but not applied."""

    params: list[Tensor]
    buffers: list[Tensor]
    """Their momentum buffers before the step (new zero ones are not in the state yet)."""
    directions: list[Tensor]
    """Local slices of ``scale * orthogonalize(U)``, ``U`` computed from ``buffers``."""
    rows: list[Tensor] | None = None
    """NorMuon: the new row moments, stored when the step commits."""


@dataclass
class _Stream:
    """The verdict of a streamed step (see ``step``): on the device, or decided on the host."""

    start: Tensor | None = None
    """On the device: ``[every gradient finite, the shared values agree]`` over every rank."""
    mask: Tensor | None = None
    """On the device: ``start.all()``, what every Muon commit is masked by."""
    finite: Tensor | None = None
    """On the device: every Muon direction of the step so far finite."""
    bad_chunks: int | None = None
    """Decided on the host: chunks left unapplied for a non-finite direction (None: no gradients)."""
    created: list[Tensor] = dataclasses.field(default_factory=list)
    """Params whose state the step created (removed again if the verdict skips it)."""

    def check(self, directions: Sequence[Tensor]) -> Tensor | bool:
        """Whether to apply a chunk with these directions: a device flag (the mask and their
        finiteness, recorded in :attr:`finite`), or on the host, where reads are free, a bool."""
        nonempty = [d for d in directions if d.numel() > 0]
        if self.mask is None:
            fine = not nonempty or within_on_host(nonempty, _finite_limits(nonempty))
            if not fine and self.bad_chunks is not None:
                self.bad_chunks += 1
            return fine
        if not nonempty:
            return self.mask
        mine = torch.stack(torch._foreach_norm(nonempty, float("inf"))).max().lt(math.inf).to(self.mask.device)
        self.finite = cast(Tensor, self.finite) & mine
        return self.mask & mine


def _bounded(config: MuonConfig) -> bool:
    """Whether the group's schedule is a preset's, whose directions are finite wherever its updates are."""
    options = config.ns_options
    return is_preset_schedule(options.coefficients, steps=options.steps)


_OVERFLOW = (
    ", or finite but so large that the step would overflow its state or a param: above ~1.8e19 in an fp32 "
    "AdamW group, ~1e31 in an fp32 Muon group; muonkit.functional.overflow"
)
"""What else a gradient verdict of "non-finite" covers (:mod:`muonkit.limits`)."""

_RATES = ("lr", "weight_decay")
"""The hyperparameters a capturable optimizer holds as device tensors (what schedules change)."""


def _check_strategy(strategy: Any, *, required: bool = False) -> None:
    """A strategy is a :class:`muonkit.distributed.Strategy` (or None: chosen at the first step)."""
    if isinstance(strategy, Strategy) or (strategy is None and not required):
        return
    allowed = "a muonkit.distributed.Strategy" + (
        "" if required else " or None (chosen from the params at the first step)"
    )
    raise TypeError(
        f"Invalid strategy={strategy!r}: must be {allowed}, e.g. muonkit.distributed.SingleDeviceStrategy() "
        "or ReplicatedStrategy(process_group); for DDP pass process_group= instead"
    )


def _check_capturable(capturable: Any, nonfinite: str, process_group: Any, strategy: Strategy | None) -> None:
    """Refuse ``capturable=True`` where the step would need a host read or host-side collectives."""
    if not isinstance(capturable, bool):
        raise ValueError(f"Invalid capturable={capturable!r}: must be True or False")
    if not capturable:
        return
    if nonfinite != "unchecked":
        raise ValueError(
            f"capturable=True needs nonfinite='unchecked', got nonfinite={nonfinite!r}: 'skip' and 'raise' read "
            "a finiteness verdict on the host every step, which a CUDA graph cannot replay and torch.compile "
            "cannot trace. Check gradients before the step instead (e.g. torch.amp.GradScaler)"
        )
    if process_group is not None:
        raise ValueError("capturable=True runs on one device only: pass no process_group")
    if strategy is not None:
        _check_capturable_strategy(strategy)


def _check_capturable_strategy(strategy: Strategy) -> None:
    if not isinstance(strategy, SingleDeviceStrategy):
        raise ValueError(
            f"capturable=True runs on one device only (SingleDeviceStrategy), but the strategy is "
            f"{type(strategy).__name__}: distributed steps issue collectives with host-side bookkeeping "
            "that a CUDA graph cannot capture. Use capturable=False"
        )


def _check_one_device(params: Sequence[Tensor], index: int) -> None:
    """A capturable group holds its lr and weight decay on its params' device: there must be one."""
    devices = list(dict.fromkeys(p.device for p in params))
    if len(devices) > 1:
        raise ValueError(
            f"Param group {index} has params on {len(devices)} devices ({', '.join(map(str, devices))}): with "
            "capturable=True every group's params must be on one device (split the group by device)"
        )


def _warn_no_gradients(groups: Sequence[Mapping[str, Any]]) -> None:
    """A step in which none of the optimizer's params has a gradient trains nothing: say so, and why.

    A warning, not an error: torch.optim allows such a step (a closure that skipped a batch,
    torch's own optimizer tests). The usual cause is a model wrapped after the optimizer was
    built (PEFT's ``get_peft_model``, TRL's ``SFTTrainer(peft_config=...)``): the optimizer holds
    the frozen base weights and the new adapter params it never sees.
    """
    params = [p for g in groups for p in g["params"]]
    if not params:
        return
    frozen = sum(not p.requires_grad for p in params)
    warnings.warn(
        f"HybridMuon.step() found no gradient on any of its {len(params)} params, so nothing was trained "
        f"({frozen} of them have requires_grad=False). Likely cause: the model was wrapped or frozen after "
        "the optimizer was built (PEFT get_peft_model, TRL SFTTrainer(peft_config=...) with an optimizer "
        "passed in optimizers=): the optimizer holds the frozen base weights, not the new trainable adapter "
        "params. Build the optimizer from the model that trains (after get_peft_model), or call backward() "
        "before step()",
        RuntimeWarning,
        stacklevel=2,
    )


def _commit_batches(chunks: Iterable[_MuonChunk]) -> Iterator[list[_MuonChunk]]:
    """The chunks of a group to commit together: all of them when they are held (a checked step)
    and their params are fp32 or fp64, so a group's commit is a few ``_foreach`` calls; one at a
    time otherwise (unchecked, a chunk is applied as it comes; a low-precision param is updated
    through an fp32 copy, which one chunk at a time keeps the size of a chunk)."""
    if not isinstance(chunks, list):
        for chunk in chunks:
            yield [chunk]
        return
    if all(p.dtype in (torch.float32, torch.float64) for chunk in chunks for p in chunk.params):
        if chunks:
            yield chunks
        return
    for chunk in chunks:
        yield [chunk]


def _finite_limits(ts: Sequence[Tensor]) -> list[float]:
    """Limits that pass exactly the finite values (:func:`~muonkit.limits.within_flags`)."""
    return [torch.finfo(t.dtype).max for t in ts]


def _check_state_fits(state: Mapping[str, Any], p: Tensor, local: Callable[[Tensor], Tensor], group: int) -> None:
    """A param whose shape or device changed after it got state (or whose grad does not fit it) raises."""
    shape, device = tuple(local(p).shape), p.device
    named = {"grad": cast(Tensor, p.grad)} | {
        k: v for k, v in state.items() if isinstance(v, Tensor) and v.ndim > 0 and k != _ROWS
    }  # NorMuon's row moments are whole on every rank, checked on load
    for key, value in named.items():
        if tuple(local(value).shape) != shape or value.device != device:
            raise ValueError(
                f"A param of shape {tuple(p.shape)} on {device} in param group {group} has a {key} of shape "
                f"{tuple(value.shape)} on {value.device}: a param's shape and device must not change once the "
                "optimizer has state for it (load a state_dict made for the new param, or build a new optimizer)"
            )


def _distributed_initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _dtensors(params: Sequence[Tensor]) -> list[Tensor]:
    module = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor can exist
    return [] if module is None else [p for p in params if isinstance(p, module.DTensor)]


def _local_view(t: Tensor) -> Tensor:
    """The part of ``t`` this rank stores: a DTensor's local shard, any other tensor itself."""
    module = sys.modules.get("torch.distributed.tensor")
    return t.to_local() if module is not None and isinstance(t, module.DTensor) else t


def _tensors_and_names(params: Any, index: int) -> tuple[list[Tensor], list[str] | None]:
    """A group's ``params`` as a list of tensors, and their names if given as ``(name, tensor)`` pairs."""
    if isinstance(params, set):
        raise TypeError("Invalid params: a set has no stable order (state_dict would mismatch); use a list")
    if isinstance(params, Tensor):
        return [params], None
    try:
        items = list(params)
    except TypeError:
        raise TypeError(
            f"Invalid params in param group {index}: expected a tensor or an iterable of tensors, "
            f"got {type(params).__name__}"
        ) from None
    pairs = [isinstance(p, tuple) for p in items]
    if any(pairs) and not all(pairs):  # torch.optim's own message
        raise ValueError("all optimizer params should be with/without names. Some param names are missing")
    names = None
    if items and all(pairs):
        if not all(len(p) == 2 and isinstance(p[0], str) for p in items):
            raise TypeError(f"Invalid params in param group {index}: named params must be (str, tensor) pairs")
        names, items = [p[0] for p in items], [p[1] for p in items]
    for p in items:
        if not isinstance(p, Tensor):
            raise TypeError(
                f"Invalid params in param group {index}: optimizer can only optimize Tensors, "
                f"but one of the params is {torch.typename(p)}"
            )
    return items, names


def _saved_skipped_steps(state_dict: Mapping[str, Any], *, default: int) -> int:
    """``skipped_steps`` of a state dict; one saved before it was kept has none: the current count stays."""
    value = state_dict.get("skipped_steps", default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"Invalid optimizer state: skipped_steps={value!r} must be an int >= 0")
    return value


def _default_algorithm(params: list[Tensor], index: int, *, advice: str) -> str:
    if all(len(full_shape(p)) >= 2 for p in params):
        return "muon"
    raise ValueError(f"Param group {index} has no 'algorithm' and contains tensors with < 2 dims: {advice}")


def _check_keywords(owner: str, unknown: Mapping[str, Any]) -> None:
    """Python's unexpected-keyword TypeError, with the hint a torch user needs (``adjust_lr_fn`` -> ``adjust_lr``)."""
    if unknown:
        key = next(iter(unknown))
        keywords = tuple(inspect.signature(HybridMuon.__init__).parameters)[2:-1]  # not self, params, **unknown
        raise TypeError(f"{owner}() got an unexpected keyword argument {key!r}{key_hint(key, keywords)}")


_SWAPPED_PARAMS = (
    ". add_param_group checked this group, so its params were replaced afterwards: DeepSpeed ZeRO hands "
    "step() flat 1-D partitions. Call muonkit.integrations.deepspeed.install(engine) right after "
    "deepspeed.initialize(optimizer=...), or build the engine with muonkit.integrations.deepspeed.initialize "
    "(the HF Trainer: muonkit.integrations.deepspeed.trainer_setup)"
)
"""Why a Muon group holds a < 2-D tensor at ``step()`` or ``load_state_dict()``."""


def _check_muon_params(
    params: list[Tensor],
    group: Mapping[str, Any],
    index: int,
    *,
    shapes: Sequence[tuple[int, ...]] | None = None,
    hint: str = "; put it in an algorithm='adamw' group",
) -> None:
    """``shapes``: the whole tensors behind ``params`` when they differ (a strategy's ``whole_shapes``).
    ``hint``: the advice after a < 2-D tensor's error."""
    config = cast(MuonConfig, group_config(group, index))
    for shape in [full_shape(p) for p in params] if shapes is None else shapes:
        if len(shape) < 2:
            raise ValueError(
                f"Param group {index} (algorithm={config.algorithm!r}) has a tensor of shape {shape}: "
                f"Muon needs >= 2 dims{hint}"
            )
        try:
            config.layout.blocks(shape)
        except ValueError as e:
            raise ValueError(f"{e} in param group {index}") from None
    _check_ns_dtype(config, params, index)


def _check_ns_dtype(config: MuonConfig, params: Sequence[Tensor], index: int) -> None:
    """fp16 on a CPU is a user error; catch it here, not halfway through a step."""
    if config.ns_dtype == torch.float16 and any(p.device.type == "cpu" for p in params):
        raise ValueError(
            f"Invalid ns_dtype=torch.float16 in param group {index}: fp16 matmul is ~1000x slower on CPU; "
            "use torch.bfloat16 or torch.float32"
        )


def _check_param_state(
    state: Mapping[str, Any] | None,
    p: Tensor,
    algorithm: str,
    group: int,
    index: int,
    *,
    local: Callable[[Tensor], Tensor],
    rows: Callable[[Tensor], int | None] | None = None,
    config: MuonConfig | AdamWConfig | None = None,
) -> None:
    """``local``: the part of a (sharded) state this rank holds, where its values are checked;
    ``rows``: the length of a param's NorMuon row moments; ``config``: the group's settings, which
    bound what a step writes (:func:`_state_bound`)."""
    if not state:
        return
    expected = _STATE_KEYS[algorithm]
    missing = [k for k in expected if k not in state]
    unexpected = sorted(k for k in state if k not in expected)
    if missing or unexpected:
        what = f"lacks {missing}" if missing else f"has keys a {algorithm} group does not keep: {unexpected}"
        raise ValueError(f"Saved state of param {index} (group {group}, {algorithm}) {what}; has {sorted(state)}")
    for key in expected:
        value = state[key]
        if key == "step":
            _check_step(value, group, index)
            continue
        count = rows(p) if key == _ROWS and rows is not None else None
        want = tuple(p.shape) if key != _ROWS else (count,) if count is not None else None
        if not isinstance(value, Tensor) or (tuple(value.shape) != want if want is not None else value.ndim != 1):
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            what = f"needs {want} (one value per matrix row)" if key == _ROWS else f"has {tuple(p.shape)}"
            raise ValueError(f"Saved {key} of param {index} (group {group}) has shape {shape}, the param {what}")
        if not value.is_floating_point():
            raise ValueError(
                f"Saved {key} of param {index} (group {group}) has dtype {value.dtype}: must be floating point"
            )
        bound = _state_bound(key, p, config)
        _check_state_values(value if key == _ROWS else local(value), key, group, index, bound=bound)


def _row_count(p: Tensor, *, whole_shapes: Callable[[Tensor], list[tuple[int, ...]]], layout: Any) -> int | None:
    """The length of ``p``'s NorMuon row moments; None while the whole tensors are not known yet."""
    shapes = whole_shapes(p)
    return sum(normuon_rows(s, layout) for s in shapes) if shapes else None


def _state_bound(key: str, p: Tensor, config: MuonConfig | AdamWConfig | None) -> tuple[float, str]:
    """The largest magnitude a state ``key`` of ``p`` may hold, and why: what a checked step
    writes (:mod:`muonkit.functional.overflow`), so that every state such a step writes loads."""
    dtype = work_dtype(p.dtype)
    if key == "exp_avg" and isinstance(config, AdamWConfig):
        return exp_avg_limit(config, dtype), (
            f"the largest a step writes with eps={config.eps:g} in {dtype} (beyond it the update may overflow)"
        )
    return torch.finfo(dtype).max, f"the largest {dtype} (the state's dtype)"


def _check_state_values(
    value: Tensor, key: str, group: int, index: int, *, bound: tuple[float, str] = (math.inf, "")
) -> None:
    """Non-finite momentum or moments, or a negative second moment, would turn the next step's
    update into NaN (and the params with it); refuse them at load time, and values beyond
    ``bound`` (the largest magnitude allowed, and why), which the state's dtype cannot hold or
    the next step could overflow on."""
    if value.numel() == 0:
        return
    low, high = (float(x) for x in torch.aminmax(value.detach()))  # NaN propagates to both
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError(
            f"Saved {key} of param {index} (group {group}) has non-finite values (min {low:.4g}, max {high:.4g}): "
            "must be finite"
        )
    limit, why = bound
    if max(-low, high) > limit:
        raise ValueError(
            f"Saved {key} of param {index} (group {group}) has values up to {max(-low, high):.4g} in magnitude: "
            f"must be within {limit:.4g}, {why}"
        )
    if key in ("exp_avg_sq", _ROWS) and low < 0:
        raise ValueError(
            f"Saved {key} of param {index} (group {group}) has negative values (min {low:.4g}): must be >= 0"
        )


def _check_step(value: Any, group: int, index: int) -> None:
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex():
        number: Any = value.item()
    else:
        number = value
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not 0 <= number <= _STEP_MAX:
        raise ValueError(
            f"Saved step of param {index} (group {group}) is {value!r}: must be a number >= 0 or a one-element tensor, "
            f"at most {_STEP_MAX:.8g} (the largest float32: the step counter's dtype)"
        )


_STEP_MAX = torch.finfo(torch.float32).max
"""The largest step count a state may hold: AdamW keeps it in float32 (a step at this count stays finite)."""


class Muon(HybridMuon):
    """Pure Muon with ``torch.optim.Muon``'s signature and defaults, also for >= 3D tensors.

    ``adjust_lr_fn`` accepts torch's names (``"original"`` = ``"keller"``, ``"match_rms_adamw"``
    = ``"match_adamw"``) and ours. 3D tensors are batches of matrices (MoE experts), >= 4D are
    flattened to ``(out, in*k...)`` (convs). Like torch's, it takes only tensors with >= 2 dims:
    for a whole model, give it the Muon groups of :func:`muonkit.param_groups` and train the rest
    with an AdamW, or use :class:`HybridMuon`, which does both::

        opt = muonkit.Muon([g for g in muonkit.param_groups(model) if g["algorithm"] == "muon"])
    """

    _for_a_model = (
        "only the >= 2D hidden matrices, e.g. muonkit.Muon([g for g in muonkit.param_groups(model) if "
        "g['algorithm'] == 'muon']) with an AdamW for the rest, or use muonkit.HybridMuon(muonkit.param_groups(model))"
    )

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = TORCH_MUON_DEFAULTS.lr,
        weight_decay: float = TORCH_MUON_DEFAULTS.weight_decay,
        momentum: float = TORCH_MUON_DEFAULTS.momentum,
        nesterov: bool = TORCH_MUON_DEFAULTS.nesterov,
        ns_coefficients: str | Sequence[Sequence[float]] | tuple[float, float, float] = (
            TORCH_MUON_DEFAULTS.ns_coefficients
        ),
        eps: float = TORCH_MUON_DEFAULTS.eps,
        ns_steps: int | None = TORCH_MUON_DEFAULTS.ns_steps,
        adjust_lr_fn: str | None = None,
        **kwargs: Any,
    ) -> None:
        if "adjust_lr" in kwargs:  # HybridMuon's name for it: accepted here too, once
            if adjust_lr_fn is not None:
                raise TypeError(
                    "muonkit.Muon got both adjust_lr_fn and adjust_lr; they are the same setting "
                    "(torch's name and muonkit's): pass one"
                )
            adjust_lr_fn = kwargs.pop("adjust_lr")
        if isinstance(adjust_lr_fn, str | None):
            adjust_lr_fn = TORCH_ADJUST_LR.get(adjust_lr_fn, adjust_lr_fn)
        super().__init__(
            params,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=cast(Sequence[Sequence[float]], ns_coefficients),
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr=adjust_lr_fn,
            **kwargs,
        )

    def _mixed_group_advice(self) -> str:
        return f"muonkit.Muon takes {self._for_a_model}"

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As :meth:`HybridMuon.add_param_group`, for Muon groups only; as in torch.optim.Muon, a
        group may set ``adjust_lr_fn`` (torch's names or ours; muonkit's ``adjust_lr``)."""
        algorithm = param_group.get("algorithm") if isinstance(param_group, Mapping) else None
        if algorithm not in (None, "muon"):
            raise ValueError(
                f"muonkit.Muon takes Muon groups only; param group {len(self.param_groups)} is {algorithm!r}: "
                f"it takes {self._for_a_model}"
            )
        if isinstance(param_group, Mapping) and "adjust_lr_fn" in param_group:
            param_group = _torch_adjust_lr(param_group, len(self.param_groups))
        super().add_param_group(param_group)


def _torch_adjust_lr(group: Mapping[str, Any], index: int) -> dict[str, Any]:
    """``group`` with torch.optim.Muon's ``adjust_lr_fn`` as muonkit's ``adjust_lr`` (:data:`TORCH_ADJUST_LR`)."""
    group = dict(group)
    value = group.pop("adjust_lr_fn")
    if "adjust_lr" in group:
        raise ValueError(
            f"Param group {index} has both adjust_lr_fn and adjust_lr; they are the same setting "
            "(torch's name and muonkit's): give one"
        )
    group["adjust_lr"] = TORCH_ADJUST_LR.get(value, value) if isinstance(value, str | None) else value
    return group


__all__ = ["NONFINITE_CHOICES", "HybridMuon", "Muon"]

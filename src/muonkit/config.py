"""Typed, validated hyperparameters of one param group.

A param group stays a plain dict (that is what ``torch.optim`` and its lr schedulers use); the
optimizer reads it through :func:`group_config`, which validates every value and returns a frozen
dataclass. Every error names the key, the value and what is allowed.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from muonkit.defaults import DEFAULTS, TORCH_MUON_DEFAULTS, Defaults  # noqa: F401 (their home before muonkit.defaults)
from muonkit.functional.coefficients import as_schedule, resolve_preset
from muonkit.functional.lr_scaling import ADJUST_LR_CHOICES
from muonkit.functional.matrices import LAYOUT_KINDS, SPLIT_ALONG, MatrixLayout
from muonkit.functional.muon import NSOptions, once
from muonkit.functional.orthogonalize import METHODS, default_compute_dtype, orthogonalization_flops
from muonkit.functional.quantize import STATE_DTYPES
from muonkit.functional.rules import RULES, rule_keywords, rule_of
from muonkit.functional.update_rule import UpdateRule
from muonkit.functional.validation import eps as _eps
from muonkit.functional.validation import flag as _bool
from muonkit.functional.validation import nonneg as _nonneg
from muonkit.functional.validation import ns_dtype as _ns_dtype
from muonkit.functional.validation import ns_steps as _ns_steps
from muonkit.functional.validation import positive_int as _positive_int
from muonkit.functional.validation import real
from muonkit.functional.validation import unit as _unit

if TYPE_CHECKING:
    from muonkit.state_precision import Codec

MATRIX_ALGORITHMS: tuple[str, ...] = tuple(RULES)
"""The algorithms that orthogonalize, one per update rule (routed alike: >= 2D hidden matrices)."""
ALGORITHMS: tuple[str, ...] = (*MATRIX_ALGORITHMS, "adamw")
MUON_KEYS = (
    "lr", "momentum", "nesterov", "ns_coefficients", "ns_steps", "eps", "weight_decay",
    "adjust_lr", "layout", "split_sizes", "split_along", "ns_dtype", "ns_method", "cautious_wd", "ns_compile",
    "state_dtype",
)  # fmt: skip
RULE_KEYS: dict[str, tuple[str, ...]] = {name: rule.keys(MUON_KEYS) for name, rule in RULES.items()}
"""Each update rule's group keys: Muon's and the rule's own (:attr:`UpdateRule.hyperparameters`)."""
MATRIX_KEYS: tuple[str, ...] = tuple(dict.fromkeys(k for keys in RULE_KEYS.values() for k in keys))
"""Every key a group of some update rule has."""
ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay", "cautious_wd", "state_dtype")
SCHEDULER_KEYS = ("initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum", "swa_lr")
"""Keys torch's lr schedulers and SWA write into param groups (a group copied from a scheduled
optimizer carries them); the step ignores them."""
GROUP_KEYS: tuple[str, ...] = (
    "params",
    "param_names",
    "algorithm",
    *dict.fromkeys(MATRIX_KEYS + ADAMW_KEYS),
    *SCHEDULER_KEYS,
)
"""Every key a param group handed to :class:`muonkit.HybridMuon` may have."""
KEY_ALIASES = {"adjust_lr_fn": "adjust_lr", "beta1": "betas", "beta2": "betas"}  # torch.optim.Muon, AdamW's parts
GROUP_DEFAULT_KEYWORDS = {
    "adamw_lr": ("lr", "adamw"), "adamw_eps": ("eps", "adamw"), "adamw_weight_decay": ("weight_decay", "adamw"),
    **{keyword: (h.key, rule.name) for keyword, (rule, h) in rule_keywords().items()},
}  # fmt: skip
"""HybridMuon's keywords that are the defaults of one algorithm's groups: ``{keyword: (its key in a
group of that algorithm, the algorithm)}``."""
OPTIMIZER_KEYWORDS = ("nonfinite", "capturable", "process_group", "strategy")
"""HybridMuon's keywords that hold for the whole optimizer: no group may set them."""
TORCH_ADJUST_LR = {None: "keller", "original": "keller", "match_rms_adamw": "match_adamw"}
"""torch.optim.Muon's ``adjust_lr_fn`` values as muonkit's ``adjust_lr`` (torch's None is its
``"original"``): :class:`muonkit.Muon` takes them as keyword and as group key."""
ADJUST_LR_ALIASES = {
    "original": ("keller", "torch.optim.Muon"), "match_rms_adamw": ("match_adamw", "torch.optim.Muon"),
    "rms_norm": ("match_adamw", "dion"), "spectral_norm": ("spectral", "dion"),
}  # fmt: skip
# torch.optim options muonkit does not implement (group keys and keys of torch.optim.AdamW state)
TORCH_ONLY_KEYS = ("amsgrad", "maximize", "foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay")


@dataclass(frozen=True)
class MuonConfig:
    """Hyperparameters of a group of one update rule (see :class:`muonkit.HybridMuon` for their meaning).

    ``algorithm`` names the rule (:attr:`rule`, :mod:`muonkit.functional.rules`); ``rule_settings``
    holds the values of the rule's own keys (``(key, value)`` pairs, read by :meth:`setting`). A
    rule may change the default of a key every group has (``eps``, also Newton-Schulz's margin).
    """

    lr: float
    momentum: float
    nesterov: bool
    ns_coefficients: str | tuple[tuple[float, float, float], ...]
    ns_steps: int | None
    eps: float
    weight_decay: float
    adjust_lr: str | None
    layout: MatrixLayout
    ns_dtype: torch.dtype | None
    ns_method: str = "gram"
    cautious_wd: bool = False
    algorithm: str = "muon"
    rule_settings: tuple[tuple[str, Any], ...] = ()
    ns_compile: bool = False
    state_dtype: str = "fp32"

    @once
    def codec(self) -> Codec | None:
        """How the group's states are stored at rest (:mod:`muonkit.state_precision`); None: fp32."""
        from muonkit.state_precision import CODECS  # it reads limits, which reads this module

        return CODECS[self.state_dtype]

    @once
    def rule(self) -> UpdateRule:
        """The group's update rule (looked up once per config: :class:`~muonkit.functional.muon.once`)."""
        return RULES[self.algorithm]

    def setting(self, key: str) -> Any:
        """The value of the rule's own key ``key`` in this group."""
        return dict(self.rule_settings)[key]

    @once
    def ns_options(self) -> NSOptions:
        """The orthogonalization options, made once per config (a steady step reuses its configs);
        made afresh while ``torch.compile`` traces (:class:`~muonkit.functional.muon.once`)."""
        return NSOptions(
            self.ns_coefficients,
            self.ns_steps,
            self.eps,
            self.ns_dtype,
            self.ns_method,
            self.ns_compile,
        )

    def flops(self, rows: int, cols: int, *, device: torch.device | str | None = None) -> int:
        """Matrix-product FLOPs of orthogonalizing one ``rows x cols`` matrix with these settings.

        ``device``: where it runs, which decides the compute dtype when ``ns_dtype`` is None (bf16
        where fast: always the plain iteration; fp32: Gram on wide matrices); None counts fp32.
        """
        dtype = self.ns_dtype
        if dtype is None and device is not None:
            dtype = default_compute_dtype(device)
        return orthogonalization_flops(rows, cols, self.steps, self.ns_method, dtype)

    @once
    def steps(self) -> int:
        """The number of Newton-Schulz steps actually run."""
        return len(self.ns_options.resolved()[0])


@dataclass(frozen=True)
class AdamWConfig:
    """Hyperparameters of an AdamW group."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    cautious_wd: bool = False
    state_dtype: str = "fp32"

    @once
    def codec(self) -> Codec | None:
        """How the group's states are stored at rest (:mod:`muonkit.state_precision`); None: fp32."""
        from muonkit.state_precision import CODECS  # it reads limits, which reads this module

        return CODECS[self.state_dtype]


def group_config(group: Mapping[str, Any], index: int | None = None) -> MuonConfig | AdamWConfig:
    """Validate a param group and return its typed configuration."""
    where = "" if index is None else f" in param group {index}"
    algorithm = group.get("algorithm")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"Invalid algorithm={algorithm!r}{where}: must be one of {ALGORITHMS}")
    try:
        return _adamw_config(group) if algorithm == "adamw" else _muon_config(group, algorithm)
    except ValueError as e:
        raise ValueError(f"{e}{where}") from None


def _muon_config(g: Mapping[str, Any], algorithm: str = "muon") -> MuonConfig:
    rule = rule_of(algorithm)
    for key in g:
        owner = _owner(key)
        if owner is not None and owner is not rule and key not in RULE_KEYS[algorithm]:
            raise ValueError(
                f"Invalid {key}={g[key]!r} in a {rule.title} group: {key} is {owner.title}'s; set algorithm={owner.name!r}"
            )
    ns_coefficients = g["ns_coefficients"]
    ns_steps = _ns_steps("ns_steps", g["ns_steps"])
    resolve_preset(ns_coefficients, steps=ns_steps)  # raises on a bad preset
    if not isinstance(ns_coefficients, str):
        ns_coefficients = as_schedule(ns_coefficients)
    adjust_lr = g["adjust_lr"]
    if adjust_lr not in ADJUST_LR_CHOICES:
        alias = ADJUST_LR_ALIASES.get(adjust_lr) if isinstance(adjust_lr, str) else None
        hint = f" ({alias[1]}'s {adjust_lr!r} is {alias[0]!r} here)" if alias else ""
        raise ValueError(f"Invalid adjust_lr={adjust_lr!r}: must be one of {ADJUST_LR_CHOICES}{hint}")
    layout = g["layout"]
    if layout not in LAYOUT_KINDS:
        raise ValueError(f"Invalid layout={layout!r}: must be one of {LAYOUT_KINDS}")
    split = g["split_sizes"]
    if split is not None and (isinstance(split, str) or not isinstance(split, Sequence)):
        raise ValueError(f"Invalid split_sizes={split!r}: must be None or a non-empty sequence of positive row counts")
    split_sizes = None if split is None else tuple(_positive_int("split_sizes", s) for s in split)
    split_along = g.get("split_along", "rows")  # routing's, per group (a per-head output projection: "cols")
    if split_along not in SPLIT_ALONG:
        raise ValueError(f"Invalid split_along={split_along!r}: must be one of {SPLIT_ALONG}")
    if split_along == "cols" and split_sizes is None:
        raise ValueError("Invalid split_along='cols' with split_sizes=None: a column split needs split_sizes")
    ns_dtype = _ns_dtype("ns_dtype", g["ns_dtype"])
    ns_method = g.get("ns_method", "gram")
    if ns_method not in METHODS:
        raise ValueError(f"Invalid ns_method={ns_method!r}: must be one of {METHODS}")
    return MuonConfig(
        lr=_nonneg("lr", g["lr"]),
        momentum=_muon_momentum(g),
        nesterov=_bool("nesterov", g["nesterov"]),
        ns_coefficients=ns_coefficients,
        ns_steps=ns_steps,
        eps=_eps("eps", g["eps"], kind="newton_schulz"),
        weight_decay=_nonneg("weight_decay", g["weight_decay"]),
        adjust_lr=adjust_lr,
        layout=MatrixLayout(layout, split_sizes, split_along),
        ns_dtype=ns_dtype,
        ns_method=ns_method,
        cautious_wd=_bool("cautious_wd", g.get("cautious_wd", DEFAULTS.cautious_wd)),
        algorithm=algorithm,
        rule_settings=tuple((h.key, h.check(h.key, g[h.key])) for h in rule.hyperparameters if not h.shared),
        ns_compile=_bool("ns_compile", g.get("ns_compile", False)),
        state_dtype=_state_dtype(g),
    )


def _muon_momentum(g: Mapping[str, Any]) -> float:
    """``momentum``; under a torch scheduler that cycles momentum, the ``betas[0]`` it writes.

    ``OneCycleLR`` and ``CyclicLR`` with ``cycle_momentum=True`` write ``betas[0]`` of every group
    (the optimizer has ``betas``) and mark each group with ``base_momentum``: in a Muon group that
    value is Muon's momentum, as it is AdamW's beta1 in an AdamW group.
    """
    betas = g.get("betas")
    if "base_momentum" in g and isinstance(betas, Sequence) and len(betas) == 2:
        return _unit("betas[0] (Muon's momentum, cycled by the lr scheduler)", betas[0])
    return _unit("momentum", g["momentum"])


def _adamw_config(g: Mapping[str, Any]) -> AdamWConfig:
    if "beta2" in g:
        raise ValueError(f"Invalid beta2={g['beta2']!r} in an AdamW group: set betas=(beta1, beta2)")
    betas = g["betas"]
    if not isinstance(betas, Sequence) or len(betas) != 2:
        raise ValueError(f"Invalid betas={betas!r}: must be a pair (beta1, beta2), each in [0, 1)")
    return AdamWConfig(
        lr=_nonneg("lr", g["lr"]),
        beta1=_unit("betas[0]", betas[0]),
        beta2=_unit("betas[1]", betas[1]),
        eps=_eps("eps", g["eps"], kind="adamw"),
        weight_decay=_nonneg("weight_decay", g["weight_decay"]),
        cautious_wd=_bool("cautious_wd", g.get("cautious_wd", DEFAULTS.cautious_wd)),
        state_dtype=_state_dtype(g),
    )


def _state_dtype(g: Mapping[str, Any]) -> str:
    value = g.get("state_dtype", DEFAULTS.state_dtype)
    if value not in STATE_DTYPES:
        raise ValueError(f"Invalid state_dtype={value!r}: must be one of {STATE_DTYPES}")
    return str(value)


def check_group_keys(
    group: Mapping[str, Any], where: str = "", *, allowed: Sequence[str] = GROUP_KEYS, algorithm: Any = None
) -> None:
    """Refuse keys a param group does not know: a typo would otherwise train on the default silently.

    ``where`` completes the message (``" in param group 2"``). The message names the closest known
    key: torch's names (``adjust_lr_fn`` -> ``adjust_lr``), misspellings (``ns_step`` ->
    ``ns_steps``), HybridMuon's keywords by what they are in a group of ``algorithm`` (the
    group's own ``algorithm`` if it has one; None: Muon's, the default).
    """
    unknown = [k for k in group if k not in allowed]
    if unknown:
        key = unknown[0]
        algorithm = group.get("algorithm", algorithm)
        raise ValueError(
            f"Unknown key {key!r}{where}{key_hint(key, allowed, algorithm=algorithm)}: Muon groups take "
            f"{MUON_KEYS}, {_RULES_ALSO}AdamW groups {ADAMW_KEYS}"
        )


_RULES_ALSO = "".join(
    f"{rule.title} groups also {', '.join(repr(k) for k in RULE_KEYS[name][len(MUON_KEYS) :])}, "
    for name, rule in RULES.items()
    if len(RULE_KEYS[name]) > len(MUON_KEYS)
)


def _owner(key: str) -> UpdateRule | None:
    """The update rule whose own key ``key`` is (None: every rule's, or none's)."""
    if key in MUON_KEYS:
        return None
    return next((RULES[name] for name, keys in RULE_KEYS.items() if key in keys), None)


READ_KEYS: dict[str, tuple[str, ...]] = {**RULE_KEYS, "adamw": ADAMW_KEYS}
"""The hyperparameters each algorithm's step reads (besides ``params``, ``param_names``,
``algorithm`` and the :data:`SCHEDULER_KEYS`)."""


def check_read_keys(group: Mapping[str, Any], index: int, *, defaults: Mapping[str, Any]) -> None:
    """Refuse a hyperparameter ``group`` sets that its algorithm never reads: it would be ignored silently.

    ``group`` is what the caller passed (before the optimizer's ``defaults`` fill it in), with its
    ``algorithm`` resolved; ``{"algorithm": "adamw", "ns_steps": 3}`` and ``betas`` in a Muon group
    raise. Two exceptions, both read or harmless: ``betas`` in a Muon group that carries
    ``base_momentum`` (a momentum-cycling scheduler's; its ``betas[0]`` is the Muon momentum), and
    in a group that holds every key of ``defaults`` (one copied whole from an optimizer's
    ``param_groups``, where torch filled them in), unread keys at exactly their value in ``defaults``.
    """
    algorithm = group.get("algorithm")
    reads = READ_KEYS.get(algorithm) if isinstance(algorithm, str) else None
    if reads is None:  # group_config refuses it
        return
    copied = all(k in group for k in defaults)
    for key in group:
        if key in reads or key in ("params", "param_names", "algorithm", *SCHEDULER_KEYS):
            continue
        if key == "betas" and algorithm in MATRIX_ALGORITHMS and "base_momentum" in group:
            continue
        if copied and key in defaults and _same(group[key], defaults[key]):
            continue
        hint = " (a group copied from param_groups may keep it only at the optimizer's default)" if copied else ""
        raise ValueError(
            f"Invalid key {key!r} in param group {index}: {algorithm!r} groups never read it, so it would be "
            f"ignored{hint}; {algorithm!r} groups read {reads}"
        )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    try:
        return type(a) is type(b) and bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # an odd value's __eq__ or __bool__: not the default
        return False


def key_hint(key: Any, allowed: Sequence[str], *, algorithm: Any = None) -> str:
    """`` (did you mean 'adjust_lr'?)`` and the like for an unknown ``key``, or ``""``; ``algorithm``:
    the group's, for the keywords that set one algorithm's groups (None: a Muon group's)."""
    if not isinstance(key, str):
        return ""
    if key in OPTIMIZER_KEYWORDS and key not in allowed:
        return f" ({key} is an optimizer keyword, not a group key: HybridMuon(..., {key}=...) sets it for every group)"
    if key in GROUP_DEFAULT_KEYWORDS and key not in allowed:
        name, owner = GROUP_DEFAULT_KEYWORDS[key]
        if algorithm == owner and name in allowed:
            return f" (did you mean {name!r}?)"
        here = f"an {algorithm!r}" if algorithm == "adamw" else f"a {algorithm or 'muon'!r}"
        return (
            f" ({key} is HybridMuon's default for {owner!r} groups, not a group key: a group with "
            f"algorithm={owner!r} sets it as {name!r}; {name!r} in {here} group would set that group's own {name})"
        )
    if key in TORCH_ONLY_KEYS:
        return f" (torch.optim's {key} option is not supported)"
    if key in KEY_ALIASES and KEY_ALIASES[key] in allowed:
        return f" (did you mean {KEY_ALIASES[key]!r}?)"
    if key in MATRIX_KEYS + ADAMW_KEYS:  # allowed elsewhere: muon_options={"betas": ...}
        rule = _owner(key)
        owner = "a Muon" if key in MUON_KEYS else f"a {rule.title}" if rule is not None else "an AdamW"
        return f" ({key!r} is {owner} setting)"
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def plain_hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``group`` with its numbers as Python ints and floats (numpy scalars, ``Decimal``...).

    So that ``state_dict()`` holds plain values (``torch.load(weights_only=True)`` refuses numpy
    scalars). Tensors (a tensor lr a scheduler updates in place) and non-numbers stay as they are.
    """
    out = dict(group)
    for key in (
        "lr",
        "momentum",
        "eps",
        "weight_decay",
        "ns_steps",
        "betas",
        "split_sizes",
        "ns_coefficients",
        *(h.key for rule in RULES.values() for h in rule.hyperparameters),
    ):
        if key in out:
            out[key] = _plain(out[key])
    return out


def _plain(value: Any) -> Any:
    if type(value) in (list, tuple):
        return type(value)(_plain(v) for v in value)
    if type(value) in (bool, int, float) or isinstance(value, torch.Tensor) or (number := real(value)) is None:
        return value
    return number  # np.float64 is a float subclass, but not one torch.load(weights_only=True) accepts

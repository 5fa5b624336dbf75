"""Every optimizer-wide keyword of :class:`muonkit.HybridMuon`, its default and its documentation, once.

A keyword is one field of :class:`Defaults`: its default, what it sets (``what``) and why the
default is what it is (``why``). Everything else is derived from these fields: the optimizer's
signature is checked against them (``tests/contract/test_defaults.py``), the DeepSpeed config's keys
(:class:`muonkit.integrations.deepspeed_config.MuonkitOptions`) and torchtitan's ``Config`` get a
field per keyword (:func:`with_default_fields`), the Hugging Face ``make_optimizer`` passes them
on, and the docs' tables are generated from them (``python -m muonkit._doc_tables``).
Param groups never copy a default: a group key overrides the optimizer's default only where the
caller set it.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Collection
from dataclasses import MISSING, dataclass, field, fields, make_dataclass
from typing import Any, Literal, TypeVar

import torch

from muonkit.functional.coefficients import KELLER
from muonkit.functional.rules import rule_keywords


def _setting(default: Any, *, what: str, why: str = "", shown: str = "") -> Any:
    """A :class:`Defaults` field: ``what`` it sets, ``why`` this default (the docs' column), and
    what the docs show (``shown``) after the default (``None`` means the preset's 5 steps...)."""
    return field(default=default, metadata={"what": what, "why": why, "shown": shown})


@dataclass(frozen=True)
class _Settings:
    """The optimizer-wide keywords of the optimizer itself; :class:`Defaults` adds the update rules'."""

    lr: float = _setting(
        0.02,
        what="Muon learning rate (hidden matrices)",
        why='Keller Jordan\'s tuned NanoGPT value for Muon with `adjust_lr="keller"`; trains small and mid-size '
        "transformers out of the box (torch.optim.Muon's 1e-3 gives tiny updates)",
    )
    momentum: float = _setting(
        0.95, what="Muon momentum (EMA form)", why="the value every reference implementation uses"
    )
    nesterov: bool = _setting(
        True, what="Nesterov blend of gradient and momentum", why="as Keller, torch, Moonlight and DeepSpeed"
    )
    ns_coefficients: str | tuple[Any, ...] = _setting(
        "polar_express",  # a preset, (a, b, c) or ((a, b, c), ...)
        what='Newton-Schulz coefficients: "polar_express", "keller", "you" or `[[a, b, c], ...]`',
        why="a tighter singular-value band than Keller's tuple for the same 5 steps (table above)",
    )
    ns_steps: int | None = _setting(None, what="Newton-Schulz steps; null = the preset's 5", shown="(the preset's 5)")
    eps: float = _setting(
        1e-7,
        what="norm epsilon: the relative margin in Newton-Schulz's normalization",
        why="relative margin in the normalization, in (0, 0.01]; keeps an all-zero update at zero; in that range "
        "every preset keeps its band (a larger eps raises: Polar Express leaves its band from 0.1, and 1e30 shrank "
        "results to ~1e-28)",
    )
    weight_decay: float = _setting(
        0.0,
        what="Muon decoupled weight decay",
        why="decoupled, applied with the unscaled `lr`; as Keller's runs (use 0.01-0.1 for long runs)",
    )
    adjust_lr: str | None = _setting(
        "keller",
        what='lr shape scale: "keller", "match_adamw", "spectral" or null',
        why='`sqrt(max(1, out/in))` (Keller, torch `"original"`, DeepSpeed); `"match_adamw"` = '
        '`0.2·sqrt(max(out, in))` (Moonlight, torch `"match_rms_adamw"`) to reuse AdamW\'s lr and weight decay; '
        '`"spectral"` = `sqrt(out/in)` (dion); `None` = 1',
    )
    layout: str = _setting(
        "auto",
        what="how a tensor becomes matrices",
        why="2D: `matrix`; 3D: `experts`; >= 4D: `flatten`; also `transposed` (GPT-2 Conv1D)",
    )
    split_sizes: tuple[int, ...] | None = _setting(
        None,
        what="row blocks orthogonalized separately",
        why="row blocks orthogonalized separately (a fused QKV weight)",
    )
    ns_dtype: torch.dtype | None = _setting(  # noqa: RUF009 (a field(), as every other)
        None,
        what="Newton-Schulz compute dtype; null = bf16 where fast, else fp32",
        why="`torch.float32`/`float64` for exactness; fp16 only on GPUs",
        shown="(bf16 where fast, else fp32)",
    )
    ns_method: str = _setting(
        "gram",
        what='"gram" (Gram iteration where the aspect ratio is >= 2, in fp32/fp64 compute) or "newton_schulz"',
        why="Gram iteration where the aspect ratio is >= 2 and the compute dtype is fp32/fp64 (the same polynomial, "
        "fewer FLOPs), plain Newton-Schulz otherwise (bf16/fp16 included: Gram is not stable there); "
        '`"newton_schulz"` always iterates on `X` (torch.optim.Muon\'s way)',
    )
    adamw_lr: float = _setting(
        3e-4,
        what="AdamW learning rate (embeddings, heads, norms, biases, routers)",
        why="the usual AdamW lr for the embeddings, head and gains of a small transformer",
    )
    betas: tuple[float, float] = _setting((0.9, 0.95), what="AdamW betas", why="the usual LLM setting")
    adamw_eps: float = _setting(1e-8, what="AdamW epsilon", why="torch's AdamW default")
    adamw_weight_decay: float = _setting(
        0.0,
        what="AdamW decoupled weight decay",
        why="AdamW groups hold embeddings, norms and biases, normally not decayed",
    )
    nonfinite: Literal["skip", "raise", "unchecked"] = _setting(
        "skip", what='"skip", "raise", "unchecked" (DeepSpeed\'s own overflow check runs first)', why="see below"
    )
    cautious_wd: bool = _setting(
        False,
        what="decay only where the update and the weight agree in sign",
        why="decay only where the update and the weight agree in sign (every group)",
    )
    state_dtype: str = _setting(
        "fp32",
        what='how states are kept at rest: "fp32", "bf16" (stochastic rounding) or "8bit" (blockwise fp8 codes)',
        why='`"fp32"`: the reference (fp64 for fp64 params); `"bf16"` halves the state, `"8bit"` keeps ~1/4 of it '
        "(Muon momentum, NorMuon's row moments, AdamW's moments); every group, or per group",
    )
    capturable: bool = _setting(
        False,
        what="lr and weight decay as device tensors: no host read in step() (one device, unchecked)",
        why="`True`: lr and weight decay as 0-dim device tensors, AdamW steps and bias corrections on the device: "
        "no host read in `step()` on accelerators, one compiled graph across lr schedules, CUDA graphs; needs "
        '`nonfinite="unchecked"` and one device',
    )
    ns_compile: bool = _setting(
        False,
        what="run the Newton-Schulz iteration through `torch.compile` (fullgraph)",
        why="`True`: Newton-Schulz through `torch.compile` (inductor), the same results; eager under "
        "`TORCH_COMPILE_DISABLE=1`",
    )


_RULES_AFTER = "nonfinite"
"""The update rules' keywords (:mod:`muonkit.functional.rules`) follow this one, in registry order."""


def _with_rule_keywords() -> type:
    """:class:`_Settings`' fields with every update rule's keywords, as one frozen dataclass."""
    hints = typing.get_type_hints(_Settings)
    own = [(f.name, hints[f.name], field(default=f.default, metadata=f.metadata)) for f in fields(_Settings)]
    at = [name for name, _, _ in own].index(_RULES_AFTER) + 1
    added = [
        (keyword, type(h.default), _setting(h.default, what=h.what, why=h.why))
        for keyword, (_, h) in rule_keywords().items()
    ]
    return make_dataclass(
        "Defaults",
        own[:at] + added + own[at:],
        frozen=True,
        namespace={
            "__module__": __name__,
            "__doc__": """The defaults of every hyperparameter, in one place.

    :class:`muonkit.HybridMuon`'s keywords, the DeepSpeed config reader
    (:mod:`muonkit.integrations.deepspeed_config`), the Hugging Face ``make_optimizer``,
    torchtitan's container and the docs' table all take their values from :data:`DEFAULTS`;
    :class:`muonkit.Muon` from :data:`TORCH_MUON_DEFAULTS` (torch.optim.Muon's). The fields are
    :class:`_Settings`' and, after ``nonfinite``, each update rule's keywords
    (:class:`muonkit.functional.update_rule.Hyperparameter`).
    """,
        },
    )


Defaults: Any = _with_rule_keywords()
"""The type of :data:`DEFAULTS`: one field per optimizer-wide keyword."""
DEFAULTS = Defaults()
""":class:`muonkit.HybridMuon`'s defaults."""
TORCH_MUON_DEFAULTS = Defaults(lr=1e-3, weight_decay=0.1, ns_coefficients=KELLER.steps[0], ns_steps=5)
""":class:`muonkit.Muon`'s: torch.optim.Muon's (Keller's tuple 5 times, ``adjust_lr_fn=None`` = ``"keller"``)."""

T = TypeVar("T", bound=type)


def with_default_fields(*, leave_out: Collection[str] = ()) -> typing.Callable[[T], T]:
    """A class decorator, below ``@dataclass``: one field per :class:`Defaults` field but ``leave_out``.

    Each field takes the keyword's name, type, default and documentation (``metadata``), in
    :class:`Defaults`' order, before the class's own fields; a field the class declares itself
    keeps its own type and default in that place (the DeepSpeed config names ``ns_dtype`` by a
    string). So a keyword added to :class:`Defaults` reaches every configuration built this way.
    """

    def add(cls: T) -> T:
        own = dict(inspect.get_annotations(cls))
        hints = typing.get_type_hints(Defaults)
        added = [f for f in fields(Defaults) if f.name not in leave_out]
        cls.__annotations__ = {**{f.name: own.get(f.name, hints[f.name]) for f in added}, **own}
        for f in added:
            if f.name not in own:
                assert f.default is not MISSING  # every keyword has a default
                setattr(cls, f.name, field(default=f.default, metadata=f.metadata))
        return cls

    return add

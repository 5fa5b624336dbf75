"""The math of muonkit: pure functions on plain local tensors (no process groups, no DTensor)."""

from muonkit.functional.adamw import adamw_
from muonkit.functional.coefficients import PRESETS, Preset, resolve_preset
from muonkit.functional.lr_scaling import ADJUST_LR_CHOICES, lr_scale
from muonkit.functional.matrices import MatrixBlock, MatrixLayout
from muonkit.functional.muon import (
    NSOptions,
    cautious_decay_,
    momentum_,
    muon_apply_,
    muon_directions,
    muon_momentum_,
    muon_update,
    rule_directions,
)
from muonkit.functional.orthogonalize import default_compute_dtype, orthogonalization_flops, orthogonalize

__all__ = [
    "ADJUST_LR_CHOICES",
    "PRESETS",
    "MatrixBlock",
    "MatrixLayout",
    "NSOptions",
    "Preset",
    "adamw_",
    "cautious_decay_",
    "default_compute_dtype",
    "lr_scale",
    "momentum_",
    "muon_apply_",
    "muon_directions",
    "muon_momentum_",
    "muon_update",
    "orthogonalization_flops",
    "orthogonalize",
    "resolve_preset",
    "rule_directions",
]

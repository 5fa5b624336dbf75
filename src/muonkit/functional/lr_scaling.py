"""Shape-dependent learning-rate scale for Muon updates.

The orthogonalized update of a ``rows x cols`` matrix has unit singular values, so its RMS is
``1/sqrt(max(rows, cols))``-ish and its effect depends on the shape. The conventions, named by
what they compute (``rows`` = out features, ``cols`` = in features):

=================  =============================  ==========================================
name               scale                          used by
=================  =============================  ==========================================
``"keller"``       ``sqrt(max(1, rows/cols))``    Keller Jordan, torch ``"original"``, DeepSpeed
``"match_adamw"``  ``0.2 * sqrt(max(rows, cols))`` Moonlight, torch ``"match_rms_adamw"``, dion
                                                  ``"rms_norm"``: reuse AdamW's lr and wd
``"spectral"``     ``sqrt(rows/cols)``            dion ``"spectral_norm"``
``None``           ``1``
=================  =============================  ==========================================
"""

from __future__ import annotations

import math

ADJUST_LR_CHOICES: tuple[str | None, ...] = ("keller", "match_adamw", "spectral", None)


def lr_scale(adjust_lr: str | None, rows: int, cols: int) -> float:
    """The factor the learning rate is multiplied by for a ``rows x cols`` matrix."""
    if adjust_lr == "keller":
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr == "match_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr == "spectral":
        return math.sqrt(rows / cols)
    if adjust_lr is None:
        return 1.0
    raise ValueError(f"Invalid adjust_lr={adjust_lr!r}: must be one of {ADJUST_LR_CHOICES}")

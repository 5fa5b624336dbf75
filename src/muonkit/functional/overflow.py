r"""How large a gradient (or a param) may be for a step to write only finite values.

A step writes momentum (every Muon update rule), ``exp_avg`` and ``exp_avg_sq`` (AdamW), an update
rule's row states, step counts and the params. Each is finite after the step if the step's inputs are
finite and within the limits below; the checked step (``nonfinite="skip"`` or ``"raise"``)
compares each gradient's largest magnitude with its limit in the same max-abs pass that finds
infs and NaNs, so a step that would overflow anything is skipped (or raised) like one with a
non-finite gradient, and a state :meth:`~muonkit.HybridMuon.load_state_dict` accepts stays one
it accepts. Every limit is exact for the worst finite state a checkpoint may hold.

Notation, for the dtype ``d`` an operation rounds to: ``p`` significand bits (24 fp32, 53 fp64,
8 bf16, 11 fp16), ``F = (2 - 2^(1-p)) 2^E`` the largest finite value, ``u = 2^-p`` the unit
roundoff, ``H = 2^(E-p)`` half an ulp of ``F`` (fp32: ``2^103``, about 1.0e31; fp64 ``2^970``;
bf16 ``2^119``) and ``Ω = F + H``. Round-to-nearest (ties to even) is monotone, gives
``|fl(x)| <= (1 + u)|x|`` for normal results, and rounds ``x`` to a finite value exactly when
``|x| < Ω`` (``F`` has an odd significand, so ``Ω`` rounds up to inf).

**Lemma (lerp stays between its ends).** torch's ``lerp(a, b, w)`` for finite ``a``, ``b`` with
``|b - a| < Ω`` and ``w`` in [0, 1] computes ``a + w (b - a)`` for ``w < 1/2`` and ``b - (b - a)(1 - w)``
otherwise (``1 - w`` is exact there, Sterbenz), each product and sum rounded or fused; its
result lies between ``a`` and ``b``. For ``a <= b``: ``δ = fl(b - a)`` is finite and
``fl(w δ) <= (1 + u)^2 (b - a) / 2 <= b - a``, so ``a <= a + fl(w δ) <= b`` and, ``a`` and ``b``
being representable, rounding keeps the sum in ``[a, b]``; the other branch and ``a > b`` are
symmetric.

**Momentum** (every Muon update rule's ``M <- lerp(M, G, 1 - β)``, Nesterov ``U = lerp(G, M, β)``;
AdamW ``exp_avg`` alike): for every finite ``M``, the new ``M`` and ``U`` are finite iff
``|G| < H``: then ``|G - M| < H + F = Ω`` and the lemma bounds both by ``max(|M|, |G|)``; at
``G = H``, ``M = -F`` the difference is ``Ω``, inf. :func:`momentum_limit` is the largest
value below ``H``: fp32 ``2^103 (1 - 2^-24)``. Since ``U`` is finite, so is its orthogonalization
with a preset's bounded schedule (:func:`muonkit.functional.coefficients.is_preset_schedule`).
An update rule's row states are finite likewise (each rule's module says why).

**AdamW** (``v <- fl(fl(b v) + c g g)``, ``b = fl(β2)``, ``c = fl(1 - β2)`` as the kernels round
their scalars, the product ``c g g`` in any order or fused): for every finite ``v >= 0``,
``fl(b v) <= A = fl(b F)`` and ``c g g`` carries at most two roundings, so the sum is below
``A + (1 + u)^2 c g^2``; it is finite if that is below ``Ω`` and ``g g`` itself is (``c <= 1``).
:func:`adamw_gradient_limit` is the largest ``g`` with ``g^2 < min(Ω, (Ω - A) / ((1 + u)^2 c))``,
within ``2u`` of the exact threshold for the worst state (``v = F``): about ``2^64 = 1.84e19``
in fp32 for any ``β2`` (CUDA's foreach ``addcmul`` squares ``g`` first; the CPU kernel
multiplies by ``c`` first, which overflows later). It is also at most
:func:`adamw_exp_avg_limit`, the largest ``|exp_avg|`` a step writes and a checkpoint may hold:
``fl(m / (sqrt(v̂) + eps))`` (the update's quotient, ``denominator >= fl(eps)``) is then finite.

**Params** (``W <- fl(W f) - δ`` with ``f = fl(1 - lr wd)`` and an update ``δ``, computed in the
work dtype ``w``, fp32 for bf16 and fp16 params, then rounded to the param's dtype): with
``|f| <= 1`` and ``|δ|`` below the param dtype's ``H`` (less an ulp of the work dtype when the
param dtype is narrower), no finite ``W`` can overflow: :func:`param_limit` returns None and the
step reads no param. Otherwise it returns the largest ``|W|`` that cannot (negative when none
can), and the checked step compares the group's params with it too. ``|δ|`` is bounded by
:func:`muon_update_bound` (``lr`` times the direction's largest entry: its largest singular value
times the lr shape scale, times the update rule's
:attr:`~muonkit.functional.update_rule.UpdateRule.direction_factor` where it changes the
orthogonalized matrix) and :func:`adamw_update_bound`
(``lr / (1 - β1) * exp_avg_limit / fl(eps)``). At lr 0.02, weight decay <= 2 / lr and eps 1e-8
that is some 24 orders of magnitude below what could overflow fp32: the params are compared only
in groups whose settings are far outside what trains.

Example::

    >>> import torch
    >>> from muonkit.functional.overflow import adamw_gradient_limit, momentum_limit
    >>> momentum_limit(torch.float32) == 2.0**103 * (1 - 2.0**-24)
    True
    >>> 1.8e19 < adamw_gradient_limit(beta2=0.95, eps=1e-8, state_dtype=torch.float32) < 2.0**64
    True
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import torch

__all__ = [
    "adamw_exp_avg_limit",
    "adamw_gradient_limit",
    "adamw_update_bound",
    "largest_below",
    "momentum_limit",
    "muon_update_bound",
    "param_limit",
    "round_down",
]

NEVER = -1.0
"""A limit no magnitude meets: the settings overflow whatever the value."""


def _bits(dtype: torch.dtype) -> int:
    """Significand bits ``p`` (the implicit one included)."""
    return round(-math.log2(torch.finfo(dtype).eps)) + 1


def _largest(dtype: torch.dtype) -> Fraction:
    return Fraction(torch.finfo(dtype).max)


def _half_ulp_of_largest(dtype: torch.dtype) -> Fraction:
    """``H = 2^(E - p)``: half an ulp of the largest finite value."""
    exponent = math.frexp(torch.finfo(dtype).max)[1] - 1
    return Fraction(2) ** (exponent - _bits(dtype))


def _overflow(dtype: torch.dtype) -> Fraction:
    """``Ω``: the smallest magnitude that rounds to inf."""
    return _largest(dtype) + _half_ulp_of_largest(dtype)


def _unit(dtype: torch.dtype) -> Fraction:
    return Fraction(1, 2 ** _bits(dtype))


def _round(x: float, dtype: torch.dtype) -> Fraction:
    """``x`` rounded to ``dtype`` as a kernel rounds a scalar argument (to nearest)."""
    return Fraction(torch.tensor(x, dtype=torch.float64).to(dtype).item())


def round_down(x: Fraction | float, dtype: torch.dtype) -> float:
    """The largest value of ``dtype`` that is ``<= x`` (``x >= 0``), at most its largest finite
    value; 0.0 below its smallest normal value, :data:`NEVER` for ``x < 0``."""
    x = Fraction(x)
    info = torch.finfo(dtype)
    if x < 0:
        return NEVER
    if x >= Fraction(info.max):
        return info.max
    if x < Fraction(info.tiny):
        return 0.0
    exponent = x.numerator.bit_length() - x.denominator.bit_length()
    if Fraction(2) ** exponent > x:
        exponent -= 1
    step = Fraction(2) ** (exponent - _bits(dtype) + 1)  # the ulp at x
    return float(math.floor(x / step) * step)


def largest_below(x: Fraction | float, dtype: torch.dtype) -> float:
    """The largest value of ``dtype`` strictly below ``x`` (see :func:`round_down`)."""
    y = round_down(x, dtype)
    return round_down(Fraction(y) * (1 - Fraction(1, 2**60)), dtype) if y != NEVER and Fraction(y) >= x else y


def _sqrt_below(x: Fraction) -> Fraction:
    """A value at most ``sqrt(x)`` and within 2^-200 of it, relative (x > 0)."""
    scale = 2**400
    return Fraction(math.isqrt(math.floor(x * scale * scale)), scale)


@functools.cache
def momentum_limit(dtype: torch.dtype) -> float:
    """The largest ``|G|`` (a ``dtype`` value) for which ``lerp(M, G, w)`` and ``lerp(G, M, w)``
    are finite for every finite ``M`` of ``dtype``: just below ``H`` (module docstring)."""
    return largest_below(_half_ulp_of_largest(dtype), dtype)


@functools.cache
def adamw_exp_avg_limit(*, eps: float, state_dtype: torch.dtype) -> float:
    """The largest ``|exp_avg|`` an AdamW step writes or a checkpoint may hold: below
    ``sqrt(Ω)`` (so that gradients up to it square to a finite value) and below ``fl(eps) Ω``
    (so that ``m / denominator`` is finite)."""
    omega = _overflow(state_dtype)
    square = largest_below(_sqrt_below(omega), state_dtype)
    eps_rounded = _round(eps, state_dtype)
    quotient = largest_below(eps_rounded * omega, state_dtype) if eps_rounded > 0 else NEVER
    return min(square, quotient)


@functools.cache
def adamw_gradient_limit(*, beta2: float, eps: float, state_dtype: torch.dtype) -> float:
    """The largest ``|g|`` for which AdamW's new ``exp_avg_sq`` is finite whatever the finite
    old one, capped at :func:`adamw_exp_avg_limit` (module docstring)."""
    b, c = _round(beta2, state_dtype), _round(1.0 - beta2, state_dtype)
    largest, omega, u = _largest(state_dtype), _overflow(state_dtype), _unit(state_dtype)
    decayed = Fraction((torch.tensor(float(b), dtype=state_dtype) * float(largest)).item())  # fl(b F), as the kernel
    bound = min(omega, (omega - decayed) / ((1 + u) ** 2 * c))
    squares = largest_below(_sqrt_below(bound), state_dtype)  # squares**2 < bound
    return min(squares, adamw_exp_avg_limit(eps=eps, state_dtype=state_dtype))


def muon_update_bound(*, lr: float, top: float, scale: float, factor: float = 1.0) -> float:
    """A bound on ``|lr * D|`` entrywise, ``D`` a Muon direction (``scale`` times an orthogonalized
    matrix whose singular values are at most ``top``: its entries are too), times ``factor``: an
    update rule's bound on what it does after the orthogonalization (1 for Muon). Twice that, for
    the rounding of the iteration in a low-precision compute dtype."""
    return 2.0 * lr * top * scale * factor


def adamw_update_bound(*, lr: float, beta1: float, eps: float, state_dtype: torch.dtype) -> float:
    """A bound on ``|lr / (1 - β1^t) * m / (sqrt(v̂) + eps)|`` and on ``|lr / (1 - β1^t) * m|`` (the
    CPU kernel's first product) over ``t >= 1``, ``|m| <=`` :func:`adamw_exp_avg_limit`: the
    denominator is at least ``fl(eps)``; 5 roundings of ``(1 + u)`` cover the step size's and the
    kernel's. Infinite where the quotient can overflow in ``state_dtype``."""
    m = Fraction(adamw_exp_avg_limit(eps=eps, state_dtype=state_dtype))
    eps_rounded = _round(eps, state_dtype)
    if eps_rounded <= 0 or m < 0:
        return math.inf
    step = Fraction(lr) / (1 - Fraction(beta1)) * (1 + _unit(state_dtype)) ** 5
    bound = step * m * max(Fraction(1), 1 / eps_rounded)
    return math.inf if bound >= _overflow(state_dtype) else float(bound)


@functools.cache
def param_limit(
    *, lr: float, weight_decay: float, update: float, param_dtype: torch.dtype, work_dtype: torch.dtype
) -> float | None:
    """The largest ``|W|`` for which ``fl(W * fl(1 - lr*wd)) - δ``, ``|δ| <= update``, computed in
    ``work_dtype`` and rounded to ``param_dtype``, is finite; None when every finite ``W`` is
    (the usual case), :data:`NEVER` when none is."""
    factor = _round(1.0 - lr * weight_decay, work_dtype) if math.isfinite(1.0 - lr * weight_decay) else None
    if factor is None or abs(factor) >= _overflow(work_dtype) or not math.isfinite(update):
        return NEVER
    u = _unit(work_dtype)
    ceiling = _overflow(param_dtype)
    if param_dtype != work_dtype:  # a wider work dtype rounds first: stay an ulp of it below Ω
        ceiling -= Fraction(2) ** (math.frexp(float(ceiling))[1] - _bits(work_dtype))
    room = ceiling - Fraction(update) * (1 + u)
    grows = abs(factor) * (1 + u) if abs(factor) > 1 else Fraction(1)
    if room / grows > _largest(param_dtype):
        return None
    return largest_below(room / grows, param_dtype) if room > 0 else NEVER

"""The Muon update on whole tensors: momentum, orthogonalize (batched by shape), scale, apply.

Momentum, one fp32 buffer per parameter, EMA form::

    M <- beta * M + (1 - beta) * G
    U <- (1 - beta) * G + beta * M     if nesterov  (G.lerp(M, beta))
    U <- M                             otherwise

:func:`muon_update` computes ``U`` without touching ``M`` and :func:`momentum_` then commits
``M``: the two halves of :func:`muon_momentum_`, bit for bit, for a step that decides whether to
apply only once every update is known.

Given the momentum updates ``U`` of whole parameter tensors, :func:`muon_directions` returns
``O = orthogonalize(U)`` per matrix block, with every block of the same ``(rows, cols)`` across
all tensors stacked into one batched call. The lr shape scale is applied once, at the update:
:func:`scale_` makes ``D = scale(rows, cols) * O`` in ``O``'s dtype (each tensor's scale a number,
or per element where ``split_sizes`` blocks differ: :func:`tensor_scale`), and
:func:`muon_apply_` then does

    W <- W * (1 - lr * wd)      # decoupled, with the unscaled lr
    W <- W - lr * D
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar, overload

import torch
from torch import Tensor

from muonkit.functional.coefficients import is_preset_schedule
from muonkit.functional.lr_scaling import lr_scale
from muonkit.functional.matrices import MatrixLayout
from muonkit.functional.orthogonalize import orthogonalize, orthogonalize_resolved, resolved_options

if TYPE_CHECKING:  # no import edge: update_rule imports this module
    from muonkit.functional.update_rule import RuleSettings, UpdateRule


def muon_momentum_(buffers: list[Tensor], grads: list[Tensor], *, momentum: float, nesterov: bool) -> list[Tensor]:
    """Update ``buffers`` in place and return the updates ``U`` (new fp32 tensors).

    ``grads`` are never modified. Buffers may be fp32 while grads are bf16.
    """
    if not buffers:
        return []
    grads32 = _like_buffers(grads, buffers)
    torch._foreach_lerp_(buffers, grads32, 1.0 - momentum)
    if nesterov:
        return list(torch._foreach_lerp(grads32, buffers, momentum))
    return [b.clone() for b in buffers]


def muon_update(buffers: list[Tensor], grads: list[Tensor], *, momentum: float, nesterov: bool) -> list[Tensor]:
    """The updates ``U`` :func:`muon_momentum_` would return, as new tensors; ``buffers`` unchanged.

    One or two ``_foreach`` calls for the whole list (a few kernel launches, not two per
    tensor); the scratch beyond the results is the list's new momentum, held while ``U`` is
    computed from it (nesterov), so callers bound it by the size of the lists they pass.
    """
    if not buffers:
        return []
    grads32 = _like_buffers(grads, buffers)
    new = torch._foreach_lerp(buffers, grads32, 1.0 - momentum)  # what lerp_ writes, out of place
    return list(torch._foreach_lerp(grads32, new, momentum)) if nesterov else list(new)


def momentum_(buffers: list[Tensor], grads: list[Tensor], *, momentum: float) -> None:
    """``M <- beta * M + (1 - beta) * G`` in place: the buffers :func:`muon_momentum_` leaves."""
    if buffers:
        torch._foreach_lerp_(buffers, _like_buffers(grads, buffers), 1.0 - momentum)


def where_(targets: Sequence[Tensor], values: Sequence[Tensor], ok: Tensor) -> None:
    """``targets <- values`` where the 0-dim bool ``ok`` is true, else unchanged, bit for bit either
    way (a NaN in ``values`` never leaks into a target it does not replace); no host read."""
    for t, v in zip(targets, values, strict=True):
        torch.where(ok, v if v.dtype == t.dtype else v.to(t.dtype), t, out=t)


def momentum_masked_(buffers: list[Tensor], grads: list[Tensor], *, momentum: float, ok: Tensor) -> None:
    """:func:`momentum_` where the device flag ``ok`` is true, else nothing (one chunk's new buffers as scratch)."""
    if buffers:
        where_(buffers, torch._foreach_lerp(buffers, _like_buffers(grads, buffers), 1.0 - momentum), ok)


def muon_apply_masked_(
    params: Sequence[Tensor],
    directions: Sequence[Tensor],
    *,
    ok: Tensor,
    lr: float | Tensor,
    weight_decay: float | Tensor,
    cautious_wd: bool = False,
) -> None:
    """:func:`muon_apply_` where the device flag ``ok`` is true, else nothing: the same operations (the
    same rounding, bit for bit), the first of them out of place, so that the new values are new
    tensors without a copy of ``params`` first; then :func:`where_`."""
    if params:
        where_(params, _applied(params, directions, lr=lr, weight_decay=weight_decay, cautious_wd=cautious_wd), ok)


def _like_buffers(grads: list[Tensor], buffers: list[Tensor]) -> list[Tensor]:
    return [g if g.dtype == b.dtype else g.to(b.dtype) for g, b in zip(grads, buffers, strict=True)]


T = TypeVar("T")
Owner = TypeVar("Owner")


class once(Generic[Owner, T]):
    """A read-only property made at its first read and kept in the object's ``__dict__``, so a later
    read runs no code at all (the object may be a frozen dataclass: a value derived from its fields).

    Made afresh while ``torch.compile`` traces (no cache for it to guard on;
    ``functools.cached_property`` takes a lock that dynamo cannot enter).
    """

    def __init__(self, make: Callable[[Owner], T]) -> None:
        self.make = make
        self.name = make.__name__
        self.__doc__ = make.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> once[Owner, T]: ...

    @overload
    def __get__(self, obj: Owner, owner: type | None = None) -> T: ...

    def __get__(self, obj: Owner | None, owner: type | None = None) -> T | once[Owner, T]:
        if obj is None:
            return self
        value = self.make(obj)
        if not torch.compiler.is_compiling():
            obj.__dict__[self.name] = value
        return value


@dataclass(frozen=True)
class NSOptions:
    """How to orthogonalize: the Newton-Schulz schedule (the lr shape scale is the update's: :func:`scale_`)."""

    coefficients: str | tuple[tuple[float, float, float], ...] = "polar_express"
    steps: int | None = None
    eps: float = 1e-7
    dtype: torch.dtype | None = None
    method: str = "gram"
    compiled: bool = False

    def orthogonalize(self, x: Tensor) -> Tensor:
        return orthogonalize(
            x, coefficients=self.coefficients, steps=self.steps, eps=self.eps, dtype=self.dtype, method=self.method
        )

    def orthogonalize_batches(self, parts: Sequence[Tensor], *, rows: int, cols: int) -> Tensor:
        """``orthogonalize(cat(parts))`` for same-shape batches of ``rows x cols`` matrices, in the
        parts' dtype (the lr shape scale is the update's: :func:`scale_`)."""
        del rows, cols  # the parts' own shape
        schedule, norm_factor, eps, dtype, method = self.resolved()
        return orthogonalize_resolved(
            parts, schedule=schedule, norm_factor=norm_factor, eps=eps, dtype=dtype, method=method,
            compiled=self.compiled,
        )  # fmt: skip

    def resolved(self) -> tuple[tuple[tuple[float, float, float], ...], float, float, torch.dtype | None, str]:
        """The validated schedule and settings (:func:`~muonkit.functional.orthogonalize.resolved_options`),
        resolved at the first use of these options, not at every batch (:class:`once`)."""
        return self._resolved

    @once
    def _resolved(self) -> tuple[tuple[tuple[float, float, float], ...], float, float, torch.dtype | None, str]:
        return resolved_options(self.coefficients, self.steps, self.eps, self.dtype, self.method)

    @once
    def bounded(self) -> bool:
        """Whether the schedule is a preset's, whose directions are finite wherever its updates are
        (:func:`~muonkit.functional.coefficients.is_preset_schedule`), worked out once (:class:`once`)."""
        return is_preset_schedule(self.coefficients, steps=self.steps)


BatchHook = Callable[[int, int, int], None]
"""Called with ``(count, rows, cols)`` for every batched orthogonalization (instrumentation)."""


def muon_directions(
    updates: Sequence[Tensor],
    layouts: Sequence[MatrixLayout],
    options: NSOptions,
    *,
    on_batch: BatchHook | None = None,
) -> list[Tensor]:
    """Orthogonalized directions ``O`` for whole tensors, same shapes and dtypes as ``updates``
    (unscaled: :func:`scale_` applies the lr shape scale at the update)."""

    def compute(batch: list[Tensor], rows: int, cols: int, members: list[tuple[int, int]]) -> Tensor:
        del members
        return options.orthogonalize_batches(batch, rows=rows, cols=cols)

    return _by_shape(updates, layouts, compute, on_batch)


Scale = float | Tensor | tuple[tuple[int, int, float | Tensor], ...]
"""A direction's lr shape scale: one number; a tensor of one value per element (``split_sizes``
blocks of different scales); or ``(start, stop, value)`` runs of the flattened local tensor, each
a number or a flat tensor (a local tensor holding parts of several whole tensors)."""


def tensor_scale(shape: Sequence[int], layout: MatrixLayout, adjust_lr: str | None, *, like: Tensor) -> float | Tensor:
    """The lr shape scale of a whole tensor of ``shape``: a number where every block of ``layout``
    has the same one, else a tensor of ``shape`` (``like``'s dtype and device) of each element's."""
    blocks = layout.blocks(tuple(shape))
    scales = [lr_scale(adjust_lr, b.rows, b.cols) if b.rows and b.cols else 1.0 for b in blocks]  # empty: no element
    if len(set(scales)) == 1:
        return scales[0]
    full = [torch.full((b.count, b.rows, b.cols), s, dtype=like.dtype) for b, s in zip(blocks, scales, strict=True)]
    return layout.from_matrices(full, tuple(shape)).to(like.device)


def scale_(directions: Sequence[Tensor], scales: Sequence[Scale]) -> None:
    """``D <- scale * D`` in place, in ``D``'s dtype (rounded once): one ``_foreach_mul_`` per distinct
    number (a ``mul_`` per tensor on the CPU), one ``mul_`` per per-element scale. Scales of 1 are skipped.

    The product is the one the step always formed (the orthogonalized matrix in the update dtype,
    times the scale, rounded once), except with an ``ns_dtype`` wider than the update's (fp64
    Newton-Schulz for fp32 updates), where it used to be formed in the compute dtype before the
    cast: the direction is now rounded first (a last-bit difference)."""
    by_value: dict[float, list[Tensor]] = {}
    for d, scale in zip(directions, scales, strict=True):
        if isinstance(scale, float):
            by_value.setdefault(scale, []).append(d)
        elif isinstance(scale, Tensor):
            d.mul_(scale.view(d.shape))
        else:
            flat = d.view(-1)
            for start, stop, value in scale:
                part = flat[start:stop]
                if isinstance(value, Tensor):
                    part.mul_(value)
                else:
                    by_value.setdefault(value, []).append(part)
    for value, group in by_value.items():
        if value == 1.0 or not group:
            continue
        if group[0].device.type == "cpu":  # the CPU's foreach is a loop of out-of-place products and copies
            for d in _stretches(group):  # a held 0-dim CPU tensor: the product of a Python number, without wrapping it
                d.mul_(_number(value, d.dtype))
        else:
            torch._foreach_mul_(group, value)


def _stretches(tensors: Sequence[Tensor]) -> list[Tensor]:
    """``tensors`` with those that tile one stretch of a storage (the directions of one same-shape batch,
    views of its result) as one flat view: one product per batch, as when the scale was applied to the
    batch. Elementwise the same products; tensors that are not contiguous, or overlap, stay as they are."""
    out: list[Tensor] = []
    shared: dict[tuple[int, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        if t.numel() and _dense(t):
            shared.setdefault((t.untyped_storage().data_ptr(), t.dtype), []).append(t)
        else:
            out.append(t)
    for members in shared.values():
        members.sort(key=Tensor.storage_offset)
        if any(a.storage_offset() + a.numel() > b.storage_offset() for a, b in itertools.pairwise(members)):
            out += members  # overlapping views: each multiplied on its own, as before
            continue
        runs = [[members[0]]]
        for member in members[1:]:
            last = runs[-1][-1]
            if member.storage_offset() == last.storage_offset() + last.numel():
                runs[-1].append(member)
            else:
                runs.append([member])
        for run in runs:
            first, size = run[0], sum(r.numel() for r in run)
            out.append(first if len(run) == 1 else first.as_strided((size,), (1,), first.storage_offset()))
    return out


def _dense(t: Tensor) -> bool:
    """Whether ``t`` fills ``[storage_offset, storage_offset + numel)`` of its storage exactly, each element
    once, in some order of its dimensions (a contiguous tensor, or a transposed view of one)."""
    dims = sorted(((t.stride(i), n) for i, n in enumerate(t.shape) if n != 1), reverse=True)
    expected = 1
    for stride, size in reversed(dims):
        if stride != expected:
            return False
        expected *= size
    return True


@functools.lru_cache(maxsize=256)
def _number(value: float, dtype: torch.dtype) -> Tensor:
    """``value`` as a 0-dim CPU tensor of ``dtype``: what ``mul_(value)`` multiplies by (a wrapped
    number rounded to the tensor's dtype), made once."""
    return torch.tensor(value, dtype=dtype)


def rule_directions(
    updates: Sequence[Tensor],
    layouts: Sequence[MatrixLayout],
    options: NSOptions,
    *,
    rule: UpdateRule,
    settings: RuleSettings,
    states: Sequence[Sequence[Tensor]] | None = None,
    on_batch: BatchHook | None = None,
) -> tuple[list[Tensor], list[list[Tensor]]]:
    """A rule's directions and new ``"rows"`` states (:mod:`muonkit.functional.update_rule`) for whole tensors.

    ``states[i]``: the ``"rows"`` states of ``updates[i]`` (one vector per entry of
    ``rule.rows_states``), not modified. Where the rule changes the orthogonalized matrices
    (:meth:`~muonkit.functional.update_rule.UpdateRule.after`), each same-shape batch is
    orthogonalized and handed to the rule with its states::

        O = after(orthogonalize(U), v)      # the update multiplies it by the lr shape scale

    else these are :func:`muon_directions` (the states, if any, copied unchanged; no states: ``[]``).
    """
    if not rule.changes_directions:  # any states unchanged (none without states)
        same = [[v.clone() for v in vs] for vs in states] if states is not None else []
        return muon_directions(updates, layouts, options, on_batch=on_batch), same
    olds = [list(v) for v in states] if states is not None else [[] for _ in updates]
    specs = rule.rows_states
    blocks = [
        [spec.split(v, u.shape, layout) for spec, v in zip(specs, vs, strict=True)]
        for vs, u, layout in zip(olds, updates, layouts, strict=True)
    ]  # [tensor][state][block]
    new_blocks = [[list(b) for b in bs] for bs in blocks]

    def compute(batch: list[Tensor], r: int, c: int, members: list[tuple[int, int]]) -> Tensor:
        out = options.orthogonalize_batches(batch, rows=r, cols=c)
        old = [torch.cat([blocks[ti][s][bi] for ti, bi in members]) for s in range(len(specs))]
        out, new = rule.after(out, old, settings)
        for s, v_new in enumerate(new):
            for (ti, bi), chunk in zip(members, torch.split(v_new, [m.size(0) for m in batch]), strict=True):
                new_blocks[ti][s][bi] = chunk
        return out

    directions = _by_shape(updates, layouts, compute, on_batch)
    new_states = [
        [
            v.clone() if not v.numel() else (b[0] if len(b) == 1 else torch.cat(b, dim=1)).reshape(-1).clone()
            for v, b in zip(vs, bs, strict=True)
        ]
        for vs, bs in zip(olds, new_blocks, strict=True)
    ]
    return directions, new_states


_PLAIN = ("auto", "matrix")
"""Layout kinds that read a 2-D tensor as one matrix, as it is."""


def _by_shape(
    updates: Sequence[Tensor],
    layouts: Sequence[MatrixLayout],
    compute: Callable[[list[Tensor], int, int, list[tuple[int, int]]], Tensor],
    on_batch: BatchHook | None,
) -> list[Tensor]:
    """``compute`` once per matrix shape on every matrix of that shape, results put back per tensor."""
    plain = [
        u.ndim == 2 and layout.kind in _PLAIN and layout.split_sizes is None
        for u, layout in zip(updates, layouts, strict=True)
    ]
    pieces: list[list[Tensor]] = [
        [u.reshape(1, *u.shape)] if flat else layout.to_matrices(u)  # a plain matrix: as to_matrices would
        for u, layout, flat in zip(updates, layouts, plain, strict=True)
    ]
    by_shape: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for ti, mats in enumerate(pieces):
        for bi, m in enumerate(mats):
            by_shape.setdefault((m.size(-2), m.size(-1)), []).append((ti, bi))
    results: dict[tuple[int, int], Tensor] = {}  # (tensor, block) -> its result; every one is set below
    for (rows, cols), members in by_shape.items():
        batch = [pieces[ti][bi] for ti, bi in members]
        if not any(m.numel() for m in batch):  # empty matrices: empty directions, nothing to compute
            for ti, bi in members:
                results[ti, bi] = pieces[ti][bi]
            continue
        if on_batch is not None:
            on_batch(sum(m.size(0) for m in batch), rows, cols)
        out = compute(batch, rows, cols, members)
        chunks = [out] if len(batch) == 1 else torch.split(out, [m.size(0) for m in batch])
        for (ti, bi), chunk in zip(members, chunks, strict=True):
            results[ti, bi] = chunk
    return [
        results[ti, 0].reshape(u.shape)
        if flat
        else layout.from_matrices([results[ti, bi] for bi in range(len(mats))], u.shape)
        for ti, (mats, u, layout, flat) in enumerate(zip(pieces, updates, layouts, plain, strict=True))
    ]


def muon_apply_(
    params: Sequence[Tensor],
    directions: Sequence[Tensor],
    *,
    lr: float | Tensor,
    weight_decay: float | Tensor,
    cautious_wd: bool = False,
) -> None:
    """``W <- W*(1 - lr*wd) - lr*D`` in place; low-precision params go through fp32.

    ``cautious_wd``: decay only where ``D`` and ``W`` agree in sign (:func:`cautious_decay_`).
    ``lr`` and ``weight_decay`` may be 0-dim tensors on the params' device (a capturable step, no
    host read): the decay then always runs (x1 for a weight decay of 0), and ``W + D*(-lr)`` is
    one ``addcmul``, which rounds once like ``add``'s ``alpha`` (bit for bit on CPU).
    """
    if not params:
        return
    work = _applied(params, directions, lr=lr, weight_decay=weight_decay, cautious_wd=cautious_wd, in_place=True)
    for p, w in zip(params, work, strict=True):
        if w is not p:
            p.copy_(w)


def _applied(
    params: Sequence[Tensor],
    directions: Sequence[Tensor],
    *,
    lr: float | Tensor,
    weight_decay: float | Tensor,
    cautious_wd: bool,
    in_place: bool = False,
) -> list[Tensor]:
    """``W*(1 - lr*wd) - lr*D``, :func:`muon_apply_`'s operations, in fp32 or fp64 (low-precision
    params through fp32 copies): written over fp32 and fp64 ``params`` where ``in_place``, else into
    new tensors by a first operation out of place (no copy of ``params`` made to write over)."""
    work = [p if p.dtype in (torch.float32, torch.float64) else p.float() for p in params]
    fresh = not in_place and any(w is p for w, p in zip(work, params, strict=True))  # the first write makes new ones
    dirs = [d if d.dtype == w.dtype else d.to(w.dtype) for d, w in zip(directions, work, strict=True)]
    if isinstance(lr, Tensor) or isinstance(weight_decay, Tensor) or weight_decay != 0:
        factor = (
            _cautious_multipliers(work, dirs, lr=lr, weight_decay=weight_decay)
            if cautious_wd
            else 1.0 - lr * weight_decay
        )
        if fresh:
            work, fresh = list(torch._foreach_mul(work, factor)), False
        else:
            torch._foreach_mul_(work, factor)
    if isinstance(lr, Tensor):  # the decay ran: ``work`` is new or the params' own
        torch._foreach_addcmul_(work, dirs, [-lr] * len(work))
    elif fresh:
        work = list(torch._foreach_add(work, dirs, alpha=-lr))
    else:
        torch._foreach_add_(work, dirs, alpha=-lr)
    return work


def cautious_decay_(
    params: Sequence[Tensor], updates: Sequence[Tensor], *, lr: float | Tensor, weight_decay: float | Tensor
) -> None:
    """Cautious weight decay (Chen et al., arXiv 2510.12402), in place: ``W <- W*(1 - lr*wd)`` only where
    ``u * W >= 0``.

    ``u`` is the step the optimizer subtracts before the lr (``W <- W - lr*u``): Muon's scaled
    direction, AdamW's ``m_hat / (sqrt(v_hat) + eps)`` (same sign as ``exp_avg``). Where ``u`` and
    ``W`` have opposite signs the update already moves ``W`` toward zero and decay is skipped;
    elsewhere (including zeros) the decay is the plain one, bit for bit. Signs are compared, not
    the product, so no underflow changes the decision. A NaN in ``u`` makes ``W`` NaN (the update
    subtracted next does so anyway).

    Foreach over the whole list: ``keep = min(sign(u)*sign(W) + 1, 1)`` (1 where the signs agree
    or either is zero, else 0), the multiplier ``keep*factor + (1 - keep)`` (one term is exactly 0,
    so it is exactly ``factor`` or 1), then ``W *= multiplier``: ``W*factor`` where decayed, as the
    plain decay computes it, and ``W*1 = W`` elsewhere. The multiplier is held in the dtype the
    plain ``W * factor`` computes in (float64 for float64 weights, else float32): the same bits
    as the per-tensor ``where(same, W * factor, W)`` for float32 and float64 weights (what the
    optimizer passes), and for bf16 ones on CPU.
    """
    if params:
        torch._foreach_mul_(list(params), _cautious_multipliers(params, updates, lr=lr, weight_decay=weight_decay))


def _cautious_multipliers(
    params: Sequence[Tensor], updates: Sequence[Tensor], *, lr: float | Tensor, weight_decay: float | Tensor
) -> list[Tensor]:
    """:func:`cautious_decay_`'s multipliers: ``factor`` where ``u`` and ``W`` agree in sign (or either is 0), else 1."""
    factor = 1.0 - lr * weight_decay
    signs = torch._foreach_sign(list(params))
    torch._foreach_mul_(signs, torch._foreach_sign(list(updates)))
    torch._foreach_add_(signs, 1.0)
    torch._foreach_clamp_max_(signs, 1.0)
    dtypes = [_multiplier_dtype(w, factor) for w in params]
    keep = [k if k.dtype == d else k.to(d) for k, d in zip(signs, dtypes, strict=True)]
    rest = torch._foreach_neg(keep)
    torch._foreach_add_(rest, 1.0)
    torch._foreach_mul_(keep, factor)
    torch._foreach_add_(keep, rest)
    return keep


def _multiplier_dtype(w: Tensor, factor: float | Tensor) -> torch.dtype:
    """The dtype ``w * factor`` computes in: float64 where the product's dtype is float64, else
    float32 (bf16 and fp16 products compute in float32 with the factor unrounded on CPU; a 0-dim
    ``factor`` promotes only with a 0-dim ``w``)."""
    common = w.dtype if not isinstance(factor, Tensor) or w.dim() > 0 else torch.promote_types(w.dtype, factor.dtype)
    return torch.float64 if common == torch.float64 else torch.float32

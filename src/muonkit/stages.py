"""The stages of a step that compute and apply updates: Muon's directions and commit, AdamW's step.

:func:`muon_chunks` computes the directions of a group's params without changing any state
(momentum buffers and the update rule's states are read, new ones made but not stored);
:func:`commit_muon` stores and advances the momentum the directions were computed from and
applies them (:func:`muonkit.functional.muon.muon_apply_`), masked on the device by a streamed
verdict (:class:`muonkit.distributed.guard.Stream`) where there is one. :func:`adamw_step` is
``torch.optim.AdamW`` (foreach, :func:`muonkit.functional.adamw.adamw_`): states made at a
param's first step, ``step`` counts on the host (capturable: on the params' device). Where
tensors live (local shards, owners, collectives) is the strategy's business; the math is
:mod:`muonkit.functional`'s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from muonkit import state_precision
from muonkit.config import AdamWConfig, MuonConfig
from muonkit.distributed import Strategy
from muonkit.distributed.guard import Stream
from muonkit.functional.adamw import adamw_
from muonkit.functional.lr_scaling import lr_scale
from muonkit.functional.matrices import MatrixLayout
from muonkit.functional.muon import (
    Scale,
    momentum_,
    momentum_masked_,
    muon_apply_,
    muon_apply_masked_,
    muon_update,
    scale_,
    tensor_scale,
    where_,
)
from muonkit.functional.update_rule import StateSpec
from muonkit.limits import work_dtype
from muonkit.state_checks import row_count
from muonkit.state_precision import SCALE_SUFFIX, Codec

Rates = tuple[float | Tensor, float | Tensor]
"""A group's ``(lr, weight_decay)`` as a step applies them: numbers, or capturable, 0-dim device tensors."""
State = MutableMapping[Tensor, Any]
"""The optimizer's ``state``: a param's dict of state tensors (torch's ``defaultdict(dict)``)."""


@dataclass
class MuonChunk:
    """One chunk of a Muon step, computed but not applied."""

    params: list[Tensor]
    buffers: list[Tensor]
    """Their momentum buffers before the step (new zero ones are not in the state yet)."""
    directions: list[Tensor]
    """Local slices of ``orthogonalize(U)``, ``U`` computed from ``buffers`` (multiplied by
    ``scales`` when the step commits)."""
    scales: list[Scale]
    """Each param's lr shape scale (:func:`local_scale`), applied once, at the commit."""
    states: list[list[Tensor]] | None = None
    """The new ``"rows"`` states of the group's update rule (per param, per state), stored when the step commits."""
    param_states: list[list[tuple[Tensor, Tensor]]] | None = None
    """The rule's other ``"param"`` states (per param, per state): the state tensor (a new zero one
    is not in the state yet) and its new local values, written when the step commits."""


def muon_chunks(params: list[Tensor], config: MuonConfig, *, strategy: Strategy, state: State) -> Iterator[MuonChunk]:
    """The directions of ``params``, chunk by chunk, computed without changing any state.

    Chunks (one matrix shape at a time on one device) bound the scratch memory of computing
    them (updates, compute batch) to that of the largest chunk, not of every matrix.
    """
    if not params:
        return
    local, codec = strategy.local, config.codec
    for chunk in strategy.muon_chunks(params, config):
        group = [params[i] for i in chunk]
        if codec is None:
            buffers = [_momentum_buffer(p, strategy, state) for p in group]
        else:
            buffers = [codec.read(state.get(p, _NONE), _MOMENTUM, p, strategy) for p in group]
        grads = [local(cast(Tensor, p.grad)) for p in group]
        extra = config.rule.param_states
        held = [[_param_state(p, spec, config, strategy, state) for spec in extra] for p in group] if extra else []
        olds = [[local(t) for t in ts] for ts in held]
        rule, bufs = config.rule, [local(b) for b in buffers]
        if rule.changes_updates:
            updates, news = rule.before(bufs, grads, olds, config)
        else:  # Muon's momentum (UpdateRule.before): one foreach call
            updates, news = muon_update(bufs, grads, momentum=config.momentum, nesterov=config.nesterov), []
        param_states = [list(zip(ts, vs, strict=True)) for ts, vs in zip(held, news, strict=True)] if extra else None
        specs = config.rule.rows_states
        if specs:  # fresh copies: the strategy writes the new ones into them
            states = [[_rows_state(p, spec, config, strategy, state) for spec in specs] for p in group]
            directions = strategy.directions(group, updates, config, states=states)
        else:
            states, directions = None, strategy.directions(group, updates, config)
        del updates
        scales = [local_scale(p, config, strategy, like=d) for p, d in zip(group, directions, strict=True)]
        yield MuonChunk(group, buffers, directions, scales, states, param_states)


def _momentum_buffer(p: Tensor, strategy: Strategy, state: State) -> Tensor:
    """``p``'s momentum buffer, or a new zero one (stored only when the step commits)."""
    return _work_state(p, _MOMENTUM, strategy, state.get(p, _NONE), unsigned=False)


def _work_state(p: Tensor, key: str, strategy: Strategy, own: Mapping[str, Any], *, unsigned: bool) -> Tensor:
    """State ``key`` of ``p`` in the work dtype (an fp32 group's): the stored tensor, a new zero one, or
    one decoded from the bf16 or 8-bit form a checkpoint or an earlier ``state_dtype`` left."""
    value = own.get(key)
    if value is None:
        return strategy.new_state(p, work_dtype(p.dtype))
    if value.dtype != work_dtype(p.dtype):
        return state_precision.to_work(own, key, p, strategy, unsigned=unsigned)
    return value


_MOMENTUM = "momentum_buffer"
_MOMENTUM_SCALE = _MOMENTUM + SCALE_SUFFIX
_NONE: dict[str, Any] = {}  # the state of a param that has none yet (read, never written)


_SCALES: dict[Hashable, Scale] = {}
_SCALES_KEPT = 4096  # local scales kept (one per distinct param layout and setting)


def local_scale(p: Tensor, config: MuonConfig, strategy: Strategy, *, like: Tensor) -> Scale:
    """The lr shape scale of ``p``'s local direction: a number where every matrix of every whole
    tensor ``p`` stands for has the same one (empty ones have none; no read of where they lie); else per element of the
    parts this rank holds (:meth:`Strategy.regions`), cached: one tensor (``like``'s dtype) where
    one part fills the local tensor, else ``(start, stop, value)`` runs of it."""
    adjust, layout = config.adjust_lr, config.layout
    shapes = tuple(tuple(s) for s in strategy.whole_shapes(p))
    values = (_scale_values.__wrapped__ if torch.compiler.is_compiling() else _scale_values)(shapes, layout, adjust)
    if len(values) <= 1:
        return values[0] if values else 1.0
    held = strategy.regions(p)
    key = (held, layout, adjust, tuple(like.shape), like.dtype, like.device)
    scale = _SCALES.get(key)
    if scale is None:
        runs: list[tuple[int, int, float | Tensor]] = []
        for part in held:
            if part.region.numel == 0:
                continue
            whole = tensor_scale(part.shape, layout, adjust, like=like)
            value = whole if isinstance(whole, float) else part.region.read(whole).reshape(-1)
            runs.append((part.offset, part.offset + part.region.numel, value))
        whole_here = len(runs) == 1 and runs[0][:2] == (0, like.numel()) and isinstance(runs[0][2], Tensor)
        scale = runs[0][2] if whole_here else tuple(runs)
        if len(_SCALES) >= _SCALES_KEPT:
            _SCALES.clear()
        _SCALES[key] = scale
    return scale


@functools.lru_cache(maxsize=1024)
def _scale_values(shapes: tuple[tuple[int, ...], ...], layout: MatrixLayout, adjust: str | None) -> tuple[float, ...]:
    """The distinct lr shape scales of the non-empty matrices of tensors of ``shapes`` (worked out once per
    shapes and settings, not at every step)."""
    return tuple(
        {lr_scale(adjust, b.rows, b.cols) for shape in shapes for b in layout.blocks(shape) if b.rows and b.cols}
    )


def _param_state(p: Tensor, spec: StateSpec, config: MuonConfig, strategy: Strategy, state: State) -> Tensor:
    """``p``'s ``"param"`` state ``spec`` (laid out like ``p``; an fp32 working tensor where the group
    stores states in lower precision), or a new zero one (stored only when the step commits)."""
    own = state.get(p, _NONE)
    if config.codec is not None:
        return config.codec.read(own, spec.key, p, strategy, unsigned=spec.nonnegative)
    return _work_state(p, spec.key, strategy, own, unsigned=spec.nonnegative)


def _rows_state(p: Tensor, spec: StateSpec, config: MuonConfig, strategy: Strategy, state: State) -> Tensor:
    """A fresh fp32 copy of ``p``'s ``"rows"`` state ``spec``, or a new zero one (stored only when the
    step commits): one value per matrix row of each whole tensor ``p`` stands for, on every rank."""
    own = state.get(p, _NONE)
    value = own.get(spec.key)
    if value is not None:
        if config.codec is None and value.dtype == work_dtype(p.dtype):
            return value.clone()
        return state_precision.decoded_copy(own, spec.key, work_dtype(p.dtype), unsigned=spec.nonnegative)
    count = row_count(p, spec, whole_shapes=strategy.whole_shapes, layout=config.layout) or 0
    return torch.zeros(count, dtype=work_dtype(p.dtype), device=p.device)


def commit_batches(chunks: Iterable[MuonChunk]) -> Iterator[list[MuonChunk]]:
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


def commit_muon(
    chunks: Sequence[MuonChunk],
    config: MuonConfig,
    rates: Rates,
    stream: Stream | None,
    *,
    strategy: Strategy,
    state: State,
    wrote: Callable[[], None],
) -> None:
    """Store and advance the momentum the directions were computed from, then apply them.

    Every chunk given is committed by the same few ``_foreach`` calls (see :func:`commit_batches`).
    In a streamed step (``stream``) the chunk's directions are checked first: on the host where
    reads are free (a non-finite one leaves the chunk unapplied), else on the device, where
    the commit is masked by the step's verdict and that check. ``wrote`` is called before the
    first write to the state or params.
    """
    local = strategy.local
    params = [p for chunk in chunks for p in chunk.params]
    buffers = [b for chunk in chunks for b in chunk.buffers]
    directions = [d for chunk in chunks for d in chunk.directions]
    scale_(directions, [s for chunk in chunks for s in chunk.scales])  # the lr shape scale, once
    ok = None if stream is None else stream.check(directions)
    if ok is False:
        for chunk in chunks:
            chunk.directions.clear()
        return
    wrote()
    if stream is not None:
        stream.created += [p for p in params if p not in state]
    codec, mask = config.codec, ok if isinstance(ok, Tensor) else None
    if codec is None:
        for p, buffer in zip(params, buffers, strict=True):
            state[p][_MOMENTUM] = buffer
            state[p].pop(_MOMENTUM_SCALE, None)  # codes replaced by the fp32 buffer
    else:
        for p in params:
            codec.advance(state[p], p, mask)
    for chunk in chunks:
        for p, pairs in zip(chunk.params, chunk.param_states or [], strict=False):
            for spec, (held, value) in zip(config.rule.param_states, pairs, strict=True):
                if codec is not None:
                    codec.write(state[p], spec.key, value, p, strategy, unsigned=spec.nonnegative, ok=mask)
                    continue
                state[p][spec.key] = held
                state[p].pop(spec.key + SCALE_SUFFIX, None)
                if mask is not None:  # masked: unchanged unless ok
                    where_([local(held)], [value], mask)
                else:
                    local(held).copy_(value)
    specs = config.rule.rows_states
    for chunk in chunks:
        if chunk.states is None:
            continue
        for p, values in zip(chunk.params, chunk.states, strict=True):
            for spec, value in zip(specs, values, strict=True):
                if codec is not None:
                    codec.write_rows(state[p], spec.key, value, unsigned=spec.nonnegative, ok=mask)
                    continue
                old = state[p].get(spec.key)
                if mask is not None:  # masked: the old values (or zeros) unless ok
                    old = old if old is None or old.dtype == value.dtype else state_precision.decode(state[p], spec.key)
                    value = torch.where(mask, value, torch.zeros_like(value) if old is None else old)
                state[p][spec.key] = value
                state[p].pop(spec.key + SCALE_SUFFIX, None)
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
    if codec is not None:
        for p, buffer in zip(params, buffers, strict=True):
            codec.write(state[p], _MOMENTUM, buffer, p, strategy, ok=mask)
    if config.rule.has_commit_hook:
        config.rule.committed([local(p) for p in params], config)
    for chunk in chunks:
        chunk.directions.clear()  # free them now, not when the next chunk replaces this one


def adamw_step(
    params: list[Tensor],
    config: AdamWConfig,
    rates: Rates,
    *,
    strategy: Strategy,
    state: State,
    capturable: bool,
    wrote: Callable[[], None],
) -> None:
    """One AdamW step on ``params`` (those of a group with a gradient); ``wrote`` is called
    before the first write. Where the group stores its states in lower precision, params go by
    batches of at most :data:`CODEC_BATCH_ELEMENTS` values: one batch's fp32 working moments at a time."""
    if not params:
        return
    wrote()
    codec = config.codec
    for p in params:
        own = state[p]
        if "step" not in own:
            own["step"] = torch.zeros((), dtype=torch.float32, device=p.device if capturable else "cpu")
            if codec is None:
                own["exp_avg"] = strategy.new_state(p, work_dtype(p.dtype))
                own["exp_avg_sq"] = strategy.new_state(p, work_dtype(p.dtype))
        elif codec is None and (
            own["exp_avg"].dtype != work_dtype(p.dtype) or own["exp_avg_sq"].dtype != own["exp_avg"].dtype
        ):
            for key in ("exp_avg", "exp_avg_sq"):  # decoded from a checkpoint's or an earlier state_dtype's form
                own[key] = _work_state(p, key, strategy, own, unsigned=key == "exp_avg_sq")
                own.pop(key + SCALE_SUFFIX, None)
    if codec is None:
        local = strategy.local
        moments = [(local(state[p]["exp_avg"]), local(state[p]["exp_avg_sq"])) for p in params]
        _adamw([(p, None) for p in params], moments, config, rates, strategy=strategy, state=state)
        return
    counts: dict[Tensor, Tensor] = {}  # a sliced param's step count before its first slice
    for batch in _batches(params, strategy.local, CODEC_BATCH_ELEMENTS, sliced=_sliceable(codec, state)):
        for p, rows in batch:
            if rows is not None:  # every slice steps from the same count, so it ends one higher
                step = state[p]["step"]
                if p in counts:
                    step.copy_(counts[p])
                else:
                    counts[p] = step.clone()
        moments = [
            (
                codec.read(state[p], "exp_avg", p, strategy, rows=rows),
                codec.read(state[p], "exp_avg_sq", p, strategy, unsigned=True, rows=rows),
            )
            for p, rows in batch
        ]  # fp32 working copies, stored back after the step
        _adamw(batch, moments, config, rates, strategy=strategy, state=state)
        for (p, rows), (m, v) in zip(batch, moments, strict=True):
            codec.write(state[p], "exp_avg", m, p, strategy, rows=rows)
            codec.write(state[p], "exp_avg_sq", v, p, strategy, unsigned=True, rows=rows)


CODEC_BATCH_ELEMENTS = 1 << 22
"""The most values of params an AdamW group in bf16 or 8-bit state steps at once (its fp32 working
moments: 32 MiB), so that the step's peak holds one batch's, not the whole group's; a larger param
(a tied embedding) goes by slices of its rows (the same bits as whole: AdamW and both codecs work
value by value, an 8-bit block within one row)."""

Unit = tuple[Tensor, "slice | None"]
"""A param, or the rows (dim 0) of its local tensor that one batch steps."""


def _rows(t: Tensor, rows: slice | None) -> Tensor:
    return t if rows is None else t[rows]


def _sliceable(codec: Codec, state: State) -> Callable[[Tensor], bool]:
    """Whether a large param may go by row slices: its states are in ``codec``'s form or not made yet
    (a state in another form converts whole at its first write, which slices would read after)."""

    def check(p: Tensor) -> bool:
        own = state[p]
        return all(key not in own or codec.stores(own, key) for key in ("exp_avg", "exp_avg_sq"))

    return check


def _batches(
    params: list[Tensor], local: Callable[[Tensor], Tensor], limit: int, *, sliced: Callable[[Tensor], bool]
) -> Iterator[list[Unit]]:
    """``params`` in order, cut into runs of at most ``limit`` local values; a larger param alone, by
    slices of at most ``limit`` values of its rows where it has rows and ``sliced(p)``."""
    batch: list[Unit] = []
    size = 0
    for p in params:
        t = local(p)
        n = t.numel()
        if n > limit and t.dim() >= 2 and t.size(0) > 1 and sliced(p):
            if batch:
                yield batch
                batch, size = [], 0
            per = max(1, limit // (n // t.size(0)))
            for start in range(0, t.size(0), per):
                yield [(p, slice(start, min(start + per, t.size(0))))]
            continue
        if batch and size + n > limit:
            yield batch
            batch, size = [], 0
        batch.append((p, None))
        size += n
    if batch:
        yield batch


def _adamw(
    units: list[Unit],
    moments: list[tuple[Tensor, Tensor]],
    config: AdamWConfig,
    rates: Rates,
    *,
    strategy: Strategy,
    state: State,
) -> None:
    """:func:`~muonkit.functional.adamw.adamw_` on params or row slices of them (:data:`Unit`) with
    their local ``moments`` (updated in place)."""
    local = strategy.local
    adamw_(
        [_rows(local(p), rows) for p, rows in units],
        [_rows(local(cast(Tensor, p.grad)), rows) for p, rows in units],
        [m for m, _ in moments],
        [v for _, v in moments],
        [state[p]["step"] for p, _ in units],
        lr=rates[0],
        beta1=config.beta1,
        beta2=config.beta2,
        eps=config.eps,
        weight_decay=rates[1],
        cautious_wd=config.cautious_wd,
    )

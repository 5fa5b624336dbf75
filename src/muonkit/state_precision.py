"""How a group keeps its optimizer states at rest: ``state_dtype="fp32" | "bf16" | "8bit"``.

Every state (Muon's momentum, an update rule's states such as NorMuon's row moments, AdamW's
``exp_avg`` and ``exp_avg_sq``) is computed in fp32 (the work dtype: fp64 for fp64 params) and
stored in its group's precision:

==========  ===============================================  ==================
precision   at rest, per state key ``K``                     bytes per value
==========  ===============================================  ==================
``fp32``    ``K``: the work-dtype tensor, updated in place   4 (8, fp64 params)
``bf16``    ``K``: bf16, stochastically rounded at each      2
            write; ``step`` (Muon-family params) salts it
``8bit``    ``K``: ``float8_e4m3fn`` codes laid out like     1 + 4 / 256
            the state; ``K_scale``: fp32, one per block of
            <= 256 values along the local tensor's last dim
==========  ===============================================  ==================

(:mod:`muonkit.functional.quantize` has the codes and the rounding.) In ``fp32`` nothing here
runs: the state tensor is the working tensor, as before this option existed (the same bits, no
copy). In ``bf16`` and ``8bit`` a :class:`Codec` reads each state into an fp32 working tensor
(:meth:`Codec.read`), the step updates it as always, and the codec stores it back
(:meth:`Codec.write`; a device verdict masks the store). The strategies lay the stored tensors
out (``new_state``, the scales with ``blocks=``); the planner and the exchanges see fp32 values.

**Changing precision.** A state stored in another form than its group's precision (a checkpoint
saved with ``state_dtype="8bit"`` loaded by an optimizer made with ``"fp32"``, or a group whose
``state_dtype`` was changed) loads as saved (:func:`loaded`) and is converted at the param's next
step: decoded by its first read, stored in the group's precision by its write (the old form's
``K_scale`` entries dropped). A checkpoint does not change a group's ``state_dtype``: the
optimizer's own setting wins.
:func:`check_stored` refuses a stored form that could not have been written: codes without
scales, scales of the wrong shape, negative or non-finite scales, NaN codes.

Example::

    >>> bytes_per_value("8bit", torch.float32)
    1.015625
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from muonkit.functional.quantize import (
    BLOCK,
    CODE_DTYPE,
    SCALE_SUFFIX,
    STATE_DTYPES,
    block_count,
    block_shape,
    blocks_consistent,
    dequantize_blockwise,
    quantize_into,
    round_bf16,
    salt_of,
    work_dtype,
)

if TYPE_CHECKING:
    from muonkit.distributed.base import Strategy

__all__ = [
    "CODECS",
    "SCALE_SUFFIX",
    "STATE_DTYPES",
    "Codec",
    "bytes_per_value",
    "check_stored",
    "decode",
    "decode_saved",
    "decoded_copy",
    "loaded",
    "local_scales",
    "to_work",
]

SALT_KEY = "step"
"""The count that salts bf16's stochastic rounding: AdamW's own ``step``; a Muon-family param keeps one in bf16."""

Own = MutableMapping[str, Any]
Local = Callable[[Tensor], Tensor]


def bytes_per_value(state_dtype: str, dtype: torch.dtype) -> float:
    """Bytes per stored state value (scales included) of a param in ``dtype`` at ``state_dtype``."""
    if state_dtype == "8bit":
        return 1.0 + 4.0 / BLOCK
    return 2.0 if state_dtype == "bf16" else float(work_dtype(dtype).itemsize)


def _plain(t: Tensor) -> Tensor:
    return t


def _rows_of(local: Local, rows: slice | None) -> Local:
    """``local``, or its ``rows`` (dim 0) where given."""
    return local if rows is None else (lambda t: local(t)[rows])


def local_scales(codes: Tensor, scales: Tensor) -> Tensor:
    """The scales of the local ``codes`` among the local ``scales`` a strategy laid out (a view): one per
    block of the local rows. A layout that shards the last dim holds ``(*lead, 1, ..., 1, k)`` (one
    unit dim per mesh dim cutting it; see ``block_state``), seen here as ``(*lead, k)``; a rank with
    fewer blocks than ``k`` uses the first."""
    lead = codes.dim() - 1
    if codes.dim() and scales.dim() > codes.dim() and math.prod(scales.shape[lead:-1]) == 1:
        scales = scales.reshape(*scales.shape[:lead], scales.shape[-1])
    cols = codes.shape[-1] if codes.dim() else 1
    return scales[..., : block_count(cols)]


def decode(own: Mapping[str, Any], key: str, local: Local = _plain, *, unsigned: bool = False) -> Tensor:
    """The local values of the state ``key`` of ``own`` (one param's state) in fp32 (a new tensor), or
    the stored tensor itself where it is already in a work dtype. ``local``: the strategy's view of
    the part this rank holds (plain tensors: themselves)."""
    value = local(own[key])
    if value.dtype == CODE_DTYPE:
        scales = local_scales(value, local(own[key + SCALE_SUFFIX]))
        return dequantize_blockwise(value, scales, signed=not unsigned)
    return value.float() if value.dtype == torch.bfloat16 else value


def decoded_copy(
    own: Mapping[str, Any], key: str, dtype: torch.dtype, local: Local = _plain, *, unsigned: bool = False
) -> Tensor:
    """:func:`decode` as a new tensor in ``dtype`` the caller may change: copied only where the stored
    tensor is already a work-dtype one (8-bit and bf16 forms decode into a new tensor)."""
    fresh = own[key].dtype in (CODE_DTYPE, torch.bfloat16)
    return decode(own, key, local, unsigned=unsigned).to(dtype, copy=not fresh)


class Codec:
    """A lower-precision way of keeping states: how to read one into an fp32 working tensor and store it back."""

    name = "abstract"

    def read(
        self,
        own: Mapping[str, Any],
        key: str,
        p: Tensor,
        strategy: Strategy,
        *,
        unsigned: bool = False,
        rows: slice | None = None,
    ) -> Tensor:
        """A new working tensor (local, the work dtype) of state ``key`` of ``p`` (``own``: its state),
        decoded from whatever form it is stored in, or zeros where ``p`` has none yet. ``rows``: only
        these rows (dim 0) of the local tensor (a block of 8-bit codes never spans two rows)."""
        local = _rows_of(strategy.local, rows)
        if key not in own:
            return torch.zeros_like(local(p), dtype=work_dtype(p.dtype))
        return decoded_copy(own, key, work_dtype(p.dtype), local, unsigned=unsigned)

    def advance(self, own: Own, p: Tensor, ok: Tensor | None) -> None:
        """Called once per committed Muon-family param and step, before its states are written."""
        del own, p, ok

    def write(
        self,
        own: Own,
        key: str,
        value: Tensor,
        p: Tensor,
        strategy: Strategy,
        *,
        unsigned: bool = False,
        ok: Tensor | None = None,
        rows: slice | None = None,
    ) -> None:
        """Store ``value`` (local fp32 values of state ``key`` of ``p``), replacing any other stored form;
        ``ok``: a device verdict, where False leaves the stored values as they were. ``rows``: ``value``
        holds only these rows of the local tensor (the others keep what they hold; a new state's are
        zeros until their own write)."""
        held = self._held(own, key, lambda dtype, blocks: strategy.new_state(p, dtype, blocks=blocks))
        local = _rows_of(strategy.local, rows)
        self._store([local(t) for t in held], value, own, key, unsigned=unsigned, ok=ok)

    def write_rows(self, own: Own, key: str, value: Tensor, *, unsigned: bool, ok: Tensor | None) -> None:
        """Store a ``"rows"`` state's new values (plain tensors, whole on every rank; masked by ``ok``)."""

        def new(dtype: torch.dtype, blocks: int | None) -> Tensor:
            shape = tuple(value.shape) if blocks is None else block_shape(tuple(value.shape), blocks)
            return torch.zeros(shape, dtype=dtype, device=value.device)

        self._store(self._held(own, key, new), value, own, key, unsigned=unsigned, ok=ok)

    def stores(self, own: Mapping[str, Any], key: str) -> bool:
        """Whether state ``key`` is stored in this codec's form (not missing, nor in another form that its
        next write replaces)."""
        raise NotImplementedError

    def _held(self, own: Own, key: str, new: New) -> list[Tensor]:
        """The stored tensors of state ``key``, made by ``new(dtype, blocks)`` where missing or in another form."""
        raise NotImplementedError

    def _store(
        self, held: list[Tensor], value: Tensor, own: Own, key: str, *, unsigned: bool, ok: Tensor | None
    ) -> None:
        """``value`` into the local views ``held`` of the stored tensors."""
        raise NotImplementedError


New = Callable[[torch.dtype, "int | None"], Tensor]
"""Makes a zero stored tensor laid out like the state (``blocks``: one value per block of that many)."""


class BF16(Codec):
    """bf16 at rest, stochastically rounded (:func:`~muonkit.functional.quantize.round_bf16`), salted by
    the param's step count: a Muon-family param keeps its own ``step`` (AdamW's counts already)."""

    name = "bf16"

    def advance(self, own: Own, p: Tensor, ok: Tensor | None) -> None:
        step = own.get(SALT_KEY)
        if step is None:
            step = own[SALT_KEY] = torch.zeros((), dtype=torch.float32, device=p.device)  # read by no host code
        step.add_(1 if ok is None else ok.to(step.dtype))

    def stores(self, own: Mapping[str, Any], key: str) -> bool:
        return own.get(key) is not None and own[key].dtype == torch.bfloat16

    def _held(self, own: Own, key: str, new: New) -> list[Tensor]:
        if not self.stores(own, key):
            own[key] = new(torch.bfloat16, None)
            own.pop(key + SCALE_SUFFIX, None)
        return [own[key]]

    def _store(
        self, held: list[Tensor], value: Tensor, own: Own, key: str, *, unsigned: bool, ok: Tensor | None
    ) -> None:
        """``value`` rounded stochastically, salted by ``own``'s step and ``key``."""
        step = own.get(SALT_KEY)
        new = round_bf16(value, salt_of(0 if step is None else step, key))
        if ok is None:
            held[0].copy_(new)
        else:  # masked, written over the stored tensor (no second copy)
            torch.where(ok, new, held[0], out=held[0])


class Blockwise8(Codec):
    """8-bit at rest: ``float8_e4m3fn`` codes and fp32 block scales (:mod:`muonkit.functional.quantize`)."""

    name = "8bit"

    def stores(self, own: Mapping[str, Any], key: str) -> bool:
        codes = own.get(key)
        return codes is not None and codes.dtype == CODE_DTYPE and own.get(key + SCALE_SUFFIX) is not None

    def _held(self, own: Own, key: str, new: New) -> list[Tensor]:
        if not self.stores(own, key):
            own[key] = new(CODE_DTYPE, None)
            own[key + SCALE_SUFFIX] = new(torch.float32, BLOCK)
        return [own[key], own[key + SCALE_SUFFIX]]

    def _store(
        self, held: list[Tensor], value: Tensor, own: Own, key: str, *, unsigned: bool, ok: Tensor | None
    ) -> None:
        """The codes and scales of ``value``; where ``ok`` is False, the stored ones stay."""
        codes, scales = held[0], local_scales(held[0], held[1])
        if ok is None:
            quantize_into(codes, scales, value, signed=not unsigned, check=False)
            return
        new_codes, new_scales = torch.empty_like(codes), torch.empty_like(scales)
        quantize_into(new_codes, new_scales, value, signed=not unsigned, check=False)
        raw = codes.view(torch.uint8)
        torch.where(ok, new_codes.view(torch.uint8), raw, out=raw)
        torch.where(ok, new_scales, scales, out=scales)


CODECS: dict[str, Codec | None] = {"fp32": None, "bf16": BF16(), "8bit": Blockwise8()}
"""Each ``state_dtype``'s codec; ``fp32`` has none (the state is the working tensor)."""


def to_work(own: Mapping[str, Any], key: str, p: Tensor, strategy: Strategy, *, unsigned: bool) -> Tensor:
    """State ``key`` of ``p`` decoded from its stored form into a new work-dtype state laid out like ``p``
    (where an fp32 group finds a bf16 or 8-bit state: a checkpoint's, or an earlier ``state_dtype``'s)."""
    new = strategy.new_state(p, work_dtype(p.dtype))
    strategy.local(new).copy_(decode(own, key, strategy.local, unsigned=unsigned))
    return new


def decode_saved(codes: Tensor, scales: Tensor, *, unsigned: bool) -> Tensor:
    """The whole fp32 values of a whole tensor of 8-bit ``codes`` and its ``scales`` as a checkpoint
    holds them, laid out by the layout that saved them: ``(*lead, blocks)`` for blocks of the whole
    rows (no rank's part cut the last dim), ``(*lead, n_1, ..., n_m, k)`` for blocks of each piece
    of the columns cut ``n_1`` ways, each piece ``n_2`` ways... as ``Shard`` placements of the last
    dim cut them (``torch.chunk`` sizes; ``block_state``). For loading on a layout that cuts the
    blocks elsewhere (the caller codes the values again in its own blocks). ``ValueError`` where
    codes and scales do not fit (corrupted: see :func:`~muonkit.functional.quantize.blocks_consistent`)."""
    lead = codes.dim() - 1
    if codes.dim() and scales.dim() > codes.dim():
        sizes = tuple(scales.shape[lead:-1])
        ranges = [(0, codes.shape[-1])]
        for n in sizes:  # DTensor's nested cut: each piece of the previous mesh dim's cut, n ways
            cut = []
            for a, b in ranges:
                size = -(-(b - a) // n)
                cut += [(min(a + i * size, b), min(a + (i + 1) * size, b)) for i in range(n)]
            ranges = cut
        flat = scales.reshape(*scales.shape[:lead], math.prod(sizes), scales.shape[-1])
        pieces = [(codes[..., a:b], flat[..., i, :]) for i, (a, b) in enumerate(ranges)]
    else:
        pieces = [(codes, scales)]
    out = []
    for part, held in pieces:
        want = block_shape(tuple(part.shape), BLOCK)
        if tuple(held.shape[:-1]) != want[:-1] or held.shape[-1] < want[-1]:
            raise ValueError(
                f"8-bit codes of shape {tuple(codes.shape)} do not fit scales of shape {tuple(scales.shape)}"
            )
        held = held[..., : want[-1]]
        if part.numel() and not bool(blocks_consistent(part, held).all()):
            raise ValueError(
                f"8-bit codes of shape {tuple(codes.shape)} do not fit their scales of shape {tuple(scales.shape)}: "
                "a block's largest code must be +-448 where its scale is non-zero, 0 where it is 0 (corrupted)"
            )
        out.append(dequantize_blockwise(part, held, signed=not unsigned))
    return torch.cat(out, dim=-1) if len(out) > 1 else out[0]


def check_stored(own: Mapping[str, Any], key: str, p: Tensor, local: Local, *, unsigned: bool, rows: bool) -> Tensor:
    """Refuse a stored form of state ``key`` of ``p`` no step could have written (``ValueError``:
    codes without their scales, scales of the wrong shape, negative or non-finite scales, an
    unknown dtype); returns the local values decoded (for the value checks). ``rows``: a ``"rows"``
    state (plain, whole)."""
    value = own[key]
    view = _plain if rows else local
    if value.dtype == CODE_DTYPE:
        scales = own.get(key + SCALE_SUFFIX)
        if not isinstance(scales, Tensor):
            raise ValueError(f"8-bit state {key!r} has no {key + SCALE_SUFFIX!r}: its block scales are missing")
        codes, stored = view(value), view(scales)
        held = local_scales(codes, stored)
        want = block_shape(tuple(codes.shape), BLOCK)
        if stored.dtype != torch.float32 or tuple(held.shape) != want:
            raise ValueError(
                f"Scales {key + SCALE_SUFFIX!r} have local shape {tuple(stored.shape)} and dtype {stored.dtype}: 8-bit "
                f"codes of local shape {tuple(codes.shape)} need float32 scales of shape {want} (one per block of "
                f"{BLOCK} along the last dim of the part this rank holds)"
            )
        if held.numel() and not bool((torch.isfinite(held) & (held >= 0)).all()):
            raise ValueError(f"Scales {key + SCALE_SUFFIX!r} hold negative, NaN or inf values: the state is corrupted")
        if codes.numel() and not bool(blocks_consistent(codes, held).all()):
            raise ValueError(
                f"8-bit state {key!r} does not fit its scales {key + SCALE_SUFFIX!r}: a block's largest code must be "
                f"+-448 where its scale is a normal float and 0 where its scale is 0, as every write leaves them "
                "(the codes or the scales are corrupted)"
            )
    elif key + SCALE_SUFFIX in own:
        raise ValueError(f"State {key!r} is {value.dtype}, not 8-bit codes, yet has scales {key + SCALE_SUFFIX!r}")
    elif not value.is_floating_point():
        raise ValueError(f"State {key!r} has dtype {value.dtype}: must be floating point (or 8-bit codes)")
    return decode(own, key, view, unsigned=unsigned)


def loaded(own: Mapping[str, Any], p: Tensor) -> dict[str, Tensor]:
    """A param's saved state tensors as loaded (new tensors on ``p``'s device, never ``own``'s; ``step``
    left out, the caller makes it): 8-bit codes, their scales and bf16 states as saved, every other
    float state in ``p``'s work dtype. A group of another precision converts them at the param's
    next step (its first read decodes any stored form)."""
    out: dict[str, Tensor] = {}
    for key, value in own.items():
        if not isinstance(value, Tensor) or key == "step":
            continue
        kept = value.dtype in (CODE_DTYPE, torch.bfloat16) or key.endswith(SCALE_SUFFIX)
        out[key] = value.to(device=p.device, dtype=value.dtype if kept else work_dtype(p.dtype), copy=True)
    return out

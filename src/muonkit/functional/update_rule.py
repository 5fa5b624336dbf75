"""Update rules: what a Muon-family group does around the orthogonalization, as one plug-in each.

A param group's ``algorithm`` names its rule (:data:`muonkit.functional.rules.RULES`). Every rule keeps Muon's momentum
buffer and its orthogonalization of whole matrices; a rule declares

- its **hyperparameters** (:class:`Hyperparameter`): the group keys it adds (a ``beta2``)
  or whose default it changes (its ``eps``), each with the optimizer-wide keyword that sets it
  for every group of the rule, its default and the documentation :mod:`muonkit.defaults` shows;
- its **state** (:class:`StateSpec`): each entry a state key, a kind (``"param"``: shaped and
  sharded like the param; ``"rows"``: one value per matrix row of each whole tensor the param
  stands for, whole on every rank), the length of a ``"rows"`` entry and its dtype;
- what it does **before** orthogonalization (:meth:`UpdateRule.before`: Muon's momentum update
  ``U`` from the local momentum buffers and gradients, elementwise on local tensors);
- what it does **after** orthogonalization of whole same-shape matrices (:meth:`UpdateRule.after`,
  with the matrices' ``"rows"`` states in and new ones out), and the same on one shard of a
  matrix whose Newton-Schulz iteration is split among ranks (:meth:`UpdateRule.after_shard`);
- what it does **at the commit** (:meth:`UpdateRule.committed`, after the update is applied).

The optimizer, the strategies and the executor call these hooks and carry the ``"rows"`` states
(:attr:`UpdateRule.rows_states`) without knowing any rule: the optimizer reads, creates and stores
the states (masked on the device when the verdict streams), the strategies hand the owner of each
whole matrix its part of every ``"rows"`` vector and share the new values.

The rules to come fit these hooks without touching the optimizer, the strategies or the executor
(checked on paper):

- an Adam second moment before Newton-Schulz: a ``"param"`` state (``exp_avg_sq``, like the
  momentum: :attr:`~UpdateRule.param_states`) and :meth:`~UpdateRule.before` returning ``U``
  divided by ``sqrt(v) + eps`` elementwise on the local tensors, with the new ``v`` (the
  optimizer creates, hands in and stores it, masked like the momentum);
- a weight-norm hook after the update: :meth:`~UpdateRule.committed` rescales the params it was
  given (local tensors; a norm across shards would need a reduction the strategy offers);
- a row normalization instead of Newton-Schulz: :meth:`~UpdateRule.after` normalizing the rows
  of ``U`` itself, with one more flag on the rule ("no iteration") read where the iteration is
  run and costed: :func:`rule_directions`, the planner's cost and the split plan (which then
  splits no matrix of such a group). That flag is not here yet: no rule needs it.

The rules themselves are listed in :mod:`muonkit.functional.rules` (by ``algorithm``).

Example::

    >>> MUON.rows_states, MUON.changes_directions
    ((), False)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from muonkit.functional.matrices import MatrixLayout
from muonkit.functional.muon import muon_update
from muonkit.functional.sharded import Reduce
from muonkit.functional.validation import unit

__all__ = ["MUON", "Hyperparameter", "Reduce", "RuleSettings", "StateSpec", "UpdateRule"]


class RuleSettings(Protocol):
    """What a rule's hooks read of a group's settings (a :class:`muonkit.config.MuonConfig`)."""

    @property
    def eps(self) -> float: ...

    @property
    def momentum(self) -> float: ...

    @property
    def nesterov(self) -> bool: ...

    def setting(self, key: str) -> Any: ...


@dataclass(frozen=True)
class Hyperparameter:
    """A group key of a rule: ``key`` in its groups, set for all of them by the optimizer keyword
    ``keyword`` (default ``default``); ``what`` and ``why`` document it (:mod:`muonkit.defaults`).
    ``check(name, value)`` validates a group's value; ``shared``: a key every Muon group has (``eps``),
    whose default the rule changes."""

    key: str
    keyword: str
    default: Any
    what: str
    why: str
    check: Callable[[str, Any], Any] = unit
    shared: bool = False


@dataclass(frozen=True)
class StateSpec:
    """One entry of a rule's state: ``key`` in the optimizer's ``state[param]``.

    ``kind``: ``"param"``, shaped and sharded like the param; ``"rows"``, one value per matrix row
    of every whole tensor the param stands for, whole on every rank: :meth:`length` values per
    whole tensor. Its dtype is the param's work dtype (fp32, fp64 for fp64 params).

    Example::

        >>> StateSpec("row_v", "rows").length((3, 8, 16), MatrixLayout())   # 3 experts of 8 rows
        24
    """

    key: str
    kind: Literal["param", "rows"]
    nonnegative: bool = False
    """Whether its values are never negative (a second moment: a checkpoint with negative ones is refused)."""

    def length(self, shape: Sequence[int], layout: MatrixLayout) -> int:
        """Values of a ``"rows"`` entry for one whole tensor of ``shape``: one per row of each matrix
        (a column split's blocks each have all the rows: one vector per block)."""
        count, rows, _ = layout.base_shape(tuple(shape))
        return count * rows * (layout.per_matrix if layout.splits_cols else 1)

    @staticmethod
    def split(v: Tensor, shape: Sequence[int], layout: MatrixLayout) -> list[Tensor]:
        """``v`` (a ``"rows"`` entry of a tensor) as one ``(count, rows)`` view per block of ``layout``:
        ``v.view(count, rows)`` cut at the row blocks, or ``v.view(count, blocks, rows)``, block by
        block, for a column split."""
        count, rows, _ = layout.base_shape(tuple(shape))
        if layout.splits_cols:
            return list(v.view(count, layout.per_matrix, rows).unbind(1))
        base = v.view(count, rows)
        if layout.split_sizes is None:
            return [base]
        return list(torch.split(base, list(layout.split_sizes), dim=1))


class UpdateRule:
    """A Muon-family update rule; this base is Muon itself (no hook does anything beyond Muon)."""

    name: str = "muon"
    """The groups' ``algorithm``."""
    title: str = "Muon"
    """Its name in messages."""
    hyperparameters: tuple[Hyperparameter, ...] = ()
    states: tuple[StateSpec, ...] = (StateSpec("momentum_buffer", "param"),)
    direction_factor: Callable[[int, int], float] | None = None
    """``(rows, cols) -> f``: a bound on ``|D| / (scale * top)`` entrywise beyond Muon's 1, where
    :meth:`after` changes the orthogonalized matrix (:mod:`muonkit.functional.overflow`)."""

    @functools.cached_property
    def param_states(self) -> tuple[StateSpec, ...]:
        """The ``"param"`` entries of :attr:`states` but the momentum buffer (which every rule keeps):
        what :meth:`before` reads and writes."""
        return tuple(s for s in self.states if s.kind == "param" and s.key != "momentum_buffer")

    @functools.cached_property
    def rows_states(self) -> tuple[StateSpec, ...]:
        """The ``"rows"`` entries of :attr:`states`: what the strategies carry, whole on every rank."""
        return tuple(s for s in self.states if s.kind == "rows")

    @functools.cached_property
    def changes_directions(self) -> bool:
        """Whether :meth:`after` does anything: the directions then travel in the update dtype
        (they are no longer the compute dtype's values)."""
        return type(self).after is not UpdateRule.after

    @functools.cached_property
    def changes_updates(self) -> bool:
        """Whether :meth:`before` is the rule's own (else the step runs Muon's momentum itself)."""
        return type(self).before is not UpdateRule.before

    @functools.cached_property
    def has_commit_hook(self) -> bool:
        """Whether :meth:`committed` does anything (else the step does not call it)."""
        return type(self).committed is not UpdateRule.committed

    def keys(self, base: Sequence[str]) -> tuple[str, ...]:
        """A group's keys: ``base`` (Muon's) and this rule's own."""
        return (*base, *(h.key for h in self.hyperparameters if h.key not in base))

    def before(
        self, buffers: list[Tensor], grads: list[Tensor], states: list[list[Tensor]], settings: RuleSettings
    ) -> tuple[list[Tensor], list[list[Tensor]]]:
        """The updates ``U`` to orthogonalize (new tensors) from the local momentum ``buffers`` and
        gradients, neither modified: Muon's momentum (:func:`~muonkit.functional.muon.muon_update`);
        the buffers are advanced the same way when the step commits. ``states``: per param, the
        local tensors of :attr:`param_states` (not modified); returned with ``U``: their new values
        (new tensors), written when the step commits (``[]`` without such states)."""
        del states
        return muon_update(buffers, grads, momentum=settings.momentum, nesterov=settings.nesterov), []

    def after(self, o: Tensor, olds: Sequence[Tensor], settings: RuleSettings) -> tuple[Tensor, list[Tensor]]:
        """``o``: ``(count, rows, cols)`` orthogonalized matrices of one shape; ``olds``: their
        ``"rows"`` states (one ``(count, rows)`` tensor per entry of :attr:`rows_states`), not
        modified. Returns the matrices to scale and apply, and the new states."""
        del settings
        return o, list(olds)

    def after_shard(
        self, o: Tensor, olds: Sequence[Tensor], *, rows_cut: bool, cols: int, reduce: Reduce, settings: RuleSettings
    ) -> tuple[Tensor, list[Tensor]]:
        """:meth:`after` on one shard of a split matrix: ``o`` ``(1, rows, cols_i)`` in the matrix's
        orientation, ``olds`` the states of the rows it holds; ``rows_cut``: each shard holds some
        columns of every row (else whole rows); ``cols``: the whole's columns."""
        del rows_cut, cols, reduce, settings
        return o, list(olds)

    def committed(self, params: Sequence[Tensor], settings: RuleSettings) -> None:
        """Called with the local params right after their update is applied (a weight-norm hook)."""
        del params, settings


MUON = UpdateRule()
"""Muon: the momentum, the orthogonalization, the lr shape scale; nothing more."""

"""The registry of update rules (:mod:`muonkit.functional.update_rule`), by their groups' ``algorithm``."""

from __future__ import annotations

from collections.abc import Mapping

from muonkit.functional.normuon import NORMUON
from muonkit.functional.update_rule import MUON, Hyperparameter, UpdateRule

__all__ = ["RULES", "WHOLE_STATES", "rule_keywords", "rule_of"]

RULES: Mapping[str, UpdateRule] = {rule.name: rule for rule in (MUON, NORMUON)}
"""Every update rule by its ``algorithm`` name."""
WHOLE_STATES = frozenset(s.key for rule in RULES.values() for s in rule.rows_states)
"""The state keys of every rule's ``"rows"`` states: one value per matrix row of the whole param,
on every rank (not sharded like the param)."""


def rule_of(algorithm: str) -> UpdateRule:
    """The rule of a group's ``algorithm`` (a name of :data:`RULES`)."""
    return RULES[algorithm]


def rule_keywords() -> dict[str, tuple[UpdateRule, Hyperparameter]]:
    """Every rule's optimizer-wide keywords: ``{keyword: (rule, hyperparameter)}``, in registry order."""
    return {h.keyword: (rule, h) for rule in RULES.values() for h in rule.hyperparameters}

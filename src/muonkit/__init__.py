"""muonkit: the Muon optimizer as a drop-in, correct and fast replacement for AdamW.

    import muonkit
    opt = muonkit.HybridMuon(muonkit.param_groups(model), lr=0.02, adamw_lr=3e-4)
    print(muonkit.explain(model))

Layers (imports flow one way): ``integrations``, ``cli``, ``bench`` -> ``optimizer`` ->
``distributed`` -> ``functional`` -> torch.
"""

from muonkit import optimizer as _optimizer
from muonkit.functional.orthogonalize import orthogonalize
from muonkit.optimizer import HybridMuon
from muonkit.param_groups import RoutingReport, explain, param_groups
from muonkit.qk_clip import QKClip
from muonkit.routing import Route, Rule, lora_rules
from muonkit.torch_muon import Muon

# Muon's home before the optimizer was split by concern: `from muonkit.optimizer import Muon` (and
# pickles made then) keep working. Set here, where both are imported, so no module imports in a circle.
setattr(_optimizer, "Muon", Muon)  # noqa: B010

__all__ = [
    "HybridMuon",
    "Muon",
    "QKClip",
    "Route",
    "RoutingReport",
    "Rule",
    "explain",
    "lora_rules",
    "orthogonalize",
    "param_groups",
]
__version__ = "0.1.0"

"""QK-Clip (MuonClip, Kimi K2, arXiv 2507.20534): keep attention logits below a threshold.

Muon's updates have a large spectral norm; on long runs some heads' query and key weights grow
until their attention logits explode (Kimi K2 saw logits above 1000 and loss spikes). QK-Clip
watches every head's largest logit ``S_h = max q . k * scale`` during the forward passes of a step
and, right after the optimizer step, shrinks the query and key rows of each head above the
threshold tau by ``gamma_h = tau / S_h`` (queries ``gamma_h ** alpha``, keys ``gamma_h ** (1 - alpha)``),
so that head's largest logit would now be exactly tau. Heads below tau are never touched; with
grouped keys see :mod:`muonkit.functional.qk_clip`.

Example::

    clip = muonkit.QKClip(model, optimizer, threshold=100.0)   # hooks optimizer.step()
    for batch in data:
        model(**batch).loss.backward()
        optimizer.step()          # QK-Clip runs right after, on every rank
        optimizer.zero_grad()
    clip.last_max_logit            # the largest logit the last step saw (for logging)

What is observed: transformers models through their attention interface (``eager`` and ``sdpa``;
the model's attention implementation is switched to a wrapper that computes the maxima and then
calls the original), and hand-written attention that calls :func:`observed_attention` and
declares its rows with a ``qk_clip_layout() -> QKLayout`` method. Only modules in training mode
are observed.

The package, by what each module does (imports flow down this list, never up):

==============================  ==============================================================
module                          what it does
==============================  ==============================================================
:mod:`.clip`                    :class:`QKClip`: after each step, reduce the maxima over the
                                ranks (counted :class:`~muonkit.distributed.collectives.Collectives`)
                                and rescale the rows this rank holds (``Strategy.regions``)
:mod:`.transformers_attention`  transformers' attention interface: the observing wrappers
:mod:`.layouts`                 which modules are observed, where their q/k rows live
:mod:`.observe`                 the running per-head maxima, :func:`observed_attention`
==============================  ==============================================================

The math (maxima, factors, per-row scales) is :mod:`muonkit.functional.qk_clip`, with the
optimizer's math: pure functions on local tensors, below the distributed layer.
"""

from muonkit.functional.qk_clip import HeadRows, QKLayout
from muonkit.qk_clip.clip import QKClip
from muonkit.qk_clip.observe import SLOT, observed_attention

__all__ = ["SLOT", "HeadRows", "QKClip", "QKLayout", "observed_attention"]

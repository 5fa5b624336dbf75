"""Whether a step applies: the one home of the rank agreement, the non-finite verdict and the late checks.

Every strategy makes one :class:`Guard` (:attr:`muonkit.distributed.Strategy.guard`); the
optimizer calls it at a few named points of ``step()`` and knows nothing else about verdicts:

============================  ===================================================================
point                         what the guard does there
============================  ===================================================================
``align_grads(params)``       lays out each gradient like its param (before anything is checked)
``before(opt, ...)``          the ranks' agreement (settings, which params have gradients, TP
                              fingerprints), then the verdict's policy: a :class:`Verdict`
``Stream.check(directions)``  per committed Muon chunk of a streamed verdict (in
                              :func:`muonkit.stages.commit_muon`): apply it, or the device mask
``outcome(opt, verdict)``     the streamed verdict's one read; whether AdamW goes on
``end()``                     the late checks of a step without a verdict; closes the step
``step_failed(error, ...)``   tells the other ranks (:mod:`muonkit.distributed.collectives`)
============================  ===================================================================

:class:`Guard` (:mod:`.local`) is one device's (nothing to agree on, nothing to tell) and holds
the policies below; :class:`CollectiveGuard` (:mod:`.ranks`) that of every communicating
strategy (the agreement, verdict flags AND-ed over ranks, the late checks and the failure
channel, in its :class:`~muonkit.distributed.collectives.Collectives`); :class:`MeshGuard` adds
what DTensor meshes need (gradients placed otherwise than their params, the fingerprints of
plain params replicated beside tensor-parallel ones); :class:`ReplicaGuard` the fingerprints of
plain params taken as DDP replicas without ``process_group=``. The verdict's parts are in :mod:`.local`.

The verdict of :class:`muonkit.HybridMuon` (``nonfinite=``) has three policies, chosen per step
by :meth:`Guard.before`:

- **unchecked** (``nonfinite="unchecked"``): no check, no read; every chunk is applied as it comes.
- **streamed** (``"skip"``/``"raise"`` with the presets' schedules, whose directions are finite
  wherever their momentum update is): the verdict on the gradients (every one within its limit,
  :mod:`muonkit.limits`) is known before any direction, on every rank. Where reads are free (the
  CPU, :meth:`Guard.reads_wait`) it is read at once; elsewhere it stays on the device as the mask
  of every Muon commit (:class:`Stream`), and its one blocking read (:meth:`Guard.outcome`) comes
  after every Muon update is launched; AdamW, which keeps its step counts on the host, follows it.
- **held** (a custom ``ns_coefficients`` schedule, which may diverge): every direction is
  computed and held before the verdict, so a non-finite one anywhere leaves everything untouched.

A skipped step is counted in ``skipped_steps`` and logged on the ``muonkit.optimizer`` logger;
``"raise"`` raises ``FloatingPointError``; both from a verdict every rank shares.
"""

from __future__ import annotations

from muonkit.distributed.guard.local import Guard, Stream, Verdict
from muonkit.distributed.guard.ranks import CollectiveGuard, MeshGuard, ReplicaGuard

__all__ = ["CollectiveGuard", "Guard", "MeshGuard", "ReplicaGuard", "Stream", "Verdict"]

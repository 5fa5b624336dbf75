"""What muonkit's tests and benchmarks measure a step with, as ``torch.testing`` is torch's.

- :func:`as_on_an_accelerator`: on the CPU, run muonkit's accelerator path (no decision read to the
  host), so that a CPU run counts what a device run does;
- :class:`OpCounter` / :func:`count_ops`: aten calls (about one kernel launch each) and blocking host
  reads of a step (:mod:`muonkit.testing.op_counts`); :func:`step_tensors`: the tensors a device run
  keeps on the host too; :func:`gpt2_hidden_params`: GPT-2's hidden matrices, scaled down, to count on;
- :class:`StepCounter`: the collectives, bytes and matmul FLOPs a step issues on this rank
  (:mod:`muonkit.testing.dist_counters`);
- :class:`LiveBytes`: the peak bytes of the storages a block allocates and holds
  (:mod:`muonkit.testing.live_bytes`).

Nothing in the optimizer imports this package: it only reads and counts.
"""

from __future__ import annotations

from muonkit.testing.dist_counters import StepCounter
from muonkit.testing.live_bytes import LiveBytes
from muonkit.testing.op_counts import (
    GPT2_SCALE,
    HOST_READ_OPS,
    OpCounter,
    OpCounts,
    as_on_an_accelerator,
    count_ops,
    gpt2_hidden_params,
    step_tensors,
)

__all__ = [
    "GPT2_SCALE",
    "HOST_READ_OPS",
    "LiveBytes",
    "OpCounter",
    "OpCounts",
    "StepCounter",
    "as_on_an_accelerator",
    "count_ops",
    "gpt2_hidden_params",
    "step_tensors",
]

"""Memory arithmetic of mixed-precision training with AdamW or HybridMuon, under ZeRO-0/1/2/3.

The accounting (per DeepSpeed's ZeRO paper, Rajbhandari et al. 2020, section 3.1), for ``n``
parameters of which ``n_muon`` are routed to Muon (f = n_muon / n):

============== ============================== =========================================
tensor         bytes per parameter            partitioned across the N ranks at stage
============== ============================== =========================================
params         2 (bf16)                       3
grads          2 (bf16)                       2, 3
master         4 (fp32 copy of the params)    1, 2, 3
states         AdamW 8 (exp_avg, exp_avg_sq);  1, 2, 3
               Muon 4 (momentum_buffer)
============== ============================== =========================================

So the paper's ``K`` (optimizer bytes per parameter, master included) is 12 for AdamW and
``12 - 4 f`` for HybridMuon. A partitioned tensor set costs ``ceil(n_set / N)`` elements on the
largest rank; the Muon-routed and AdamW-routed tensors are partitioned as two separate sets
(two param groups), so both optimizers see the same partitions.

Savings of HybridMuon against AdamW::

    states only:            1 - (4 f + 8 (1 - f)) / 8   = f / 2
    states + fp32 master:   1 - (12 - 4 f) / 12         = f / 3
    all model states:       4 f / (16) at stage 0, more at higher stages (the states dominate)

Activations, temporary buffers (communication buckets, the optimizer's own workspace) and
allocator fragmentation are outside this arithmetic; :mod:`muonkit_bench.memory_probe`
measures a real process.

Example::

    >>> model_state_bytes(n_muon=48, n_adamw=58, optimizer="hybrid_muon", stage=2, world_size=4).total
    542
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

OptimizerName = Literal["adamw", "hybrid_muon"]
OPTIMIZERS: tuple[OptimizerName, ...] = ("adamw", "hybrid_muon")
STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class ElementBytes:
    """Bytes per parameter of each tensor kind (the mixed-precision defaults)."""

    param: int = 2
    grad: int = 2
    master: int = 4
    muon_state: int = 4
    adamw_state: int = 8


@dataclass(frozen=True)
class RankBytes:
    """Model-state bytes held by the largest rank."""

    params: int
    grads: int
    master: int
    states: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master + self.states

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def shard(n: int, world_size: int) -> int:
    """Elements of an ``n``-element set on the largest of ``world_size`` ranks (padded split)."""
    return -(-n // world_size)


def model_state_bytes(
    *,
    n_muon: int,
    n_adamw: int,
    optimizer: OptimizerName,
    stage: int,
    world_size: int,
    sizes: ElementBytes = ElementBytes(),
) -> RankBytes:
    """Per-rank bytes of params, grads, fp32 master weights and optimizer states.

    ``optimizer="adamw"`` keeps AdamW states for all ``n_muon + n_adamw`` params;
    ``"hybrid_muon"`` keeps Muon's one buffer for the ``n_muon`` and AdamW's two for the rest.
    """
    if stage not in STAGES:
        raise ValueError(f"Invalid stage={stage!r}: must be one of {STAGES}")
    if world_size < 1:
        raise ValueError(f"Invalid world_size={world_size!r}: must be >= 1")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"Invalid optimizer={optimizer!r}: must be one of {OPTIMIZERS}")
    if n_muon < 0 or n_adamw < 0:
        raise ValueError(f"Invalid counts n_muon={n_muon}, n_adamw={n_adamw}: must be >= 0")
    n = n_muon + n_adamw

    def elements(partitioned: bool) -> int:
        return shard(n_muon, world_size) + shard(n_adamw, world_size) if partitioned else n

    muon_state = sizes.muon_state if optimizer == "hybrid_muon" else sizes.adamw_state
    states_muon = shard(n_muon, world_size) if stage >= 1 else n_muon
    states_adamw = shard(n_adamw, world_size) if stage >= 1 else n_adamw
    return RankBytes(
        params=sizes.param * elements(stage >= 3),
        grads=sizes.grad * elements(stage >= 2),
        master=sizes.master * elements(stage >= 1),
        states=muon_state * states_muon + sizes.adamw_state * states_adamw,
    )


@dataclass(frozen=True)
class Savings:
    """HybridMuon's saving against AdamW, as fractions of AdamW's figure."""

    states: float
    states_and_master: float

    @classmethod
    def of(cls, *, n_muon: int, n_adamw: int, sizes: ElementBytes = ElementBytes()) -> Savings:
        n = n_muon + n_adamw
        if n == 0:
            return cls(0.0, 0.0)
        adamw = sizes.adamw_state * n
        hybrid = sizes.muon_state * n_muon + sizes.adamw_state * n_adamw
        master = sizes.master * n
        return cls(states=1 - hybrid / adamw, states_and_master=1 - (hybrid + master) / (adamw + master))


def zero_table(
    *, n_muon: int, n_adamw: int, world_size: int, sizes: ElementBytes = ElementBytes()
) -> dict[int, dict[str, RankBytes]]:
    """``{stage: {optimizer: RankBytes}}`` for ZeRO stages 0-3 at ``world_size`` ranks."""
    return {
        stage: {
            opt: model_state_bytes(
                n_muon=n_muon, n_adamw=n_adamw, optimizer=opt, stage=stage, world_size=world_size, sizes=sizes
            )
            for opt in OPTIMIZERS
        }
        for stage in STAGES
    }


def world_size_for_saving(*, n_muon: int, saving_bytes: float, sizes: ElementBytes = ElementBytes()) -> float:
    """The world size N at which the per-rank state saving (ZeRO-1/2) equals ``saving_bytes``.

    At stage >= 1 the saving per rank is ``(adamw_state - muon_state) * n_muon / N``.
    """
    return (sizes.adamw_state - sizes.muon_state) * n_muon / saving_bytes

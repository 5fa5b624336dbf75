"""The simulator's table (one row per model and mesh) and what its columns mean."""

from __future__ import annotations

from collections.abc import Sequence

from muonkit.simulator.simulate import Estimate, Simulation, describe_bytes, describe_flops

__all__ = ["COLUMNS", "footnote", "header", "row", "table"]

COLUMNS = {
    "ranks": "world size (all pipeline stages)",
    "jobs": "matrices to orthogonalize (each expert and split block its own)",
    "pieces": "(rank, region) pairs of the layout: what planning walks",
    "plan s": "CPU seconds to build the jobs and plan them, one rank's stage, from cold caches",
    "plan MiB": "resident memory those jobs and plans take",
    "NS/rank": "Newton-Schulz FLOPs of the busiest rank, and busiest / mean",
    "sent/rank": "bytes the busiest rank sends per step, and that in bf16 gradients of the Muon params",
    "recv/rank": "bytes the busiest rank receives per step (x one bf16 gradient)",
    "host ms": "the executor's Python and dispatch work per steady step on the rank handling most pieces",
    "overhead": "(Newton-Schulz + exchange) / training step, see the cost model",
}


def table(sims: Sequence[Simulation]) -> str:
    """A Markdown table of ``sims``, then the cost model's assumptions."""
    lines = [header(), *(row(sim) for sim in sims)]
    return "\n".join(lines + ([f"\n{footnote(sims[0].estimate)}"] if sims else []))


def header() -> str:
    names = ["model", "mesh", *COLUMNS]
    return "| " + " | ".join(names) + " |\n|" + "---|" * len(names)


def row(sim: Simulation) -> str:
    d = sim.to_dict()
    grad = d["bf16_gradient_bytes"]
    host = d["host"].get("step_s")
    cells = [
        sim.model.name.split(" (")[0],
        d["mesh"],
        f"{d['world_size']:,}",
        f"{d['jobs']:,}",
        f"{d['pieces']:,}",
        f"{d['plan_seconds']:.2f}",
        f"{d['plan_memory_bytes'] / 2**20:.1f}",
        f"{describe_flops(d['ns_flops_busiest'])} ({d['ns_busiest_over_mean']:.2f}x)",
        f"{describe_bytes(d['sent_bytes_busiest'])} ({d['sent_bytes_busiest'] / grad:.3g}x)",
        f"{describe_bytes(d['received_bytes_busiest'])} ({d['received_bytes_busiest'] / grad:.3g}x)",
        "-" if host is None else f"{1000 * host:.1f}",
        f"{100 * d['estimate']['overhead']:.2f}%",
    ]
    return "| " + " | ".join(cells) + " |"


def footnote(e: Estimate) -> str:
    return (
        f"Overhead at {e.tokens:,} tokens per step, {e.peak_tflops:g} TFLOP/s peak per rank (training at "
        f"{e.mfu:.0%}, Newton-Schulz at {e.ns_efficiency:.0%} of it), {e.bandwidth:g} GB/s per rank."
    )

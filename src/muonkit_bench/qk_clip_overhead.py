"""What QK-Clip's observation costs per training step: forward + backward with and without a QKClip.

``python -m muonkit_bench.qk_clip_overhead [--seq 128] [--batch 2] [--repeats 3]`` builds a small
random Llama (hidden 256, 4 layers, 8 query heads, 4 key heads, vocab 2048; no download) with
attn_implementation eager and sdpa, and times, interleaved, a forward + backward without QK-Clip
and with a QKClip observing every head (the max of q.k*scale computed in query-row blocks), and
the clip itself (the all-reduce is a no-op on one process). Times are this process's CPU time,
the fastest of the repeats (wall-clock on a shared machine measures the neighbours). Prints a
table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

import muonkit


def _model(implementation: str) -> Any:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
                            bos_token_id=0, eos_token_id=1)  # fmt: skip
    return tf.AutoModelForCausalLM.from_config(config, attn_implementation=implementation).train()


def _step_seconds(model: Any, ids: torch.Tensor) -> float:
    start = time.process_time()
    model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    return time.process_time() - start


def measure(implementation: str, *, seq: int, batch: int, repeats: int) -> dict[str, float]:
    model = _model(implementation)
    ids = torch.randint(0, 2048, (batch, seq), generator=torch.Generator().manual_seed(1))
    clip = muonkit.QKClip(model, threshold=100.0)
    plain, observed, clips = [], [], []
    for _ in range(repeats + 1):  # the first round warms up and is dropped
        clip.remove()
        plain.append(_step_seconds(model, ids))
        clip = muonkit.QKClip(model, threshold=100.0)
        observed.append(_step_seconds(model, ids))
        start = time.process_time()
        clip.clip()
        clips.append(time.process_time() - start)
    clip.remove()
    base, watched = min(plain[1:]), min(observed[1:])
    return {
        "plain_ms": 1e3 * base,
        "observed_ms": 1e3 * watched,
        "overhead_pct": 100 * (watched / base - 1),
        "clip_ms": 1e3 * min(clips[1:]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("qk_clip_overhead.json"))
    args = parser.parse_args(argv)
    results: dict[str, Any] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "seq": args.seq,
        "batch": args.batch,
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch} x seq {args.seq}")
    print(f"{'attention':<10}{'plain CPU ms':>14}{'observed CPU ms':>17}{'overhead':>10}{'clip ms':>9}")
    for implementation in ("eager", "sdpa"):
        row = measure(implementation, seq=args.seq, batch=args.batch, repeats=args.repeats)
        results[implementation] = row
        print(
            f"{implementation:<10}{row['plain_ms']:>14.1f}{row['observed_ms']:>17.1f}"
            f"{row['overhead_pct']:>9.1f}%{row['clip_ms']:>9.2f}"
        )
    args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`muonkit inspect`: the benchmark GPT and Hugging Face configs, printed and as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from muonkit.bench.model import GPT, GPTConfig
from muonkit.cli import main


def _inspect(args: list[str], tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / "report.json"
    assert main(["inspect", *args, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def _algorithms(report: dict[str, Any]) -> dict[str, str]:
    return {t["name"]: t["algorithm"] for t in report["tensors"]}


def test_inspect_gpt_routes_every_tensor_and_counts_match(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = _inspect(["gpt"], tmp_path)
    printed = capsys.readouterr().out
    assert "lm_head.weight" in printed and "Muon fraction f" in printed
    algorithms = _algorithms(report)
    for name, algorithm in algorithms.items():
        hidden = name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))
        assert algorithm == ("muon" if hidden else "adamw"), name
    assert algorithms["wte.weight"] == algorithms["wpe.weight"] == algorithms["lm_head.weight"] == "adamw"
    # The totals agree with the model itself (built for real here, small enough) and the state arithmetic.
    model = GPT(GPTConfig())
    muon = sum(p.numel() for n, p in model.named_parameters() if algorithms[n] == "muon")
    total = sum(p.numel() for p in model.parameters())
    assert report["params"] == {"muon": muon, "adamw": total - muon, "total": total}
    assert report["muon_fraction"] == pytest.approx(muon / total)
    assert report["state_bytes"] == {"hybrid_muon": 4 * muon + 8 * (total - muon), "adamw": 8 * total}
    assert {"name", "shape", "algorithm", "reason", "layout"} <= set(report["tensors"][0])


def test_inspect_gpt_split_qkv(tmp_path: Path) -> None:
    report = _inspect(["gpt", "--split-qkv"], tmp_path)
    n = GPTConfig().n_embd
    reasons = {t["name"]: t["reason"] for t in report["tensors"]}
    assert f"fused QKV split [{n}, {n}, {n}]" in reasons["blocks.0.attn.c_attn.weight"]
    assert "split" not in reasons["blocks.0.attn.c_proj.weight"]


def test_tied_head_is_the_embedding_and_counted_once() -> None:
    from muonkit import explain

    with torch.device("meta"):
        model = GPT(GPTConfig(tie_embeddings=True))
    report = explain(model)
    names = [r.name for r in report.routes]
    assert "lm_head.weight" not in names
    wte = next(r for r in report.routes if r.name == "wte.weight")
    assert (wte.algorithm, wte.reason) == ("adamw", "embedding (tied with the output head)")


LLAMA = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "architectures": ["LlamaForCausalLM"],
}  # fmt: skip
GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 64}


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (
            LLAMA,
            {
                "model.embed_tokens.weight": ("adamw", "auto"),
                "model.layers.0.self_attn.q_proj.weight": ("muon", "matrix"),
                "model.layers.1.mlp.down_proj.weight": ("muon", "matrix"),
                "model.layers.0.input_layernorm.weight": ("adamw", "auto"),
                "lm_head.weight": ("adamw", "auto"),
            },
        ),
        (
            GPT2,
            {
                "transformer.wte.weight": ("adamw", "auto"),
                "transformer.wpe.weight": ("adamw", "auto"),
                "transformer.h.0.attn.c_attn.weight": ("muon", "transposed"),
                "transformer.h.1.mlp.c_proj.bias": ("adamw", "auto"),
            },
        ),
    ],
    ids=["llama", "gpt2"],
)
def test_inspect_hugging_face_config(tmp_path: Path, config: dict[str, Any], expected: dict[str, Any]) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    report = _inspect([str(path)], tmp_path)
    rows = {t["name"]: (t["algorithm"], t["layout"]) for t in report["tensors"]}
    for name, want in expected.items():
        assert rows[name] == want, name
    assert report["params"]["muon"] + report["params"]["adamw"] == report["params"]["total"] > 0


def test_console_entry_point_lists_the_nanogpt_benchmark() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "muonkit.cli", "bench", "nanogpt", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "--preset" in out.stdout and "--adamw-lr" in out.stdout

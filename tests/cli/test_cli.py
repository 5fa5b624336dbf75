"""`muonkit inspect` (GPT-2 and Hugging Face configs, printed and as JSON); `muonkit bench` with and without the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from muonkit.cli import main


def _inspect(args: list[str], tmp_path: Path) -> dict[str, Any]:
    pytest.importorskip("transformers", reason="muonkit inspect builds models from configs with the hf extra")
    out = tmp_path / "report.json"
    assert main(["inspect", *args, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def _algorithms(report: dict[str, Any]) -> dict[str, str]:
    return {t["name"]: t["algorithm"] for t in report["tensors"]}


def test_inspect_defaults_to_gpt2_and_counts_match(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = _inspect([], tmp_path)
    printed = capsys.readouterr().out
    assert "transformer.wte.weight" in printed and "Muon fraction f" in printed
    algorithms = _algorithms(report)
    for name, algorithm in algorithms.items():
        hidden = name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))
        assert algorithm == ("muon" if hidden else "adamw"), name
    assert "lm_head.weight" not in algorithms  # tied with wte, counted once
    # GPT-2 124M's published arithmetic: 12 layers of 768x2304 + 768x768 + 2 x 768x3072 on Muon.
    muon = 12 * (768 * 2304 + 768 * 768 + 2 * 768 * 3072)
    total = 124_439_808
    assert report["params"] == {"muon": muon, "adamw": total - muon, "total": total}
    assert report["muon_fraction"] == pytest.approx(muon / total)
    assert report["state_bytes"] == {"hybrid_muon": 4 * muon + 8 * (total - muon), "adamw": 8 * total}
    assert {"name", "shape", "algorithm", "reason", "layout"} <= set(report["tensors"][0])


def test_inspect_gpt2_split_qkv(tmp_path: Path) -> None:
    report = _inspect(["gpt2", "--split-qkv"], tmp_path)
    reasons = {t["name"]: t["reason"] for t in report["tensors"]}
    assert "fused QKV split [768, 768, 768]" in reasons["transformer.h.0.attn.c_attn.weight"]
    assert "split" not in reasons["transformer.h.0.attn.c_proj.weight"]


def test_inspect_gpt2_per_head(tmp_path: Path) -> None:
    report = _inspect(["gpt2", "--per-head"], tmp_path)
    reasons = {t["name"]: t["reason"] for t in report["tensors"]}
    assert reasons["transformer.h.0.attn.c_attn.weight"].endswith("per head: 36 x (64, 768)")
    assert reasons["transformer.h.0.attn.c_proj.weight"].endswith("per head: 12 x (768, 64)")
    assert "per head" not in reasons["transformer.h.0.mlp.c_proj.weight"]
    with pytest.raises(SystemExit, match=r"per-head settings: pass per_head=True"):
        main(["inspect", "gpt2", "--heads", "6"])


def test_inspect_refuses_what_it_cannot_build(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"'gpt' is neither 'gpt2' nor a path to a Hugging Face config.json"):
        main(["inspect", "gpt"])


def test_bench_without_the_suite_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The library's CLI without the benchmark package: the other commands work, ``bench`` says what to install."""
    for name in [m for m in sys.modules if m == "muonkit_bench" or m.startswith("muonkit_bench.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "muonkit_bench", None)  # import muonkit_bench -> ModuleNotFoundError
    with pytest.raises(
        SystemExit,
        match=r"not installed: muonkit-bench is not on PyPI yet: .*pip install -e \./bench.*--find-links dist 'muonkit\[bench\]'",
    ):
        main(["bench", "nanogpt", "--preset", "tiny"])
    with pytest.raises(SystemExit) as help_exit:
        main(["convert-deepspeed", "--help"])
    assert help_exit.value.code == 0


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


def test_version_is_the_packages(capsys: pytest.CaptureFixture[str]) -> None:
    import muonkit

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"muonkit {muonkit.__version__}\n"


def test_inspect_without_transformers_is_one_line() -> None:
    """In a fresh process with transformers blocked: one line on stderr, exit 1, no traceback."""
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    code = "import sys; sys.modules['transformers'] = None; from muonkit.cli import main; sys.exit(main(['inspect']))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("muonkit inspect: muonkit's Hugging Face integration needs transformers: ")

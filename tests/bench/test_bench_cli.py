"""``muonkit bench``: the suite's commands on the library's parser, a benchmark whose dependency is missing, the GPT's routing."""

from __future__ import annotations

import argparse
import sys

import pytest
import torch

from muonkit import explain
from muonkit.cli import main
from muonkit_bench import cli as bench_cli
from muonkit_bench.model import GPT, GPTConfig


def test_every_benchmark_is_on_the_library_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["bench", "--help"])
    assert done.value.code == 0
    listed = capsys.readouterr().out
    for name in bench_cli.BENCHES:
        assert name in listed, name


def test_a_benchmark_missing_a_dependency_is_listed_and_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """numpy is imported when the module loads, tqdm only when a run starts: both say what to install."""
    for name in [m for m in sys.modules if m.startswith("muonkit_bench.") and m != "muonkit_bench.cli"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "numpy", None)  # import numpy -> ModuleNotFoundError
    parser = argparse.ArgumentParser()
    bench_cli.add_commands(parser.add_subparsers(dest="bench", required=True))
    args = parser.parse_args(["nanogpt", "--preset", "tiny"])
    with pytest.raises(SystemExit, match=r"needs the package 'numpy'.*pip install -e \./bench"):
        args.run(args)


def test_a_package_imported_when_the_run_starts_is_reported_too(monkeypatch: pytest.MonkeyPatch) -> None:
    def main(args: argparse.Namespace) -> int:
        import tqdm  # noqa: F401

        return 0

    monkeypatch.setitem(sys.modules, "tqdm", None)
    with pytest.raises(SystemExit, match=r"muonkit bench x: this benchmark needs the package 'tqdm'"):
        bench_cli._guarded(main)(argparse.Namespace(bench="x"))


def test_gpt_tied_head_is_the_embedding_and_counted_once() -> None:
    with torch.device("meta"):
        model = GPT(GPTConfig(tie_embeddings=True))
    report = explain(model)
    names = [r.name for r in report.routes]
    assert "lm_head.weight" not in names
    wte = next(r for r in report.routes if r.name == "wte.weight")
    assert (wte.algorithm, wte.reason) == ("adamw", "embedding (tied with the output head)")


def test_gpt_routes_its_hidden_matrices_to_muon() -> None:
    with torch.device("meta"):
        model = GPT(GPTConfig())
    algorithms = {r.name: r.algorithm for r in explain(model).routes}
    for name, algorithm in algorithms.items():
        hidden = name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))
        assert algorithm == ("muon" if hidden else "adamw"), name


NAME_LISTS = [  # (argv, the message's start, the names it must list)
    (["step", "--methods", "hybrid_muon,nope"], "Invalid --methods 'hybrid_muon,nope': 'nope'; known: ", ["adamw", "hybrid_muon", "torch_muon"]),
    (["step", "--methods", "deepspeed_gram", "--no-deepspeed"], "Invalid --methods 'deepspeed_gram': 'deepspeed_gram'", ["adamw_compiled, torch_muon_compiled need --compiled; --no-deepspeed leaves out deepspeed_standard, deepspeed_gram"]),
    (["step", "--models", "tiny,gpt3"], "Invalid --models 'tiny,gpt3': 'gpt3'; known: ", ["gpt2-124m", "bench-gpt", "tiny"]),
    (["step", "--presets", "keller,jordan"], "Invalid --presets 'keller,jordan': 'jordan'; known: ", ["polar_express", "keller", "you"]),
    (["step", "--ns-steps", "3,x"], "Invalid --ns-steps '3,x': must be comma-separated integers >= 1", []),
    (["memory", "--measure", "--probe-optimizers", "adamw,sgd"], "Invalid --probe-optimizers 'adamw,sgd': 'sgd'; known: ", ["adamw", "hybrid_muon", "torch_muon"]),
    (["finetune", "--tasks", "sentiment,imdb"], "Invalid --tasks 'sentiment,imdb': 'imdb'; known: ", ["sentiment", "trec", "rotten"]),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "start", "names"), NAME_LISTS, ids=[" ".join(a[:2]) for a, _, _ in NAME_LISTS])
def test_an_unknown_name_in_a_list_option_exits_listing_the_known_ones_before_any_work(
    argv: list[str], start: str, names: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: pytest.TempPathFactory
) -> None:
    from muonkit_bench import finetune, memory, step

    def ran(*args: object, **kwargs: object) -> None:
        raise AssertionError("the benchmark started before checking its name lists")

    monkeypatch.setattr(step, "Harness", ran)
    monkeypatch.setattr(memory, "model_report", ran)
    monkeypatch.setattr(finetune, "gpt_finetunes", ran)
    with pytest.raises(SystemExit) as done:
        main(["bench", *argv, "--out", str(tmp_path / "out")])
    message = str(done.value.code)
    assert message.startswith(start), message
    assert all(n in message for n in names), message

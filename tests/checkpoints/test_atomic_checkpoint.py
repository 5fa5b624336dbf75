"""A ``kill -9`` while ``save_checkpoint`` overwrites a checkpoint leaves the previous or the new
one loadable, never a broken one; so does a crash between the two renames of the portable swap.

The kill test forks a writer that saves generation 1, 2, 3, ... (every param and state filled
with the generation number) into the same directory, kills it with SIGKILL part-way through a
save, and loads what is there: every tensor must hold one and the same generation.
``python tests/checkpoints/test_atomic_checkpoint.py --trials 10`` prints how many trials left an unloadable
or mixed checkpoint (the figures in docs/reliability.md).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

import muonkit
from muonkit import atomic
from muonkit.distributed.checkpoint import load_checkpoint, save_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
FRACTIONS = (0.1, 0.3, 0.5, 0.7, 0.9)  # of one save's duration, after the save began


def _model() -> tuple[torch.nn.Module, muonkit.HybridMuon]:
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)])
    opt = muonkit.HybridMuon(muonkit.param_groups(model))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return model, opt


def _fill(model: torch.nn.Module, opt: muonkit.HybridMuon, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
            for key, state in opt.state[p].items():
                if key != "step":
                    state.fill_(value)


def _save(how: str, path: str, model: torch.nn.Module, opt: muonkit.HybridMuon) -> None:
    if how == "save_checkpoint":
        save_checkpoint(path, model=model, optimizer=opt)
    elif how == "torch.save":  # what the issue did: overwrite the previous file in place
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    else:  # the docs' pattern (docs/reliability.md) for your own files: write aside, fsync, os.replace
        atomic.replace_file(path, lambda f: torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f))


def _writer(path: str, progress: str, how: str) -> None:
    """Save generation 1, 2, ... forever; ``progress``: the generation being saved (or last saved)
    and how long the previous save took."""
    model, opt = _model()
    took = 0.0
    for gen in range(1, 1_000_000):
        _fill(model, opt, float(gen))
        _report(progress, f"start {gen} {took}")
        begun = time.monotonic()
        _save(how, path, model, opt)
        took = time.monotonic() - begun
        _report(progress, f"done {gen} {took}")


def _report(progress: str, line: str) -> None:
    """Replace the progress file in one step: a kill never leaves it half-written."""
    Path(progress + ".new").write_text(line)
    os.replace(progress + ".new", progress)


def _generations(path: str, how: str = "save_checkpoint") -> set[float]:
    model, opt = _model()
    _fill(model, opt, -1.0)
    if how == "save_checkpoint":
        load_checkpoint(path, model=model, optimizer=opt)
    else:
        saved = torch.load(path, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    values = {float(v) for p in model.parameters() for v in p.detach().unique()}
    values |= {float(v) for p in model.parameters() for k, s in opt.state[p].items() if k != "step" for v in s.unique()}
    return values


def _read(progress: str) -> tuple[str, int, float]:
    state, gen, took = Path(progress).read_text().split()
    return state, int(gen), float(took)


def _trial(tmp: Path, fraction: float, how: str = "save_checkpoint") -> tuple[bool, str]:
    """Kill the writer ``fraction`` of a save into its third save; returns (killed mid-save, outcome)."""
    tmp.mkdir(parents=True, exist_ok=True)
    path, progress = str(tmp / "ckpt"), str(tmp / "progress")
    _report(progress, "none 0 0")
    writer = multiprocessing.get_context("fork").Process(target=_writer, args=(path, progress, how), daemon=True)
    writer.start()
    while (now := _read(progress))[:2] != ("start", 3):  # generations 1 and 2 are saved
        assert writer.is_alive(), f"the writer died (exit code {writer.exitcode})"
        time.sleep(0.001)
    time.sleep(fraction * now[2])
    assert writer.pid is not None
    os.kill(writer.pid, signal.SIGKILL)
    writer.join()
    state, gen, _ = _read(progress)
    try:
        found = _generations(path, how)
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        return state == "start", f"unloadable ({type(e).__name__})"
    if len(found) != 1 or not found <= {float(gen), float(gen - 1)}:
        return state == "start", f"mixed or wrong generations {sorted(found)[:4]} (saving {gen})"
    return state == "start", "ok"


def test_kill_9_during_save_leaves_a_loadable_checkpoint(tmp_path: Path) -> None:
    outcomes = [_trial(tmp_path / str(i), f) for i, f in enumerate(FRACTIONS)]
    assert all(outcome == "ok" for _, outcome in outcomes), outcomes
    assert any(mid for mid, _ in outcomes), "no kill landed during a save: the test proved nothing"


def test_crash_between_the_two_renames_recovers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where RENAME_EXCHANGE is missing, publish_dir renames twice; a crash in between leaves the
    previous checkpoint at PATH.muonkit-old, which load_checkpoint reads and the next save restores."""
    path = str(tmp_path / "ckpt")
    model, opt = _model()
    _fill(model, opt, 1.0)
    save_checkpoint(path, model=model, optimizer=opt)
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    renames: list[tuple[str, str]] = []
    real_rename = os.rename

    def crash_before_the_new_one_is_in(a: str, b: str) -> None:
        renames.append((a, b))
        if a == path + atomic.TMP_SUFFIX:
            raise KeyboardInterrupt("killed")
        real_rename(a, b)

    monkeypatch.setattr(os, "rename", crash_before_the_new_one_is_in)
    _fill(model, opt, 2.0)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, model=model, optimizer=opt)
    monkeypatch.setattr(os, "rename", real_rename)
    assert not os.path.exists(path) and (path, path + atomic.OLD_SUFFIX) in renames
    assert _generations(path) == {1.0}
    _fill(model, opt, 3.0)
    save_checkpoint(path, model=model, optimizer=opt)
    assert _generations(path) == {3.0}
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_save_refuses_to_replace_a_directory_of_other_files(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    model, opt = _model()
    with pytest.raises(ValueError, match=r"holds \['notes.txt'\] besides a checkpoint: save_checkpoint replaces"):
        save_checkpoint(tmp_path, model=model, optimizer=opt)
    assert os.listdir(tmp_path) == ["notes.txt"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="kill -9 during save_checkpoint: outcomes per trial")
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--dir", default="/tmp/muonkit_kill_trials")
    parser.add_argument(
        "--writer", choices=["save_checkpoint", "torch.save", "replace_file"], default="save_checkpoint"
    )
    args = parser.parse_args()
    trials = range(args.trials)
    results = [_trial(Path(args.dir) / str(i), (i + 0.5) / args.trials, args.writer) for i in trials]
    for i, (mid, outcome) in enumerate(results):
        print(f"trial {i}: killed {'during' if mid else 'between'} saves: {outcome}")
    bad = sum(outcome != "ok" for _, outcome in results)
    print(f"{bad}/{len(results)} trials left no loadable checkpoint of one generation")
    sys.exit(0)

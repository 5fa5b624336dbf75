"""``muonkit convert-deepspeed`` on a small synthetic ZeRO-3 checkpoint (no DeepSpeed run): it
never writes outside ``--output``, refuses tags that leave the checkpoint directory, never
unpickles code, and never leaves a half-written conversion over a previous one.

(tests/deepspeed_engine/ds_checks_load converts real 2-rank checkpoints of every stage.)
"""

from __future__ import annotations

import os
from collections import OrderedDict
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("deepspeed", reason="the DeepSpeed extra is not installed (pip install 'muonkit[deepspeed]')")

from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum

from muonkit.cli import main
from muonkit.integrations.deepspeed_convert import convert

SHAPES = OrderedDict([("w", torch.Size([3, 4])), ("b", torch.Size([3]))])  # one sub-group, 12 + 3 elements


def _write_zero3(tag_dir: Path, world: int = 2, rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A ZeRO-3 tag directory as DeepSpeed writes it for ``world`` ranks; returns the whole tensors.

    ``rows``: a NorMuon group's row moments, whole in every rank's state (3 rows of ``w``)."""
    tag_dir.mkdir(parents=True)
    whole = {"fp32": torch.arange(15.0), "momentum_buffer": -torch.arange(15.0)}
    sizes = [-(-12 // world), -(-3 // world)]
    for rank in range(world):
        flat = {}
        for key, t in whole.items():
            w, b = t[:12], t[12:]
            parts = [
                torch.cat([x, x.new_zeros(s * world - x.numel())])[rank * s : (rank + 1) * s]
                for x, s in zip((w, b), sizes, strict=True)
            ]
            flat[key] = torch.cat(parts)
        optim = {
            "zero_stage": ZeroStageEnum.weights, "loss_scaler": LossScaler(1.0), "dynamic_loss_scale": False,
            "overflow": False, "partition_count": world, "fp32_flat_groups": [flat["fp32"]],
            "optimizer_state_dict": {
                "state": {0: {"momentum_buffer": flat["momentum_buffer"]} | ({} if rows is None else {"row_exp_avg_sq": rows})},
                "param_groups": [{"algorithm": "muon" if rows is None else "normuon", "lr": 0.02, "params": [0]}],
            },
        }  # fmt: skip
        torch.save(
            {"optimizer_state_dict": optim, "ds_version": "0.19.8"},
            tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
        )
        model = {
            "module": OrderedDict(),
            "param_shapes": [SHAPES],
            "ds_config": {"zero_optimization": {"stage": 3}},
            "dp_world_size": world,
        }
        torch.save(model, tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
    return whole


def _checkpoint(root: Path) -> Path:
    ckpt = root / "ckpt"
    _write_zero3(ckpt / "step2")
    (ckpt / "latest").write_text("step2")
    return ckpt


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_converts_to_one_rank(tmp_path: Path) -> None:
    whole = _write_zero3(tmp_path / "ckpt" / "step2")
    assert (
        main(
            [
                "convert-deepspeed",
                str(tmp_path / "ckpt"),
                "--world-size",
                "1",
                "--tag",
                "step2",
                "--output",
                str(tmp_path / "out"),
            ]
        )
        == 0
    )
    osd = torch.load(tmp_path / "out/step2/zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)[
        "optimizer_state_dict"
    ]
    assert torch.equal(osd["fp32_flat_groups"][0], whole["fp32"])
    assert torch.equal(osd["optimizer_state_dict"]["state"][0]["momentum_buffer"], whole["momentum_buffer"])
    assert (tmp_path / "out/latest").read_text() == "step2"
    assert sorted(os.listdir(tmp_path / "out")) == ["latest", "step2"]  # nothing left aside


def test_normuon_row_moments_are_copied_not_repartitioned(tmp_path: Path) -> None:
    rows = torch.tensor([0.5, 0.25, 0.125])
    whole = _write_zero3(tmp_path / "ckpt" / "step2", world=2, rows=rows)
    argv = ["convert-deepspeed", str(tmp_path / "ckpt"), "--world-size", "3", "--tag", "step2", "--output"]
    assert main([*argv, str(tmp_path / "out")]) == 0
    for rank in range(3):
        path = tmp_path / f"out/step2/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        state = torch.load(path, weights_only=False)["optimizer_state_dict"]["optimizer_state_dict"]["state"][0]
        assert torch.equal(state["row_exp_avg_sq"], rows)
        assert state["momentum_buffer"].numel() == 4 + 1  # ceil(12/3) + ceil(3/3): repartitioned
    assert whole["momentum_buffer"].numel() == 15


def _victim(root: Path) -> Path:
    """A valid tag directory outside the checkpoint, which the conversion must not touch."""
    _write_zero3(root / "victim")
    return root / "victim"


@pytest.mark.parametrize("how", ["--tag ../victim", "absolute path in latest", "--tag /abs", "symlinked tag"])
def test_tags_that_leave_the_checkpoint_are_refused(
    tmp_path: Path, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, victim = _checkpoint(tmp_path), _victim(tmp_path)
    before = _snapshot(tmp_path)
    args = ["convert-deepspeed", str(ckpt), "--world-size", "1", "--output", str(tmp_path / "out")]
    if how == "--tag ../victim":
        args += ["--tag", "../victim"]
    elif how == "--tag /abs":
        args += ["--tag", str(victim)]
    elif how == "absolute path in latest":
        (ckpt / "latest").write_text(str(victim))
        before = _snapshot(tmp_path)
    else:
        (ckpt / "linked").symlink_to(victim)
        args += ["--tag", "linked"]
        before = _snapshot(tmp_path)
    with pytest.raises(SystemExit, match=r"muonkit convert-deepspeed: Invalid tag "):
        main(args)
    assert _snapshot(tmp_path) == before  # nothing written anywhere (no output either)


@pytest.mark.parametrize("output", ["ckpt", "ckpt/converted", "."])
def test_an_output_overlapping_the_checkpoint_is_refused(tmp_path: Path, output: str) -> None:
    ckpt = _checkpoint(tmp_path)
    before = _snapshot(tmp_path)
    with pytest.raises(ValueError, match=r"^Invalid output .* overlaps the checkpoint directory"):
        convert(ckpt, world_size=1, output=tmp_path / output if output != "." else ckpt / "step2" / "..")
    assert _snapshot(tmp_path) == before


class _Payload:
    """Unpickling this creates a directory: code run from a checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.marker),))


@pytest.mark.parametrize(
    "file", ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"]
)
def test_a_checkpoint_that_runs_code_is_refused_unexecuted(tmp_path: Path, file: str) -> None:
    ckpt = _checkpoint(tmp_path)
    marker = tmp_path / "pwned"
    path = ckpt / "step2" / file
    saved = torch.load(path, weights_only=False)
    saved["client_state"] = _Payload(marker)
    torch.save(saved, path)
    with pytest.raises(ValueError, match=r"holds objects convert-deepspeed does not unpickle \(\['posix.mkdir'\]\)"):
        convert(ckpt, world_size=1, output=tmp_path / "out")
    assert not marker.exists()
    assert not (tmp_path / "out" / "step2").exists()


def _with_client_state(ckpt: Path, value: Any, file: str = "zero_pp_rank_1_mp_rank_00_optim_states.pt") -> None:
    path = ckpt / "step2" / file
    saved = torch.load(path, weights_only=False)
    saved["client_state"] = value
    torch.save(saved, path)


def test_trusted_converts_a_checkpoint_holding_other_objects(tmp_path: Path) -> None:
    """A client_state of the user's own objects is refused by default, unpickled with --trusted."""
    ckpt = _checkpoint(tmp_path)
    _with_client_state(ckpt, Fraction(1, 3), file="zero_pp_rank_0_mp_rank_00_optim_states.pt")
    argv = ["convert-deepspeed", str(ckpt), "--world-size", "1", "--output", str(tmp_path / "out")]
    with pytest.raises(SystemExit, match=r"\(\['fractions.Fraction'\]\).*pass trusted=True \(--trusted\)"):
        main(argv)
    assert main([*argv, "--trusted"]) == 0
    out = torch.load(tmp_path / "out/step2/zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    assert out["client_state"] == Fraction(1, 3)


class _Engine:
    """What guard_load_checkpoint wraps: DeepSpeed's engine.load_checkpoint, recording its calls."""

    dp_world_size = 2

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def load_checkpoint(self, load_dir: str, tag: str | None = None, **kwargs: Any) -> tuple[str, dict[str, Any]]:
        self.calls.append((load_dir, tag, kwargs))
        return load_dir, {}


@pytest.mark.parametrize(
    "file", ["zero_pp_rank_1_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"]
)
def test_the_guarded_engine_load_refuses_a_checkpoint_that_runs_code(tmp_path: Path, file: str) -> None:
    """DeepSpeed unpickles with weights_only=False; the guard scans every file first, statically."""
    from muonkit.integrations.deepspeed_checkpoint import guard_load_checkpoint
    from muonkit.safe_load import UntrustedCheckpointError

    ckpt, marker = _checkpoint(tmp_path), tmp_path / "pwned"
    engine = _Engine()
    guard_load_checkpoint(engine)
    engine.load_checkpoint(str(ckpt))  # muonkit's own checkpoints pass
    _with_client_state(ckpt, _Payload(marker), file=file)
    message = rf"{file} holds a pickle of \['posix.mkdir'\].*guard of engine.load_checkpoint.*pass trusted=True"
    with pytest.raises(UntrustedCheckpointError, match=message):
        engine.load_checkpoint(str(ckpt), load_optimizer_states=False)
    with pytest.raises(UntrustedCheckpointError, match=message):
        engine.load_checkpoint(str(ckpt), tag="step2")
    assert not marker.exists()
    assert engine.calls == [(str(ckpt), None, {})]
    engine.load_checkpoint(str(ckpt), "step2", trusted=True)  # skips the scan; DeepSpeed itself gets no `trusted`
    assert engine.calls[-1] == (str(ckpt), "step2", {})


def test_a_failed_conversion_leaves_the_previous_output_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt, out = _checkpoint(tmp_path), tmp_path / "out"
    convert(ckpt, world_size=1, output=out)
    before = _snapshot(out)
    real_save = torch.save
    calls: list[Any] = []

    def dies_on_the_second_file(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(f)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", dies_on_the_second_file)
    with pytest.raises(KeyboardInterrupt):
        convert(ckpt, world_size=2, output=out)
    monkeypatch.setattr(torch, "save", real_save)
    assert {k: v for k, v in _snapshot(out).items() if not k.startswith("step2.muonkit-tmp")} == before
    convert(ckpt, world_size=2, output=out)  # the next run cleans up and replaces it
    assert sorted(os.listdir(out)) == ["latest", "step2"]
    assert len(os.listdir(out / "step2")) == 4


def test_help_says_what_is_unpickled(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["convert-deepspeed", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "torch.load(weights_only=True)" in text and "never unpickled" in text
    assert "engine.load_checkpoint unpickles with weights_only=False" in text


def test_module_entry_point_has_the_same_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m muonkit.integrations.deepspeed_convert`` parses on its own (no import of the CLI)."""
    from muonkit.integrations.deepspeed_convert import main as module_main

    with pytest.raises(SystemExit) as info:
        module_main(["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert text.startswith("usage: muonkit convert-deepspeed [-h] --world-size WORLD_SIZE --output OUTPUT")
    assert "never unpickled" in text


@pytest.mark.parametrize(
    ("rank", "edit", "message"),
    [
        (0, lambda s: s.pop("momentum_buffer"), r"rank 1 holds \['momentum_buffer'\], rank 0 \[\]"),
        (1, lambda s: s.pop("momentum_buffer"), r"rank 1 holds \[\], rank 0 \['momentum_buffer'\]"),
        (
            1,
            lambda s: s.update(momentum_buffer=torch.zeros(3, 3)),
            r"momentum_buffer of sub-group 0 in rank 1's file has 9",
        ),
    ],
    ids=["entry missing in rank 0's file", "entry missing in rank 1's file", "entry of the wrong size"],
)
def test_a_rank_file_with_other_state_is_refused(tmp_path: Path, rank: int, edit: Any, message: str) -> None:
    """Converting took rank 0's state keys for every rank: an entry missing from rank 0's file was
    dropped from the conversion without a word, one missing elsewhere raised a bare KeyError."""
    ckpt = _checkpoint(tmp_path)
    path = ckpt / "step2" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    saved = torch.load(path, weights_only=False)
    edit(saved["optimizer_state_dict"]["optimizer_state_dict"]["state"][0])
    torch.save(saved, path)
    with pytest.raises(ValueError, match=message):
        convert(ckpt, world_size=1, output=tmp_path / "out")
    assert not (tmp_path / "out" / "step2").exists()


def _trainer_checkpoint(root: Path) -> Path:
    """A Hugging Face Trainer ``checkpoint-2`` saved by 2 ranks under DeepSpeed (the engine's tag
    and ``latest``, the Trainer's own files beside them)."""
    ckpt = root / "checkpoint-2"
    _write_zero3(ckpt / "global_step2")
    (ckpt / "latest").write_text("global_step2")
    (ckpt / "trainer_state.json").write_text('{"global_step": 2}')
    for name in ("scheduler.pt", "training_args.bin", "model.safetensors", "config.json", "zero_to_fp32.py"):
        (ckpt / name).write_bytes(name.encode())
    for rank in range(2):
        (ckpt / f"rng_state_{rank}.pth").write_bytes(f"rng of rank {rank}".encode())
    return ckpt


@pytest.mark.parametrize(
    ("world_size", "rng"),
    [
        (1, {"rng_state.pth": b"rng of rank 0"}),
        (3, {f"rng_state_{r}.pth": f"rng of rank {r}".encode() for r in (0, 1)}),
    ],
)
def test_a_trainer_checkpoint_keeps_the_trainers_files(tmp_path: Path, world_size: int, rng: dict[str, bytes]) -> None:
    """The Trainer resumes from its own files besides DeepSpeed's: they are copied (RNG states per new rank)."""
    ckpt = _trainer_checkpoint(tmp_path)
    out = tmp_path / "out" / "checkpoint-2"
    assert convert(ckpt, world_size=world_size, output=out) == "global_step2"
    copied = ["config.json", "model.safetensors", "scheduler.pt", "trainer_state.json", "training_args.bin"]
    assert sorted(os.listdir(out)) == sorted(["global_step2", "latest", "zero_to_fp32.py", *copied, *rng])
    assert all((out / name).read_bytes() == (ckpt / name).read_bytes() for name in copied)
    assert {name: (out / name).read_bytes() for name in rng} == rng
    assert (out / "latest").read_text() == "global_step2"


def test_help_names_the_trainer_checkpoint_and_the_errors_without_trainer_setup(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["convert-deepspeed", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Trainer checkpoint-N converts into one the Trainer resumes from" in text
    assert "trainer_setup" in text and "used a DP world size of W but the current world size is N" in text

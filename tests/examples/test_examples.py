"""Every script in examples/ runs, as the docs show it: one process, or torchrun at 2 gloo ranks.

The docs pages include these files (``--8<--``), so what a reader copies is what ran here. Each
example needs a few seconds of work and its imports; optional stacks are skipped when missing.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

# script: (ranks, optional modules it needs, a line its output must contain)
CASES: dict[str, tuple[int, tuple[str, ...], str]] = {
    "plain_loop.py": (1, (), "step  29"),
    "ddp.py": (2, (), "matrices orthogonalized by rank 0"),
    "fsdp2.py": (2, (), "strategy fsdp2"),
    "mesh_2d.py": (2, (), "mesh (1, 2)"),
    "hf_trainer.py": (1, ("transformers", "accelerate"), "MuonTrainer reached step 4"),
    "hf_trainer_deepspeed.py": (2, ("transformers", "accelerate", "deepspeed"), "ZeRO-2 with HybridMuon: step 3"),
    "accelerate_ddp.py": (2, ("accelerate",), "loss "),
    "lightning_fsdp2.py": (1, ("lightning",), "strategy fsdp2; step 6"),
    "trl_peft.py": (1, ("trl", "peft", "datasets"), "for 3 steps"),
    "torchtitan_container.py": (2, ("torchtitan",), "state dict keys like state."),
    "deepspeed_launcher.py": (2, ("deepspeed",), "global grad norm"),
    "qk_clip.py": (1, ("transformers",), "heads clipped"),
}


def test_every_example_is_run_here() -> None:
    assert sorted(CASES) == sorted(p.name for p in EXAMPLES.glob("*.py"))


@pytest.mark.parametrize("script", sorted(CASES))
def test_example_runs(script: str, tmp_path: Path) -> None:
    ranks, needs, says = CASES[script]
    for module in needs:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{script} needs {module}")
    launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    if ranks > 1:
        launcher += [f"--nproc_per_node={ranks}"]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TORCH_COMPILE_DISABLE": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    args = [str(tmp_path)] if script in {"ddp.py", "hf_trainer.py", "hf_trainer_deepspeed.py", "trl_peft.py"} else []
    done = subprocess.run(
        [*launcher, str(EXAMPLES / script), *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert says in output, output[-4000:]

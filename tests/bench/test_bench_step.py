"""`muonkit bench step`: the error metric, the update recovered from the weights, a smoke run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import muonkit
from muonkit.cli import main
from muonkit_bench import step
from muonkit_bench.peers import hybrid_muon


def test_orthogonality_error_on_exact_cases() -> None:
    q, _ = torch.linalg.qr(torch.randn(12, 5, dtype=torch.float64))
    exact = step.orthogonality_error(q, q)
    assert exact["max_abs_s_minus_1"] < 1e-12 and exact["polar"] < 1e-12
    doubled = step.orthogonality_error(2 * q, q)  # every singular value 2: |s-1| = 1, ||2Q-Q|| = ||Q||
    assert doubled["max_abs_s_minus_1"] == pytest.approx(1.0, abs=1e-12)
    assert doubled["mean_abs_s_minus_1"] == pytest.approx(1.0, abs=1e-12)
    assert doubled["polar"] == pytest.approx(1.0, abs=1e-12)


def test_polar_factor_is_orthogonal() -> None:
    g = torch.randn(9, 4)
    p = step.polar_factor(g)
    assert torch.allclose(p.T @ p, torch.eye(4, dtype=torch.float64), atol=1e-12)


def test_harness_recovers_the_orthogonalized_update() -> None:
    """The error the harness reports for HybridMuon is that of muonkit.orthogonalize on the gradient."""
    h = step.Harness("tiny", device="cpu", grads="random", seed=0)
    result = h.run(lambda g: hybrid_muon(g, ns_coefficients="keller", ns_steps=5), warmup=1, repeats=1)
    for i in h.probes:
        g = h.grads[i]
        u = g.lerp(torch.zeros_like(g).lerp(g, 0.05), 0.95)  # step one of Nesterov momentum, as HybridMuon does it
        direct = muonkit.orthogonalize(
            u, coefficients="keller", steps=5, method="gram"
        ).double()  # HybridMuon's default
        expected = step.orthogonality_error(direct, h.polar[i])
        got = result["errors"]["x".join(map(str, g.shape))]
        # tolerance: the update goes through fp32 weights of size ~0.02 (ulp ~2e-9) and
        # is divided by lr=0.02: ~1e-6 relative noise on singular values of size ~1.
        assert got["mean_abs_s_minus_1"] == pytest.approx(expected["mean_abs_s_minus_1"], abs=1e-4)
        assert got["polar"] == pytest.approx(expected["polar"], abs=1e-4)
    assert math.isfinite(result["median_s"]) and result["min_s"] <= result["median_s"] <= result["max_s"]
    assert result["host_reads"] == 1 and result["aten_calls"] > 0  # the non-finite verdict, read once


def test_cli_smoke(tmp_path: Path) -> None:
    argv = ["bench", "step", "--models", "tiny", "--warmup", "1", "--repeats", "1", "--out", str(tmp_path)]
    argv += ["--methods", "adamw,hybrid_muon,torch_muon,deepspeed_standard", "--presets", "keller,polar_express"]
    argv += ["--ns-steps", "3,5"]
    assert main(argv) == 0
    data = json.loads((tmp_path / "step.json").read_text())
    rows = data["models"]["tiny"]["peers"]
    assert set(rows) == {"adamw", "hybrid_muon", "torch_muon", "deepspeed_standard"}
    for name, r in rows.items():
        assert r["median_s"] > 0
        assert r["scratch_bytes"] > 0  # every method allocates something to step
        assert r["aten_calls"] > 0 and r["host_reads"] == (1 if name == "hybrid_muon" else 0), name
        if name != "adamw":
            assert 0 <= r["mean_abs_s_minus_1"] < 1 and r["polar"] < 1
    presets = data["models"]["tiny"]["presets"]
    assert set(presets) == {"kellerx3", "kellerx5", "polar_expressx3", "polar_expressx5"}
    assert rows["hybrid_muon"]["matrices"] == 2 * 4  # tiny: 2 layers of c_attn, c_proj, c_fc, c_proj
    # more steps move the singular values closer to 1 on average (a property of the polynomials)
    assert presets["polar_expressx5"]["mean_abs_s_minus_1"] < presets["polar_expressx3"]["mean_abs_s_minus_1"]


def test_compiled_peers_step_like_their_eager_selves() -> None:
    """``--compiled`` adds torch_muon_compiled and adamw_compiled; in the suite (TORCH_COMPILE_DISABLE=1)
    they run eagerly, and must then give exactly the updates of torch_muon and adamw."""
    from muonkit_bench.peers import compile_enabled, peers

    table = peers(deepspeed=False, compiled=True)
    assert not compile_enabled() and "run eagerly" in table["torch_muon_compiled"].notes
    assert "torch_muon_compiled" not in peers(deepspeed=False)
    for name in ("adamw", "torch_muon"):
        finals = []
        for peer in (name, f"{name}_compiled"):
            torch.manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(8, 16)), torch.nn.Parameter(torch.randn(16))]
            opt = table[peer].build(
                [{"algorithm": "muon", "params": params[:1]}, {"algorithm": "adamw", "params": params[1:]}]
            )
            for _ in range(2):
                for p in params:
                    p.grad = torch.ones_like(p).cumsum(0)
                opt.step()
            assert set(opt.state) == set(params)
            finals.append([p.detach() for p in params])
        assert all(torch.equal(a, b) for a, b in zip(*finals, strict=True)), name
        assert not torch.equal(finals[0][0], torch.randn(8, 16, generator=torch.Generator().manual_seed(0)))


def test_cli_per_head_rows(tmp_path: Path) -> None:
    """``--per-head`` adds a HybridMuon row with attention per head: more, smaller matrices, fewer FLOPs."""
    argv = ["bench", "step", "--models", "tiny", "--warmup", "1", "--repeats", "1", "--out", str(tmp_path)]
    argv += ["--methods", "hybrid_muon", "--no-presets", "--per-head"]
    assert main(argv) == 0
    rows = json.loads((tmp_path / "step.json").read_text())["models"]["tiny"]["peers"]
    whole, heads = rows["hybrid_muon"], rows["hybrid_muon+per_head"]
    assert heads["matrices"] == 2 * (3 * 2 + 2 + 2)  # per layer: c_attn 6 heads' rows, c_proj 2 heads, the MLP's 2
    assert heads["flops"] < whole["flops"]
    assert heads["polar"] is None  # per-head matrices are not the whole matrix's polar factor


def test_cli_state_dtype_rows(tmp_path: Path) -> None:
    """``--state-dtypes`` adds a +bf16 and a +8bit row beside each HybridMuon peer's fp32 row."""
    argv = ["bench", "step", "--models", "tiny", "--warmup", "1", "--repeats", "1", "--out", str(tmp_path)]
    argv += ["--methods", "hybrid_muon", "--no-presets", "--state-dtypes", "fp32,bf16,8bit"]
    assert main(argv) == 0
    rows = json.loads((tmp_path / "step.json").read_text())["models"]["tiny"]["peers"]
    assert list(rows) == ["hybrid_muon", "hybrid_muon+bf16", "hybrid_muon+8bit"]
    assert all(r["aten_calls"] and r["matrices"] == rows["hybrid_muon"]["matrices"] for r in rows.values())
    with pytest.raises(SystemExit, match="Invalid --state-dtypes"):
        main([*argv[:-1], "fp16"])


def _keller_float64(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller's quintic iteration in float64, short side first (the reference of the peers' iteration)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    tall = x.size(0) > x.size(1)
    x = x.T if tall else x
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@pytest.mark.parametrize("shape", [(24, 40), (48, 16)])
def test_torch_muon_in_fp32_runs_torchs_iteration_in_fp32(shape: tuple[int, int]) -> None:
    """``ns_dtype="fp32"`` runs torch.optim.Muon's own iteration in fp32: its update is within fp32
    rounding of a float64 run of the same iteration, where the default (bf16) is ~1e-2 away; and
    ``torch.Tensor.bfloat16`` is itself again after the step."""
    from muonkit_bench.peers import TorchMuonAdamW

    gen = torch.Generator().manual_seed(1)
    u, _ = torch.linalg.qr(torch.randn(shape[0], shape[0], generator=gen))
    v, _ = torch.linalg.qr(torch.randn(shape[1], shape[1], generator=gen))
    s = torch.logspace(0, -4, min(shape))  # ill-conditioned: singular values 1 .. 1e-4
    grad = (u[:, : len(s)] * s) @ v[:, : len(s)].T
    scale = math.sqrt(max(1.0, shape[0] / shape[1]))
    expected = _keller_float64(grad.lerp(grad * 0.05, 0.95))  # step one of Nesterov momentum
    gaps = {}
    for dtype in ("fp32", "bf16"):
        w = torch.nn.Parameter(torch.zeros(shape))
        w.grad, bias = grad.clone(), torch.nn.Parameter(torch.zeros(3))
        groups = [{"algorithm": "muon", "params": [w]}, {"algorithm": "adamw", "params": [bias]}]
        opt = TorchMuonAdamW(groups, lr=1.0, ns_dtype=dtype)
        opt.step()
        assert torch.Tensor.bfloat16 is not torch.Tensor.clone
        assert w.dtype == torch.float32 and w.grad.dtype == torch.float32
        gaps[dtype] = float((-w.detach().double() / scale - expected).abs().max())
    assert gaps["fp32"] < 1e-5, gaps
    assert gaps["bf16"] > 1e-3, gaps
    with pytest.raises(ValueError, match="ns_dtype='fp16'"):
        TorchMuonAdamW([{"algorithm": "muon", "params": [torch.nn.Parameter(torch.zeros(2, 2))]}], ns_dtype="fp16")


def test_cli_same_dtype_rows(tmp_path: Path) -> None:
    """``--ns-dtype fp32``: HybridMuon and torch.optim.Muon both iterate in fp32 (their errors agree
    to fp32 rounding, not bf16's), and the choice is recorded."""
    argv = ["bench", "step", "--models", "tiny", "--warmup", "1", "--repeats", "1", "--out", str(tmp_path)]
    argv += ["--methods", "hybrid_muon_ns,torch_muon", "--no-presets", "--ns-dtype", "fp32"]
    assert main(argv) == 0
    data = json.loads((tmp_path / "step.json").read_text())
    assert data["args"]["ns_dtype"] == "fp32"
    rows = data["models"]["tiny"]["peers"]
    assert "fp32" in rows["torch_muon"]["notes"] and "fp32" in rows["hybrid_muon_ns"]["notes"]
    for key in ("max_abs_s_minus_1", "mean_abs_s_minus_1", "polar"):
        assert rows["hybrid_muon_ns"][key] == pytest.approx(rows["torch_muon"][key], abs=1e-5), key

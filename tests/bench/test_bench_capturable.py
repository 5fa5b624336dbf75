"""`muonkit bench capturable`: a smoke run of the eager variants (the compiled ones take minutes on CPU)."""

from __future__ import annotations

import json
from pathlib import Path

from muonkit.cli import main


def test_smoke_run_writes_equal_plain_and_capturable_results(tmp_path: Path) -> None:
    out = tmp_path / "capturable.json"
    args = ["bench", "capturable", "--layers", "1", "--width", "32", "--repeats", "1", "--variants", "plain,capturable"]
    assert main([*args, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    results = report["results"]
    assert set(results) == {"plain", "capturable"}
    assert results["capturable"]["equal_to_plain"] is True and results["capturable"]["max_abs_diff"] == 0.0
    assert all(r["median_s"] > 0 and r["graphs"] == 0 for r in results.values())

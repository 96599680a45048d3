"""`make bench`'s script runs end to end on tiny inputs and writes its report (no timings
are asserted: speed is measured by `make bench`, never by a test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_script_runs_on_tiny_inputs(tmp_path):
    out = tmp_path / "docs"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "bench.py"),
            "--tiny",
            "--repeats",
            "1",
            "--layers",
            "2",
            "--experts",
            "4",
            "--out",
            str(out),
            "--work",
            str(tmp_path / "w"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "benchmarks.json").read_text())
    conv = report["throughput"]["warm"]["convert"]
    assert set(conv) >= {"1", "2"} and all(r["median_s"] > 0 for r in conv.values())
    assert report["memory"]["0.5GB"]["peak_rss"] > 0
    text = (out / "benchmarks.md").read_text()
    assert "convert / (cp && sync)" in text and "sha256sum" in text
    assert not (tmp_path / "w").exists()  # the work directory is cleaned up

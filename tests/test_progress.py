"""Progress a log can trust: plain lines at a steady interval where no terminal watches,
a final line, nothing with `--progress none`; checked from captured output."""

from __future__ import annotations

import re
import time

from cli_helpers import run_cli
from kimi_w31.converter import console

LINE = re.compile(
    r"^convert: \S+ \S+/\S+ \S+ \((\d+)%\), .*elapsed \d+:\d\d:\d\d; shards (\d+)/(\d+)"
)


def test_lines_mode_prints_at_the_interval_and_at_the_end(capsys):
    progress = console.Progress("lines", "work", total=1000, interval=0.1)
    for _ in range(5):
        progress.advance(10)  # 5% in all: no tenth is crossed, only the clock speaks
        time.sleep(0.12)
    progress.stop()
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("work: ")]
    assert len(lines) >= 4  # ~0.6 s at a 0.1 s interval, plus the final line
    assert lines[-1].startswith("work: 50 B/1.0 KB (5%)")
    assert all("B/s" in x and "elapsed" in x for x in lines)


def test_cli_progress_lines_and_none(small_source, tmp_path):
    env_lines = run_cli(
        small_source,
        tmp_path / "a",
        "--manifest",
        "kimi-k3-any",
        "--max-shard-size",
        "600000",
        "--progress",
        "lines",
    )
    assert env_lines.returncode == 0, env_lines.stderr
    lines = [x for x in env_lines.stderr.splitlines() if x.startswith("convert: ")]
    assert lines, env_lines.stderr
    last = LINE.match(lines[-1])
    assert last and last[1] == "100" and last[2] == last[3]  # every shard done
    quiet = run_cli(small_source, tmp_path / "b", "--manifest", "kimi-k3-any", "--progress", "none")
    assert quiet.returncode == 0 and "convert: " not in quiet.stderr


def test_auto_is_lines_when_no_terminal_watches():
    assert console.resolve_mode("auto") == ("bar" if console.err.is_terminal else "lines")
    assert console.resolve_mode("bar", quiet=True) == "none"

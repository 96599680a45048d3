"""Progress a log can trust: plain lines at a steady interval where no terminal watches,
a final line, nothing with `--progress none`; checked from captured output."""

from __future__ import annotations

import os
import re
import time

import pytest
from cli_helpers import run_cli
from hub_server import FakeHub
from hypothesis import given, settings
from hypothesis import strategies as st
from kimi_w31.converter.cli import console
from kimi_w31.converter.cli.convert import ProgressReporter
from kimi_w31.converter.errors import reason
from kimi_w31.converter.execute.shard import Outcome, ShardOutcome
from kimi_w31.converter.output.records import ShardRecord
from kimi_w31.converter.reasons import Code
from kimi_w31.converter.synth import SynthSpec, synth_checkpoint

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
        [
            small_source,
            tmp_path / "a",
            "--manifest",
            "kimi-k3-any",
            "--max-shard-size",
            "600000",
            "--progress",
            "lines",
        ],
    )
    assert env_lines.returncode == 0, env_lines.stderr
    lines = [x for x in env_lines.stderr.splitlines() if x.startswith("convert: ")]
    assert lines, env_lines.stderr
    last = LINE.match(lines[-1])
    assert last and last[1] == "100" and last[2] == last[3]  # every shard done
    quiet = run_cli(
        [small_source, tmp_path / "b", "--manifest", "kimi-k3-any", "--progress", "none"]
    )
    assert quiet.returncode == 0 and "convert: " not in quiet.stderr


def test_auto_is_lines_when_no_terminal_watches():
    assert console.resolve_mode("auto") == ("bar" if console.err.is_terminal else "lines")
    assert console.resolve_mode("bar", quiet=True) == "none"


# -- each shard counts once: never past 100 %, never backwards, 100 % at the end ----------
_FATES = ("written", "kept", "kept-reread", "reread-then-written")


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 10_000), st.sampled_from(_FATES)), min_size=1, max_size=12),
    st.randoms(use_true_random=False),
)
def test_conversion_progress_counts_each_shard_once(shards, rnd):
    """Shards of any fate, their byte flows interleaved as concurrent workers interleave
    them: what the progress shows stays within the total and ends exactly at it."""
    reporter = ProgressReporter("none")
    total = sum(size for size, _ in shards)
    reporter.start(total, len(shards))
    events: list[list[tuple[str, int, str]]] = []
    for size, fate in shards:
        flows = {"written": 1, "kept": 0, "kept-reread": 1, "reread-then-written": 2}[fate]
        chunks = [("bytes", part, fate) for _ in range(flows) for part in _split(size, rnd)]
        events.append([*chunks, ("done", size, fate)])
    seen = []
    while any(events):
        queue = rnd.choice([e for e in events if e])
        kind, n, fate = queue.pop(0)
        if kind == "bytes":
            reporter.advance(n)
        else:
            outcome = Outcome.KEPT if fate.startswith("kept") else Outcome.WRITTEN
            reporter.shard_done(ShardOutcome("s", outcome, ShardRecord("s", n, "", {}, {})))
        seen.append(reporter.progress.done)
    assert all(0 <= a <= b <= total for a, b in zip([0, *seen], seen, strict=False))
    assert seen[-1] == total


def _split(size: int, rnd) -> list[int]:
    cuts = sorted(rnd.sample(range(1, size), min(3, size - 1))) if size > 1 else []
    return [b - a for a, b in zip([0, *cuts], [*cuts, size], strict=True)]


def test_rehash_of_a_finished_output_stays_within_100_percent(small_source, tmp_path):
    args = [small_source, tmp_path / "o", "--manifest", "kimi-k3-any", "--max-shard-size"]
    assert run_cli([*args, "600000", "-q"]).returncode == 0
    proc = run_cli([*args, "600000", "--rehash", "--progress", "lines"])
    assert proc.returncode == 0, proc.stderr
    percents = [int(m[1]) for m in map(LINE.match, proc.stderr.splitlines()) if m]
    assert percents and max(percents) == percents[-1] == 100


@pytest.mark.parametrize("mode", ["lines", "bar"])
def test_work_that_never_started_leaves_no_progress_line(mode, capsys):
    progress = console.Progress(mode, "convert", total=1000, interval=3600)
    progress.note(shards="0/3")
    progress.stop()
    assert "convert" not in capsys.readouterr().err


def test_a_window_refused_before_any_download_prints_no_progress(tmp_path):
    """The refusal is the whole message: no 0 % line above it."""
    repo = tmp_path / "repo"
    synth_checkpoint(repo, SynthSpec(layers=4, experts=8, shards=6))
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("HF_")}
    with FakeHub({"org/kimi-synth": repo}) as hub:
        env.update(HF_ENDPOINT=hub.endpoint, HF_HOME=str(tmp_path / "hf"))
        env.update(HF_HUB_CACHE=str(tmp_path / "cache"), HF_HUB_DISABLE_TELEMETRY="1")
        proc = run_cli(
            [
                "org/kimi-synth",
                tmp_path / "out",
                "--download",
                "--manifest",
                "kimi-k3-any",
                "--max-shard-size",
                "600000",
                "--delete-source-shards",
                "--max-source-window",
                "1",
                "--progress",
                "lines",
            ],
            env=env,
        )
    assert proc.returncode == reason(Code.WINDOW_TOO_SMALL).exit, proc.stderr
    assert Code.WINDOW_TOO_SMALL.value not in proc.stdout  # text mode: on stderr
    assert not [x for x in proc.stderr.splitlines() if x.startswith(("convert:", "download:"))]

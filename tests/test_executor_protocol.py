"""The executor seam declares what it offers: the pipeline and the command line call the
`Executor` protocol's members plainly (no getattr/hasattr probes), and an executor with
nothing to say about downloads, the plan or the summary inherits the protocol's defaults."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from kimi_w31.converter.execute import DownloadProgress, Executor
from kimi_w31.converter.execute.download import DownloadExecutor
from kimi_w31.converter.execute.local import LocalExecutor
from kimi_w31.converter.execute.ray import RayExecutor
from kimi_w31.converter.execute.shard import SourceFiles
from kimi_w31.converter.pipeline import ConvertOptions, prepare

ROOT = Path(__file__).resolve().parent.parent
MEMBERS = ("claimed", "open_sources", "download_progress", "plan_rows", "summary", "run")


def test_nothing_probes_the_executor():
    probe = re.compile(r"\b(?:getattr|hasattr)\(\s*[\w.]*executor\b")
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "converter").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if probe.search(line)
    ]
    assert found == []


@pytest.mark.parametrize("cls", [LocalExecutor, DownloadExecutor, RayExecutor])
def test_every_executor_is_an_executor_with_every_member(cls):
    assert Executor in cls.__mro__  # inherits the defaults, not only the shape
    assert all(hasattr(cls, member) for member in MEMBERS)


def test_the_defaults_say_nothing_and_read_sources_from_disk(small_source):
    source, _, plan = prepare(
        ConvertOptions(str(small_source), small_source.parent / "unused", manifest="kimi-k3-any")
    )
    executor = LocalExecutor()
    assert executor.plan_rows(plan) == [] and executor.summary(plan) == {}
    assert type(executor.download_progress) is DownloadProgress
    files = executor.open_sources(source)
    try:
        assert type(files) is SourceFiles and set(files.identity) == set(source.shard_files)
    finally:
        files.close()


def test_a_worker_sees_the_files_the_driver_saw_or_refuses(tmp_path):
    """`SourceFiles.check_seen`: a file is the one another process saw (its identity), else
    `SourceChanged` naming it; the same file passes (the negative control)."""
    from kimi_w31.converter.execute.shard import SourceChanged

    (tmp_path / "a.safetensors").write_bytes(b"x" * 16)
    seen = SourceFiles(tmp_path, ["a.safetensors"]).identity
    SourceFiles(tmp_path, ["a.safetensors"]).check_seen(seen, "differs")  # the same file
    (tmp_path / "b").write_bytes(b"y" * 16)
    os.replace(tmp_path / "b", tmp_path / "a.safetensors")  # same size, another file
    with pytest.raises(SourceChanged) as exc:
        SourceFiles(tmp_path, ["a.safetensors"]).check_seen(seen, "differs")
    assert exc.value.file == "a.safetensors"

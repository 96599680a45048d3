"""Class: a source file changed while a run is in flight is never published from what was
read before. Every source file the output derives from (each shard, written or kept, the
config, the index, each file copied) is proven unchanged when the output is published; a
fresh run and a rerun of a finished output alike."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import faults as fl
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kimi_w31.converter.errors import Fatal
from kimi_w31.converter.pipeline import ConvertOptions, Reporter, convert
from kimi_w31.converter.reasons import Code
from kimi_w31.converter.synth import SynthSpec, synth_checkpoint


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pub") / "src"
    synth_checkpoint(root, SynthSpec(layers=2, experts=2, shards=2))
    return root


class _ChangeAt(Reporter):
    """Changes one source file when the n-th shard is settled (written or kept)."""

    def __init__(self, path: Path, at: int, how: str) -> None:
        self.path, self.at, self.how, self.seen = path, at, how, 0

    def shard_done(self, result) -> None:
        self.seen += 1
        if self.seen != self.at:
            return
        if self.how == "new inode":  # the same bytes, another file
            tmp = self.path.with_name(self.path.name + ".tmp")
            shutil.copyfile(self.path, tmp)
            os.replace(tmp, self.path)
        else:  # the same bytes written back through the same inode, mtime restored
            st_ = self.path.stat()
            self.path.write_bytes(self.path.read_bytes())
            os.utime(self.path, ns=(st_.st_atime_ns, st_.st_mtime_ns))


def _opts(src: Path, out: Path) -> ConvertOptions:
    return ConvertOptions(str(src), out, manifest="kimi-k3-any", max_shard_size=200_000)


@fl.fuzz(15)
@given(data=st.data())
def test_a_source_file_changed_in_flight_is_refused_at_publish(template, tmp_path_factory, data):
    work = tmp_path_factory.mktemp("run")
    src = Path(shutil.copytree(template, work / "src"))
    out = work / "out"
    rerun = data.draw(st.booleans(), label="rerun of a finished output")
    if rerun:
        convert(_opts(src, out))
    # every file the output derives from (a hidden path, such as .gitattributes, is not one)
    names = (p.relative_to(src) for p in src.rglob("*") if p.is_file())
    files = sorted(r.as_posix() for r in names if not any(x.startswith(".") for x in r.parts))
    rel = data.draw(st.sampled_from(files), label="file changed")
    how = data.draw(st.sampled_from(["new inode", "in place, mtime restored"]), label="how")
    at = data.draw(st.integers(1, 3), label="after shard")
    index_before = (out / fl.INDEX).read_bytes() if rerun else None
    with pytest.raises(Fatal) as caught:
        convert(_opts(src, out), _ChangeAt(src / rel, at, how))
    assert [(p.code, p.file) for p in caught.value.problems] == [(Code.SOURCE_CHANGED, rel)]
    # Nothing new published: no index, or the earlier run's, untouched.
    index = out / fl.INDEX
    assert (index.read_bytes() if index.exists() else None) in (None, index_before)
    # The rerun after the change: a fresh run's output.
    convert(_opts(src, out))
    convert(_opts(src, work / "fresh"))
    assert fl.tree(out) == fl.tree(work / "fresh")


def test_an_unchanged_source_publishes(template, tmp_path):
    """Negative control: the same runs with nothing changed succeed (the reporter runs)."""
    src = Path(shutil.copytree(template, tmp_path / "src"))
    reporter = _ChangeAt(src / "config.json", 99, "new inode")
    convert(_opts(src, tmp_path / "out"), reporter)
    convert(_opts(src, tmp_path / "out"), reporter)
    assert reporter.seen >= 6 and (tmp_path / "out" / fl.INDEX).exists()

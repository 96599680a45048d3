"""Hostile `model.safetensors.index.json` and source trees: property test of the index
reader, and every listed case through the CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import faults as fl
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kimi_w31.converter.contract import INDEX_NAME
from kimi_w31.converter.errors import Fatal
from kimi_w31.converter.source import read_source
from kimi_w31.converter.source.local import LocalOrigin

FAST = fl.fuzz(120)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A small valid source, plus links inside and outside it for the map to point at."""
    base = tmp_path_factory.mktemp("index")
    src = fl.make_source(base / "src", layers=2, experts=2, shards=2)
    (base / "outside.safetensors").write_bytes(
        (src / "model-00001-of-000002.safetensors").read_bytes()
    )
    os.symlink(base / "outside.safetensors", src / "escape.safetensors")
    os.symlink("model-00001-of-000002.safetensors", src / "alias.safetensors")
    (src / "sub").mkdir()
    weight_map = json.loads((src / INDEX_NAME).read_text())["weight_map"]
    return src, weight_map


hostile_names = st.one_of(
    st.sampled_from(
        [
            "/etc/passwd",
            "/abs/model.safetensors",
            "../outside.safetensors",
            "sub/../../outside.safetensors",
            "escape.safetensors",
            "alias.safetensors",
            "config.json",
            "model.safetensors.index.json",
            "sub",
            "sub/",
            "missing.safetensors",
            "model-00001-of-000002.safetensors",
            "model-00002-of-000002.safetensors",
            "",
            "\\\\server\\share.safetensors",
            "./model-00001-of-000002.safetensors",
            "model-00001-of-000002.safetensors\x00.txt",
            "a\x00.safetensors",
        ]
    ),
    st.text(max_size=12),
    st.text(max_size=6).map(lambda s: s + ".safetensors"),
    st.integers(),
    st.none(),
    st.booleans(),
    st.lists(st.text(max_size=3), max_size=2),
)


@FAST
@given(data=st.data())
def test_index_reader_never_crashes(tiny, data) -> None:
    src, real = tiny
    names = sorted(real)
    weight_map: dict = dict(real)
    for tensor in data.draw(st.lists(st.sampled_from(names), max_size=4, unique=True)):
        weight_map[tensor] = data.draw(hostile_names)
    for tensor in data.draw(st.lists(st.sampled_from(names), max_size=2, unique=True)):
        weight_map.pop(tensor, None)
    weight_map.update(data.draw(st.dictionaries(st.text(max_size=5), hostile_names, max_size=2)))
    index = data.draw(
        st.one_of(
            st.just({"metadata": {"total_size": 1}, "weight_map": weight_map}),
            st.just({"weight_map": weight_map}),
            st.just(weight_map),
            st.just({"weight_map": list(weight_map)}),
        )
    )
    (src / INDEX_NAME).write_text(json.dumps(index))
    try:
        source = read_source(src, str(src), LocalOrigin())
    except Fatal as exc:
        assert exc.problems and all(p.code and p.render() for p in exc.problems)
        return
    # Accepted: every shard is a real file inside the source; each tensor is where the
    # index says, exactly once.
    root = src.resolve()
    for shard in source.shard_files:
        assert root in (src / shard).resolve().parents
        assert (src / shard).is_file()
    held = {t: f for f, h in source.headers.items() for t in h.tensors}
    assert held == source.weight_map


def test_every_hostile_index_is_a_clean_cli_error(tmp_path: Path) -> None:
    template = fl.make_source(tmp_path / "template", experts=4)  # 6 shards: VICTIM
    rows = fl.index_cases(template, tmp_path / "work")
    assert len(rows) == len(fl.INDEX_CASES) >= 15
    assert not fl.bad_rows(rows, {fl.CLEAN}), fl.bad_rows(rows, {fl.CLEAN})

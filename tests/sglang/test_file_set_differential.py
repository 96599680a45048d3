"""The file set as SGLang's loader sees it: the shards the converter reads, and the ones
`verify --source` derives on its own, against SGLang 0.5.23's `_prepare_weights` (its glob,
`filter_duplicate_safetensors_files`, the consolidated/model pair) over generated directory
layouts: index present or absent, several top-level shards, shards in subfolders, hidden
ones, index entries the glob cannot list, shards no index names. Either reader must open
exactly SGLang's files, or refuse.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
from file_layouts import layouts, write_layout
from hypothesis import HealthCheck, given, settings
from kimi_w31.converter.audit.served import loaded_files
from kimi_w31.converter.errors import Fatal
from kimi_w31.converter.source import read_source
from kimi_w31.converter.source.local import LocalOrigin

pytestmark = pytest.mark.sglang


def sglang_files(root: Path) -> set[str] | Exception:
    """The weight files SGLang's default loader opens from `root` (load format auto)."""
    import sglang.srt.model_loader.loader as loader
    from sglang.srt.configs.load_config import LoadConfig, LoadFormat

    # Outside a server there are no server args; they only switch on checksum checking.
    with mock.patch.object(loader, "get_server_args", lambda: None):
        try:
            _, files, _ = loader.DefaultModelLoader(
                LoadConfig(load_format=LoadFormat.AUTO)
            )._prepare_weights(str(root), None, False)
        except Exception as exc:  # noqa: BLE001 - SGLang refuses the directory
            return exc
    return {str(Path(f).relative_to(root)) for f in files}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts())
def test_both_readers_open_exactly_sglangs_files(tmp_path_factory, layout):
    root = write_layout(tmp_path_factory.getbasetemp() / "sglang-file-set" / "src", layout)
    theirs = sglang_files(root)
    try:
        ours = set(read_source(root, str(root), LocalOrigin()).shard_files)
    except Fatal:
        ours = None
    if ours is not None:
        assert ours == theirs, layout
    files, problems = loaded_files(root)
    if not problems:
        assert set(files) == theirs, layout


def test_no_index_several_shards_all_load():
    """Stated once by hand: without an index SGLang opens every top-level shard."""
    import tempfile

    layout = {"files": ["model.safetensors", "extra.safetensors"], "index": None, "shared": False}
    root = write_layout(Path(tempfile.mkdtemp()) / "src", layout)
    assert sglang_files(root) == {"model.safetensors", "extra.safetensors"}
    assert set(read_source(root, str(root), LocalOrigin()).shard_files) == sglang_files(root)

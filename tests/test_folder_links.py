"""Class: a folder reachable under several names inside the source (a folder and links to
it) is published under every name, as a copy or a loader sees the tree, by convert and
verify alike; a folder link on its own path (a loop: names without end) is refused
(`link-escapes`), never silently cut at one name."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import faults as fl
import pytest
from cli_helpers import run_cli
from hypothesis import given
from hypothesis import strategies as st
from kimi_w31.converter.errors import Fatal
from kimi_w31.converter.reasons import Code
from kimi_w31.converter.source.local import LocalOrigin

FOLDERS = ["a", "a/b", "c", "c/d/e"]


def _oracle(root: Path) -> set[str] | None:
    """Every file name reached by walking the tree and following every folder link, hidden
    names skipped; None if the walk never ends (deeper than any finite tree here goes)."""
    names: set[str] = set()

    def walk(folder: Path, rel: str, depth: int) -> bool:
        if depth > 40:  # 5 folder levels x 4 links at most without a loop
            return False
        for entry in sorted(os.listdir(folder)):
            if entry.startswith("."):
                continue
            path, name = folder / entry, f"{rel}{entry}"
            if path.is_dir():
                if not walk(path, name + "/", depth + 1):
                    return False
            else:
                names.add(name)
        return True

    return names if walk(root, "", 0) else None


@st.composite
def trees(draw):
    """Folders with a file each, and links to folders: to another folder, to an ancestor."""
    links = draw(
        st.lists(
            st.tuples(st.sampled_from(["", *FOLDERS]), st.sampled_from(["", *FOLDERS])),
            max_size=3,
            unique_by=lambda t: t[0],
        )
    )
    return links


@fl.fuzz(40)
@given(links=trees())
def test_every_name_a_folder_is_reached_by_is_published(tmp_path_factory, links):
    root = tmp_path_factory.mktemp("tree") / "src"
    for folder in FOLDERS:
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "f.txt").write_text(folder)
    (root / "top.txt").write_text("top")
    for i, (where, target) in enumerate(links):
        link = root / where / f"link{i}"
        link.symlink_to(os.path.relpath(root / target, link.parent), target_is_directory=True)
    want = _oracle(root)
    if want is None:
        with pytest.raises(Fatal) as caught:
            LocalOrigin().extra_files(root, set())
        assert {p.code for p in caught.value.problems} == {Code.LINK_ESCAPES}
    else:
        assert set(LocalOrigin().extra_files(root, set())) == want


def test_a_folder_and_its_link_are_both_published_and_verify_agrees(tmp_path):
    """End to end: both names in the output; verify --source passes; negative control:
    an output missing one name fails verify --source."""
    src = fl.make_source(tmp_path / "src", layers=2, experts=2, shards=2)
    (src / "assets").mkdir(exist_ok=True)  # synth ships assets/ as published
    (src / "assets" / "notes.txt").write_text("notes\n")
    (src / "alias").symlink_to("assets", target_is_directory=True)
    out = tmp_path / "out"
    assert run_cli([src, out, *fl.MANIFEST, "-q"]).returncode == 0
    assert (out / "assets" / "notes.txt").is_file() and (out / "alias" / "notes.txt").is_file()
    assert not (out / "alias").is_symlink()
    assert run_cli(["verify", out, "--source", src, "-q"]).returncode == 0
    shutil.rmtree(out / "alias")
    assert run_cli(["verify", out, "--source", src, "-q"]).returncode == 1

"""The Hugging Face cache, shared: one source identity whatever the route, and a deletion that
never takes bytes another snapshot still links to (`converter/source/hub_cache.py`).

- Identity: a file of a cache snapshot is recorded as `[size, etag]` whether it is read from
  the cache path or fetched with `--download` (the Hub's listing): a property over generated
  cache layouts, and both route orders through the CLI against the fake Hub (the rerun keeps
  every shard and downloads nothing).
- Deletion: `--delete-source-shards` frees a blob only when no snapshot entry anywhere in the
  cache (any revision of any repo, any file name) links to it: a property over generated
  caches, and through the CLI with another revision sharing all or half of the blobs.
- The summary counts what the Hub sent: a shard linked to a blob already in the cache is no
  download; bytes kept for another snapshot are not "freed".
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import faults as fl
import pytest
from cli_helpers import run_cli
from hub_server import FakeHub
from hypothesis import given
from hypothesis import strategies as st
from kimi_w31.converter.execute.shard import SourceFiles, file_identity
from kimi_w31.converter.source import hub_cache
from kimi_w31.converter.source.hub import HubOrigin, HubRepo, HubSnapshot, RemoteFile
from kimi_w31.converter.synth import SynthSpec, synth_checkpoint

REPO = "org/kimi-routes"
FOLDER = "models--org--kimi-routes"
ARGS = ["--manifest", "kimi-k3-any", "--max-shard-size", "600000"]
OTHER = "f" * 40  # another revision's commit, downloaded earlier


# -- identity: the rule, over generated layouts ------------------------------------------------

KINDS = ["etag-link", "named-link", "regular", "outside-link", "dangling"]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@fl.fuzz(40)
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=5),
    snapshot=st.booleans(),
    data=st.lists(st.binary(min_size=1, max_size=64), min_size=5, max_size=5),
)
def test_a_cache_file_is_known_by_size_and_etag_and_anything_else_by_its_inode(
    tmp_path_factory, kinds, snapshot, data
):
    base = tmp_path_factory.mktemp("layout")
    repo = base / (FOLDER if snapshot else "plain")
    root = repo / "snapshots" / ("a" * 40)
    blobs, outside = repo / "blobs", base / "elsewhere"
    for d in (root, blobs, outside):
        d.mkdir(parents=True)
    files, want = [], {}
    for i, kind in enumerate(kinds):
        name, payload = f"f{i}.safetensors", data[i]
        path = root / name
        if kind == "etag-link":
            blob = blobs / _sha(payload)
            blob.write_bytes(payload)
            path.symlink_to(os.path.relpath(blob, root))
            want[name] = [len(payload), blob.name] if snapshot else None
        elif kind == "named-link":  # a blob not named by a content id
            blob = blobs / name
            blob.write_bytes(payload)
            path.symlink_to(os.path.relpath(blob, root))
            want[name] = None
        elif kind == "regular":
            path.write_bytes(payload)
            want[name] = None
        elif kind == "outside-link":  # named like a blob, but outside the repo's blobs/
            blob = outside / _sha(payload)
            blob.write_bytes(payload)
            path.symlink_to(blob)
            want[name] = None
        else:
            path.symlink_to(blobs / ("0" * 64))
            want[name] = None
        files.append(name)
    for name in files:
        assert hub_cache.content_id(root, name) == want[name], name
    present = [f for f in files if (root / f).exists()]
    sources = SourceFiles(root, present)
    try:
        got = sources.fingerprint(present)
    finally:
        sources.close()
    for f in present:  # what a record keeps: the content id where known, else the file
        assert got[f] == (want[f] or file_identity(root / f)), f


def _conv_env(hub: FakeHub, tmp: Path, **extra: str) -> dict[str, str | None]:
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("HF_")}
    env.update(
        HF_ENDPOINT=hub.endpoint,
        HF_HOME=str(tmp / "hf_home"),
        HF_HUB_CACHE=str(tmp / "hf_cache"),
        HF_HUB_DISABLE_TELEMETRY="1",
    )
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def routes_source(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("routes") / "repo"
    synth_checkpoint(root, SynthSpec(layers=4, experts=8, shards=6))
    return root


@pytest.fixture
def hub(routes_source):
    with FakeHub({REPO: routes_source}) as server:
        yield server


def _shards(hub: FakeHub) -> list[str]:
    return sorted(f for f in hub.files[REPO] if f.endswith(".safetensors"))


def _download(hub: FakeHub, tmp: Path, out: Path, *extra: str):
    r = run_cli([REPO, out, "--download", *ARGS, *extra, "--json"], env=_conv_env(hub, tmp))
    assert r.returncode == 0, r.output
    return r.json


def _from_cache(hub: FakeHub, tmp: Path, out: Path, *extra: str):
    r = run_cli([REPO, out, *ARGS, *extra, "--json"], env=_conv_env(hub, tmp, HF_HUB_OFFLINE="1"))
    assert r.returncode == 0, r.output
    return r.json


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("first", ["cache", "download"])
def test_a_rerun_by_the_other_route_keeps_every_shard_and_downloads_nothing(hub, tmp_path, first):
    _download(hub, tmp_path, tmp_path / "seed")  # the cache now holds the whole snapshot
    out = tmp_path / "out"
    route = _from_cache if first == "cache" else _download
    made = route(hub, tmp_path, out)
    assert made["shards_written"] > 0
    before, served = _tree(out), len(hub.downloads())
    again = _download(hub, tmp_path, out) if first == "cache" else _from_cache(hub, tmp_path, out)
    assert again["already_complete"] is True, again["redone"]
    assert (again["shards_written"], again["files_rewritten"]) == (0, 0)
    assert again["shards_kept"] == made["shards_written"]
    assert len(hub.downloads()) == served  # not one source byte fetched again
    assert _tree(out) == before
    if first == "cache":
        assert (again["hub"]["downloaded_files"], again["hub"]["downloaded_bytes"]) == (0, 0)
    # Both routes recorded the Hub's identity of every source shard: [size, sha256].
    sums = json.loads((out / "kimi_w31.checksums.json").read_text())
    for entry in sums["files"].values():
        for file, identity in entry.get("sources", {}).items():
            assert identity == [hub.files[REPO][file].size, hub.files[REPO][file].etag], file


# -- deletion: the rule, over generated caches --------------------------------------------------


@fl.fuzz(40)
@given(
    layout=st.lists(  # per snapshot: (repo index, file -> blob index)
        st.tuples(st.integers(0, 1), st.dictionaries(st.sampled_from("abcd"), st.integers(0, 3))),
        min_size=1,
        max_size=4,
    ),
    ours=st.dictionaries(st.sampled_from("abcd"), st.integers(0, 3), min_size=1),
)
def test_a_deleted_shard_frees_its_blob_only_when_no_snapshot_links_to_it(
    tmp_path_factory, layout, ours
):
    """Our snapshot (repo 0) and others (repo 0 or 1, any files) link into pools of blobs;
    each of our files is deleted in turn: a blob goes exactly when no entry links to it."""
    cache = tmp_path_factory.mktemp("cache")
    repos = [cache / FOLDER, cache / "models--org--other"]
    payload = {(r, b): f"repo{r}-blob{b}".encode() * (b + 1) for r in range(2) for b in range(4)}

    def blob(r: int, b: int) -> Path:
        return repos[r] / "blobs" / _sha(payload[(r, b)])

    def snapshot(r: int, commit: str, files: dict[str, int], link_repo: int) -> Path:
        root = repos[r] / "snapshots" / commit
        root.mkdir(parents=True)
        for name, b in files.items():
            target = blob(link_repo, b)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(payload[(link_repo, b)])
            (root / f"{name}.safetensors").symlink_to(os.path.relpath(target, root))
        return root

    root = snapshot(0, "0" * 40, ours, 0)
    others = [
        snapshot(r, f"{i + 1:040d}", files, 0 if i % 2 == 0 else r)  # some link across repos
        for i, (r, files) in enumerate(layout)
    ]
    names = {f"{n}.safetensors": b for n, b in ours.items()}
    repo = HubRepo(REPO, "0" * 40, {n: RemoteFile(n, 1, "x") for n in names})
    snap = HubSnapshot(HubOrigin(), repo, None, repos[0], [])
    expected_links = {  # every other snapshot entry and the bytes it must still give
        p: p.read_bytes() for o in others for p in o.iterdir()
    }
    for name, b in names.items():
        still_linked = any(os.path.realpath(p) == str(blob(0, b)) for p in expected_links) or any(
            names[n] == b for n in names if (root / n).is_symlink() and n != name
        )
        size = len(payload[(0, b)])
        freed = snap.delete(root, name)
        assert not (root / name).is_symlink()
        if still_linked:
            assert freed == 0 and blob(0, b).exists(), name
        else:
            assert freed == size and not blob(0, b).exists(), name
    for p, data in expected_links.items():  # no other snapshot lost a byte
        assert p.read_bytes() == data, p


# -- deletion and the summary, through the CLI -----------------------------------------------


@pytest.mark.parametrize("shared", ["all", "half"])
def test_deleting_source_shards_never_destroys_another_cached_revision(hub, tmp_path, shared):
    """Another revision, downloaded earlier, links to the blobs of all (or half of) this
    revision's shards. `--download --delete-source-shards` links what is there, downloads
    only the rest, and frees only blobs nothing else links to; the summary says so."""
    _download(hub, tmp_path, tmp_path / "seed")
    cache = tmp_path / "hf_cache" / FOLDER
    ours = cache / "snapshots" / hub.commit
    other = cache / "snapshots" / OTHER
    ours.rename(other)  # the earlier revision: same bytes (same blobs), another commit
    shards = _shards(hub)
    fetched = shards[1::2] if shared == "half" else []
    for name in fetched:  # the other revision does not have these: their blobs go too
        blob = Path(os.path.realpath(other / name))
        (other / name).unlink()
        blob.unlink()
    kept = {name: (other / name).read_bytes() for name in shards if name not in fetched}
    hub.log.clear()
    out = tmp_path / "out"
    summary = _download(hub, tmp_path, out, "--delete-source-shards", "--max-source-window", "3")
    h = summary["hub"]
    sizes = {f: hub.files[REPO][f].size for f in shards}
    assert sorted({d.file for d in hub.downloads()}) == sorted(fetched)
    assert (h["downloaded_files"], h["downloaded_bytes"]) == (
        len(fetched),
        sum(sizes[f] for f in fetched),
    )
    assert h["deleted_files"] == len(shards)
    assert h["deleted_bytes"] == sum(sizes[f] for f in fetched)  # only what nothing else holds
    assert h["deleted_shared_kept"] == len(shards) - len(fetched)
    # The earlier revision is whole: every entry gives its bytes, and its content is the Hub's.
    for name, data in kept.items():
        assert (other / name).read_bytes() == data
        assert _sha(data) == hub.files[REPO][name].etag
    # The freed blobs are gone: nothing of this run's downloads is left behind.
    left = {p.name for p in (cache / "blobs").iterdir()}
    assert not {hub.files[REPO][f].etag for f in fetched} & left
    assert (out / "model.safetensors.index.json").exists()


def test_a_download_dir_deletion_reports_the_bytes_it_freed(hub, tmp_path):
    dl = tmp_path / "dl"
    summary = _download(
        hub, tmp_path, tmp_path / "out", "--download-dir", str(dl), "--delete-source-shards"
    )
    h = summary["hub"]
    total = sum(hub.files[REPO][f].size for f in _shards(hub))
    assert (h["downloaded_bytes"], h["deleted_bytes"], h["deleted_shared_kept"]) == (
        total,
        total,
        0,
    )
    assert not list(dl.glob("*.safetensors"))
    shutil.rmtree(dl)

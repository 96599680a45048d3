"""The output directory is read at once, judged by values, and changed only through what
was read: the survey lists what stands without following a link, a refusal is a value the
claim raises, and the lock is taken in its folder opened without following a link, so a
folder swapped for a link between the decision and the lock is refused, never written
through.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kimi_w31.converter import fsio
from kimi_w31.converter.contract import STATE_DIR, not_part_of_checkpoint
from kimi_w31.converter.errors import Fatal
from kimi_w31.converter.output.directory import OutputDir
from kimi_w31.converter.output.lock import OutputLock
from kimi_w31.converter.output.records import Mode
from kimi_w31.converter.reasons import Code
from kimi_w31.converter.source import SourceId

FP = "f" * 64
SRC = SourceId("src", "/somewhere/src")


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): ("link" if p.is_symlink() else "dir" if p.is_dir() else "file")
        for p in root.rglob("*")
    }


@pytest.mark.parametrize("target", ["dir", "file", "dangling"])
def test_a_lock_folder_that_is_a_link_is_refused_and_nothing_is_written_through_it(
    tmp_path, target
):
    victim = tmp_path / "victim"
    victim.mkdir()
    folder = tmp_path / "out" / STATE_DIR
    folder.parent.mkdir()
    pointee = {"dir": victim, "file": victim / "f", "dangling": victim / "gone"}[target]
    if target == "file":
        pointee.write_bytes(b"x")
    folder.symlink_to(pointee)
    before = _tree(victim)
    with pytest.raises(Fatal) as exc:
        OutputLock(folder / "lock").acquire()
    assert exc.value.codes == [Code.STATE_FOLDER_INVALID]
    assert _tree(victim) == before


@settings(max_examples=40, deadline=None)
@given(
    depth=st.integers(1, 4),
    link_at=st.one_of(st.none(), st.integers(0, 3)),
    umask=st.sampled_from([0o022, 0o077, 0o277]),
)
def test_the_lock_makes_its_missing_folders_and_never_through_a_link(
    tmp_path_factory, depth, link_at, umask
):
    """Missing folders on the way to the lock are made (0755 whatever the umask) and named in
    `made`, outermost first; a link anywhere on the part still to make is refused as the lock
    folder's refusal, and nothing is made through it."""
    tmp = tmp_path_factory.mktemp("lock")
    victim = tmp / "victim"
    victim.mkdir()
    names = [f"d{i}" for i in range(depth)]
    folder = tmp.joinpath("out", *names)
    if link_at is not None and link_at < depth:
        tmp.joinpath("out", *names[:link_at]).mkdir(parents=True, exist_ok=True)
        tmp.joinpath("out", *names[: link_at + 1]).symlink_to(victim)
    lock = OutputLock(folder / "lock")
    old = os.umask(umask)
    try:
        refused = lock.attempt()
    finally:
        os.umask(old)
        lock.release()
    assert list(victim.iterdir()) == []  # nothing made or written through the link
    if link_at is not None and link_at < depth:
        assert refused is not None and refused.why == "not-a-folder"
        assert all(not p.is_symlink() and p.is_dir() for p in lock.made)
        return
    assert refused is None
    assert lock.made == [tmp.joinpath("out", *names[:i]) for i in range(depth + 1)]
    assert all(p.stat().st_mode & 0o777 == 0o755 for p in lock.made)


def test_a_lock_is_taken_in_the_folder_it_opened_even_if_its_path_moves(tmp_path):
    folder = tmp_path / "state"
    folder.mkdir()
    lock = OutputLock(folder / "lock")
    lock.acquire()
    try:
        moved = tmp_path / "moved"
        folder.rename(moved)
        folder.symlink_to(tmp_path / "elsewhere")  # the old path now leads away
    finally:
        lock.release()
    assert not (moved / "lock").exists()  # removed where it was made, not through the link
    assert not (tmp_path / "elsewhere").exists()


def test_a_held_lock_refuses_a_second_taker(tmp_path):
    first = OutputLock(tmp_path / "lock")
    first.acquire()
    try:
        with pytest.raises(Fatal) as exc:
            OutputLock(tmp_path / "lock").acquire()
        assert exc.value.codes == [Code.OUTPUT_LOCKED]
    finally:
        first.release()
    OutputLock(tmp_path / "lock").acquire()  # released: free again


_NAMES = st.sampled_from(["a", "b", ".git", ".kimi_w31", "c.safetensors", "d"])


@settings(max_examples=40, deadline=None)
@given(
    layout=st.lists(
        st.tuples(_NAMES, st.sampled_from(["file", "dir", "link", "dirlink"]), _NAMES),
        max_size=6,
    )
)
def test_the_listing_never_follows_a_link_and_skips_what_is_never_ours(tmp_path_factory, layout):
    root = tmp_path_factory.mktemp("root")
    outside = tmp_path_factory.mktemp("outside")
    (outside / "secret").write_bytes(b"s")
    for top, kind, inner in layout:
        path = root / top
        if os.path.lexists(path):
            continue
        if kind == "file":
            path.write_bytes(b"12345")
        elif kind == "dir":
            path.mkdir()
            (path / inner).write_bytes(b"123")
        elif kind == "link":
            path.symlink_to(outside / "secret")
        else:
            path.symlink_to(outside)
    entries, files = fsio.listing(root, not_part_of_checkpoint)
    for path, size in files.items():
        rel = path.relative_to(root).as_posix()
        assert not not_part_of_checkpoint(rel)
        assert outside not in path.parents  # nothing reached through a link
        if path.is_symlink():
            assert size is None  # a link is a file here, never a regular one
        else:
            assert size == path.stat().st_size
    assert {p.name for p in entries} == {
        p.name for p in root.iterdir() if not not_part_of_checkpoint(p.name)
    }


def test_a_refusal_is_a_value_and_the_decision_raises_it(tmp_path):
    (tmp_path / "out").write_bytes(b"a file, not a directory")
    out = OutputDir(tmp_path / "out")
    found = out.survey()
    refusal = found.refusal()
    assert isinstance(refusal, Fatal) and refusal.codes == [Code.OUTPUT_NOT_DIRECTORY]
    with pytest.raises(Fatal) as exc:
        out.resume_decision(FP, SRC, force=False)
    assert exc.value.codes == refusal.codes
    assert (tmp_path / "out").read_bytes() == b"a file, not a directory"  # nothing changed


@pytest.mark.parametrize("force", [False, True])
def test_a_directory_holding_a_file_of_no_record_is_never_cleared(tmp_path, force):
    root = tmp_path / "out"
    root.mkdir()
    (root / "notes.txt").write_bytes(b"mine")
    found = OutputDir(root).survey()
    assert found.previous(FP, SRC) == (Mode.FRESH, {})
    want = Code.FOREIGN_OUTPUT if force else Code.OUTPUT_NOT_EMPTY
    refusal = found.room_refusal([root / "notes.txt"], force)
    assert refusal is not None and refusal.codes == [want]
    with pytest.raises(Fatal) as exc:
        OutputDir(root).claim(FP, force=force, source=SRC)
    assert exc.value.codes == [want]
    assert (root / "notes.txt").read_bytes() == b"mine"
    assert not (root / STATE_DIR).exists()  # the claim abandoned: the folders it made are gone


def _plant(path: Path, kind: str, tmp: Path) -> None:
    if kind == "dir":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "link-to-file":
        (tmp / "target").write_bytes(b"t")
        path.symlink_to(tmp / "target")
    else:  # a dangling link
        path.symlink_to(tmp / "nowhere")


@pytest.mark.parametrize("kind", ["dir", "fifo", "link-to-file", "dangling"])
def test_a_refused_lock_is_worded_by_the_claim_as_the_lock_words_it_and_changes_nothing(
    tmp_path, kind
):
    state = tmp_path / "out" / STATE_DIR
    state.mkdir(parents=True)
    _plant(state / "lock", kind, tmp_path)
    with pytest.raises(Fatal) as alone:
        OutputLock(state / "lock").acquire()
    before = _tree(tmp_path / "out")
    with pytest.raises(Fatal) as claimed:
        OutputDir(tmp_path / "out").claim(FP, False, SRC)
    assert claimed.value.codes == [Code.STATE_FOLDER_INVALID]
    assert [p.as_dict() for p in claimed.value.problems] == [
        p.as_dict() for p in alone.value.problems
    ]
    assert _tree(tmp_path / "out") == before  # no ledger, nothing removed


def test_a_claim_refused_by_a_held_lock_leaves_the_holder_and_its_folder_alone(tmp_path):
    state = tmp_path / "out" / STATE_DIR
    state.mkdir(parents=True)
    holder = OutputLock(state / "lock")
    assert holder.attempt() is None
    try:
        held = (state / "lock").read_bytes()
        with pytest.raises(Fatal) as exc:
            OutputDir(tmp_path / "out").claim(FP, False, SRC)
        assert exc.value.codes == [Code.OUTPUT_LOCKED]
        assert (state / "lock").read_bytes() == held
        assert sorted(p.name for p in state.iterdir()) == ["lock"]
    finally:
        holder.release()


def test_the_survey_does_not_fail_where_the_lock_cannot_be_looked_at(tmp_path, monkeypatch):
    """A state folder this user cannot search (root bypasses modes, so the error is made):
    the survey still reads, and the refusal is the permission one, not an OSError."""
    out = OutputDir(tmp_path / "out")
    out.state.mkdir(parents=True)
    lstat = os.lstat

    def refused(path, *a, **k):
        if Path(path).parent == out.state:
            raise PermissionError(13, "Permission denied", str(path))
        return lstat(path, *a, **k)

    monkeypatch.setattr(os, "lstat", refused)
    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    found = out.survey()
    assert found.standing.lock_shown.startswith("unreadable")
    assert found.refusal().codes == [Code.PERMISSION_DENIED]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 10**12), min_size=0, max_size=8),
    done=st.sets(st.integers(0, 7)),
    free=st.integers(0, 4 * 10**12),
)
def test_the_space_refusal_counts_only_the_shards_not_finished(tmp_path_factory, sizes, done, free):
    from kimi_w31.converter.output.records import Ledger, ShardRecord

    out = OutputDir(tmp_path_factory.mktemp("out"))
    names = {f"s{i}": n for i, n in enumerate(sizes)}
    ledger = Ledger(out.ledger_path, FP)
    ledger.seed(ShardRecord(f"s{i}", sizes[i], "h", {}, {}) for i in done if i < len(sizes))
    refusal = ledger.space_refusal(out.root, names, free)
    needed = sum(n for i, n in enumerate(sizes) if i not in done)
    if needed > free:
        assert refusal is not None and refusal.codes == [Code.NO_SPACE]
    else:
        assert refusal is None


_ENTRY_KINDS = ["file", "link-to-file", "link-to-dir", "dangling", "dir"]


def _entry(path: Path, kind: str, victim: Path) -> None:
    if kind == "file":
        path.write_bytes(b"ours")
    elif kind == "link-to-file":
        path.symlink_to(victim / "f")
    elif kind == "link-to-dir":
        path.symlink_to(victim)
    elif kind == "dangling":
        path.symlink_to(victim / "gone")
    else:
        path.mkdir()
        (path / "inner").write_bytes(b"ours")
        (path / "inner-link").symlink_to(victim)


@settings(max_examples=40, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(_ENTRY_KINDS), min_size=1, max_size=6),
    keep=st.sets(st.integers(0, 5)),
)
def test_clearing_removes_links_as_links_and_keeps_what_it_is_told(tmp_path_factory, kinds, keep):
    """`fsio.remove_all` and `fsio.empty` (how a claim clears room and resets the state
    folder) remove a link as itself, never what it leads to, and leave the names kept."""
    tmp = tmp_path_factory.mktemp("clear")
    victim = tmp / "victim"
    victim.mkdir()
    (victim / "f").write_bytes(b"not ours")
    before = _tree(victim)
    area = tmp / "area"
    area.mkdir()
    paths = [area / f"e{i}" for i in range(len(kinds))]
    for path, kind in zip(paths, kinds, strict=True):
        _entry(path, kind, victim)
    files = [p for p, k in zip(paths, kinds, strict=True) if k != "dir"]
    folders = [p for p, k in zip(paths, kinds, strict=True) if k == "dir"]
    # A folder goes once what it holds is gone: its files are named like any other.
    fsio.remove_all(files + [f / n for f in folders for n in ("inner", "inner-link")], folders)
    assert list(area.iterdir()) == [] and _tree(victim) == before
    for path, kind in zip(paths, kinds, strict=True):
        _entry(path, kind, victim)
    kept = {f"e{i}" for i in keep if i < len(kinds)}
    fsio.empty(area, keep=kept)
    assert {p.name for p in area.iterdir()} == kept and _tree(victim) == before


_HIDDEN_SPOTS = ["sub/.keep", "sub/deep/.cache/x", "a/b/c/.note", ".top/f", "sub/.d/y"]
_OURS = ["sub/f.txt", "sub/deep/g.txt", "a/b/c/h.txt", "a/i.txt", "j.txt"]


@settings(max_examples=30, deadline=None)
@given(
    ours=st.sets(st.sampled_from(_OURS), min_size=1),
    hidden=st.sets(st.sampled_from(_HIDDEN_SPOTS)),
)
def test_force_deletes_only_recorded_files_and_only_emptied_folders(tmp_path_factory, ours, hidden):
    """Class: --force replacing an earlier conversion. Only files its records name go; a
    folder goes only once empty: a hidden file someone put in one (never listed, so never
    judged foreign) keeps it, with its parents, byte for byte."""
    root = tmp_path_factory.mktemp("force") / "out"
    for rel in ours:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"ours")
    records = "".join(f'{{"file": "{rel}", "size": 4}}\n' for rel in ours)
    (root / STATE_DIR).mkdir(parents=True, exist_ok=True)
    (root / STATE_DIR / "journal.jsonl").write_text(records)
    for rel in hidden:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"someone else's")
    out = OutputDir(root)
    out.claim("fp", force=True, source=SourceId("s", "s"))
    out.release(finished=False)
    left = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
    assert {rel for rel in left if not rel.startswith(STATE_DIR)} == hidden
    assert all((root / rel).read_bytes() == b"someone else's" for rel in hidden)
    # Every folder left holds something: an emptied one is gone.
    for folder in (p for p in root.rglob("*") if p.is_dir()):
        assert STATE_DIR in folder.parts or any(folder.iterdir()), folder


# -- the room: read with the survey, measured by the claim once the directory is its own ---------


@pytest.mark.parametrize("beside_made", [False, True])
def test_the_survey_reads_the_room_of_the_output_and_of_the_folder_beside_it(tmp_path, beside_made):
    beside = tmp_path / "downloads" / "deeper"  # a folder not made yet: its parent stands in
    if beside_made:
        beside.mkdir(parents=True)
    standing = OutputDir(tmp_path / "out", beside=beside).survey().standing
    assert standing.space is not None and standing.space.device == os.stat(tmp_path).st_dev
    assert standing.beside is not None and standing.beside.device == os.stat(tmp_path).st_dev
    assert OutputDir(tmp_path / "out").survey().standing.beside is None  # nothing beside


@pytest.mark.parametrize("frees", [True, False])
def test_the_claim_measures_its_room_after_the_executor_freed_what_it_may(
    tmp_path, monkeypatch, frees
):
    """The room is measured once `prepare` ran: what it frees counts; a claim without room
    is refused (NO_SPACE) and abandoned, leaving no state folder behind."""
    room = {"free": 0}
    real = fsio.shutil.disk_usage
    monkeypatch.setattr(fsio.shutil, "disk_usage", lambda p: real(p)._replace(free=room["free"]))

    def prepare(downloads) -> None:
        if frees:
            room["free"] = 10**6

    out = OutputDir(tmp_path / "out")
    if frees:
        with out.claim(FP, False, SRC, {"s0": 1000}, prepare) as run:
            assert run.mode is Mode.FRESH
    else:
        with pytest.raises(Fatal) as exc:
            out.claim(FP, False, SRC, {"s0": 1000}, prepare)
        assert exc.value.codes == [Code.NO_SPACE]
        assert not out.state.exists()

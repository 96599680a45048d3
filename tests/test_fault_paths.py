"""Output vs source paths, --force, Hugging Face cache snapshots, permissions; the filesystem
as a hostile user leaves it (links, FIFOs, devices, odd names, hidden folders), and what a
rerun may claim or destroy (whose output it is, what it proved)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import string
from pathlib import Path

import faults as fl
import pytest
from faults import filesystem as ffs
from hypothesis import assume, example, given
from hypothesis import strategies as st
from kimi_w31.converter import contract, fsio
from kimi_w31.converter.audit import verify
from kimi_w31.converter.audit.files import list_files, load_checksums, unsafe_name
from kimi_w31.converter.contract import STATE_DIR
from kimi_w31.converter.errors import Fatal
from kimi_w31.converter.output.directory import OutputDir
from kimi_w31.converter.pipeline import ConvertOptions, convert, source_id
from kimi_w31.converter.reasons import Code
from kimi_w31.converter.source import read_json
from kimi_w31.converter.source.local import LocalOrigin, publish_problem

FAST = fl.fuzz(25)
SLOW = fl.fuzz(8)


def test_paths(tmp_path: Path) -> None:
    template = fl.make_source(tmp_path / "template")
    rows = fl.path_cases(template, tmp_path / "work")
    assert len(rows) == 7
    want = [fl.CLEAN] * 3 + [fl.CORRECT] * 3 + [fl.CLEAN]
    assert [r.outcome for r in rows] == want, fl.bad_rows(rows, set())


@pytest.mark.parametrize("name", [name for name, _ in ffs.SCENARIOS])
def test_filesystem_scenarios(tmp_path: Path, name: str) -> None:
    """Every row of the fault table's filesystem classes: a clean refusal with its code
    (asserted inside the scenario) or a correct result; never a hang, crash or wrong output."""
    template = fl.make_source(tmp_path / "template")
    rows = dict(ffs.SCENARIOS)[name](template, tmp_path / "work")
    assert rows
    assert all(r.outcome in (fl.CLEAN, fl.CORRECT) for r in rows), fl.bad_rows(
        rows, {fl.CLEAN, fl.CORRECT}
    )


# ------------------------------------------------------------------ never block, never hang


@contextlib.contextmanager
def within(seconds: int):
    """Fail instead of hanging: SIGALRM interrupts a blocking open or read."""

    def expired(*_):
        raise TimeoutError(f"still blocked after {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _place(path: Path, kind: str) -> None:
    """Put a hostile thing at `path` (its parent exists)."""
    with contextlib.suppress(FileNotFoundError):
        fsio.remove(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    elif kind == "device":
        path.symlink_to("/dev/zero")
    elif kind == "fifo-link":
        os.mkfifo(path.parent / (path.name + ".fifo"))
        path.symlink_to(path.name + ".fifo")
    elif kind == "dangling":
        path.symlink_to("nowhere")
    elif kind == "loop":
        path.symlink_to(path.name)
    else:
        raise AssertionError(kind)


KINDS = ["fifo", "dir", "device", "fifo-link", "dangling", "loop"]


@FAST
@given(kind=st.sampled_from(KINDS), victim=st.sampled_from(["config.json", fl.INDEX]))
def test_source_json_is_read_only_from_a_regular_file(tmp_path_factory, kind, victim):
    root = tmp_path_factory.mktemp("src")
    _place(root / victim, kind)
    with within(10), pytest.raises(Fatal) as exc:
        read_json(root / victim)
    assert exc.value.codes[0] in (Code.NOT_A_REGULAR_FILE, Code.FILE_MISSING, Code.FILE_UNREADABLE)
    if kind in ("fifo", "dir", "device", "fifo-link"):
        assert exc.value.codes == [Code.NOT_A_REGULAR_FILE]


@FAST
@given(kind=st.sampled_from(KINDS))
def test_every_reader_refuses_what_is_not_a_regular_file_without_blocking(tmp_path_factory, kind):
    root = tmp_path_factory.mktemp("x")
    _place(root / "a.safetensors", kind)
    _place(root / "tokenizer.json", kind)
    _place(root / contract.CHECKSUMS_NAME, kind)
    with within(10):
        with pytest.raises(Fatal) as exc:
            LocalOrigin().read_header(root, "a.safetensors")
        assert set(exc.value.codes) <= {Code.NOT_A_REGULAR_FILE, Code.SHARD_MISSING}
        problem = publish_problem(root, "tokenizer.json")
        assert problem is not None and problem.code is Code.NOT_A_REGULAR_FILE
        table, problems = load_checksums(root)
        assert table is None and problems[0].code is Code.CHECKSUMS_INVALID
        with pytest.raises(OSError):
            fsio.read_regular(root / "tokenizer.json")


# ------------------------------------------------------------------ the state folder


def _finished_copy(converted: Path, out: Path) -> None:
    """The shared conversion as `convert` left it: without the record a verify of it (by a
    test that ran earlier, in any order) may have added to its state folder."""
    shutil.copytree(converted, out, ignore=shutil.ignore_patterns(STATE_DIR))


STATE_MAKERS = {
    "link-to-dir": lambda p, v: p.symlink_to(v),
    "link-to-file": lambda p, v: p.symlink_to(v / "precious.txt"),
    "dangling": lambda p, v: p.symlink_to(v / "nowhere"),
    "file": lambda p, v: p.write_text("the user's\n"),
    "fifo": lambda p, v: os.mkfifo(p),
}


@SLOW
@given(
    kind=st.sampled_from(sorted(STATE_MAKERS)),
    force=st.booleans(),
    dry_run=st.booleans(),
    finished=st.booleans(),
)
def test_a_state_folder_that_is_not_a_real_directory_is_never_used(
    small_source, converted, tmp_path_factory, kind, force, dry_run, finished
):
    work = tmp_path_factory.mktemp("state")
    victim = work / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me\n")
    out = work / "out"
    if finished:
        _finished_copy(converted, out)
    else:
        out.mkdir()
    STATE_MAKERS[kind](out / STATE_DIR, victim)
    before = fl.tree(work)
    opts = ConvertOptions(
        str(small_source),
        out,
        manifest="kimi-k3-any",
        max_shard_size=600_000,
        force=force,
        dry_run=dry_run,
    )
    with within(30), pytest.raises(Fatal) as exc:
        convert(opts)
    assert exc.value.codes == [Code.STATE_FOLDER_INVALID]
    assert fl.tree(work) == before


@SLOW
@given(
    entry=st.sampled_from(
        ["lock", "ledger.jsonl", "journal.jsonl", "tmp", "partials.jsonl", "ledger.jsonl.partial"]
    ),
    kind=st.sampled_from(["link-to-file", "link-to-dir", "fifo"]),
    finished=st.booleans(),
    force=st.booleans(),
)
@example(entry="ledger.jsonl.partial", kind="link-to-file", finished=True, force=False)
@example(entry="journal.jsonl", kind="fifo", finished=True, force=True)
@example(entry="lock", kind="fifo", finished=False, force=False)
def test_nothing_in_the_state_folder_leads_a_write_or_a_read_elsewhere(
    small_source, converted, tmp_path_factory, entry, kind, finished, force
):
    """Links and FIFOs planted inside a real state folder: never written through, never
    blocked on; the run either refuses with a code or converts, and the victim is intact."""
    work = tmp_path_factory.mktemp("inner")
    victim = work / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text(json.dumps({"pid": 2**22 + 7, "host": os.uname()[1]}))
    out = work / "out"
    if finished:
        _finished_copy(converted, out)
    else:
        out.mkdir()
    (out / STATE_DIR).mkdir()
    planted = out / STATE_DIR / entry
    if kind == "fifo":
        os.mkfifo(planted)
    else:
        planted.symlink_to(victim / "precious.txt" if kind == "link-to-file" else victim)
    before = fl.tree(victim)
    opts = ConvertOptions(
        str(small_source), out, manifest="kimi-k3-any", max_shard_size=600_000, force=force
    )
    with within(60):
        try:
            convert(opts)
        except Fatal as exc:
            assert exc.codes == [Code.STATE_FOLDER_INVALID], exc.problems
            assert entry == "lock"
    assert fl.tree(victim) == before


# ------------------------------------------------------------------ the link policy


@FAST
@given(
    where=st.sampled_from(["published", "hidden", "weights", "outside", "blob", "checksums"]),
    depth=st.integers(0, 2),
)
def test_a_linked_extra_file_is_published_only_if_it_would_be_published_directly(
    tmp_path_factory, where, depth
):
    """The rule restated from the outside: a link's target must be a regular file that is
    itself one of the source's published files, or a blob of the Hub cache snapshot."""
    base = tmp_path_factory.mktemp("links")
    snapshot = where == "blob"
    root = base / "models--org--m" / "snapshots" / ("0" * 40) if snapshot else base / "src"
    root.mkdir(parents=True)
    sub = "/".join(f"d{i}" for i in range(depth))
    if where == "published":
        target = root / "real.txt"
    elif where == "hidden":
        target = root / ".git" / "config"
    elif where == "weights":
        target = root / "other.safetensors"
    elif where == "checksums":
        target = root / contract.CHECKSUMS_NAME
    elif where == "outside":
        target = base / "secret.txt"
    else:
        target = base / "models--org--m" / "blobs" / "abc123"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("content\n")
    rel = f"{sub}/notes.txt" if sub else "notes.txt"
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).symlink_to(target)
    problem = publish_problem(root, rel)
    if where in ("published", "blob"):
        assert problem is None
    else:
        assert problem is not None and problem.code is Code.LINK_ESCAPES
        assert "symlink" in (problem.found or "")
    with pytest.raises(Fatal) if problem else contextlib.nullcontext() as exc:
        extra = LocalOrigin().extra_files(root, set())
    if problem is None:
        assert rel in extra
    else:
        assert exc.value.codes.count(Code.LINK_ESCAPES) == 1  # said once, for the file
        assert exc.value.hint


def test_linked_shards_convert_and_verify_against_the_source(source_copy, tmp_path):
    disk = tmp_path / "disk2"
    disk.mkdir()
    for shard in sorted(source_copy.glob("*.safetensors")):
        shutil.move(shard, disk / shard.name)
        shard.symlink_to(disk / shard.name)
    out = tmp_path / "out"
    convert(ConvertOptions(str(source_copy), out, manifest="kimi-k3-any"))
    report = verify(out, source=str(source_copy))
    assert report.ok, report.problems
    assert all(fsio.lkind(p) == "regular file" for p in out.glob("*.safetensors"))


# ------------------------------------------------------------------ names


NAME_CHARS = st.characters(codec="utf-8") | st.sampled_from(list("\\\n\t\x7f .-_/" + "é中"))


@FAST
@given(
    name=st.text(NAME_CHARS, min_size=1, max_size=24)
    | st.binary(min_size=1, max_size=12).map(os.fsdecode)
)
def test_every_name_convert_publishes_verify_reads_back(tmp_path_factory, name):
    """A name the converter publishes is one verify reads back: it is listed as a file and
    passes verify's own name check; a name verify would refuse is refused by convert with
    its code (or is hidden, and skipped like every hidden path)."""
    # one path component: a leading or trailing "/" would name another place entirely
    assume("/" not in name and "\x00" not in name and name not in (".", ".."))
    root = tmp_path_factory.mktemp("names")
    try:
        (root / name).write_text("x\n")
    except (OSError, ValueError):
        assume(False)  # not a name this filesystem takes
    rel = os.fsdecode(next(iter(os.listdir(root))))
    try:
        published = LocalOrigin().extra_files(root, set())
    except Fatal as exc:
        assert exc.codes == [Code.FILE_NAME_INVALID]
        assert contract.file_name_problem(rel) is not None
        assert unsafe_name(root, rel) is not None
        return
    if rel.startswith("."):
        assert published == []
        return
    assert published == [rel]
    files, problems, _ = list_files(root)
    assert rel in files and not problems
    assert unsafe_name(root, rel) is None
    assert json.loads(json.dumps({rel: 1}, ensure_ascii=True)) == {rel: 1}
    rel.encode("utf-8")  # strict: what any reader of the checksums file can decode


def test_odd_but_valid_names_survive_convert_and_verify(source_copy, tmp_path):
    names = ["notes with spaces.txt", "ünïcödé.md", "sub dir/ä b.txt", "a'b\"c.txt", "x.y.z"]
    for rel in names:
        (source_copy / rel).parent.mkdir(parents=True, exist_ok=True)
        (source_copy / rel).write_text(rel)
    out = tmp_path / "out"
    convert(ConvertOptions(str(source_copy), out, manifest="kimi-k3-any"))
    report = verify(out, checksums=True, source=str(source_copy))
    assert report.ok, report.problems
    assert all((out / rel).read_text() == rel for rel in names)


# ------------------------------------------------------------------ whose output


@FAST
@given(
    spelling=st.sampled_from(["abs", "abs/", "rel", "link", "dot"]),
    other=st.sampled_from(["abs", "abs/", "rel", "link", "dot"]),
)
def test_a_source_is_where_it_is_read_from_however_it_is_spelled(
    small_source, tmp_path_factory, spelling, other
):
    base = tmp_path_factory.mktemp("spell")
    link = base / "link"
    link.symlink_to(small_source, target_is_directory=True)

    def spelled(how: str) -> str:
        return {
            "abs": str(small_source),
            "abs/": str(small_source) + "/",
            "rel": os.path.relpath(small_source),
            "link": str(link),
            "dot": str(small_source / "."),
        }[how]

    def identity(how: str):
        root = LocalOrigin().resolve(spelled(how), None).root
        from kimi_w31.converter.source import read_source

        return source_id(read_source(root, spelled(how), LocalOrigin()), LocalOrigin())

    a, b = identity(spelling), identity(other)
    assert a == b
    assert a.name == small_source.name and "/" not in a.name
    assert a.key not in a.digest


def test_a_finished_output_refuses_another_source_and_names_its_owner(
    small_source, converted, tmp_path
):
    out = tmp_path / "out"
    _finished_copy(converted, out)
    other = tmp_path / "elsewhere" / "ft"
    shutil.copytree(small_source, other)
    before = fl.tree(out)
    for dry_run in (False, True):
        with pytest.raises(Fatal) as exc:
            convert(
                ConvertOptions(
                    str(other), out, manifest="kimi-k3-any", max_shard_size=600_000, dry_run=dry_run
                )
            )
        assert exc.value.codes == [Code.OUTPUT_OF_ANOTHER_SOURCE]
        assert small_source.name in exc.value.problems[0].what
    assert fl.tree(out) == before


# ------------------------------------------------------------------ claim what was proven


@SLOW
@given(
    deleted=st.sets(st.integers(0, 5), max_size=2),
    flipped=st.sets(st.integers(0, 5), max_size=2),
    rehash=st.booleans(),
)
def test_a_rerun_claims_the_data_proven_only_when_it_re_read_it(
    small_source, converted, tmp_path_factory, deleted, flipped, rehash
):
    out = tmp_path_factory.mktemp("claim") / "out"
    _finished_copy(converted, out)
    shards = sorted(out.glob("*.safetensors"))
    for i in flipped - deleted:
        path = shards[i % len(shards)]
        data = bytearray(path.read_bytes())
        data[-1 - i] ^= 0x40
        path.write_bytes(bytes(data))
    for i in deleted:
        shards[i % len(shards)].unlink(missing_ok=True)
    result = convert(
        ConvertOptions(
            str(small_source), out, manifest="kimi-k3-any", max_shard_size=600_000, rehash=rehash
        )
    )
    summary = result.summary()
    intact = verify(out, checksums=True).ok
    assert summary["kept_data_reread"] is (rehash or summary["shards_kept"] == 0)
    if summary["kept_data_reread"]:
        assert intact  # it says it proved the data: it must be so
    if rehash:
        assert intact


# ------------------------------------------------------------------ safe to publish


@FAST
@given(
    dirname=st.text(string.ascii_letters + string.digits + "-_. ", min_size=1, max_size=12),
    how=st.sampled_from(["abs", "rel", "trailing"]),
)
def test_no_machine_path_is_published(small_source, tmp_path_factory, dirname, how):
    assume(not dirname.startswith(".") and dirname.strip() == dirname)
    base = tmp_path_factory.mktemp("pub")
    src = base / "data" / "models" / dirname
    shutil.copytree(small_source, src)
    spelled = {"abs": str(src), "rel": os.path.relpath(src), "trailing": str(src) + "/"}[how]
    out = base / "out"
    convert(ConvertOptions(spelled, out, manifest="kimi-k3-any"))
    for name in (contract.CONFIG_NAME, contract.CHECKSUMS_NAME, contract.INDEX_NAME):
        text = (out / name).read_text()
        assert str(base) not in text and "data/models" not in text, name
    config = json.loads((out / contract.CONFIG_NAME).read_text())
    assert config["kimi_w31"]["source"]["path"] == dirname


HIDDEN = [
    ".cache/huggingface/upload/model.safetensors.metadata",
    ".cache/huggingface/download/x.lock",
    ".git/HEAD",
    ".gitattributes",
    "sub/.git/config",
    ".DS_Store",
    "sub/.hidden.safetensors",
    ".ipynb_checkpoints/x.json",
]


@FAST
@given(
    paths=st.lists(st.sampled_from(HIDDEN), min_size=1, max_size=4, unique=True),
    stray=st.booleans(),
)
def test_verify_ignores_hidden_paths_and_says_which(converted, tmp_path_factory, paths, stray):
    """Upload state, git's files, anything hidden: not part of a checkpoint, ignored and
    named. A file that is not hidden is still one the conversion must have written."""
    out = tmp_path_factory.mktemp("hidden") / "out"
    _finished_copy(converted, out)
    for rel in paths + (["notes.txt"] if stray else []):
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text("not written by the conversion\n")
    report = verify(out, checksums=True)
    assert report.ok is not stray
    if stray:
        assert report.codes == {Code.FILE_UNRECORDED}
    detail = report.check("files").detail
    shown = [p for p in detail.split(": ", 1)[1].split(", ")] if "ignored" in detail else []
    for rel in paths:
        assert any(rel == s or rel.startswith(s.split(" and ")[0] + "/") for s in shown) or (
            "more" in detail
        ), (rel, detail)


@FAST
@given(
    path=st.lists(
        st.sampled_from([".git", ".cache", "huggingface", "a", ".gitattributes", "b.txt", ".x"]),
        min_size=1,
        max_size=4,
    ).map("/".join)
)
def test_what_huggingface_hub_does_not_upload_is_not_part_of_a_checkpoint(path):
    """Differential: every path huggingface_hub's upload skips is one verify ignores (verify
    ignores every hidden path: a loader reads only what the index names)."""
    from huggingface_hub.utils import filter_repo_objects
    from huggingface_hub.utils._paths import DEFAULT_IGNORE_PATTERNS

    hub_skips = not list(filter_repo_objects([path], ignore_patterns=DEFAULT_IGNORE_PATTERNS))
    ours = contract.not_part_of_checkpoint(path)
    if hub_skips:
        assert ours, path
    assert ours is any(p.startswith(".") for p in path.split("/"))
    assert contract.not_part_of_checkpoint(STATE_DIR)


# ------------------------------------------------------------------ blame the right thing


def test_no_permission_is_named_as_such_also_by_dry_run(small_source, tmp_path, monkeypatch):
    """Run as root here, so permissions are simulated: access(2) says no, as it does for
    another user on a read-only parent or on a read-only filesystem."""
    parent = tmp_path / "readonly"
    parent.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, m, **kw: Path(p) != parent and real_access(p, m))
    for dry_run in (True, False):
        with pytest.raises(Fatal) as exc:
            convert(
                ConvertOptions(
                    str(small_source), parent / "out", manifest="kimi-k3-any", dry_run=dry_run
                )
            )
        assert exc.value.codes == [Code.PERMISSION_DENIED]
    assert not (parent / "out").exists()


@pytest.mark.parametrize("err", [errno.EACCES, errno.EPERM, errno.EROFS])
def test_a_permission_error_is_not_a_lost_state_folder(tmp_path, err):
    out = OutputDir(tmp_path / "out")
    exc = out.io_error(OSError(err, os.strerror(err), str(tmp_path / "out")))
    assert exc.codes == [Code.PERMISSION_DENIED]

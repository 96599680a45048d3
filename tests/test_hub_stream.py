"""Hub streaming through the real `huggingface_hub` client against a loopback fake Hub.

The server (tests/hub_server.py) serves a synthetic six-shard repo the way the Hub's file
endpoints do; `HF_ENDPOINT` points the client at it and the cache lives in tmp. Every run is
the real convert command in a subprocess. The reference is a plain local conversion of the
same files. Errors are checked by their `Code` (the `--json` problems), never by wording.

Where a test interrupts downloads or reads their progress, the client's read chunk (10 MB,
far larger than these shards) is scaled down with them, so partial downloads hold data and
progress moves within a file, as on the real model.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from cli_helpers import CliResult, cli_argv, cli_env, ctrl_c_as_at_a_terminal, run_cli
from hub_server import FakeHub
from hypothesis import given, settings
from hypothesis import strategies as st
from kimi_w31.converter.cli.console import human
from kimi_w31.converter.contract import STATE_DIR
from kimi_w31.converter.errors import Fatal
from kimi_w31.converter.execute.stream import download_order, estimate
from kimi_w31.converter.output.directory import OutputDir
from kimi_w31.converter.output.records import PartialDownloads
from kimi_w31.converter.pipeline import ConvertOptions, convert, prepare
from kimi_w31.converter.reasons import Code
from kimi_w31.converter.source.hub import remove_partial
from kimi_w31.converter.synth import SynthSpec, synth_checkpoint

REPO = "org/kimi-synth"
SHARD_SIZE = "600000"
ARGS = ["--manifest", "kimi-k3-any", "--max-shard-size", SHARD_SIZE]
SHARDS = [f"model-0000{i}-of-000006.safetensors" for i in range(1, 7)]
STATE = STATE_DIR
# The convert command as `kimi-convert SRC OUT ...` runs it (prelude ""); SMALL_CHUNKS also
# scales the client's read chunk down to these shards' size (see the module docstring).
SMALL_CHUNKS = "import huggingface_hub.constants as c; c.DOWNLOAD_CHUNK_SIZE = 65536; "


@pytest.fixture(scope="module")
def hub_source(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hubsrc") / "repo"
    synth_checkpoint(root, SynthSpec(layers=4, experts=8, shards=6))  # even shards: windows
    assert sorted(p.name for p in root.glob("*.safetensors")) == SHARDS
    return root


@pytest.fixture(scope="module")
def reference(hub_source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hubref") / "out"
    convert(
        ConvertOptions(str(hub_source), out, manifest="kimi-k3-any", max_shard_size=int(SHARD_SIZE))
    )
    (out.parent / "source-path").write_text(str(hub_source))  # config.json names it only
    return out


@pytest.fixture
def hub(hub_source):
    with FakeHub({REPO: hub_source}) as server:
        yield server


def _env(hub: FakeHub, tmp: Path, **extra: str) -> dict[str, str | None]:
    """What the run's environment changes (as `run_cli` takes it): no HF_ setting of ours."""
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("HF_")}
    env.update(
        HF_ENDPOINT=hub.endpoint,
        HF_HOME=str(tmp / "hf_home"),
        HF_HUB_CACHE=str(tmp / "hf_cache"),
        HF_HUB_DISABLE_TELEMETRY="1",
    )
    env.update(extra)
    return env


def _argv(*args: object, small_chunks: bool = False) -> list[str]:
    return cli_argv(args, SMALL_CHUNKS if small_chunks else "")


def _run(*args: object, env: dict[str, str | None], small_chunks: bool = False, **kw) -> CliResult:
    return run_cli(args, env=env, prelude=SMALL_CHUNKS if small_chunks else "", **kw)


def _convert(
    hub: FakeHub, tmp: Path, out: Path, *args: str, small_chunks: bool = False, **env: str
) -> CliResult:
    return _run(
        REPO, out, "--download", *ARGS, *args, env=_env(hub, tmp, **env), small_chunks=small_chunks
    )


def _problems(r: CliResult) -> list[dict]:
    assert r.json["ok"] is False
    return r.problems


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _assert_same_as_reference(out: Path, reference: Path) -> None:
    """Byte-identical, except that config.json names its source as the user typed it."""
    got, want = _files(out), _files(reference)
    want_source = _files(Path((reference.parent / "source-path").read_text()))
    assert sorted(got) == sorted(want)
    for name in want:
        if name not in ("config.json", "kimi_w31.checksums.json"):
            assert got[name] == want[name], name
    sums_got, sums_want = (
        json.loads(got["kimi_w31.checksums.json"]),
        json.loads(want["kimi_w31.checksums.json"]),
    )
    assert sums_got["files"].pop("config.json") != sums_want["files"].pop("config.json")
    assert sums_got.pop("source") != sums_want.pop("source")  # a Hub commit, a directory
    # Source identities differ by kind: a Hub run names each source shard by content (size
    # and the Hub's sha256), a local run by file (size, times, inode).
    for name, entry in sums_got["files"].items():
        for file, identity in entry.pop("sources", {}).items():
            assert identity == [len(want_source[file]), sha256(want_source[file])], name
        sums_want["files"][name].pop("sources", None)
    assert sums_got == sums_want  # per-tensor checksums and the plan fingerprint agree
    cfg_got, cfg_want = json.loads(got["config.json"]), json.loads(want["config.json"])
    cfg_got["kimi_w31"]["source"].pop("path")
    cfg_want["kimi_w31"]["source"].pop("path")
    assert cfg_got == cfg_want


def _without_sources(checksums: bytes) -> dict:
    doc = json.loads(checksums)
    for entry in doc["files"].values():
        entry.pop("sources", None)
    return doc


def _repo_cache(tmp: Path) -> Path:
    return tmp / "hf_cache" / "models--org--kimi-synth"


def _cached_shards(tmp: Path) -> list[Path]:
    """Source shard bytes still on disk in the HF cache (blobs larger than any small file)."""
    blobs = _repo_cache(tmp) / "blobs"
    return [p for p in blobs.iterdir() if p.stat().st_size > 100_000] if blobs.exists() else []


def _partials(root: Path) -> list[Path]:
    """huggingface_hub's temporary download files anywhere under root."""
    try:
        return sorted(root.rglob("*.incomplete"))
    except OSError:  # not there yet, or a folder removed while it was listed
        return []


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # completed (renamed) or removed since it was listed
        return 0


def _wait_for(what: str, done: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_streamed_conversion_with_deletion_matches_local_and_bounds_disk(
    hub, hub_source, reference, tmp_path
):
    out = tmp_path / "out"
    r = _convert(hub, tmp_path, out, "--delete-source-shards", "--max-source-window", "3", "--json")
    assert r.returncode == 0, r.stderr
    _assert_same_as_reference(out, reference)
    assert _cached_shards(tmp_path) == []  # every source shard deleted once consumed
    for shard in SHARDS:
        assert len(hub.downloads(shard)) == 1, shard  # each fetched exactly once
    summary = r.json
    h = summary["hub"]
    shard_bytes = sum(hub.files[REPO][s].size for s in SHARDS)
    assert h["commit"] == hub.commit and h["source_bytes"] == shard_bytes
    assert h["window"] == 3 and h["min_window"] == 3
    assert (h["downloaded_files"], h["downloaded_bytes"]) == (6, shard_bytes)
    assert (h["deleted_files"], h["deleted_bytes"]) == (6, shard_bytes)
    for path in (summary["source"], summary["output"], h["download_dir"]):
        assert os.path.isabs(path), path
    source = sum(p.stat().st_size for p in hub_source.iterdir())
    output = sum(p.stat().st_size for p in out.iterdir())
    # The measured high-water mark of cache + output stays under the plan's bound and well
    # under keeping everything (source + output).
    assert 0 < h["peak_disk_measured"] <= h["peak_disk_bound"]
    assert h["peak_disk_measured"] < 0.8 * (source + output)


def test_without_deletion_the_cache_is_a_normal_snapshot_and_converts_identically(
    hub, reference, tmp_path
):
    out = tmp_path / "out"
    r = _convert(hub, tmp_path, out, "--json")
    assert r.returncode == 0, r.stderr
    _assert_same_as_reference(out, reference)
    assert len(_cached_shards(tmp_path)) == 6
    assert r.json["hub"]["deleted_files"] == 0
    # The snapshot huggingface_hub left behind converts offline to the very same bytes,
    # config.json included (both runs name the source "org/kimi-synth"); only the source
    # identities in the checksums file differ in kind (files offline, content from the Hub).
    offline = tmp_path / "offline"
    r2 = _run(REPO, offline, *ARGS, env=_env(hub, tmp_path, HF_HUB_OFFLINE="1"))
    assert r2.returncode == 0, r2.stderr
    got, want = _files(offline), _files(out)
    sums = "kimi_w31.checksums.json"
    assert _without_sources(got.pop(sums)) == _without_sources(want.pop(sums))
    assert got == want
    # Rerunning the download command on a complete output downloads nothing.
    before = len(hub.downloads())
    r3 = _convert(hub, tmp_path, out, "--json")
    assert r3.returncode == 0, r3.stderr
    summary = r3.json
    assert summary["already_complete"] is True
    assert (summary["hub"]["downloaded_files"], summary["hub"]["downloaded_bytes"]) == (0, 0)
    assert len(hub.downloads()) == before


def test_download_dir_instead_of_cache(hub, reference, tmp_path):
    out, dl = tmp_path / "out", tmp_path / "dl"
    r = _convert(hub, tmp_path, out, "--download-dir", dl, "--delete-source-shards", "--json")
    assert r.returncode == 0, r.stderr
    _assert_same_as_reference(out, reference)
    assert (dl / "config.json").is_file() and not list(dl.glob("*.safetensors"))
    meta = dl / ".cache" / "huggingface" / "download"
    assert not list(meta.glob("*.safetensors.metadata"))
    assert not _repo_cache(tmp_path).exists()
    assert r.json["hub"]["download_dir"] == str(dl)


def test_manifest_check_happens_before_any_shard_is_downloaded(hub, tmp_path):
    out = tmp_path / "out"
    # The pinned official manifest rejects the scaled-down checkpoint, from headers alone.
    r = _run(
        REPO, out, "--download", "--max-shard-size", SHARD_SIZE, "--json", env=_env(hub, tmp_path)
    )
    assert r.returncode == 1
    assert "pinned-mismatch" in {p["code"] for p in _problems(r)}
    assert hub.downloads(None) and all(d.file not in SHARDS for d in hub.downloads())
    assert not out.exists()


def test_dry_run_prints_the_window_and_peak_and_downloads_nothing(hub, tmp_path):
    out = tmp_path / "out"
    r = _convert(
        hub, tmp_path, out, "--dry-run", "--delete-source-shards", "--max-source-window", "3"
    )
    assert r.returncode == 0, r.stderr
    assert "peak disk (at most)" in r.stdout and "at least 3 needed" in r.stdout
    # --json: the same figures, every path absolute even with a relative cache folder.
    r = _run(
        REPO,
        "out",
        "--download",
        *ARGS,
        "--dry-run",
        "--delete-source-shards",
        "--max-source-window",
        "2",
        "--json",
        cwd=tmp_path,
        env=_env(hub, tmp_path, HF_HUB_CACHE="rel_cache"),
    )
    assert r.returncode == 0, r.stderr
    summary = r.json
    h = summary["hub"]
    assert (h["window"], h["min_window"]) == (2, 3)
    # the time, from a measured download rate (a short ranged read, not a download)
    assert summary["estimate_seconds"] > 0 and summary["estimate_rate_bytes_s"] > 0
    assert "download measured" in summary["estimate_basis"]
    assert h["peak_disk_bound"] > 0 and h["peak_disk_measured"] is None
    for path in (summary["source"], summary["output"], h["download_dir"]):
        assert os.path.isabs(path), path
    assert h["download_dir"] == str(tmp_path / "rel_cache" / "models--org--kimi-synth")
    assert all(d.file not in SHARDS for d in hub.downloads())
    assert not out.exists() and not (tmp_path / "out").exists()


def test_window_smaller_than_the_layout_needs_is_refused_before_downloading(hub, tmp_path):
    r = _convert(
        hub,
        tmp_path,
        tmp_path / "out",
        "--delete-source-shards",
        "--max-source-window",
        "2",
        "--json",
    )
    assert r.returncode == 2
    [problem] = _problems(r)
    assert problem["code"] == "window-too-small"
    assert (problem["expected"], problem["found"]) == ("at least 3", "2")
    assert all(d.file not in SHARDS for d in hub.downloads())
    assert not (tmp_path / "out").exists()


def test_unknown_repo_gated_repo_and_bad_revision_are_clear_errors(hub, tmp_path):
    r = _run("org/missing", tmp_path / "o1", "--download", *ARGS, "--json", env=_env(hub, tmp_path))
    assert r.returncode == 1
    [problem] = _problems(r)
    assert (problem["code"], problem["file"]) == ("hub-not-found", "org/missing")
    hub.gated.add(REPO)
    r = _convert(hub, tmp_path, tmp_path / "o0", "--json")
    hub.gated.clear()
    assert r.returncode == 1
    [problem] = _problems(r)
    assert (problem["code"], problem["file"]) == ("hub-gated", REPO)
    assert not (tmp_path / "o0").exists()
    r = _convert(hub, tmp_path, tmp_path / "o2", "--revision", "nope", "--json")
    assert r.returncode == 1
    [problem] = _problems(r)
    assert (problem["code"], problem["found"]) == ("hub-revision", "nope")  # the bad revision
    r = _run(
        REPO, tmp_path / "o3", "--delete-source-shards", *ARGS, "--json", env=_env(hub, tmp_path)
    )
    assert r.returncode == 2
    assert [p["code"] for p in _problems(r)] == ["usage"]


def _completed(hub: FakeHub) -> set[str]:
    """Source shards whose download finished (the whole body was sent)."""
    sizes = {name: f.size for name, f in hub.files[REPO].items()}
    return {d.file for d in hub.downloads() if d.range is None and d.sent == sizes[d.file]}


class _StoredWatch:
    """Source shards the client stored in the HF cache at some point during a run (its
    snapshot link appeared). A download the server finished sending may still be dropped by
    the client when the run stops; only a stored one was "fully downloaded"."""

    def __init__(self, tmp: Path) -> None:
        self.snapshots = _repo_cache(tmp) / "snapshots"
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.scan()
            time.sleep(0.002)

    def scan(self) -> None:
        for shard in SHARDS:
            if any(os.path.lexists(d / shard) for d in _dirs(self.snapshots)):
                self.seen.add(shard)

    def __enter__(self) -> _StoredWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.scan()


def _dirs(root: Path) -> list[Path]:
    try:
        return [p for p in root.iterdir() if p.is_dir()]
    except OSError:
        return []


def test_failed_download_midway_then_resume_completes_without_refetching(hub, reference, tmp_path):
    out = tmp_path / "out"
    hub.fail_download.add(SHARDS[3])  # HTTP 500 for every download of shard 4
    with _StoredWatch(tmp_path) as stored:
        r = _convert(
            hub,
            tmp_path,
            out,
            "--delete-source-shards",
            "--max-source-window",
            "3",
            "--workers",
            "1",
            "--json",
        )
    assert r.returncode == 1
    [problem] = _problems(r)
    assert (problem["code"], problem["file"]) == ("hub-error", SHARDS[3])
    assert r.json["hint"]  # says how to resume
    assert not (out / "model.safetensors.index.json").exists()
    first = stored.seen
    assert first and SHARDS[3] not in first
    assert first <= _completed(hub)  # the watch saw only what the Hub served whole
    hub.log.clear()
    hub.fail_download.clear()
    r = _convert(hub, tmp_path, out, "--delete-source-shards", "--max-source-window", "3", "--json")
    assert r.returncode == 0, r.stderr
    summary = r.json
    assert summary["shards_kept"] >= 1
    _assert_same_as_reference(out, reference)
    assert not (first & _completed(hub)), "a finished source shard was downloaded again"
    assert _cached_shards(tmp_path) == []
    assert _partials(tmp_path / "hf_cache") == []


def test_dropped_connection_is_retried_by_the_client(hub, reference, tmp_path):
    out = tmp_path / "out"
    hub.drop_once[SHARDS[4]] = 10_000
    r = _convert(hub, tmp_path, out, "--delete-source-shards", "--max-source-window", "3")
    assert r.returncode == 0, r.stderr
    _assert_same_as_reference(out, reference)
    # huggingface_hub retried the cut transfer (from the last whole 10 MB chunk it had kept:
    # byte 0 for a file this small) and the short body never reached the cache.
    sent = [d.sent for d in hub.downloads(SHARDS[4])]
    assert sent == [10_000, hub.files[REPO][SHARDS[4]].size]


def test_killed_run_resumes_without_downloading_finished_shards_again(hub, reference, tmp_path):
    out = tmp_path / "out"
    held = hub.hold[SHARDS[4]] = threading.Event()  # the run stalls on shard 5
    proc = subprocess.Popen(
        _argv(
            REPO,
            out,
            "--download",
            *ARGS,
            "--delete-source-shards",
            "--max-source-window",
            "3",
            "--workers",
            "1",
        ),
        env=cli_env(_env(hub, tmp_path)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ledger = OutputDir(out).ledger_path
    try:
        # the fingerprint line and two finished shards
        _wait_for(
            "two finished shards",
            lambda: ledger.exists() and len(ledger.read_text().splitlines()) >= 3,
        )
        time.sleep(0.3)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    held.set()
    del hub.hold[SHARDS[4]]
    assert not (out / "model.safetensors.index.json").exists()
    first = _completed(hub)
    assert len(first) >= 2
    hub.log.clear()
    r = _convert(hub, tmp_path, out, "--delete-source-shards", "--max-source-window", "3", "--json")
    assert r.returncode == 0, r.stderr
    assert r.json["shards_kept"] >= 2
    _assert_same_as_reference(out, reference)
    assert not (first & _completed(hub)), "a finished source shard was downloaded again"


# -- partial downloads: recorded as they appear, removed, never another's -------------------


@pytest.mark.parametrize("where", ["cache", "download-dir"])
def test_interrupted_downloads_leave_no_partial_files(hub, reference, tmp_path, where):
    """Ctrl-C, then two kills, each while downloads are partly on disk; then a resume."""
    out, dl = tmp_path / "out", tmp_path / "dl"
    args = ["--delete-source-shards", "--max-source-window", "3"]
    if where == "cache":
        storage = _repo_cache(tmp_path)
    else:
        storage = dl
        args += ["--download-dir", str(dl)]
    temp_dir = storage / "blobs" if where == "cache" else dl / ".cache/huggingface/download"
    # Another process's partial download of the same file: never ours to remove.
    etag = hub.files[REPO][SHARDS[5]].etag
    foreign = temp_dir / f"{etag}.0badf00d.incomplete"
    hub.rate = 300_000  # bytes/s per download: each shard takes about 2.5 s

    def with_data() -> list[Path]:
        return [p for p in _partials(storage) if p != foreign and _size(p) > 0]

    def settled() -> bool:
        """Partial downloads hold data and every one is recorded: a kill now cannot land in
        the instant between a download creating its file and the record of it (a known
        limit, documented in the README)."""
        journal = OutputDir(out).partials_path
        try:
            recorded = {Path(json.loads(x)["path"]) for x in journal.read_text().splitlines()}
        except (OSError, ValueError):
            return False
        mine = [p for p in _partials(storage) if p != foreign]
        return bool(with_data()) and {p.resolve() for p in mine} <= recorded

    for sig in (signal.SIGINT, signal.SIGKILL, signal.SIGKILL):
        proc = subprocess.Popen(
            _argv(REPO, out, "--download", *ARGS, *args, small_chunks=True),
            env=cli_env(_env(hub, tmp_path)),
            preexec_fn=ctrl_c_as_at_a_terminal,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            _wait_for("recorded partial downloads holding data", settled)
            if not foreign.exists():
                foreign.write_bytes(b"not ours")
        finally:
            proc.send_signal(sig)
            _, stderr = proc.communicate(timeout=60)
        if sig == signal.SIGINT:  # the run removes its own partial downloads as it stops
            assert proc.returncode == 130, stderr
            assert _partials(storage) == [foreign]
        else:  # a kill leaves them, each recorded before it held any data
            left = set(_partials(storage)) - {foreign}
            assert left, stderr
            journal = OutputDir(out).partials_path
            recorded = {Path(json.loads(line)["path"]) for line in journal.read_text().splitlines()}
            assert {p.resolve() for p in left} <= recorded
    hub.rate = None
    r = _convert(hub, tmp_path, out, *args, "--json")
    assert r.returncode == 0, r.stderr
    _assert_same_as_reference(out, reference)
    assert _partials(storage) == [foreign]  # ours removed, the other process's kept
    assert not (out / STATE).exists()
    h = r.json["hub"]
    assert h["partial_downloads_removed"] >= 1 and h["partial_bytes_removed"] > 0
    assert 0 < h["peak_disk_measured"] <= h["peak_disk_bound"]


def test_only_recorded_partial_downloads_are_removed(tmp_path):
    """The journal is the only proof: an unrecorded file stays, and a recorded name that is
    not one of the client's temporaries (a finished blob, a link) is never removed."""
    out = OutputDir(tmp_path / "out")
    out.state.mkdir(parents=True)
    downloads = PartialDownloads(out.partials_path)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    etag = "a" * 64
    ours, other = blobs / f"{etag}.0123abcd.incomplete", blobs / f"{etag}.89abcdef.incomplete"
    blob, link = blobs / etag, blobs / f"{etag}.fedcba98.incomplete"
    ours.write_bytes(b"x" * 10)
    other.write_bytes(b"y")
    blob.write_bytes(b"z")
    link.symlink_to(blob)
    for path in (ours, blob, link, blobs / f"{etag}.00000000.incomplete"):  # the last: gone
        downloads.note(path)
    assert downloads.recorded() == [ours, blob, link, blobs / f"{etag}.00000000.incomplete"]
    assert [remove_partial(p) for p in downloads.recorded()] == [10, None, None, None]
    downloads.forget()
    assert downloads.recorded() == []
    assert not out.partials_path.exists()  # forgotten on disk too
    assert not ours.exists() and other.exists() and blob.exists() and link.is_symlink()


# -- download progress: network bytes beside the output ------------------------------------

PROGRESS_LINE = re.compile(
    r"download: (?P<done>[\d.]+ [KMGT]?B)/(?P<total>[\d.]+ [KMGT]?B)"
    r" \((?P<pct>\d+)%\)(?P<rest>.*)"
)


def _download_lines(stderr: str) -> list[re.Match]:
    lines = [line for line in stderr.splitlines() if line.startswith("download:")]
    matches = [PROGRESS_LINE.fullmatch(line) for line in lines]
    assert all(matches), lines
    return matches  # type: ignore[return-value]


def test_download_progress_lines_count_source_bytes_to_fetch(hub, reference, tmp_path):
    hub.rate = 1_500_000
    env = _env(hub, tmp_path, KIMI_W31_PROGRESS_INTERVAL="0.1")
    r = _run(
        REPO,
        tmp_path / "out",
        "--download",
        *ARGS,
        "--progress",
        "lines",
        env=env,
        small_chunks=True,
    )
    assert r.returncode == 0, r.stderr
    lines = _download_lines(r.stderr)
    total = human(sum(hub.files[REPO][s].size for s in SHARDS))
    assert {m["total"] for m in lines} == {total}
    assert lines[-1]["done"] == total and lines[-1]["pct"] == "100"
    assert lines[-1]["rest"].endswith("; files 6/6")
    during = [m for m in lines if 0 < int(m["pct"]) < 100]
    assert during and all("/s, ETA " in m["rest"] for m in during)
    assert any(line.startswith("convert: ") for line in r.stderr.splitlines())
    # Nothing else is printed while working (the small files download quietly, no client
    # progress bars): the progress lines, then the summary table on stdout.
    assert all(line.startswith(("convert: ", "download: ")) for line in r.stderr.splitlines())
    _assert_same_as_reference(tmp_path / "out", reference)

    # Two shards missing from the cache: the total is theirs alone.
    snapshot = next((_repo_cache(tmp_path) / "snapshots").iterdir())
    for name in (SHARDS[0], SHARDS[5]):
        (snapshot / name).resolve().unlink()
        (snapshot / name).unlink()
    r = _run(
        REPO,
        tmp_path / "out2",
        "--download",
        *ARGS,
        "--progress",
        "lines",
        env=env,
        small_chunks=True,
    )
    assert r.returncode == 0, r.stderr
    lines = _download_lines(r.stderr)
    total = human(hub.files[REPO][SHARDS[0]].size + hub.files[REPO][SHARDS[5]].size)
    assert {m["total"] for m in lines} == {total}
    assert lines[-1]["done"] == total and lines[-1]["rest"].endswith("; files 2/2")


# -- the schedule, on the plan alone ------------------------------------------------------------


def test_schedule_follows_the_plan_and_finds_the_smallest_window(hub_source, tmp_path):
    source, _, plan = prepare(
        ConvertOptions(
            str(hub_source),
            tmp_path / "out",
            manifest="kimi-k3-any",
            max_shard_size=int(SHARD_SIZE),
        )
    )
    order = download_order(plan.shards, source.shard_files)
    # synth moves one w3 into the last shard, so the output shard holding that w31 needs
    # source shard 6 right after 3; the rest follow in file order.
    assert {SHARDS[2], SHARDS[5]} in [set(s.input_files) for s in plan.shards]
    assert order == [SHARDS[0], SHARDS[1], SHARDS[2], SHARDS[5], SHARDS[3], SHARDS[4]]
    sizes = {f: source.headers[f].file_size for f in SHARDS}
    est = estimate(plan.shards, source.shard_files, sizes, 0, 3, delete=True)
    assert est.min_window == 3  # 6 is needed early and to the end: 3, 4 and 6 together
    largest3 = sum(sorted(sizes.values())[-3:])
    assert est.peak_bound == plan.output_bytes + largest3
    keep = estimate(plan.shards, source.shard_files, sizes, 10, 3, delete=False)
    assert keep.peak_bound == plan.output_bytes + sum(sizes.values()) + 10


# -- what cannot be a repo id is refused before the Hub is asked ----------------------------
_NOT_REPO_IDS = st.one_of(
    st.text("abc-_", min_size=1, max_size=8),  # no slash
    st.builds("/".join, st.lists(st.text("abc", min_size=1, max_size=4), min_size=3, max_size=4)),
    st.builds(lambda a, b: f".{a}/{b}", st.text("abc", max_size=4), st.text("abc", max_size=4)),
)


@settings(max_examples=30, deadline=None)
@given(spec=_NOT_REPO_IDS)
def test_what_cannot_be_a_repo_id_is_refused_before_the_hub_is_asked(spec):
    from kimi_w31.converter.source.hub import open_repo

    with pytest.MonkeyPatch.context() as m:
        _forbid_the_hub(m)
        with pytest.raises(Fatal) as exc:
            open_repo(spec, None)
    assert exc.value.codes == [Code.USAGE]


def test_a_local_path_is_never_taken_for_a_repo_id(tmp_path, monkeypatch):
    from kimi_w31.converter.source.hub import open_repo

    _forbid_the_hub(monkeypatch)
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)  # "org/name" names a folder here
    with pytest.raises(Fatal) as exc:
        open_repo("org/name", None)
    assert exc.value.codes == [Code.USAGE]


def _forbid_the_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any question to the Hub fails the test: a refusal must come first."""
    import huggingface_hub

    def asked(*args: object, **kwargs: object) -> None:
        raise AssertionError("the Hub was asked")

    monkeypatch.setattr(huggingface_hub, "HfApi", asked)


FAKE_FREE = (
    "import os, shutil\n"
    "_real = shutil.disk_usage\n"
    "shutil.disk_usage = lambda p: _real(p)._replace(free=int(os.environ['FAKE_FREE']))\n"
)


def test_dry_run_refuses_downloads_that_do_not_fit_as_the_run_does(hub, tmp_path):
    """The dry run asks the run's own question of the downloads beside the output: the same
    refusal (code and figures) before anything is downloaded."""
    args = ["--delete-source-shards", "--max-source-window", "3", "--json"]
    plan = _convert(hub, tmp_path, tmp_path / "out", "--dry-run", *args)
    assert plan.returncode == 0, plan.stderr
    assert plan.json["space_ok"] is True
    free = str(plan.json["output_bytes"] + 1)  # the output alone fits, the window does not
    env = _env(hub, tmp_path, FAKE_FREE=free)
    refusals = []
    for dry in (["--dry-run"], []):
        r = run_cli(
            [REPO, tmp_path / "out", "--download", *ARGS, *dry, *args], env=env, prelude=FAKE_FREE
        )
        assert r.returncode == 1, r.stderr
        (problem,) = r.problems
        refusals.append((problem["code"], problem["expected"], problem["found"]))
    assert refusals[0] == refusals[1] and refusals[0][0] == "no-space"
    assert all(d.file not in SHARDS for d in hub.downloads())

"""Convert straight from the Hugging Face Hub with bounded disk.

Planning needs no tensor data: the config, the index and the small non-weight files are
downloaded, and each shard's safetensors header is read with HTTP range requests (the
first 100 kB, then the rest if the header is longer), so the manifest check happens before
any large download. The header bytes are the very bytes a local read would see, so the plan
(and its fingerprint) is identical to the plan of a local copy of the same repo.

Source shards are then fetched with `huggingface_hub` (its resumable, size-checked
downloads, into its cache or `--download-dir`) in the order the plan first needs them, at
most `--max-source-window` of them live at once (downloading, or present with output shards
still waiting for them). An output shard is written by the same `write_shard` as a local
run as soon as every source shard it reads is present; with `--delete-source-shards` a
source shard is deleted once every output shard that reads it is done. Peak disk is then
the output plus the window of source shards.

Resume: ledger entries of a Hub run name source shards by content (size and the Hub's
ETag, the sha256 of an LFS file), not by inode, so an output shard whose source shards were
deleted is still recognised as done and nothing it needed is downloaded again.
"""

from __future__ import annotations

import os
import shutil
import struct
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from .backends import Backend
from .errors import ConvertError, Problem, fail
from .execute import Hooks, SourceFiles, file_identity, shard_still_valid, write_shard
from .ledger import Ledger
from .plan import OutputShard, Plan
from .safetensors_format import MAX_HEADER_BYTES, ShardHeader, parse_header_bytes
from .source import (
    CONFIG_NAME,
    INDEX_NAME,
    SINGLE_NAME,
    Source,
    check_index_against_headers,
    check_weight_map,
    read_json,
)
from .streaming import Interrupted

DEFAULT_WINDOW = 4
HEADER_PROBE = 100_000  # one request covers the header of almost every shard
_MAX_DOWNLOADS = 4  # parallel source downloads, within the window


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    etag: str  # the Hub's content id: an LFS file's sha256, else its git blob id


@dataclass
class HubRepo:
    repo_id: str
    commit: str
    files: dict[str, RemoteFile]


def _hub_error(exc: BaseException, what: str, file: str | None = None) -> ConvertError:
    """One clear line for the errors `huggingface_hub` and its HTTP client raise."""
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, GatedRepoError):
        msg = "the repository is gated: accept its terms on the Hub and log in (hf auth login)"
    elif isinstance(exc, RepositoryNotFoundError):
        msg = "repository not found (or private: log in with hf auth login or set HF_TOKEN)"
    elif isinstance(exc, RevisionNotFoundError):
        msg = "revision not found in the repository"
    else:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        msg = f"{what} failed: {detail}"
    return ConvertError(
        [Problem(msg, file=file)],
        hint="rerun the same command once the cause is fixed: finished output shards and "
        "fully downloaded source shards are kept",
    )


def open_repo(repo_id: str, revision: str | None, endpoint: str | None = None,
              token: str | bool | None = None) -> HubRepo:  # fmt: skip
    """Pin the revision to a commit and list every file with its size and content id."""
    from huggingface_hub import HfApi

    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(
            repo_id, revision=revision, files_metadata=True
        )
    except Exception as exc:  # network, HTTP, auth: all end the run the same way
        raise _hub_error(exc, "reading the repository's file list", repo_id) from None
    files = {}
    for s in info.siblings or []:
        size = s.lfs.size if s.lfs else s.size
        etag = s.lfs.sha256 if s.lfs else s.blob_id
        if size is None or not etag:
            raise fail("the Hub did not report size and content id for a file", file=s.rfilename)
        files[s.rfilename] = RemoteFile(s.rfilename, int(size), str(etag))
    if not info.sha:
        raise fail("the Hub did not report a commit for this revision", file=repo_id)
    return HubRepo(repo_id, info.sha, files)


def read_remote_header(repo: HubRepo, file: str, endpoint: str | None = None,
                       token: str | bool | None = None) -> ShardHeader:  # fmt: skip
    """A shard's header through HTTP range requests; the same checks as `read_header`."""
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    url = hf_hub_url(repo.repo_id, file, revision=repo.commit, endpoint=endpoint)
    headers = {**build_hf_headers(token=token), "Accept-Encoding": "identity"}
    size = repo.files[file].size

    def get(first: int, last: int) -> bytes:
        try:
            resp = get_session().get(url, headers={**headers, "range": f"bytes={first}-{last}"},
                                     timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT)  # fmt: skip
            hf_raise_for_status(resp)
        except Exception as exc:
            raise _hub_error(exc, "reading the safetensors header", file) from None
        body = resp.content
        if resp.status_code == 200:  # the server ignored the range: cut it ourselves
            body = body[first : last + 1]
        return body

    def bad(what: str, expected: str, found: str) -> ConvertError:
        return ConvertError([Problem(what, file=file, expected=expected, found=found)])

    if size < 8:
        raise bad("file too small for a safetensors header", "at least 8 bytes", f"{size} bytes")
    head = get(0, min(size, HEADER_PROBE) - 1)
    (length,) = struct.unpack("<Q", head[:8])
    if length == 0:
        raise fail("header length is 0", file=file)
    if length > MAX_HEADER_BYTES:
        raise bad("header length exceeds the 100 MB limit", f"<= {MAX_HEADER_BYTES}", str(length))
    if 8 + length > size:
        raise bad("header length is larger than the file", f"<= {size - 8}", str(length))
    raw = head[8 : 8 + length]
    if len(raw) < length:
        raw += get(8 + len(raw), 8 + length - 1)
    if len(raw) != length:
        raise fail("the server returned a short range for the header", file=file)
    return parse_header_bytes(file, raw, size)


def download_order(shards: list[OutputShard], file_order: list[str]) -> list[str]:
    """Source shards in the order the output shards first need them."""
    rank = {f: i for i, f in enumerate(file_order)}
    order: dict[str, None] = {}
    for shard in shards:
        for f in sorted(shard.source_files, key=lambda f: rank.get(f, len(rank))):
            order.setdefault(f)
    return list(order)


@dataclass
class DiskEstimate:
    min_window: int  # fewest live source shards with which in-order streaming cannot stall
    window: int
    peak_bound: int  # output + small files + the largest `window` source shards (or all)
    output_bytes: int
    source_bytes: int
    small_bytes: int


def estimate(shards: list[OutputShard], file_order: list[str], sizes: dict[str, int],
             small_bytes: int, window: int, delete: bool) -> DiskEstimate:  # fmt: skip
    """Window feasibility and the peak-disk bound, from the plan alone.

    Sequential in-order streaming with eager deletion: just after source shard k arrives,
    the live set is the shards still pinned by unfinished output shards, plus k. Its
    largest size over k is the fewest window slots that never stall.
    """
    pending = shards
    output_bytes = sum(s.file_size for s in shards)
    order = download_order(pending, file_order)
    consumers: dict[str, set[str]] = {f: set() for f in order}
    for s in pending:
        for f in s.source_files:
            consumers[f].add(s.name)
    live: set[str] = set()
    arrived: set[str] = set()
    need = {s.name: set(s.source_files) for s in pending}
    min_window = 0
    for f in order:
        live.add(f)
        arrived.add(f)
        min_window = max(min_window, len(live))
        for name in sorted(consumers[f]):
            if name in need and need[name] <= arrived:
                for g in need.pop(name):
                    consumers[g].discard(name)
        live = {g for g in live if consumers[g]}
    needed = sorted((sizes[f] for f in order), reverse=True)
    source_part = sum(needed[: max(window, 1)]) if delete else sum(needed)
    return DiskEstimate(min_window, window, output_bytes + small_bytes + source_part,
                        output_bytes, sum(sizes[f] for f in file_order), small_bytes)  # fmt: skip


class HubSourceFiles(SourceFiles):
    """Source shards that arrive (and may leave) during the run.

    `identity` (size, mtime, inode) is recorded when a shard lands, so a file changed under
    us is still caught; `fingerprint` (what ledger entries record) names content instead.
    """

    def __init__(self, root: Path, repo: HubRepo, files: list[str],
                 header_sha256: dict[str, str]) -> None:  # fmt: skip
        # No file is there yet: identities are taken as shards arrive. A downloaded shard
        # must still carry the very header the plan was made from.
        super().__init__(root, [], header_sha256=header_sha256)
        self.content = {f: repo.files[f] for f in files}

    def arrived(self, file: str) -> None:
        with self._lock:
            self.identity[file] = file_identity(self.root / file)

    def release(self, file: str) -> None:
        with self._lock:
            fd = self._fds.pop(file, None)
            if fd is not None:
                os.close(fd)
            self.identity.pop(file, None)

    def fingerprint(self, files: list[str]) -> dict[str, list]:
        return {f: [self.content[f].size, self.content[f].etag] for f in files}


def _in_daemon_thread(fn: Callable[..., None], *args: object) -> Future:
    """Run fn on a daemon thread: Ctrl-C must not wait for a multi-GB download to end."""
    fut: Future = Future()

    def run() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:
            fut.set_exception(exc)

    threading.Thread(target=run, name="download", daemon=True).start()
    return fut


def _tree_bytes(*roots: Path) -> int:
    """Apparent size of every file under the roots (temporaries included)."""
    total = 0
    for root in roots:
        for dirpath, _, names in os.walk(root):
            for n in names:
                try:
                    st = os.lstat(os.path.join(dirpath, n))
                except OSError:
                    continue
                if not os.path.islink(os.path.join(dirpath, n)):
                    total += st.st_size
    return total


@dataclass
class HubBackend(Backend):
    """`--download`: read headers over HTTP, stream source shards through a bounded window."""

    download_dir: Path | None = None  # None: the Hugging Face cache
    delete_source_shards: bool = False
    window: int = DEFAULT_WINDOW
    endpoint: str | None = None  # None: HF_ENDPOINT or the public Hub
    token: str | bool | None = None  # None: HF_TOKEN or the stored login
    repo: HubRepo | None = None
    file_order: list[str] = field(default_factory=list)
    small_files: list[str] = field(default_factory=list)
    storage: Path | None = None  # what holds the downloads (for the disk meter)
    peak_disk_measured: int = 0
    downloaded: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    _meter_lock: threading.Lock = field(default_factory=threading.Lock)

    # -- reading ---------------------------------------------------------------------------
    def _fetch(self, file: str) -> Path:
        from huggingface_hub import hf_hub_download

        assert self.repo is not None
        try:
            path = hf_hub_download(
                self.repo.repo_id, file, revision=self.repo.commit, endpoint=self.endpoint,
                token=self.token, local_dir=self.download_dir,
            )  # fmt: skip
        except Exception as exc:
            raise _hub_error(exc, "download", file) from None
        return Path(path)

    def resolve(self, spec: str, revision: str | None) -> Path:
        if Path(spec).expanduser().exists() or spec.count("/") != 1 or spec.startswith("."):
            raise ConvertError([Problem("--download needs a Hugging Face repo id (org/name)",
                                        file=spec)], exit_code=2)  # fmt: skip
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()  # our own progress bar counts the output
        self.repo = open_repo(spec, revision, self.endpoint, self.token)
        files = self.repo.files
        if CONFIG_NAME not in files:
            raise fail("the repository has no config.json", file=spec)
        if INDEX_NAME not in files and SINGLE_NAME not in files:
            raise fail(f"the repository has no {INDEX_NAME} or {SINGLE_NAME}", file=spec)
        # The same selection `read_source` makes locally: every non-weight file is copied.
        self.small_files = sorted(
            f for f in files
            if not f.endswith(".safetensors")
            and not any(part.startswith(".") for part in Path(f).parts)
        )  # fmt: skip
        root = None
        for f in self.small_files:
            path = self._fetch(f)
            if f == CONFIG_NAME:
                root = path.parent
        assert root is not None
        if self.download_dir is None:  # cache layout: <repo folder>/snapshots/<commit>/
            self.storage = root.parent.parent
            # Downloads were pinned to the commit; record the ref the user asked for, as
            # huggingface_hub does, so `kimi-convert org/name` later finds it offline.
            ref = revision or "main"
            if ref != self.repo.commit:
                ref_path = self.storage / "refs" / ref
                ref_path.parent.mkdir(parents=True, exist_ok=True)
                ref_path.write_text(self.repo.commit)
        else:
            self.storage = root
        return root

    def read_source(self, root: Path, label: str) -> Source:
        repo = self.repo
        assert repo is not None
        config = read_json(root / CONFIG_NAME)
        if not isinstance(config, dict):
            raise fail("config.json is not a JSON object", file=CONFIG_NAME)
        index_metadata: dict = {}
        if INDEX_NAME in repo.files:
            index = read_json(root / INDEX_NAME)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise fail("index has no weight_map object", file=INDEX_NAME)
            index_metadata = index.get("metadata") or {}
            problems = check_weight_map(root, weight_map, INDEX_NAME)
            if problems:
                raise ConvertError(problems)
            shard_files = list(dict.fromkeys(weight_map.values()))
        else:
            shard_files, weight_map = [SINGLE_NAME], {}
        missing = [f for f in shard_files if f not in repo.files]
        if missing:
            raise ConvertError([Problem("shard named in the index is missing from the "
                                        "repository", file=f) for f in missing])  # fmt: skip
        headers: dict[str, ShardHeader] = {}
        problems: list[Problem] = []
        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="header") as pool:
            futures = {f: pool.submit(read_remote_header, repo, f, self.endpoint, self.token)
                       for f in shard_files}  # fmt: skip
            for f, fut in futures.items():
                try:
                    headers[f] = fut.result()
                except ConvertError as exc:
                    problems.extend(exc.problems)
        if problems:
            raise ConvertError(problems)
        if not weight_map:
            weight_map = {name: SINGLE_NAME for name in headers[SINGLE_NAME].tensors}
        else:
            problems = check_index_against_headers(weight_map, headers, INDEX_NAME)
            if problems:
                raise ConvertError(problems)
        self.file_order = shard_files
        extra = [f for f in self.small_files if f not in (CONFIG_NAME, INDEX_NAME)]
        return Source(root, label, config, weight_map, shard_files, headers, extra,
                      index_metadata)  # fmt: skip

    # -- planning figures ------------------------------------------------------------------
    def estimate(self, plan: Plan) -> DiskEstimate:
        assert self.repo is not None
        sizes = {f: self.repo.files[f].size for f in self.file_order}
        small = sum(self.repo.files[f].size for f in self.small_files)
        return estimate(plan.shards, self.file_order, sizes, small, self.window,
                        self.delete_source_shards)  # fmt: skip

    def plan_rows(self, source: Source, plan: Plan) -> list[tuple[str, str]]:
        from .cli import human

        est = self.estimate(plan)
        assert self.repo is not None
        rows = [
            ("Hub revision", f"{self.repo.repo_id}@{self.repo.commit}"),
            ("source bytes (download)", human(est.source_bytes)),
            ("source window", f"{est.window} shards (at least {est.min_window} needed)"),
            ("peak disk (at most)", f"{human(est.peak_bound)} (source + output: "
             f"{human(est.source_bytes + est.output_bytes + est.small_bytes)})"),
        ]  # fmt: skip
        if not self.delete_source_shards:
            rows.append(("note", "without --delete-source-shards every source shard stays"))
        return rows

    def plan_summary(self, source: Source, plan: Plan) -> dict:
        est = self.estimate(plan)
        assert self.repo is not None
        return {
            "hub": {
                "repo": self.repo.repo_id, "commit": self.repo.commit,
                "source_bytes": est.source_bytes, "output_bytes": est.output_bytes,
                "small_files_bytes": est.small_bytes, "window": est.window,
                "min_window": est.min_window, "peak_disk_bound": est.peak_bound,
                "peak_disk_measured": self.peak_disk_measured or None,
                "downloaded": len(self.downloaded), "deleted": len(self.deleted),
            }
        }  # fmt: skip

    # -- running ---------------------------------------------------------------------------
    def source_files(self, source: Source) -> SourceFiles:
        assert self.repo is not None
        planned = {f: h.header_sha256 for f, h in source.headers.items()}
        return HubSourceFiles(source.root, self.repo, source.shard_files, planned)

    def _measure(self, out_dir: Path) -> None:
        """Disk use of downloads + output right now; called at every high-water point."""
        assert self.storage is not None
        now = _tree_bytes(self.storage, out_dir)
        with self._meter_lock:
            self.peak_disk_measured = max(self.peak_disk_measured, now)

    def _delete(self, root: Path, file: str) -> None:
        """Remove a source shard: the file, and in the cache its blob too."""
        path = root / file
        target = path.resolve() if path.is_symlink() else None
        path.unlink(missing_ok=True)
        if target is not None and self.download_dir is None:
            target.unlink(missing_ok=True)  # the blob: the bytes that take the space
        if self.download_dir is not None:  # huggingface_hub's per-file download record
            meta = self.download_dir / ".cache" / "huggingface" / "download" / f"{file}.metadata"
            meta.unlink(missing_ok=True)
        self.deleted.append(file)

    def run_shards(self, shards: list[OutputShard], sources: SourceFiles, out_dir: Path,
                   tmp_dir: Path, ledger: Ledger, workers: int, stop: threading.Event,
                   hooks: Hooks, check_scales: bool = False) -> dict[str, str]:  # fmt: skip
        assert isinstance(sources, HubSourceFiles)
        root = sources.root
        outcome: dict[str, str] = {}
        # 1. What is already done (same rule as the local executor: ledger + rehash).
        for shard in shards:
            entry = ledger.done.get(shard.name)
            if (entry is not None
                    and entry.get("sources") == sources.fingerprint(shard.source_files)
                    and shard_still_valid(shard, entry, out_dir, stop, hooks)):  # fmt: skip
                outcome[shard.name] = "reused"
                if hooks.on_shard:
                    hooks.on_shard(shard.name, True)
            else:
                ledger.forget(shard.name)
        pending = [s for s in shards if s.name not in outcome]
        est = estimate(pending, self.file_order,
                       {f: sources.content[f].size for f in self.file_order}, 0, self.window,
                       self.delete_source_shards)  # fmt: skip
        if pending and self.window < est.min_window:
            raise ConvertError(
                [Problem("--max-source-window is too small for this checkpoint's layout",
                         expected=f"at least {est.min_window}", found=str(self.window))],
                exit_code=2,
            )  # fmt: skip
        order = download_order(pending, self.file_order)
        consumers: dict[str, set[str]] = {f: set() for f in order}
        for s in pending:
            for f in s.source_files:
                consumers[f].add(s.name)
        by_name = {s.name: s for s in pending}
        if self.delete_source_shards:  # present but needed by nothing left: free it now
            for f in self.file_order:
                if f not in consumers and os.path.lexists(root / f):
                    self._delete(root, f)
        self._check_space(out_dir, pending, order, root)

        arrived: set[str] = set()
        submitted: set[str] = set()
        queue = list(order)
        live: set[str] = set()
        downloads: dict[Future, str] = {}
        writes: dict[Future, OutputShard] = {}
        wr_pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="shard")

        def start_downloads() -> None:
            while (queue and len(live) < self.window and len(downloads) < _MAX_DOWNLOADS
                   and not stop.is_set()):  # fmt: skip
                f = queue.pop(0)
                live.add(f)
                downloads[_in_daemon_thread(self._get_source, f, stop)] = f

        def on_arrival(f: str) -> None:
            sources.arrived(f)
            arrived.add(f)
            for name in sorted(consumers[f]):
                shard = by_name[name]
                if name not in submitted and set(shard.source_files) <= arrived:
                    submitted.add(name)
                    fut = wr_pool.submit(write_shard, shard, sources, out_dir, tmp_dir, stop,
                                         hooks, check_scales)  # fmt: skip
                    writes[fut] = shard

        def on_written(shard: OutputShard, entry: dict | None) -> None:
            if entry is None:
                outcome[shard.name] = "rejected"  # NaN scales: reported by the hook
            else:
                ledger.record(entry)
                outcome[shard.name] = "written"
                if hooks.on_shard:
                    hooks.on_shard(shard.name, False)
            self._measure(out_dir)  # the high-water mark: before any source is freed
            for f in shard.source_files:
                consumers[f].discard(shard.name)
                if not consumers[f]:
                    live.discard(f)
                    if self.delete_source_shards and entry is not None:
                        sources.release(f)
                        self._delete(root, f)

        try:
            start_downloads()
            while downloads or writes:
                done, _ = wait([*downloads, *writes], return_when=FIRST_COMPLETED)
                for fut in done:
                    if fut in downloads:
                        f = downloads.pop(fut)
                        fut.result()
                        on_arrival(f)
                    else:
                        shard = writes.pop(fut)
                        on_written(shard, fut.result())
                start_downloads()
                if not downloads and not writes and queue:  # pragma: no cover - see estimate
                    raise RuntimeError("download schedule stalled: window too small")
        except BaseException:
            # Writes stop at their next chunk; a download cannot be interrupted, so it is left
            # to finish or die with the process (huggingface_hub renames only whole files).
            stop.set()
            for fut in writes:
                fut.cancel()
            wait(list(writes))
            errors = [f.exception() for f in writes
                      if not f.cancelled() and f.exception() is not None]  # fmt: skip
            real = [e for e in errors if not isinstance(e, Interrupted)]
            if real and not isinstance(real[0], KeyboardInterrupt):
                raise real[0] from None
            raise
        finally:
            wr_pool.shutdown(wait=True)
            self._measure(out_dir)
        return outcome

    def _get_source(self, file: str, stop: threading.Event) -> None:
        if stop.is_set():
            raise Interrupted()
        self._fetch(file)
        self.downloaded.append(file)

    def _check_space(self, out_dir: Path, pending: list[OutputShard], order: list[str],
                     root: Path) -> None:  # fmt: skip
        """The source window must fit beside the output (the output itself is checked too)."""
        assert self.repo is not None and self.storage is not None
        absent = [self.repo.files[f].size for f in order if not os.path.lexists(root / f)]
        absent.sort(reverse=True)
        need = sum(absent[: self.window]) if self.delete_source_shards else sum(absent)
        free = shutil.disk_usage(self.storage).free
        if os.stat(self.storage).st_dev == os.stat(out_dir).st_dev:
            need += sum(s.file_size for s in pending)
        if need > free:
            raise ConvertError(
                [Problem("not enough free space for the downloads and the output",
                         file=str(self.storage), expected=f"{need} bytes free",
                         found=f"{free} bytes free")],
                hint="pass --delete-source-shards and a smaller --max-source-window, or free "
                "space; --dry-run shows the peak",
            )  # fmt: skip

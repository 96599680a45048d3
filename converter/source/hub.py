"""A source on the Hugging Face Hub, read over HTTP (`--download`).

Planning needs no tensor data: the config, the index and the small non-weight files are
downloaded, and each shard's safetensors header is read with HTTP range requests (the first
100 kB, then the rest if the header is longer), so the manifest check happens before any
large download. The header bytes are the very bytes a local read would see, so the plan
(and its fingerprint) is identical to the plan of a local copy of the same repo.

Shards themselves are fetched later, when the download executor (`execute/download.py`) schedules
them, through `huggingface_hub` (its resumable, size-checked downloads, into its cache or
`--download-dir`). The revision is pinned to one commit at the start.

`huggingface_hub` downloads each file to a temporary `*.incomplete` file of a name unique to
the download and renames it when complete. A process that is killed leaves that file behind.
`open_partials` finds the ones this process holds open (the proof that this run started
them) so the executor can record them and remove them later; `PartialCreated` says when to
look; `DownloadBar` is the progress hook `hf_hub_download` reports bytes through.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..contract import CHECKSUMS_NAME, CONFIG_NAME, INDEX_NAME, SINGLE_NAME
from ..errors import Fatal, fatal
from ..hashing import Interrupted
from ..reasons import Code
from ..safetensors_format import ShardHeader, check_header_length, parse_header_bytes
from . import FetchHooks, Resolved, hub_cache
from .hub_net import NetSettings, is_timeout, read_range, with_retries

HEADER_PROBE = 100_000  # one request covers the header of almost every shard


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


def hub_error(
    exc: BaseException, what: str, file: str | None = None, revision: str | None = None
) -> Fatal:
    """One clear line for the errors `huggingface_hub` and its HTTP client raise."""
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, GatedRepoError):
        return fatal(Code.HUB_GATED, file=file)
    if isinstance(exc, RepositoryNotFoundError):
        return fatal(Code.HUB_NOT_FOUND, file=file)
    if isinstance(exc, RevisionNotFoundError):
        # Named as `found`: in the message, and for scripts reading --json.
        return fatal(Code.HUB_REVISION, file=file, revision=revision)
    if is_timeout(exc):  # huggingface_hub's own waits and retries were spent
        return fatal(Code.HUB_TIMEOUT, rule="client", file=file, action=what)
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return fatal(Code.HUB_ERROR, rule="request", file=file, action=what, error=detail)


def open_repo(
    repo_id: str,
    revision: str | None,
    endpoint: str | None = None,
    token: str | bool | None = None,
    net: NetSettings | None = None,
) -> HubRepo:
    """Pin the revision to a commit and list every file with its size and content id.
    Refuses, before anything is asked of the Hub, what cannot be a repo id: a path that
    exists here (a local source), or anything but one `org/name`."""
    if Path(repo_id).expanduser().exists() or repo_id.count("/") != 1 or repo_id.startswith("."):
        raise fatal(Code.USAGE, rule="hub-repo-id", file=repo_id)
    from huggingface_hub import HfApi

    net = net or NetSettings.from_env()
    action = "reading the repository's file list"
    api = HfApi(endpoint=endpoint, token=token)
    try:
        info = with_retries(
            lambda timeout: api.model_info(
                repo_id, revision=revision, files_metadata=True, timeout=timeout
            ),
            net,
            action,
            repo_id,
        )
    except Fatal:
        raise
    except Exception as exc:  # network, HTTP, auth: all end the run the same way
        raise hub_error(exc, action, repo_id, revision) from None
    files = {}
    for s in info.siblings or []:
        size = s.lfs.size if s.lfs else s.size
        etag = s.lfs.sha256 if s.lfs else s.blob_id
        if size is None or not etag:
            raise fatal(Code.HUB_ERROR, rule="no-size", file=s.rfilename)
        files[s.rfilename] = RemoteFile(s.rfilename, int(size), str(etag))
    if not info.sha:
        raise fatal(Code.HUB_ERROR, rule="no-commit", file=repo_id)
    return HubRepo(repo_id, info.sha, files)


def read_remote_header(
    repo: HubRepo,
    file: str,
    endpoint: str | None = None,
    token: str | bool | None = None,
    net: NetSettings | None = None,
) -> ShardHeader:
    """A shard's header through HTTP range requests; the same checks as `read_header`.
    Every read is bounded (`hub_net.read_range`): a server that ignores the range costs
    the bytes asked for, never the shard."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(repo.repo_id, file, revision=repo.commit, endpoint=endpoint)
    headers = {**build_hf_headers(token=token), "Accept-Encoding": "identity"}
    size = repo.files[file].size
    net = net or NetSettings.from_env()
    action = "reading the safetensors header"

    def get(first: int, last: int) -> bytes:
        try:
            return with_retries(
                lambda timeout: read_range(url, headers, first, last, timeout, file),
                net,
                action,
                file,
            )
        except Fatal:
            raise
        except Exception as exc:
            raise hub_error(exc, action, file) from None

    head = get(0, min(size, HEADER_PROBE) - 1) if size >= 8 else b""
    length = check_header_length(file, head, size)
    raw = head[8 : 8 + length]
    if len(raw) < length:
        raw += get(8 + len(raw), 8 + length - 1)
    if len(raw) != length:
        raise fatal(Code.HUB_ERROR, rule="short-range", file=file)
    return parse_header_bytes(file, raw, size)


def measure_download(
    repo: HubRepo,
    file: str,
    endpoint: str | None = None,
    token: str | bool | None = None,
    limit: int = 64 * 2**20,
    budget: float = 3.0,
) -> tuple[int, float]:
    """(bytes, seconds) of downloading the start of `file` (a ranged GET, read until `limit`
    bytes or `budget` seconds): the network rate a --download run will see, measured."""
    import time

    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    url = hf_hub_url(repo.repo_id, file, revision=repo.commit, endpoint=endpoint)
    last = min(limit, repo.files[file].size) - 1
    headers = {**build_hf_headers(token=token), "Accept-Encoding": "identity"}
    started = time.perf_counter()
    done = 0
    try:
        with get_session().stream(
            "GET",
            url,
            headers={**headers, "range": f"bytes=0-{last}"},
            timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT,
            follow_redirects=True,
        ) as resp:
            hf_raise_for_status(resp)
            for chunk in resp.iter_bytes(2**20):
                done += len(chunk)
                if done > last or time.perf_counter() - started >= budget:
                    break
    except Exception as exc:
        raise hub_error(exc, "measuring the download rate", file) from None
    return done, time.perf_counter() - started


# huggingface_hub 2.x: `<etag>.<8 hex>.incomplete` in the cache's blobs folder, and
# `<short hash>.<etag>.<8 hex>.incomplete` under `<local_dir>/.cache/huggingface/download/`.
PARTIAL_NAME = re.compile(r".+\.[0-9a-f]{8}\.incomplete")


def open_partials(storage: Path) -> list[Path]:
    """Partial downloads under `storage` that this process holds open: proof that this run
    started them (another process's, or a dead run's, are never among them).

    Read from /proc/self/fd (Linux). Where it does not exist none are found, so none are
    ever removed: a leak there, never a deleted foreign file.
    """
    fd_dir = "/proc/self/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return []
    prefix = os.path.join(os.path.realpath(storage), "")  # the kernel names real paths
    found = []
    for fd in fds:
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:  # closed since the listing
            continue
        if target.startswith(prefix) and PARTIAL_NAME.fullmatch(os.path.basename(target)):
            found.append(Path(target))
    return found


def remove_partial(path: Path) -> int | None:
    """Remove a partial download an earlier `open_partials` named; returns the bytes freed,
    None if there was nothing to remove.

    The name is checked again: the journal it comes from is a file, and a file named
    otherwise (or a link, or a folder) is not one of huggingface_hub's temporaries.
    """
    try:
        st = os.lstat(path)
    except OSError:  # renamed into place when complete, or already gone
        return None
    if not stat.S_ISREG(st.st_mode) or not PARTIAL_NAME.fullmatch(path.name):
        return None
    try:
        path.unlink()
    except OSError:  # gone since, or not ours to remove after all (permissions)
        return None
    return st.st_size


class PartialCreated(logging.Filter):
    """Calls `callback` as soon as huggingface_hub has created a download's temporary file.

    The client logs a debug line naming that file in the downloading thread right after it
    opens it, before it sends the request. A filter on its logger runs first, in that
    thread: the file can be recorded before it holds any data and almost before it exists
    (this process just made it: that is the proof). The callback gets the path when the
    line names one, else None (look for it). Records below the level the logger had are
    dropped again, so nothing more is printed.
    """

    LOGGER = "huggingface_hub.file_download"
    _NAMED = re.compile(r"'([^']+\.incomplete)'")

    def __init__(self, callback: Callable[[Path | None], None]) -> None:
        super().__init__()
        self.callback = callback
        self._logger = logging.getLogger(self.LOGGER)
        self._shown = self._logger.getEffectiveLevel()
        self._level = self._logger.level

    def filter(self, record: logging.LogRecord) -> bool:
        named = self._NAMED.search(record.getMessage())
        self.callback(Path(os.path.realpath(named[1])) if named else None)
        return record.levelno >= self._shown

    def install(self) -> None:
        self._shown = self._logger.getEffectiveLevel()
        self._level = self._logger.level
        self._logger.addFilter(self)
        self._logger.setLevel(min(self._shown, logging.DEBUG))

    def remove(self) -> None:
        self._logger.removeFilter(self)
        self._logger.setLevel(self._level)


class DownloadBar:
    """The progress bar `hf_hub_download` drives (its `tqdm_class`), reduced to what it calls.

    `on_open` runs when the bar is made: the temporary file exists by then and no byte has
    been written to it. `on_bytes` gets every increment (negative when the client rewinds a
    retry). Once `stop` is set the next increment raises, so the client ends the download
    at its next chunk and removes its own temporary file. A class bound to no callbacks is
    silent.
    """

    on_open: Callable[[], None] | None = None
    on_bytes: Callable[[int], None] | None = None
    stop: Callable[[], bool] | None = None

    def __init__(
        self, *args: object, total: int | None = None, initial: int = 0, **kwargs: object
    ) -> None:
        self.total = total
        self.n = initial
        if self.on_open is not None:
            self.on_open()

    @classmethod
    def bound(cls, hooks: FetchHooks) -> type[DownloadBar]:
        """A bar class for one download (huggingface_hub wants a class, not an object)."""
        callbacks = {
            name: staticmethod(hook) if hook else None
            for name, hook in (
                ("on_open", hooks.on_open),
                ("on_bytes", hooks.on_bytes),
                ("stop", hooks.stop),
            )
        }
        return type("DownloadBar", (cls,), callbacks)

    def update(self, n: int | float | None = 1) -> None:
        if self.stop is not None and self.stop():
            raise Interrupted()
        self.n += int(n or 0)
        if self.on_bytes is not None:
            self.on_bytes(int(n or 0))

    # Called by the client where present: network bytes of a Xet download, which
    # `update` already counts as file bytes (one quantity, no double count).
    def update_transfer(self, n: int | float | None = 1) -> None:
        pass

    def set_postfix_str(self, *args: object, **kwargs: object) -> None:
        pass

    def set_transfer_postfix_str(self, *args: object, **kwargs: object) -> None:
        pass

    def refresh(self, *args: object, **kwargs: object) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> DownloadBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _accepts(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class HubOrigin:
    """Where a Hub repo is read from and where its files go; `resolve` pins one commit."""

    download_dir: Path | None = None  # None: the Hugging Face cache
    endpoint: str | None = None  # None: HF_ENDPOINT or the public Hub
    token: str | bool | None = None  # None: HF_TOKEN or the stored login
    # The project's own requests' wait and retries (None: from the environment, `hub_net`).
    net: NetSettings | None = None

    def settings(self) -> NetSettings:
        return self.net or NetSettings.from_env()

    def resolve(self, spec: str, revision: str | None) -> Resolved:
        """Pin the revision, download the small files; the snapshot read from then on."""
        repo = open_repo(spec, revision, self.endpoint, self.token, self.settings())
        files = repo.files
        if CONFIG_NAME not in files:
            raise fatal(Code.FILE_MISSING, rule="hub-config", file=spec)
        if INDEX_NAME not in files and SINGLE_NAME not in files:
            raise fatal(Code.FILE_MISSING, rule="hub-weights", file=spec)
        # The same selection a local read makes: every non-weight file is copied.
        small_files = sorted(
            f
            for f in files
            if not f.endswith(".safetensors")
            and f != CHECKSUMS_NAME
            and not any(part.startswith(".") for part in Path(f).parts)
        )
        # Quiet: the shards' bytes are what is shown. config.json is among them (checked above).
        paths = {f: self.download(repo, f, DownloadBar) for f in small_files}
        root = Path(os.path.abspath(paths[CONFIG_NAME].parent))  # HF_HUB_CACHE may be relative
        storage = root
        if self.download_dir is None:  # cache layout: <repo folder>/snapshots/<commit>/
            storage = root.parent.parent
            # Downloads were pinned to the commit; record the ref the user asked for, as
            # huggingface_hub does, so `kimi-convert org/name` later finds it offline.
            ref = revision or "main"
            if ref != repo.commit:
                ref_path = storage / "refs" / ref
                ref_path.parent.mkdir(parents=True, exist_ok=True)
                ref_path.write_text(repo.commit)
        return Resolved(root, HubSnapshot(self, repo, revision, storage, small_files))

    def download(self, repo: HubRepo, file: str, tqdm_class: type | None = None) -> Path:
        """Download one file of the pinned commit (a no-op if it is already complete)."""
        from huggingface_hub import hf_hub_download

        kwargs = {}
        if tqdm_class is not None and _accepts(hf_hub_download, "tqdm_class"):
            kwargs["tqdm_class"] = tqdm_class
        try:
            path = hf_hub_download(
                repo.repo_id,
                file,
                revision=repo.commit,
                endpoint=self.endpoint,
                token=self.token,
                local_dir=self.download_dir,
                **kwargs,
            )
        except Interrupted:  # the run is stopping (DownloadBar): not a download failure
            raise
        except Exception as exc:
            raise hub_error(exc, "download", file) from None
        return Path(path)


@dataclass(frozen=True)
class HubPartials:
    """huggingface_hub's partial downloads under one storage folder (`Partials`)."""

    storage: Path  # real path: the kernel names open files so

    def open(self) -> list[Path]:
        return open_partials(self.storage)

    def owns(self, path: Path) -> bool:
        """A partial download of this storage (a name the client gives, in its folder)."""
        return PARTIAL_NAME.fullmatch(path.name) is not None and path.is_relative_to(self.storage)

    def remove(self, path: Path) -> int | None:
        return remove_partial(path)

    def on_created(self, callback: Callable[[Path | None], None]) -> PartialCreated:
        return PartialCreated(callback)


def _unlink_file(path: Path) -> int:
    """Remove one name of a file; the bytes freed (none while another name holds them)."""
    try:
        st = os.lstat(path)
        path.unlink()
    except OSError:  # gone already
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 else 0


@dataclass(frozen=True)
class HubSnapshot:
    """One pinned commit of a Hub repo: what `read_source` reads (headers over HTTP, the file
    list), and the `Remote` the streaming executor fetches shards from."""

    origin: HubOrigin
    repo: HubRepo
    revision: str | None  # as asked for (the commit it was pinned to is in `repo`)
    storage: Path  # what holds the downloads (for the disk meter)
    small_files: list[str]
    header_workers: int = 8
    kind: str = "hub"

    @property
    def partials(self) -> HubPartials:
        return HubPartials(Path(os.path.realpath(self.storage)))  # as the kernel names files

    # -- SourceReader ------------------------------------------------------------------------
    def has_file(self, root: Path, name: str) -> bool:
        return name in self.repo.files

    def read_header(self, root: Path, file: str) -> ShardHeader:
        if file not in self.repo.files:
            raise fatal(Code.SHARD_MISSING, rule="hub", file=file)
        return read_remote_header(
            self.repo, file, self.origin.endpoint, self.origin.token, self.origin.settings()
        )

    def extra_files(self, root: Path, weight_files: set[str]) -> list[str]:
        return [f for f in self.small_files if f not in weight_files]

    def top_level_names(self, root: Path) -> list[str]:
        return sorted(f for f in self.repo.files if "/" not in f)

    # -- Remote ------------------------------------------------------------------------------
    def size(self, file: str) -> int:
        return self.repo.files[file].size

    def content_id(self, file: str) -> list:
        """What a record keeps of a source shard: size and the Hub's content id."""
        return [self.repo.files[file].size, self.repo.files[file].etag]

    def other_bytes(self) -> int:
        return sum(self.repo.files[f].size for f in self.small_files)

    def measure(self, file: str) -> tuple[int, float]:
        """(bytes, seconds) of a short timed download of `file`'s start."""
        return measure_download(self.repo, file, self.origin.endpoint, self.origin.token)

    def rows(self) -> list[tuple[str, str]]:
        return [
            ("Hub repo", f"{self.repo.repo_id} (revision {self.revision or 'main'})"),
            ("commit", self.repo.commit),
            ("downloads to", str(self.storage)),
        ]

    def summary(self) -> dict:
        return {
            "repo": self.repo.repo_id,
            "revision": self.revision,
            "commit": self.repo.commit,
            "download_dir": str(self.storage),
        }

    def fetch(self, file: str, hooks: FetchHooks) -> None:
        self.origin.download(self.repo, file, DownloadBar.bound(hooks))

    def delete(self, root: Path, file: str) -> int:
        """Remove a source shard: the file, and in the cache its blob too unless another
        snapshot entry (any revision of any repo in the cache) still links to it. Returns
        the bytes freed."""
        download_dir = self.origin.download_dir
        path = root / file
        if download_dir is not None:
            freed = _unlink_file(path)
            # huggingface_hub's per-file download record
            meta = download_dir / ".cache" / "huggingface" / "download" / f"{file}.metadata"
            meta.unlink(missing_ok=True)
            return freed
        if not path.is_symlink():  # a copy in the snapshot (no symlinks here): its own bytes
            return _unlink_file(path)
        return self._unlink_entry(path)

    def _unlink_entry(self, path: Path) -> int:
        """This snapshot's link, then its blob if nothing else in the cache links to it."""
        from huggingface_hub.utils import WeakFileLock

        storage = Path(os.path.realpath(self.storage))
        blob = Path(os.path.realpath(path))
        cache_root = hub_cache.cache_root_of(storage)
        # huggingface_hub links a new snapshot entry to an existing blob under this lock:
        # held, no entry is half made while the cache is searched.
        lock = cache_root / ".locks" / storage.name / f"{blob.name}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        with WeakFileLock(str(lock)):
            path.unlink(missing_ok=True)
            if blob.parent != storage / "blobs":  # a link out of the cache: not ours to free
                return 0
            if hub_cache.linked_from_any_snapshot(blob, cache_root) is not None:
                return 0  # another revision (or repo, or file) still holds these bytes
            try:
                size = os.stat(blob).st_size
                blob.unlink()
            except OSError:  # gone already
                return 0
        return size

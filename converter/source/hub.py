"""A source on the Hugging Face Hub, read over HTTP (`--download`).

Planning needs no tensor data: the config, the index and the small non-weight files are
downloaded, and each shard's safetensors header is read with HTTP range requests (the first
100 kB, then the rest if the header is longer), so the manifest check happens before any
large download. The header bytes are the very bytes a local read would see, so the plan
(and its fingerprint) is identical to the plan of a local copy of the same repo.

Shards themselves are fetched later, when the Hub executor (`execute/hub.py`) schedules
them, through `huggingface_hub` (its resumable, size-checked downloads, into its cache or
`--download-dir`). The revision is pinned to one commit at the start.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..contract import CHECKSUMS_NAME, CONFIG_NAME, INDEX_NAME, SINGLE_NAME
from ..errors import EXIT_USAGE, Code, Fatal, fail
from ..safetensors_format import ShardHeader, check_header_length, parse_header_bytes

HEADER_PROBE = 100_000  # one request covers the header of almost every shard
RESUME_HINT = ("rerun the same command once the cause is fixed: finished output shards and "
               "fully downloaded source shards are kept")


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


def hub_error(exc: BaseException, what: str, file: str | None = None,
              revision: str | None = None) -> Fatal:
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
        msg = f"revision {revision!r} not found in the repository (check --revision)"
    else:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        msg = f"{what} failed: {detail}"
    return fail(Code.HUB_ERROR, msg, file=file, hint=RESUME_HINT)


def open_repo(repo_id: str, revision: str | None, endpoint: str | None = None,
              token: str | bool | None = None) -> HubRepo:
    """Pin the revision to a commit and list every file with its size and content id."""
    from huggingface_hub import HfApi

    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(
            repo_id, revision=revision, files_metadata=True
        )
    except Exception as exc:  # network, HTTP, auth: all end the run the same way
        raise hub_error(exc, "reading the repository's file list", repo_id, revision) from None
    files = {}
    for s in info.siblings or []:
        size = s.lfs.size if s.lfs else s.size
        etag = s.lfs.sha256 if s.lfs else s.blob_id
        if size is None or not etag:
            raise fail(Code.HUB_ERROR, "the Hub did not report size and content id for a file",
                       file=s.rfilename)
        files[s.rfilename] = RemoteFile(s.rfilename, int(size), str(etag))
    if not info.sha:
        raise fail(Code.HUB_ERROR, "the Hub did not report a commit for this revision",
                   file=repo_id)
    return HubRepo(repo_id, info.sha, files)


def read_remote_header(repo: HubRepo, file: str, endpoint: str | None = None,
                       token: str | bool | None = None) -> ShardHeader:
    """A shard's header through HTTP range requests; the same checks as `read_header`."""
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    url = hf_hub_url(repo.repo_id, file, revision=repo.commit, endpoint=endpoint)
    headers = {**build_hf_headers(token=token), "Accept-Encoding": "identity"}
    size = repo.files[file].size

    def get(first: int, last: int) -> bytes:
        try:
            resp = get_session().get(url, headers={**headers, "range": f"bytes={first}-{last}"},
                                     timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT)
            hf_raise_for_status(resp)
        except Exception as exc:
            raise hub_error(exc, "reading the safetensors header", file) from None
        body = resp.content
        if resp.status_code == 200:  # the server ignored the range: cut it ourselves
            body = body[first : last + 1]
        return body

    head = get(0, min(size, HEADER_PROBE) - 1) if size >= 8 else b""
    length = check_header_length(file, head, size)
    raw = head[8 : 8 + length]
    if len(raw) < length:
        raw += get(8 + len(raw), 8 + length - 1)
    if len(raw) != length:
        raise fail(Code.HUB_ERROR, "the server returned a short range for the header", file=file)
    return parse_header_bytes(file, raw, size)


def _accepts(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


@dataclass
class HubOrigin:
    """Files of one pinned Hub commit: small files at once, shards when asked for."""

    download_dir: Path | None = None  # None: the Hugging Face cache
    endpoint: str | None = None  # None: HF_ENDPOINT or the public Hub
    token: str | bool | None = None  # None: HF_TOKEN or the stored login
    repo: HubRepo | None = None
    small_files: list[str] = field(default_factory=list)
    storage: Path | None = None  # what holds the downloads (for the disk meter)
    header_workers: int = 8

    def resolve(self, spec: str, revision: str | None) -> Path:
        if Path(spec).expanduser().exists() or spec.count("/") != 1 or spec.startswith("."):
            raise fail(Code.USAGE, "--download needs a Hugging Face repo id (org/name)",
                       file=spec, exit_code=EXIT_USAGE)
        self.repo = open_repo(spec, revision, self.endpoint, self.token)
        files = self.repo.files
        if CONFIG_NAME not in files:
            raise fail(Code.FILE_MISSING, "the repository has no config.json", file=spec)
        if INDEX_NAME not in files and SINGLE_NAME not in files:
            raise fail(Code.FILE_MISSING, f"the repository has no {INDEX_NAME} or "
                       f"{SINGLE_NAME}", file=spec)
        # The same selection a local read makes: every non-weight file is copied.
        self.small_files = sorted(
            f for f in files
            if not f.endswith(".safetensors") and f != CHECKSUMS_NAME
            and not any(part.startswith(".") for part in Path(f).parts)
        )
        root = None
        for f in self.small_files:
            path = self.fetch(f)
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

    def has_file(self, root: Path, name: str) -> bool:
        assert self.repo is not None
        return name in self.repo.files

    def read_header(self, root: Path, file: str) -> ShardHeader:
        assert self.repo is not None
        if file not in self.repo.files:
            raise fail(Code.SHARD_MISSING, "shard named in the index is missing from the "
                       "repository", file=file)
        return read_remote_header(self.repo, file, self.endpoint, self.token)

    def extra_files(self, root: Path, weight_files: set[str]) -> list[str]:
        return [f for f in self.small_files if f not in weight_files]

    def fetch(self, file: str, tqdm_class: type | None = None) -> Path:
        """Download one file of the pinned commit (a no-op if it is already complete)."""
        from huggingface_hub import hf_hub_download

        assert self.repo is not None
        kwargs = {}
        if tqdm_class is not None and _accepts(hf_hub_download, "tqdm_class"):
            kwargs["tqdm_class"] = tqdm_class
        try:
            path = hf_hub_download(self.repo.repo_id, file, revision=self.repo.commit,
                                   endpoint=self.endpoint, token=self.token,
                                   local_dir=self.download_dir, **kwargs)
        except Exception as exc:
            raise hub_error(exc, "download", file) from None
        return Path(path)

    def delete(self, root: Path, file: str) -> None:
        """Remove a source shard: the file, and in the cache its blob too."""
        path = root / file
        target = path.resolve() if path.is_symlink() else None
        path.unlink(missing_ok=True)
        if target is not None and self.download_dir is None:
            target.unlink(missing_ok=True)  # the blob: the bytes that take the space
        if self.download_dir is not None:  # huggingface_hub's per-file download record
            meta = self.download_dir / ".cache" / "huggingface" / "download" / f"{file}.metadata"
            meta.unlink(missing_ok=True)

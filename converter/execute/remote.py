"""The seam between the streaming executor and a remote origin: what the executor asks of
the origin (`Remote`, and its `Partials`: how its partial downloads are named and found),
and the source files that origin delivers during a run (`StreamedSources`).

The Hub is one such origin (`source/hub.py`); another (S3, say) is one more file that
implements `Remote` beside `Origin`, and nothing here changes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

from ..source import FetchHooks
from .shard import SourceFiles, file_identity


class CreatedHook(Protocol):
    """Calls back the moment the client has created a partial download (`stream.py`)."""

    def install(self) -> None: ...

    def remove(self) -> None: ...


class Partials(Protocol):
    """The client's partial downloads: the temporary files a cut-short download leaves."""

    def open(self) -> list[Path]:
        """Those this process holds open under the storage: proof that this run made them."""
        ...

    def owns(self, path: Path) -> bool:
        """Whether `path` is a partial download of this storage."""
        ...

    def remove(self, path: Path) -> int | None:
        """Remove a recorded one; the bytes freed, None if there was nothing to remove."""
        ...

    def on_created(self, callback: Callable[[Path | None], None]) -> CreatedHook: ...


@runtime_checkable
class Remote(Protocol):
    """A resolved source whose shards are fetched during the run."""

    kind: str  # the key of this executor's block in the summary
    storage: Path  # what holds the downloads: measured for peak disk, checked for space
    partials: Partials

    def size(self, file: str) -> int: ...

    def content_id(self, file: str) -> list:
        """What a record keeps of a source shard instead of its inode (it may be deleted)."""
        ...

    def other_bytes(self) -> int:
        """The non-weight files, already downloaded while resolving."""
        ...

    def rows(self) -> list[tuple[str, str]]:
        """Which source, for the dry run's table."""
        ...

    def summary(self) -> dict:
        """Which source, for the summary."""
        ...

    def fetch(self, file: str, hooks: FetchHooks) -> None:
        """Download one shard (a no-op if complete), reporting through `hooks`."""
        ...

    def delete(self, root: Path, file: str) -> int:
        """Remove a source shard (what else still needs its bytes keeps them); the bytes
        actually freed."""
        ...


class StreamedSources(SourceFiles):
    """Source shards that arrive (and may leave) during the run, from `remote`.

    `identity` is recorded when a shard lands, so a file changed under us is still caught;
    `fingerprint` (what records keep) names content: the Hub's listing, which a cache path
    read of the same snapshot gives too (`source/hub_cache.py`).
    """

    def __init__(
        self, root: Path, remote: Remote, files: list[str], header_sha256: dict[str, str]
    ) -> None:
        # No file is there yet: identities are taken as shards arrive. A downloaded shard
        # must still carry the very header the plan was made from.
        super().__init__(root, [], header_sha256=header_sha256)
        self.remote = remote
        self.order = list(files)  # index order
        self.content = {f: remote.content_id(f) for f in files}

    def arrived(self, file: str) -> None:
        with self._lock:
            self.identity[file] = file_identity(self.root / file)

    def drop(self, file: str) -> None:
        with self._lock:
            fd = self._fds.pop(file, None)
            if fd is not None:
                os.close(fd)
            self.identity.pop(file, None)

"""The Hugging Face cache's layout, read in one place: which repo and commit a snapshot
folder is, and what a file of it is by content.

A cache repo folder is `models--<org>--<name>/` with `snapshots/<commit>/<path>` links into
`blobs/<etag>`: huggingface_hub names each blob by the Hub's content id (an LFS file's
sha256, else its git blob id), and links every snapshot holding that content to it.

One source identity whatever the route (`content_id`): a file of a cache snapshot is the
same Hub file whether it is read from the cache path or fetched with `--download` (whose
identity is the Hub's listing: size and content id), so both routes record `[size, etag]`
and a rerun by the other route keeps what the first wrote. The blob's name is trusted as
huggingface_hub trusts it; within a run, every file is still held to its inode and times
(`SourceFiles.check_unchanged`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO_PREFIX = "models--"
_ETAG = re.compile(r"[0-9a-f]{64}|[0-9a-f]{40}")  # sha256 (LFS) or git blob sha1


def snapshot_of(root: Path) -> tuple[str, str] | None:
    """(repo id, commit) when `root` (a real path) is a cache snapshot folder, else None."""
    folder = root.parent.parent.name
    if root.parent.name == "snapshots" and folder.startswith(REPO_PREFIX):
        return folder.removeprefix(REPO_PREFIX).replace("--", "/"), root.name
    return None


def content_id(root: Path, file: str) -> list | None:
    """`[size, etag]` of a file of a cache snapshot: a link into its repo's `blobs/` to a
    regular file named by a content id. None for anything else (a plain folder, a copied
    file, a link elsewhere): such a file is known by its inode and times."""
    real_root = Path(os.path.realpath(root))
    if snapshot_of(real_root) is None:
        return None
    path = root / file
    if not path.is_symlink():
        return None
    blob = Path(os.path.realpath(path))
    if blob.parent != real_root.parent.parent / "blobs" or not _ETAG.fullmatch(blob.name):
        return None
    try:
        st = os.stat(blob)
    except OSError:
        return None
    if not os.path.isfile(blob):
        return None
    return [st.st_size, blob.name]


def cache_root_of(repo_folder: Path) -> Path:
    """The cache folder holding a repo folder (`HF_HUB_CACHE`)."""
    return repo_folder.parent


def linked_from_any_snapshot(blob: Path, cache_root: Path) -> Path | None:
    """A snapshot entry anywhere in the cache (any revision of any repo) that is this blob
    (a link to it, or another name of the same file), else None.

    Every `*/snapshots/` folder of the cache is walked (links to folders not followed);
    an entry is the blob when it resolves to the same file (device and inode).
    """
    try:
        target = os.stat(blob)
    except OSError:
        return None
    try:
        repos = list(os.scandir(cache_root))
    except OSError:
        return None
    for repo in repos:
        snapshots = os.path.join(repo.path, "snapshots")
        if not repo.is_dir(follow_symlinks=False) or not os.path.isdir(snapshots):
            continue
        for dirpath, _, names in os.walk(snapshots):
            for name in names:
                entry = os.path.join(dirpath, name)
                try:
                    st = os.stat(entry)
                except OSError:  # dangling, or gone since the listing
                    continue
                if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
                    return Path(entry)
    return None

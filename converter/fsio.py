"""The filesystem is hostile: the one place that opens, inspects and deletes paths.

Rules every reader and writer of the tool goes through here for:
- read only regular files, opened without blocking (`O_NONBLOCK`: a FIFO swapped in for a
  file cannot hang the open) and checked *after* opening (`fstat`), so neither a FIFO nor a
  link to a device (an endless `/dev/zero`) is ever read;
- delete only what lies inside a real directory, never through a link: a link is removed
  as a link, its target untouched (`remove`);
- describe what a path is in words a user can act on (`describe`), naming a symlink as one.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Callable, Container, Iterable
from pathlib import Path
from typing import NamedTuple

_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class NotRegularFile(OSError):
    """A path that is there but is not a regular file (FIFO, socket, device, directory)."""


def not_regular(path: str | os.PathLike[str], mode: int) -> NotRegularFile:
    return NotRegularFile(errno.EINVAL, f"not a regular file ({kind(mode)})", os.fspath(path))


def kind(mode: int) -> str:
    """What a file mode is, in a word."""
    for test, what in (
        (stat.S_ISREG, "regular file"),
        (stat.S_ISDIR, "directory"),
        (stat.S_ISLNK, "symlink"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
    ):
        if test(mode):
            return what
    return "device or other special file"


def lkind(path: str | os.PathLike[str]) -> str | None:
    """What the path itself is (a link is a "symlink"); None if nothing is there."""
    try:
        return kind(os.lstat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):  # or a file where a folder would be
        return None


def describe(path: str | os.PathLike[str]) -> str:
    """What a path is, following a link and saying so: "symlink to a FIFO (-> /x)". Never
    raises: it words refusals, and a path that cannot be looked at (a folder on the way not
    searchable) is "unreadable (why)"."""
    try:
        own = lkind(path)
        if own != "symlink":
            return own or "missing"
        target = os.readlink(path)
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    try:
        what = kind(os.stat(path).st_mode)
    except OSError:
        what = "nothing (a dangling link)"
    return f"symlink to {'' if what.startswith('nothing') else 'a '}{what} (-> {target})"


def open_regular(path: str | os.PathLike[str], *, follow: bool = True) -> int:
    """A read-only fd of a regular file; never blocks. `follow=False` refuses a link
    (ELOOP). Raises `NotRegularFile` for anything else that is there."""
    flags = os.O_RDONLY | _NONBLOCK | _CLOEXEC | (0 if follow else _NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno in (errno.ENXIO, errno.EOPNOTSUPP):  # a socket cannot be opened at all
            with contextlib.suppress(OSError):
                mode = (os.stat if follow else os.lstat)(path).st_mode
                if not stat.S_ISREG(mode):
                    raise not_regular(path, mode) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise not_regular(path, mode)
    if _NONBLOCK:  # regular files ignore it, but a caller's reads must not see EAGAIN
        os.set_blocking(fd, True)
    return fd


def read_regular(path: str | os.PathLike[str], *, follow: bool = True) -> bytes:
    """The whole content of a regular file (see `open_regular`)."""
    with os.fdopen(open_regular(path, follow=follow), "rb") as fh:
        return fh.read()


def identity(st: os.stat_result) -> list[int]:
    """What a file is, cheaply: size, mtime, ctime and inode (nanoseconds).

    ctime cannot be set back by a user (utime sets only mtime/atime): any write through the
    filesystem, even one whose author restores the mtime, changes it. The device number is
    left out on purpose: it differs between the nodes that mount one shared filesystem.
    """
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def read_identified(path: str | os.PathLike[str]) -> tuple[bytes, list[int]]:
    """The content of a regular file and its `identity`, taken from the descriptor read
    (before reading: a write during the read changes what a later look sees)."""
    with os.fdopen(open_regular(path), "rb") as fh:
        seen = identity(os.fstat(fh.fileno()))
        return fh.read(), seen


def read_if_regular(path: str | os.PathLike[str]) -> bytes | None:
    """The content of a record file of ours, or None when it is missing, is not a regular
    file, or is a link (never followed): a record that cannot be read is no record."""
    try:
        return read_regular(path, follow=False)
    except OSError:
        return None


def is_regular(path: str | os.PathLike[str], *, follow: bool = True) -> bool:
    """Whether the path is a regular file (never opens it)."""
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode)


def is_real_dir(path: str | os.PathLike[str]) -> bool:
    """A directory, and not a link to one."""
    return lkind(path) == "directory"


def remove(path: str | os.PathLike[str]) -> None:
    """Remove a path without ever following a link: a link or file is unlinked, a real
    directory removed with its content (`shutil.rmtree` does not follow links inside it
    either, on platforms where it can say so). Nothing there: nothing to do."""
    what = lkind(path)
    if what is None:
        return
    if what == "directory":
        shutil.rmtree(path)
    else:
        os.unlink(path)


def remove_all(files: Iterable[Path], folders: Iterable[Path] = ()) -> None:
    """Remove `files` in order (a link as itself; nothing there: nothing to do), then each of
    `folders` that is a real directory and is empty once they are gone: its empty subfolders
    first, deepest first, links never followed. Whatever else lies in a folder (a hidden
    file someone put there, that no record of ours names) keeps it and its parents."""
    for path in files:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    for path in folders:
        if is_real_dir(path):
            prune_empty(path)


def prune_empty(folder: Path) -> None:
    """Remove `folder` and every folder under it that holds nothing, deepest first (a link
    to a folder is not entered, and keeps its parent); never a file."""
    for dirpath, _, _ in os.walk(folder, topdown=False):
        with contextlib.suppress(OSError):  # not empty, or gone: left as it is
            os.rmdir(dirpath)


def empty(folder: Path, keep: Container[str] = ()) -> None:
    """Remove what lies in `folder` (a real directory) but the names in `keep` (`remove`)."""
    for path in folder.iterdir():
        if path.name not in keep:
            remove(path)


def make_dirs(path: Path) -> list[Path]:
    """mkdir -p where nothing is there (links not followed: what stands is left as it is),
    0755 whatever the umask (others must read it). Returns the folders made, outermost first."""
    made = []
    for p in reversed((path, *path.parents)):
        if os.path.lexists(p):
            continue
        try:
            os.mkdir(p, 0o755)
        except FileExistsError:  # made meanwhile by someone else: not ours
            continue
        os.chmod(p, 0o755)
        made.append(p)
    return made


def nearest_existing(path: Path) -> Path:
    """The path itself, or its closest ancestor that exists (links not followed)."""
    for p in (path, *path.parents):
        if os.path.lexists(p):
            return p
    return Path(path.anchor or ".")


def listing(root: Path, skip: Callable[[str], bool]) -> tuple[list[Path], dict[Path, int | None]]:
    """What lies in a directory, links never followed: its entries, and every file under
    them (a link is a file here, never entered) with its size where it is a regular file
    (None otherwise); `skip` is asked with each path relative to `root`, posix-style."""
    entries = [p for p in root.iterdir() if not skip(p.name)]
    files: dict[Path, int | None] = {}
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            under = (p for p in entry.rglob("*") if p.is_symlink() or not p.is_dir())
            paths = sorted(p for p in under if not skip(p.relative_to(root).as_posix()))
        else:
            paths = [entry]
        for path in paths:
            try:
                st = os.lstat(path)
            except FileNotFoundError:  # gone since it was listed: not there
                continue
            files[path] = st.st_size if stat.S_ISREG(st.st_mode) else None
    return entries, files


def append_durably(path: str | os.PathLike[str], data: bytes) -> None:
    """Append to a record file and fsync it; never through a link (`O_NOFOLLOW`), never to
    anything but a regular file (a FIFO planted there would block the write)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _NONBLOCK | _CLOEXEC
    fd = os.open(path, flags, 0o644)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise not_regular(path, mode)
        os.set_blocking(fd, True)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def create_fresh(path: str | os.PathLike[str], mode: int = 0o644) -> int:
    """A write fd of a new, empty regular file at `path` (a temporary of ours): whatever lay
    there is removed as itself first (a planted link goes, its target untouched), and the
    create is exclusive and does not follow links, so no write can land elsewhere."""
    remove(path)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode)


def write_atomic(path: Path, data: bytes, tmp_dir: Path) -> None:
    """Replace `path` with `data`, fsynced first: a reader sees the old file or the new one,
    never a torn one (the temporary is made in `tmp_dir`, see `create_fresh`)."""
    tmp = tmp_dir / (path.name + ".partial")
    with os.fdopen(create_fresh(tmp), "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the directory's entries (a rename, an unlink) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Space(NamedTuple):
    """The filesystem a path is on: its free bytes and its device."""

    free: int
    device: int


def space(path: Path) -> Space:
    """The filesystem `path` is on, or will be on once made: its nearest existing folder's
    (a dry run asks before the output folder exists)."""
    near = nearest_existing(Path(os.path.abspath(path)))
    return Space(shutil.disk_usage(near).free, os.stat(near).st_dev)


def space_if_readable(path: Path) -> Space | None:
    """`space`, or None where it cannot be read (a folder on the way not searchable, a
    dangling link standing in for the folder): for a survey, which never raises."""
    try:
        return space(path)
    except OSError:
        return None


def free_bytes(path: Path) -> int:
    """Free bytes of the filesystem `path` is on, or will be on once made (`space`)."""
    return space(path).free

"""One conversion per output directory: a lock file that names its owner.

`O_CREAT | O_EXCL` makes creation atomic (also on NFS v3+); the file records pid and host
so a second run can say who holds it, and a lock left by a dead process on this host is
taken over with a warning instead of blocking forever. The holder also keeps an `flock` on
the file: the kernel drops it when the process dies, and it serialises a takeover, so two
runs that find the same stale lock at once cannot both take it. Every step is taken in
the lock's folder opened without following a link (`dir_fd`), so a folder swapped for a
link is refused, never written through; a folder that is missing is made first, each one
in the folder above it, opened the same way.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .. import fsio
from ..errors import Fatal, fatal
from ..reasons import Code

_OWNER_MAX = 64 * 1024  # a lock we wrote names its owner in a few dozen bytes
# Never through a link, never blocking on a FIFO planted in the lock's place.
_FLAGS = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
_FOLDER_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_DIRECTORY", 0)
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
)


def _alive(pid: int) -> bool:
    if pid <= 0:  # 0 / negative address process groups, not a process: never "dead"
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:  # a filesystem without flock: fall back to pid/host alone
        return True
    return True


@dataclass(frozen=True)
class LockRefused:
    """Why the lock is not ours, as a value (`OutputLock.attempt`): "vanished" (three times),
    "busy" (`owner` holds it), "not-a-lock" (something else lies at its path) or
    "not-a-folder" (its folder is not a real directory: a link would put the lock elsewhere)."""

    why: Literal["vanished", "busy", "not-a-lock", "not-a-folder"]
    owner: dict | None = None

    def worded(self, lock: Path, shown: str) -> Fatal:
        """The refusal in words; `shown` is what stands where the lock or its folder should
        be (`fsio.describe`), read by the caller after the refusal."""
        folder = lock.parent
        if self.why == "not-a-folder":
            return fatal(
                Code.STATE_FOLDER_INVALID, rule="state", file=folder, state=folder.name, kind=shown
            )
        if self.why == "not-a-lock":
            return fatal(Code.STATE_FOLDER_INVALID, rule="lock", file=lock, kind=shown)
        if self.why == "vanished":
            return fatal(Code.OUTPUT_LOCKED, rule="take", file=lock)
        owner = self.owner
        who = f"pid {owner.get('pid')} on {owner.get('host')}" if owner else "unknown owner"
        return fatal(Code.OUTPUT_LOCKED, rule="busy", file=folder.parent, who=who, lock=lock)

    def where(self, lock: Path) -> Path | None:
        """The path whose kind the refusal shows (None: it shows none)."""
        return {"not-a-folder": lock.parent, "not-a-lock": lock}.get(self.why)


class OutputLock:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.warning: str | None = None
        self._fd: int | None = None
        # The lock's folder, opened without following a link: every step on the lock is
        # taken in that very folder, whatever its path comes to name meanwhile.
        self._folder: int | None = None
        self.made: list[Path] = []  # the folders `attempt` made, outermost first

    def acquire(self) -> None:
        """Take the lock or raise why not (`attempt`, worded from what stands there now)."""
        refused = self.attempt()
        if refused is not None:
            where = refused.where(self.path)
            raise refused.worded(self.path, fsio.describe(where) if where is not None else "")

    def attempt(self) -> LockRefused | None:
        """Take the lock, its folder made first where missing (the folders above it too):
        None once it is ours, why not otherwise (a value: the caller words and raises it
        once, from what it reads of the folder)."""
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        try:
            refused = self._take(me)
        except BaseException:
            self._close_folder()
            raise
        if refused is not None:
            self._close_folder()
        return refused

    def _take(self, me: dict) -> LockRefused | None:
        """None once we hold the lock; why not otherwise (a value: `acquire` raises once)."""
        try:
            self._folder = _open_folder(self.path.parent, self.made)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                return LockRefused("not-a-folder")
            raise
        for _ in range(3):
            try:
                fd = os.open(
                    self.path.name, _FLAGS | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=self._folder
                )
            except FileExistsError:
                taken = self._take_over_stale(me)
                if taken is False:
                    continue  # the lock vanished (its owner finished): try to create it again
                return None if taken is True else taken
            # Blocking: a taker may hold it for a moment, but never keeps a lock whose
            # content (still empty) names no dead owner.
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX)
            self._hold(fd, me)
            return None
        return LockRefused("vanished")

    def _take_over_stale(self, me: dict) -> bool | LockRefused:
        """True if we now hold the lock, False if it vanished; why not where someone holds it
        or it is no lock."""
        try:
            fd = os.open(self.path.name, _FLAGS, dir_fd=self._folder)
        except FileNotFoundError:
            return False
        except OSError:  # a link (ELOOP) or anything else that cannot be a lock
            return LockRefused("not-a-lock")
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return LockRefused("not-a-lock")
            if not _flock(fd):  # the owner is alive (or another run is taking over)
                return LockRefused("busy", _owner(fd))
            if not self._is_current(fd):  # released and recreated while we waited
                return False
            owner = _owner(fd)
            pid = owner.get("pid") if owner else None
            if not (
                owner and owner.get("host") == me["host"] and type(pid) is int and not _alive(pid)
            ):
                return LockRefused("busy", owner)
            self.warning = f"took over a stale lock left by pid {pid} (no longer running)"
            self._hold(fd, me)
            fd = -1
            return True
        finally:
            if fd >= 0:
                os.close(fd)

    def _is_current(self, fd: int) -> bool:
        try:
            st = os.stat(self.path.name, dir_fd=self._folder, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return os.fstat(fd).st_ino == st.st_ino

    def _hold(self, fd: int, me: dict) -> None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Let go of a lock we hold (a no-op otherwise: never remove another run's lock)."""
        if self._fd is None:
            self._close_folder()
            return
        # Unlink while still holding the flock, then let go: a waiter that opened the old
        # file sees it is no longer the lock (`_is_current`) and starts over.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path.name, dir_fd=self._folder)
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._fd = None
        self._close_folder()

    def _close_folder(self) -> None:
        if self._folder is not None:
            with contextlib.suppress(OSError):
                os.close(self._folder)
            self._folder = None


def _open_folder(folder: Path, made: list[Path]) -> int:
    """`folder` opened without following a link, made first where missing with the folders
    above it (0755 whatever the umask: others must read it). Each missing folder is made and
    opened inside the one above it, itself opened: a link met on the way (ELOOP, ENOTDIR) is
    refused, never followed. The folders made are added to `made`, outermost first; one made
    meanwhile by someone else is not ours."""
    missing: list[str] = []
    there = folder
    while not os.path.lexists(there) and there != there.parent:
        missing.append(there.name)
        there = there.parent
    fd = os.open(there, _FOLDER_FLAGS)
    try:
        for name in reversed(missing):
            there = there / name
            try:
                os.mkdir(name, 0o755, dir_fd=fd)
                made.append(there)
            except FileExistsError:
                pass
            inner = os.open(name, _FOLDER_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = inner
            if made and made[-1] == there:
                os.fchmod(fd, 0o755)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _owner(fd: int) -> dict | None:
    """Who the lock file open on `fd` (a regular file, checked) names; read from that fd, so
    it is the very file whose `flock` was asked, not whatever the path holds by now."""
    try:
        owner = json.loads(os.pread(fd, _OWNER_MAX, 0))
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None

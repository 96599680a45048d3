"""One conversion per output directory: a lock file that names its owner.

`O_CREAT | O_EXCL` makes creation atomic (also on NFS v3+); the file records pid and host
so a second run can say who holds it, and a lock left by a dead process on this host is
taken over with a warning instead of blocking forever. The holder also keeps an `flock` on
the file: the kernel drops it when the process dies, and it serialises a takeover, so two
runs that find the same stale lock at once cannot both take it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from . import fsio
from .errors import Code, Fatal, fatal

_OWNER_MAX = 64 * 1024  # a lock we wrote names its owner in a few dozen bytes
# Never through a link, never blocking on a FIFO planted in the lock's place.
_FLAGS = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


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
class _Refused:
    """Why the lock is not ours: the path holds no lock, or a live owner (None: unknown)."""

    owner: dict | None = None
    not_a_lock: bool = False


class OutputLock:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.warning: str | None = None
        self._fd: int | None = None

    def acquire(self) -> None:
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        refused: _Refused | None = None  # None after three tries: the lock kept vanishing
        for _ in range(3):
            try:
                fd = os.open(self.path, _FLAGS | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                taken = self._take_over_stale(me)
                if taken is True:
                    return
                if taken is False:
                    continue  # the lock vanished (its owner finished): try to create it again
                refused = taken
                break
            # Blocking: a taker may hold it for a moment, but never keeps a lock whose
            # content (still empty) names no dead owner.
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX)
            self._hold(fd, me)
            return
        raise self._refusal(refused)

    def _take_over_stale(self, me: dict) -> bool | _Refused:
        """True if we now hold the lock, False if it vanished; why not where someone holds it
        or it is no lock (a value: `acquire` raises once)."""
        try:
            fd = os.open(self.path, _FLAGS)
        except FileNotFoundError:
            return False
        except OSError:  # a link (ELOOP) or anything else that cannot be a lock
            return _Refused(not_a_lock=True)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return _Refused(not_a_lock=True)
            if not _flock(fd):  # the owner is alive (or another run is taking over)
                return _Refused(owner=_owner(fd))
            if not self._is_current(fd):  # released and recreated while we waited
                return False
            owner = _owner(fd)
            pid = owner.get("pid") if owner else None
            if not (
                owner and owner.get("host") == me["host"] and type(pid) is int and not _alive(pid)
            ):
                return _Refused(owner=owner)
            self.warning = f"took over a stale lock left by pid {pid} (no longer running)"
            self._hold(fd, me)
            fd = -1
            return True
        finally:
            if fd >= 0:
                os.close(fd)

    def _is_current(self, fd: int) -> bool:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        return os.fstat(fd).st_ino == st.st_ino

    def _hold(self, fd: int, me: dict) -> None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._fd = fd

    def _refusal(self, refused: _Refused | None) -> Fatal:
        """The one refusal `acquire` raises: no lock there (`refused.not_a_lock`), a live
        owner, or a lock that kept vanishing (None)."""
        if refused is None:
            return fatal(Code.OUTPUT_LOCKED, rule="take", file=self.path)
        if refused.not_a_lock:
            kind = fsio.describe(self.path)
            return fatal(Code.STATE_FOLDER_INVALID, rule="lock", file=self.path, kind=kind)
        owner = refused.owner
        who = f"pid {owner.get('pid')} on {owner.get('host')}" if owner else "unknown owner"
        return fatal(
            Code.OUTPUT_LOCKED, rule="busy", file=self.path.parent.parent, who=who, lock=self.path
        )

    def release(self) -> None:
        """Let go of a lock we hold (a no-op otherwise: never remove another run's lock)."""
        if self._fd is None:
            return
        # Unlink while still holding the flock, then let go: a waiter that opened the old
        # file sees it is no longer the lock (`_is_current`) and starts over.
        self.path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._fd = None


def _owner(fd: int) -> dict | None:
    """Who the lock file open on `fd` (a regular file, checked) names; read from that fd, so
    it is the very file whose `flock` was asked, not whatever the path holds by now."""
    try:
        owner = json.loads(os.pread(fd, _OWNER_MAX, 0))
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None

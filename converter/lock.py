"""One conversion per output directory: a lock file that names its owner.

`O_CREAT | O_EXCL` makes creation atomic (also on NFS v3+); the file records pid and host
so a second run can say who holds it, and a lock left by a dead process on this host is
taken over with a warning instead of blocking forever.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from .errors import fail


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class OutputLock:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.warning: str | None = None

    def acquire(self) -> None:
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                owner = self._owner()
                if owner and owner.get("host") == me["host"] and not _alive(int(owner["pid"])):
                    self.warning = (
                        f"took over a stale lock left by pid {owner['pid']} (no longer running)"
                    )
                    self.path.unlink(missing_ok=True)
                    continue
                who = f"pid {owner.get('pid')} on {owner.get('host')}" if owner else "unknown owner"
                raise fail(
                    f"another conversion is writing this output directory ({who}); wait for "
                    f"it, or remove {self.path} if you are sure it is gone",
                    file=str(self.path.parent.parent),
                ) from None
            with os.fdopen(fd, "w") as fh:
                json.dump(me, fh)
            return
        raise fail("could not take the output lock", file=str(self.path))

    def _owner(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def release(self) -> None:
        self.path.unlink(missing_ok=True)

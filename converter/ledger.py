"""The resume ledger: an append-only, fsynced record of finished output shards.

Line 1 names the plan fingerprint; each further line is one finished shard with its size
and per-tensor checksums, appended only after the shard is fsynced and renamed into place.
A line torn by a crash is ignored (that shard is simply redone).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from . import faults


class Ledger:
    def __init__(self, path: Path, fingerprint: str) -> None:
        self.path = path
        self.fingerprint = fingerprint
        self.done: dict[str, dict] = {}
        self._lock = threading.Lock()

    @staticmethod
    def read_fingerprint(path: Path) -> str | None:
        try:
            with open(path, encoding="utf-8") as fh:
                first = json.loads(fh.readline())
            return first.get("fingerprint")
        except (OSError, ValueError, AttributeError):
            return None

    def open(self) -> None:
        """Load finished entries if this ledger belongs to our plan, else start afresh."""
        if self.read_fingerprint(self.path) == self.fingerprint:
            data = self.path.read_bytes()
            if not data.endswith(b"\n"):  # a torn last line: drop it, or the next append
                os.truncate(self.path, data.rfind(b"\n") + 1)  # would be glued onto it
            with open(self.path, encoding="utf-8") as fh:
                for line in fh.readlines()[1:]:
                    try:
                        entry = json.loads(line)
                        self.done[entry["shard"]] = entry
                    except (ValueError, KeyError, TypeError):
                        continue  # torn last line
            return
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(json.dumps({"fingerprint": self.fingerprint}) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)

    def record(self, entry: dict) -> None:
        with self._lock:
            faults.fault_point("ledger.append")
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(entry, separators=(",", ":")) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            faults.fault_point("ledger.appended")
            self.done[entry["shard"]] = entry

    def forget(self, shard: str) -> None:
        self.done.pop(shard, None)

"""Text for people, shared by the library layers and the command lines (no UI here)."""

from __future__ import annotations

from collections.abc import Iterable

from .errors import human_size

human = human_size  # the one rule for sizes people read (errors.py: messages use it too)


def id_ranges(ids: Iterable[int], limit: int | None = 10) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8": runs of consecutive ids, each id once; after
    `limit` runs, " ..." (None: every run)."""
    ordered = sorted(set(ids))
    if not ordered:
        return "(none)"
    runs: list[str] = []
    start = prev = ordered[0]
    for i in [*ordered[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    shown = runs if limit is None else runs[:limit]
    return ", ".join(shown) + (" ..." if len(shown) < len(runs) else "")


def duration(seconds: float) -> str:
    """3725.4 -> "1:02:05"."""
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}"

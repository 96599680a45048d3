"""Text for people, shared by the messages, the library layers and the command lines (no UI
here): sizes, plurals, durations, id ranges, the repair command."""

from __future__ import annotations

from collections.abc import Iterable


def human_size(n: float) -> str:
    """1_600_000_000_000 -> '1.6 TB' (decimal units, as disks are sold and `df -H` shows)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def repair_command(output: str, source: str = "SRC") -> str:
    """The command that repairs an output whose data was damaged after its conversion: the
    conversion again, re-reading every kept shard (verify names it; so does a plain rerun,
    which does not re-read and so cannot see the damage)."""
    return f"kimi-convert {source} {output} --rehash"


def plural(n: int, noun: str, many: str | None = None) -> str:
    """'1 shard', '2 shards', '0 shards' (`many` where the plural is not noun + s)."""
    return f"{n} {noun if n == 1 else many or noun + 's'}"


class Size(int):
    """A byte count as a fact: messages show it for people and exactly ('46.0 GB
    (45,998,000,000 bytes)'); it is still the int, for code that reads it."""

    def __str__(self) -> str:
        return f"{human_size(self)} ({int(self):,} bytes)"

    def __format__(self, spec: str) -> str:
        return str(self) if not spec else int(self).__format__(spec)


human = human_size  # the one rule for sizes people read (messages use it too)


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

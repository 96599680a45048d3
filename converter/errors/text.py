"""Text helpers the messages and the console share: sizes, plurals, the repair command."""

from __future__ import annotations


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

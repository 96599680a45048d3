"""Time the checks the plugin makes before a converted checkpoint's weights load, at full
scale: a header-only replica of Kimi-K3 (tools/replica.py), its proof recorded as a passing
`verify --checksums` would record it (the replica's data are holes: no byte is read here).

    python tools/served_check.py WORK_DIR [--shard-size BYTES]

Prints the shard count and the seconds each check takes (best of 3): the verified-record
check (stat calls; all a verified checkpoint costs at load) and the shard/index/shape/name
check (every shard header; what a load costs with KIMI_W31_SKIP_VERIFIED_CHECK=1, an
unconverted checkpoint, or to name the damage once the first check refuses).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from kimi_w31.adapter.served import structure_refusal, verified_refusal  # noqa: E402
from kimi_w31.converter.output import verified  # noqa: E402
from replica import write_converted_replica, write_source_replica  # noqa: E402


def _best(fn, runs: int = 3) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(runs):
        started = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - started)
    return best, result


def main(work: Path, shard_size: int) -> None:
    src, out = work / "replica-src", work / "replica-out"
    if not (out / "model.safetensors.index.json").exists():
        write_source_replica(src, shard_size=shard_size)
        write_converted_replica(src, out)
    shards = len(list(out.glob("*.safetensors")))
    verified.settle(out, ["structure", "checksums"], True, verified.identities(out))
    t_record, refusal = _best(lambda: verified_refusal(out, env={}))
    assert refusal is None, refusal
    t_struct, refusal = _best(lambda: structure_refusal(out, converted=True))
    assert refusal is None, refusal and refusal.render(out)
    print(f"replica: {shards} shards")
    print(f"verified checkpoint, before the first weight (stat calls): {t_record:.3f} s")
    print(f"without a proof: shard/index/shape/name check (headers): {t_struct:.3f} s")


if __name__ == "__main__":
    args = sys.argv[1:]
    size = 5_000_000_000
    if "--shard-size" in args:
        i = args.index("--shard-size")
        size = int(args[i + 1])
        del args[i : i + 2]
    main(Path(args[0]), size)

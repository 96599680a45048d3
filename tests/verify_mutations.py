"""Edit a converted output the way an accident or a tamperer would, for the verify tests.

`Model` loads a (small, synthetic) output's shards into memory, lets a test add, remove,
rename or reshape tensors, and writes everything back consistently: shard files, the
index (weight_map and total_size) and the checksums file, so that only the planted fault
is left for `verify` to find. `rerecord` forges the checksums file to match the bytes on
disk (what a careless tamperer would do); `forge_crc` patches 4 bytes of a buffer so that
its CRC-32 equals a chosen value (what a careful one would do).
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from kimi_w31.converter.safetensors_format import HeaderEntry, build_header, tensor_nbytes

INDEX = "model.safetensors.index.json"
CHECKSUMS = "kimi_w31.checksums.json"
CONFIG = "config.json"


@dataclass
class Tensor:
    dtype: str
    shape: tuple[int, ...]
    data: bytes


def read_shard(path: Path) -> tuple[dict, bytes, int]:
    """(header JSON without __metadata__, whole file bytes, data start)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    return header, raw, 8 + n


def locate(out: Path, tensor: str) -> tuple[Path, int, int]:
    """(shard path, absolute begin, end) of a tensor in an output."""
    index = json.loads((out / INDEX).read_text())
    path = out / index["weight_map"][tensor]
    header, _, start = read_shard(path)
    begin, end = header[tensor]["data_offsets"]
    return path, start + begin, start + end


def patch(out: Path, tensor: str, fn) -> None:
    """Replace a tensor's bytes in place by fn(old bytes) (same length)."""
    path, begin, end = locate(out, tensor)
    raw = bytearray(path.read_bytes())
    new = fn(bytes(raw[begin:end]))
    assert len(new) == end - begin
    raw[begin:end] = new
    path.write_bytes(bytes(raw))


class Model:
    """Every shard's tensors in memory, in file order, with the shard they live in."""

    def __init__(self, out: Path) -> None:
        self.out = out
        index = json.loads((out / INDEX).read_text())
        self.shards: dict[str, dict[str, Tensor]] = {}
        for shard in dict.fromkeys(index["weight_map"].values()):
            header, raw, start = read_shard(out / shard)
            items = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
            self.shards[shard] = {
                name: Tensor(
                    e["dtype"],
                    tuple(e["shape"]),
                    raw[start + e["data_offsets"][0] : start + e["data_offsets"][1]],
                )
                for name, e in items
            }

    def names(self) -> list[str]:
        return [n for tensors in self.shards.values() for n in tensors]

    def get(self, name: str) -> Tensor:
        return next(t[name] for t in self.shards.values() if name in t)

    def remove(self, pred) -> int:
        count = 0
        for tensors in self.shards.values():
            for name in [n for n in tensors if pred(n)]:
                del tensors[name]
                count += 1
        return count

    def add(self, name: str, tensor: Tensor, shard: str | None = None) -> None:
        self.shards[shard or next(reversed(self.shards))][name] = tensor

    def rename(self, fn) -> None:
        for shard, tensors in self.shards.items():
            self.shards[shard] = {fn(n): t for n, t in tensors.items()}

    def write(self) -> None:
        """Shards, index and checksums, all consistent with the tensors held."""
        weight_map, total = {}, 0
        for shard, tensors in self.shards.items():
            entries = [
                HeaderEntry(n, t.dtype, t.shape, tensor_nbytes(t.dtype, t.shape))
                for n, t in tensors.items()
            ]
            assert all(
                e.nbytes == len(t.data) for e, t in zip(entries, tensors.values(), strict=True)
            )
            data = b"".join(t.data for t in tensors.values())
            (self.out / shard).write_bytes(build_header(entries) + data)
            weight_map.update(dict.fromkeys(tensors, shard))
            total += len(data)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (self.out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        rerecord(self.out)


def rerecord(out: Path) -> None:
    """Rewrite the checksums file to match every recorded file as it is now on disk."""
    doc = json.loads((out / CHECKSUMS).read_text())
    for name, entry in doc["files"].items():
        path = out / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        entry["size"] = len(data)
        if "header_sha256" in entry:
            header, raw, start = read_shard(path)
            entry["header_sha256"] = hashlib.sha256(raw[:start]).hexdigest()
            spans = {n: e["data_offsets"] for n, e in header.items()}
            entry["tensors"] = {
                n: f"{zlib.crc32(raw[start + b : start + e]):08x}" for n, (b, e) in spans.items()
            }
        else:
            entry["sha256"] = hashlib.sha256(data).hexdigest()
    (out / CHECKSUMS).write_text(json.dumps(doc) + "\n")


def edit_json(path: Path, fn) -> None:
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc, indent=2) + "\n")


def forge_crc(data: bytes, target: int, at: int) -> bytes:
    """`data` with bytes [at, at+4) replaced so that zlib.crc32 of the result is `target`.

    CRC-32 is affine over GF(2): with the 4 bytes zeroed the CRC is c0, and setting bit i
    XORs in a fixed d_i. Solve sum x_i d_i = target ^ c0 by Gaussian elimination (any 32
    consecutive bits of a message can be forced).
    """
    base = bytearray(data)
    base[at : at + 4] = b"\0\0\0\0"
    c0 = zlib.crc32(base)
    rows = []  # (delta, bit mask of the unknowns that produce it)
    for bit in range(32):
        probe = bytearray(base)
        probe[at + bit // 8] |= 1 << (bit % 8)
        rows.append((zlib.crc32(probe) ^ c0, 1 << bit))
    want, solution = target ^ c0, 0
    pivots: dict[int, tuple[int, int]] = {}
    for delta, mask in rows:
        for b in range(31, -1, -1):
            if not delta >> b & 1:
                continue
            if b not in pivots:
                pivots[b] = (delta, mask)
                break
            delta, mask = delta ^ pivots[b][0], mask ^ pivots[b][1]
    for b in range(31, -1, -1):
        if want >> b & 1:
            assert b in pivots, "4 consecutive bytes always suffice"
            want ^= pivots[b][0]
            solution ^= pivots[b][1]
    base[at : at + 4] = solution.to_bytes(4, "little")
    assert zlib.crc32(base) == target
    return bytes(base)

"""Header-only replicas of the real Kimi-K3 checkpoint: real names, shapes, dtypes and
shard sizes, with tensor data left as holes (sparse files), so a 1.46 TB checkpoint costs
a few hundred MB of headers on disk. Used by the planning-scale benchmark.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kimi_w31.converter.pipeline import ConvertOptions, final_files, prepare
from kimi_w31.converter.plan import OutputTensor, Piece, pack_shards
from kimi_w31.converter.safetensors_format import tensor_nbytes
from kimi_w31.converter.synth import (
    EXTRA_FILES,
    REAL_ATTN,
    REAL_HIDDEN,
    REAL_K,
    REAL_N,
    REAL_VISION,
    SynthSpec,
    make_config,
    tensor_specs,
)

# The pinned dims of the official model, every layer a MoE layer: ~500k tensors, 1.46 TB of
# routed experts (the real config's dense prefix, if any, changes this by one layer).
REAL = SynthSpec(
    layers=93,
    dense_layers=0,
    experts=896,
    hidden=REAL_HIDDEN,
    k=REAL_K,
    n=REAL_N,
    top_k=16,
    vocab=163840,
    attn=REAL_ATTN,
    vision=REAL_VISION,
)


def _write_sparse(path: Path, header: bytes, size: int) -> None:
    with open(path, "wb") as fh:
        fh.write(header)
        fh.truncate(size)  # the rest is a hole: apparent size only


def write_source_replica(
    root: Path, spec: SynthSpec = REAL, shard_size: int = 5_000_000_000
) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    tensors = [
        OutputTensor(n, d, s, (Piece("", 0, tensor_nbytes(d, s)),), tensor_nbytes(d, s))
        for n, d, s in tensor_specs(spec)
    ]
    shards = pack_shards(tensors, shard_size)
    weight_map = {}
    for shard in shards:
        _write_sparse(root / shard.name, shard.header, shard.file_size)
        weight_map.update({t.name: shard.name for t in shard.tensors})
    index = {"metadata": {"total_size": sum(s.data_size for s in shards)}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    (root / "config.json").write_text(json.dumps(make_config(spec), indent=2))
    for name, text in EXTRA_FILES.items():
        (root / name).write_text(text)
    return {
        "tensors": len(tensors),
        "shards": len(shards),
        "apparent_bytes": sum(s.file_size for s in shards),
    }


def write_converted_replica(source_root: Path, out: Path, manifest: str = "kimi-k3") -> dict:
    """What kimi-convert would write for `source_root`, as sparse files (plan -> headers)."""
    source, m, plan = prepare(ConvertOptions(str(source_root), out, manifest=manifest))
    out.mkdir(parents=True, exist_ok=True)
    for shard in plan.shards:
        _write_sparse(out / shard.name, shard.header, shard.file_size)
    for f in final_files(source, plan, m):
        data = f.content if isinstance(f.content, bytes) else f.content.read_bytes()
        (out / f.name).write_bytes(data)
    return {"tensors": plan.tensors, "shards": len(plan.shards)}


if __name__ == "__main__":  # pragma: no cover - manual use
    import sys

    info = write_source_replica(Path(sys.argv[1]))
    print(info, os.path.getsize(sys.argv[1]) if False else "")

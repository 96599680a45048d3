"""Header-only replicas of the published Kimi-K3 checkpoint: its names, shapes, dtypes, shard
placement and headers (the safetensors library's order, no `__metadata__`), with tensor data
left as holes (sparse files), so a 1.56 TB checkpoint costs its ~76 MB of headers on disk.
Used by the planning-scale benchmark; `figures` gives the same numbers without writing.

    python tools/replica.py OUT_DIR [--real-dims] [--layers 93] [--experts 896]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import Counter
from pathlib import Path

from kimi_w31.converter.pipeline import ConvertOptions, final_files, prepare
from kimi_w31.converter.safetensors_format import tensor_nbytes
from kimi_w31.converter.synth import (
    SynthSpec,
    cli_spec,
    library_header,
    library_order,
    make_config,
    shard_groups,
    source_shard_name,
    tensor_specs,
    write_extra_files,
)

PUBLISHED_VOCAB = 163840


def replica_spec(*, real_dims: bool = True, layers: int = 93, experts: int = 896) -> SynthSpec:
    """synth's spec for these options, with the published vocabulary and top-k (a replica
    has no data, so the 2.35 GB embedding costs nothing)."""
    spec = cli_spec(
        layers=layers,
        dense_layers=None,
        moe_every=1,
        experts=experts,
        top_k=16,
        shards=None,
        real_dims=real_dims,
        k=None,
        n=None,
        seed=0,
    )
    return dataclasses.replace(spec, vocab=PUBLISHED_VOCAB)


# The published checkpoint: 93 layers (layer 0 dense), 896 experts, the real dims.
REAL = replica_spec()


def _shards(spec: SynthSpec) -> list[tuple[str, bytes, list, int]]:
    """(name, header, tensors in file order, file size) of every shard."""
    groups = shard_groups(spec, tensor_specs(spec))
    out = []
    for i, group in enumerate(groups, start=1):
        ordered = library_order(group)
        header = library_header(ordered)
        size = len(header) + sum(tensor_nbytes(d, s) for _, d, s in ordered)
        out.append((source_shard_name(i, len(groups)), header, ordered, size))
    return out


def figures(spec: SynthSpec = REAL) -> dict:
    """Tensor count, shard names, dtype census, tensor and file bytes, from headers alone."""
    shards = _shards(spec)
    tensors = [t for _, _, ordered, _ in shards for t in ordered]
    return {
        "tensors": len(tensors),
        "shards": len(shards),
        "shard_names": [name for name, *_ in shards],
        "dtypes": dict(Counter(d for _, d, _ in tensors)),
        "tensor_bytes": sum(tensor_nbytes(d, s) for _, d, s in tensors),
        "file_bytes": sum(size for *_, size in shards),
        "shard_bytes": [size for *_, size in shards],
    }


def _write_sparse(path: Path, header: bytes, size: int) -> None:
    with open(path, "wb") as fh:
        fh.write(header)
        fh.truncate(size)  # the rest is a hole: apparent size only


def write_source_replica(root: Path, spec: SynthSpec = REAL) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    weight_map, tensor_bytes = {}, 0
    shards = _shards(spec)
    for name, header, ordered, size in shards:
        _write_sparse(root / name, header, size)
        weight_map.update({t[0]: name for t in ordered})
        tensor_bytes += size - len(header)
    index = {"metadata": {"total_size": tensor_bytes}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (root / "config.json").write_text(json.dumps(make_config(spec), indent=2) + "\n")
    write_extra_files(root)
    return {
        "tensors": len(weight_map),
        "shards": len(shards),
        "apparent_bytes": sum(size for *_, size in shards),
    }


def write_converted_replica(source_root: Path, out: Path, manifest: str = "kimi-k3") -> dict:
    """What kimi-convert would write for `source_root`, as sparse files (plan -> headers)."""
    source, m, plan = prepare(ConvertOptions(str(source_root), out, manifest=manifest))
    out.mkdir(parents=True, exist_ok=True)
    for shard in plan.shards:
        _write_sparse(out / shard.name, shard.header, shard.file_size)
    for f in final_files(source, plan, m):
        data = f.content if isinstance(f.content, bytes) else f.content.read_bytes()
        path = out / f.name
        path.parent.mkdir(parents=True, exist_ok=True)  # a file in a subfolder (assets/)
        path.write_bytes(data)
    return {"tensors": plan.tensors, "shards": len(plan.shards)}


def main() -> None:  # pragma: no cover - manual use
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, nargs="?", help="write the replica here")
    parser.add_argument("--real-dims", action="store_true")
    parser.add_argument("--layers", type=int, default=93)
    parser.add_argument("--experts", type=int, default=896)
    args = parser.parse_args()
    spec = replica_spec(real_dims=args.real_dims, layers=args.layers, experts=args.experts)
    info = figures(spec)
    del info["shard_names"], info["shard_bytes"]
    print(json.dumps(info))
    if args.out:
        print(json.dumps(write_source_replica(args.out, spec)))


if __name__ == "__main__":  # pragma: no cover
    main()

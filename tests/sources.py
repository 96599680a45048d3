"""Sources made of parsed headers alone: the validator and the planner never need bytes."""

from __future__ import annotations

from pathlib import Path

from kimi_w31.converter.safetensors_format import ShardHeader, TensorInfo, tensor_nbytes
from kimi_w31.converter.source import Source
from kimi_w31.converter.synth import SynthSpec, make_config, tensor_specs

Tensor = tuple[str, str, tuple[int, ...]]


def header_only_source(
    tensors: list[Tensor], config: dict, files: int = 1, placement: dict[str, int] | None = None
) -> Source:
    """Tensors spread round-robin over `files` shards (or as `placement` says), in order."""
    per_file: dict[str, list[Tensor]] = {}
    for i, t in enumerate(tensors):
        n = (placement or {}).get(t[0], i % files)
        per_file.setdefault(f"s{n}.safetensors", []).append(t)
    headers = {}
    for file, items in sorted(per_file.items()):
        data_start = cursor = 64
        infos = {}
        for name, dtype, shape in items:
            size = tensor_nbytes(dtype, shape)
            infos[name] = TensorInfo(name, dtype, shape, cursor, cursor + size)
            cursor += size
        headers[file] = ShardHeader(file, cursor, data_start, infos, {}, f"sha-{file}")
    return Source(Path("/nonexistent"), "headers-only", config, sorted(headers), headers)


def synth_source(spec: SynthSpec, files: int = 2, **placement: int) -> tuple[Source, list]:
    """The tensors `synth` would write for `spec`, as a header-only source."""
    tensors = tensor_specs(spec)
    return header_only_source(tensors, make_config(spec), files, placement or None), tensors

"""What a complete output holds besides its shards and its checksums file: the source's
other files, `config.json` and the index, computed from the source and the plan before
any byte of output is written (so a source problem found here changes nothing)."""

from __future__ import annotations

import json

from ... import __version__
from .. import contract
from ..hashing import sha256_bytes, sha256_identified
from ..manifest import Manifest
from ..plan import Plan
from ..source import Source
from .records import FinalFile, FinalFiles


def final_files(
    source: Source, plan: Plan, manifest: Manifest, name: str | None = None
) -> FinalFiles:
    """The source's other files, config.json and the index, computed before any write."""
    identity = {
        # Published: a repo id or the source directory's own name, never a path of this
        # machine (`source_id`).
        "path": name if name is not None else source.root.name,
        "files": {
            f: {"size": h.file_size, "header_sha256": h.header_sha256}
            for f, h in sorted(source.headers.items())
        },
    }
    situ = {
        k: float(contract.config_value(source.config, v))
        for k, v in contract.SITU_CONFIG_KEYS.items()
    }
    block = contract.make_block(
        **situ,
        converter=f"kimi-w31 {__version__}",
        manifest=manifest.name,
        manifest_sha256=manifest.sha256,
        source=identity,
        dims=plan.dims.values,
    )
    config = contract.converted_config(source.config, block)
    index = {"metadata": {"total_size": plan.total_size}, "weight_map": plan.weight_map()}
    extras, derived_from = [], dict(source.read_identity)
    for rel in source.extra_files:
        sha256, seen = sha256_identified(source.root / rel)
        extras.append(FinalFile(rel, seen[0], sha256, source.root / rel))
        derived_from[rel] = seen
    return FinalFiles(
        extras,
        config=_json_file(contract.CONFIG_NAME, json.dumps(config, indent=2, ensure_ascii=False)),
        index=_json_file(contract.INDEX_NAME, json.dumps(index, indent=2)),
        derived_from=derived_from,
    )


def _json_file(name: str, doc: str) -> FinalFile:
    data = (doc + "\n").encode()
    return FinalFile(name, len(data), sha256_bytes(data), data)

"""Sources the planner must refuse against the manifest: shapes, partners, layers, names."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from kimi_w31.converter.reasons import Code

from .core import (
    INDEX,
    C,
    Case,
    hostile_cases,
    read_shard,
    shard_bytes,
)


def _config_edit(fn: Callable[[dict], None]):
    def mutate(src: Path) -> None:
        config = json.loads((src / "config.json").read_text())
        fn(config)
        (src / "config.json").write_text(json.dumps(config))

    return mutate


def _expert(config_key: str, fn: Callable[[dict, str], None]):
    """Edit the header of the shard holding the first tensor whose name contains `key`."""

    def mutate(src: Path) -> None:
        index = json.loads((src / INDEX).read_text())
        tensor = next(t for t in index["weight_map"] if config_key in t)
        path = src / index["weight_map"][tensor]
        header, data = read_shard(path)
        fn(header, tensor)
        path.write_bytes(shard_bytes(header, data))

    return mutate


def _reshape(header: dict, tensor: str) -> None:
    # Same byte count, wrong shape: only the manifest can tell.
    rows, cols = header[tensor]["shape"]
    header[tensor]["shape"] = [rows * 2, cols // 2]


def _retype(header: dict, tensor: str) -> None:
    header[tensor].update(dtype="I8")


def _rename_index(old_part: str, new_part: str) -> Callable[[Path], None]:
    """Rename every tensor containing old_part, in the header and in the index."""

    def mutate(src: Path) -> None:
        index = json.loads((src / INDEX).read_text())
        renamed = {}
        for t, f in list(index["weight_map"].items()):
            if old_part in t:
                path = src / f
                header, data = read_shard(path)
                new = t.replace(old_part, new_part)
                header[new] = header.pop(t)
                path.write_bytes(shard_bytes(header, data))
                renamed[t] = new
        index["weight_map"] = {renamed.get(t, t): f for t, f in index["weight_map"].items()}
        (src / INDEX).write_text(json.dumps(index))

    return mutate


def _chain(*fns: Callable[[Path], None]) -> Callable[[Path], None]:
    def mutate(src: Path) -> None:
        for fn in fns:
            fn(src)

    return mutate


def _drop_partner(src: Path) -> None:
    """Rename one w3 to a non-expert name: its w1 then has no partner."""
    _rename_index(
        ".block_sparse_moe.experts.1.w3.weight_packed",
        ".block_sparse_moe.experts.1.w9.weight_packed",
    )(src)


def _wrap_quantization(config: dict) -> None:
    text = config["text_config"]  # published: the one quantization_config is in text_config
    text["quantization_config"] = {
        "quant_method": "kimi_w31",
        "base": text["quantization_config"],
    }


PLAN_CASES: dict[str, tuple[Callable[[Path], None], Code]] = {
    "wrong expert shape": (_expert(".experts.3.w1.weight_packed", _reshape), C.EXPERT_SHAPE),
    "wrong expert dtype": (_expert(".experts.3.w2.weight_scale", _retype), C.EXPERT_DTYPE),
    "w3 partner missing": (_drop_partner, C.EXPERT_PARTNER_MISSING),
    "expert id beyond num_experts": (
        _rename_index(".experts.7.", ".experts.9."),
        C.EXPERT_ID_RANGE,
    ),
    "a layer misses an expert": (
        _rename_index(
            "layers.1.block_sparse_moe.experts.5.", "layers.1.block_sparse_moe.xperts.5."
        ),
        C.LAYER_INCOMPLETE,
    ),
    "no quantization_config": (
        _config_edit(lambda c: c["text_config"].pop("quantization_config")),
        C.NO_QUANTIZATION_CONFIG,
    ),
    "hidden_act is not situ": (
        _config_edit(lambda c: c["text_config"].update(hidden_act="silu")),
        C.SITU_MISMATCH,
    ),
    "SiTU beta disagrees with the manifest": (
        _config_edit(lambda c: c["text_config"].update(activation_situ_beta=5.0)),
        C.SITU_MISMATCH,
    ),
    # -- missing structure: the MoE-layer rule over num_hidden_layers
    "a whole MoE layer without experts (index and headers agree)": (
        _rename_index("layers.2.block_sparse_moe.experts.", "layers.2.block_sparse_moe.xperts."),
        C.LAYER_MISSING,
    ),
    "experts under a layer beyond num_hidden_layers": (
        _rename_index("layers.2.block_sparse_moe.experts.", "layers.7.block_sparse_moe.experts."),
        C.LAYER_UNEXPECTED,
    ),
    "experts in a dense layer (first_k_dense_replace)": (
        _config_edit(lambda c: c["text_config"].update(first_k_dense_replace=2)),
        C.LAYER_UNEXPECTED,
    ),
    "experts off the moe_layer_freq cadence": (
        _config_edit(lambda c: c["text_config"].update(moe_layer_freq=2)),
        C.LAYER_UNEXPECTED,
    ),
    "routed experts named gate_proj/up_proj/down_proj": (
        _chain(
            _rename_index(".w1.weight_", ".gate_proj.weight_"),
            _rename_index(".w3.weight_", ".up_proj.weight_"),
            _rename_index(".w2.weight_", ".down_proj.weight_"),
        ),
        C.NO_EXPERTS,
    ),
    # -- names the grammar must refuse as a whole
    "expert name with a trailing newline": (
        _rename_index(
            "layers.1.block_sparse_moe.experts.4.w1.weight_packed",
            "layers.1.block_sparse_moe.experts.4.w1.weight_packed\n",
        ),
        C.EXPERT_NAME,
    ),
    "expert id with a leading zero": (_rename_index(".experts.6.", ".experts.06."), C.EXPERT_NAME),
    "expert id in look-alike digits": (
        _rename_index(".experts.6.", ".experts.\u0666."),
        C.EXPERT_NAME,
    ),
    "fused w31 already in the source": (
        _rename_index(".experts.2.w1.", ".experts.2.w31."),
        C.EXPERT_TENSOR_UNEXPECTED,
    ),
    # -- a config that already carries our markers
    "config already has a kimi_w31 block": (
        _config_edit(lambda c: c.update(kimi_w31={"format_version": 1})),
        C.ALREADY_MARKED,
    ),
    "quantization_config already wrapped as kimi_w31": (
        _config_edit(_wrap_quantization),
        C.ALREADY_MARKED,
    ),
}


def plan_cases(template: Path, work: Path) -> list[Case]:
    rows = hostile_cases(template, work, "manifest / planner mismatch", PLAN_CASES)
    # The official manifest's pins against a scaled-down source: every mismatch reported.
    rows += hostile_cases(
        template,
        work / "pinned",
        "manifest / planner mismatch",
        {"pinned manifest vs scaled-down source": (lambda src: None, C.PINNED_MISMATCH)},
        manifest=[],
    )
    return rows

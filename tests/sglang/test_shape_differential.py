"""The non-expert shapes the converter derives from the config (converter/shapes.py) against
the model SGLang 0.5.23 builds: KimiK3ForConditionalGeneration on CPU, for a table of
generated configs over the dims (MLA heads, head dims and LoRA ranks, Q with and without
LoRA, KDA heads/head dim/conv size, full-rank and LoRA gates, dense and shared-expert
intermediate sizes, experts, latent MoE with and without its norm, attention residuals on
and off, the output gate, layer kinds and cadence, vision depth and widths).

For every tensor the kimi-k3 inventory requires, a tensor of each shape the rule accepts is
loaded by the model's own `load_weights` into a NaN-filled model (shape_probe.py): it must
load without error and fill exactly as many elements as its parameter slice holds; all of
them together fill every parameter (no element twice, none left: no other shape would), the
routed experts' parameters aside. A negative control per config: one dimension off is
refused by SGLang, or fills another number of elements, or is zero-padded into its slice,
or has part of it dropped, so the measurement can fail. SGLang itself does not refuse most
of these: a merged parameter's slice is zero-padded from a tensor too short for it
(`gate_proj`/`up_proj`), and a row- or column-parallel linear narrows a tensor too long
for it (`o_proj`, `down_proj`, `gate_proj` one row or column over), silently. Only the
derived shapes (`inventory-shape`) refuse them.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
from kimi_w31.converter.manifest import expected_inventory, load_manifest
from kimi_w31.converter.shapes import VISION_DEFAULTS, shape_rule
from kimi_w31.converter.synth import AttnDims, SynthSpec, VisionDims, make_config

pytestmark = pytest.mark.sglang

PROBE = Path(__file__).with_name("shape_probe.py")
INVENTORY = load_manifest("kimi-k3").inventory
# Parameters no non-expert checkpoint tensor is for: the routed experts' (the contract's,
# held to SGLang by test_whole_model.py), SGLang's zero expert biases among them.
EXPERT_PARAMS = (".mlp.experts.",)


def _config(spec: SynthSpec, **text) -> dict:
    config = make_config(spec)
    for key, value in text.items():
        if value is ...:
            config["text_config"].pop(key, None)
        elif key == "linear_attn_config":
            config["text_config"][key].update(value)
        else:
            config["text_config"][key] = value
    return config


def _kda(layers: int, mla: set[int]) -> dict:
    return {
        "kda_layers": [i + 1 for i in range(layers) if i not in mla],
        "full_attn_layers": [i + 1 for i in sorted(mla)],
    }


# K and N stay 256 (a size SGLang's MXFP4 MoE method takes on every arch); everything
# else varies. Vocabularies are multiples of 64 (SGLang pads the embedding to 64 rows).
CASES = {
    "synth's layout": _config(SynthSpec(layers=4, experts=4, k=256, n=256, hidden=512)),
    "q without LoRA, LoRA gate, no residuals, no shared experts": _config(
        SynthSpec(
            layers=3,
            experts=4,
            k=256,
            n=256,
            hidden=384,
            vocab=128,
            attn=AttnDims(
                heads=2,
                kv_lora_rank=32,
                qk_nope_head_dim=16,
                qk_rope_head_dim=8,
                v_head_dim=24,
                kda_heads=2,
                kda_head_dim=16,
                conv_size=3,
                intermediate=192,
                shared_experts=0,
            ),
            vision=VisionDims(layers=0),
        ),
        q_lora_rank=None,
        attn_res_block_size=...,
        mla_use_output_gate=False,
        latent_moe_use_norm=False,
        linear_attn_config={"use_full_rank_gate": False},
    ),
    "no latent MoE, two shared experts, MoE every other layer, A_log narrower than heads": _config(
        SynthSpec(
            layers=5,
            dense_layers=0,
            moe_every=2,
            experts=8,
            k=256,
            n=256,
            hidden=256,
            vocab=192,
            attn=AttnDims(
                heads=4,
                q_lora_rank=48,
                qk_nope_head_dim=8,
                qk_rope_head_dim=16,
                v_head_dim=8,
                kda_heads=6,
                kda_head_dim=8,
                conv_size=2,
                intermediate=320,
                shared_experts=2,
            ),
            vision=VisionDims(hidden=32, heads=2, qkv=48, intermediate=80, layers=2, patch=8),
        ),
        routed_expert_hidden_size=None,
        latent_moe_use_norm=False,
        linear_attn_config=_kda(5, {0, 4}),
    ),
    "A_log padded to head_dim, all-MLA and all-KDA neighbours, deeper vision": _config(
        SynthSpec(
            layers=4,
            experts=4,
            k=256,
            n=256,
            hidden=512,
            attn=AttnDims(
                heads=5,
                q_lora_rank=96,
                kv_lora_rank=80,
                qk_nope_head_dim=16,
                qk_rope_head_dim=8,
                v_head_dim=16,
                kda_heads=3,
                kda_head_dim=16,
                conv_size=4,
                intermediate=256,
                shared_experts=1,
                attn_res_block=3,
            ),
            vision=VisionDims(hidden=48, heads=3, qkv=96, intermediate=64, layers=3, pos_emb=6),
        ),
        linear_attn_config=_kda(4, {1}),
    ),
}


def _generated(seed: int) -> dict:
    """A config drawn over the dims (within what SGLang builds: even RoPE and head dims)."""
    rng = random.Random(seed)
    layers = rng.randint(2, 6)
    dense, freq = rng.randint(0, min(2, layers - 1)), rng.choice([1, 1, 2])
    if not [i for i in range(layers) if i >= dense and i % freq == 0]:
        freq = 1
    latent = rng.random() < 0.7
    hidden = rng.choice([256, 384, 512]) if latent else rng.choice([256, 512])
    mla = {i for i in range(layers) if rng.random() < 0.4}
    spec = SynthSpec(
        layers=layers,
        dense_layers=dense,
        moe_every=freq,
        experts=rng.choice([4, 8]),
        k=256,
        n=256,
        hidden=hidden,
        vocab=64 * rng.randint(1, 4),
        attn=AttnDims(
            heads=rng.choice([1, 2, 4, 8]),
            q_lora_rank=16 * rng.randint(1, 6),
            kv_lora_rank=16 * rng.randint(1, 6),
            qk_nope_head_dim=rng.choice([8, 16, 24]),
            qk_rope_head_dim=rng.choice([8, 16]),
            v_head_dim=rng.choice([8, 16, 24]),
            kda_heads=rng.randint(1, 6),
            kda_head_dim=rng.choice([8, 16, 32]),
            conv_size=rng.randint(2, 4),
            intermediate=64 * rng.randint(1, 5),
            shared_experts=rng.randint(0, 2),
            attn_res_block=rng.randint(1, 3),
        ),
        vision=VisionDims(
            hidden=rng.choice([16, 32, 48]),
            heads=2,
            qkv=rng.choice([16, 32, 64]),
            intermediate=rng.choice([32, 48]),
            layers=rng.randint(0, 2),
            patch=rng.choice([2, 14]),
            pos_emb=rng.randint(1, 4),
        ),
    )
    return _config(
        spec,
        q_lora_rank=rng.choice([None, spec.attn.q_lora_rank]),
        attn_res_block_size=rng.choice([..., spec.attn.attn_res_block]),
        mla_use_output_gate=rng.random() < 0.5,
        latent_moe_use_norm=rng.random() < 0.5,
        routed_expert_hidden_size=spec.k if latent else None,
        linear_attn_config={**_kda(layers, mla), "use_full_rank_gate": rng.random() < 0.5},
    )


CASES.update({f"generated (seed {seed})": _generated(seed) for seed in range(4)})


def _cases(tmp: Path, seed: int) -> tuple[list[dict], list[dict]]:
    """The probe's cases and, per case, what the rule expects of each tensor."""
    rng = random.Random(seed)
    cases, expected = [], []
    for i, config in enumerate(CASES.values()):
        model = tmp / f"m{i}"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(config))
        rule = shape_rule(config, _moe_layers(config))
        names = sorted(expected_inventory(INVENTORY, config))
        judged = {name: rule.judge(name) for name in names}
        assert [n for n, j in judged.items() if j is None] == [], "the rule must know them all"
        accepted = {name: j[1] for name, j in judged.items()}
        tensors = [[name, list(s)] for name, shapes in accepted.items() for s in shapes]
        negatives = []
        for name in rng.sample(names, 6):
            shape = list(accepted[name][0])
            axis = rng.randrange(len(shape))
            shape[axis] = rng.choice([shape[axis] + 1, max(1, shape[axis] // 2)])
            if tuple(shape) not in accepted[name]:
                negatives.append([name, shape])
        whole = [[name, list(shapes[0])] for name, shapes in accepted.items()]
        cases.append({"dir": str(model), "tensors": tensors + negatives, "whole": whole})
        expected.append({"accepted": accepted, "negatives": negatives})
    return cases, expected


def _moe_layers(config: dict) -> list[int]:
    from kimi_w31.converter import contract

    rule, problems = contract.layer_rule(config)
    assert problems == []
    return rule.moe


@pytest.fixture(scope="module")
def probed(tmp_path_factory) -> tuple[list[dict], list[dict]]:
    tmp = tmp_path_factory.mktemp("shapes")
    cases, expected = _cases(tmp, seed=0)
    (tmp / "cases.json").write_text(json.dumps(cases))
    proc = subprocess.run(
        [sys.executable, str(PROBE), str(tmp / "cases.json"), str(tmp / "out.json")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads((tmp / "out.json").read_text()), expected


def _fill(accepted: list[tuple[int, ...]]) -> int:
    """Elements a tensor of any accepted shape fills: its parameter slice (the first shape;
    a longer A_log fills its first `num_heads` entries)."""
    return math.prod(accepted[0])


@pytest.mark.parametrize("case", range(len(CASES)), ids=list(CASES))
def test_each_derived_shape_fills_its_parameter_slice_exactly(probed, case):
    reports, expected = probed
    report, want = reports[case], expected[case]
    assert report["model_class"] == "KimiK3ForConditionalGeneration"
    negatives = {(n, tuple(s)) for n, s in want["negatives"]}
    bad = []
    for m in report["measured"]:
        name, shape = m["name"], tuple(m["shape"])
        if (name, shape) in negatives:
            continue
        fill = _fill(want["accepted"][name])
        if m["error"] is not None or sum(m["written"].values()) != fill or m["other"]:
            bad.append((name, shape, m["error"], m["written"], m["other"], fill))
    assert bad == []


@pytest.mark.parametrize("case", range(len(CASES)), ids=list(CASES))
def test_the_derived_tensors_fill_every_parameter_once(probed, case):
    reports, expected = probed
    report, want = reports[case], expected[case]
    assert report["whole_errors"] == []
    params = report["params"]
    non_expert = {n: s for n, s in params.items() if not any(e in n for e in EXPERT_PARAMS)}
    assert non_expert and len(non_expert) < len(params)
    assert {n for n in report["unwritten"] if n in non_expert} == set()
    # each element written once: the isolated fills add up to exactly the parameters' size
    firsts = {(n, tuple(s[0])) for n, s in want["accepted"].items()}
    filled = sum(
        sum(m["written"].values())
        for m in report["measured"]
        if (m["name"], tuple(m["shape"])) in firsts
    )
    assert filled == sum(math.prod(s) for s in non_expert.values())


@pytest.mark.parametrize("case", range(len(CASES)), ids=list(CASES))
def test_negative_control_a_wrong_dimension_is_seen(probed, case):
    reports, expected = probed
    report, want = reports[case], expected[case]
    negatives = {(n, tuple(s)) for n, s in want["negatives"]}
    assert negatives
    measured = [m for m in report["measured"] if (m["name"], tuple(m["shape"])) in negatives]
    unseen = [
        m
        for m in measured
        if m["error"] is None
        and not m["other"]
        and sum(m["written"].values()) == _fill(want["accepted"][m["name"]])
        and sum(m["written"].values()) == math.prod(m["shape"])  # nothing of it dropped
    ]
    assert len(measured) == len(negatives) and unseen == []


def test_the_defaults_the_rule_reads_are_sglangs():
    """Fields a config leaves out take SGLang's defaults (KimiLinearConfig,
    KimiK3VisionConfig): the rule's tables of them agree."""
    from kimi_w31.converter.contract import TEXT_DEFAULTS
    from sglang.srt.configs.kimi_k3 import KimiK3VisionConfig
    from sglang.srt.configs.kimi_linear import KimiLinearConfig

    text, vision = KimiLinearConfig(), KimiK3VisionConfig()
    assert {k: getattr(text, k) for k in TEXT_DEFAULTS} == TEXT_DEFAULTS
    got = {k: getattr(vision, k) for k in VISION_DEFAULTS}
    got["merge_kernel_size"] = list(got["merge_kernel_size"])
    assert got.pop("mm_hidden_size") == vision.vt_hidden_size  # None: the tower's width
    assert got == {k: v for k, v in VISION_DEFAULTS.items() if k != "mm_hidden_size"}
    assert VISION_DEFAULTS["mm_hidden_size"] is None


def test_the_rule_spells_names_as_sglangs_mapper():
    from kimi_w31.converter.shapes import canonical_name
    from sglang.srt.models.kimi_k3 import KimiK3ForConditionalGeneration

    mapper = KimiK3ForConditionalGeneration.hf_to_sglang_mapper
    names = [
        "language_model.layers.1.block_sparse_moe.gate.weight",
        "language_model.model.layers.1.block_sparse_moe.shared_experts.up_proj.weight",
        "language_model.layers.0.mlp.down_proj.weight",
        "language_model.model.embed_tokens.weight",
        "vision_tower.encoder.blocks.0.wqkv.weight",
    ]
    assert [n for n, _ in mapper.apply((n, None) for n in names)] == list(
        map(canonical_name, names)
    )

"""verify --numerics: the same experts computed from source and converted semantics.

Source semantics: w1 is gate, w3 is up, betas from the source config. Converted semantics:
w31 split by `kimi_w31.fc1_order`, betas from the `kimi_w31` block. Both dequantize MXFP4
and run the SiTU expert MLP in fp32 on the same random inputs; the outputs must agree to
fp32 rounding. Swapped halves or swapped betas fail here even if every byte "moved right".
"""

from __future__ import annotations

import random

from .config_rewrite import BLOCK_KEY
from .errors import Problem
from .manifest import config_value

RTOL = 1e-5  # identical bytes through identical fp32 ops: only rounding may differ


def compare_experts(conv, source, sample: int | None, seed: int) -> tuple[list[Problem], str]:
    try:
        import torch
        from safetensors import safe_open
    except ImportError:
        return [Problem("verify --numerics needs torch (pip install 'kimi-w31[numerics]')")], ""
    from . import reference as ref

    manifest = conv.manifest
    block = conv.config.get(BLOCK_KEY) or {}
    keys = manifest.raw["situ"]["config_keys"]
    src_beta = float(config_value(source.config, keys["beta"]))
    src_lin = float(config_value(source.config, keys["linear_beta"]))
    try:
        out_beta, out_lin = float(block["situ_beta"]), float(block["situ_linear_beta"])
        order = list(block["fc1_order"])
        ref.split_w31(torch.zeros(2, 1), order)
    except (KeyError, TypeError, ValueError) as exc:
        return [Problem(f"kimi_w31 block unusable for numerics ({exc})", file="config.json")], ""

    k = int(config_value(source.config, manifest.raw["dims"]["K"]))
    num_experts = int(config_value(source.config, manifest.raw["dims"]["E"]))
    layers = sorted({n.split("experts.")[0] for n in conv.weight_map if ".w31." in n})
    chosen = [(layer, e) for layer in layers for e in range(num_experts)]
    if sample is not None and sample < len(chosen):
        chosen = sorted(random.Random(seed).sample(chosen, sample))

    def load(root, weight_map, name):
        with safe_open(str(root / weight_map[name]), framework="pt") as fh:
            return fh.get_tensor(name)

    gen = torch.Generator().manual_seed(seed)
    problems: list[Problem] = []
    worst = 0.0
    for layer, e in chosen:
        p = f"{layer}experts.{e}."
        try:
            src = ref.dequant_expert(
                *[(load(source.root, source.weight_map, f"{p}{w}.weight_packed"),
                   load(source.root, source.weight_map, f"{p}{w}.weight_scale"))
                  for w in ("w1", "w3", "w2")]
            )  # fmt: skip
            conv_exp = ref.dequant_converted_expert(
                (load(conv.root, conv.weight_map, f"{p}w31.weight_packed"),
                 load(conv.root, conv.weight_map, f"{p}w31.weight_scale")),
                (load(conv.root, conv.weight_map, f"{p}w2.weight_packed"),
                 load(conv.root, conv.weight_map, f"{p}w2.weight_scale")),
                order,
            )  # fmt: skip
        except (KeyError, ValueError) as exc:
            problems.append(Problem(f"cannot load expert for numerics ({exc})", tensor=p + "*"))
            continue
        x = torch.randn(16, k, generator=gen)
        want = ref.expert_forward(x, src, src_beta, src_lin)
        got = ref.expert_forward(x, conv_exp, out_beta, out_lin)
        scale = want.abs().max().item() or 1.0
        err = (got - want).abs().max().item() / scale
        worst = max(worst, err)
        if not err <= RTOL:
            stats = ref.compare(got, want)
            problems.append(Problem(
                "converted expert computes a different function than the source expert",
                tensor=p + "w31", expected=f"relative max error <= {RTOL:g}",
                found=f"{err:.3g} (cosine {stats['cosine']:.6f})"))  # fmt: skip
    detail = f"{len(chosen)} experts, SiTU({out_beta:g}, {out_lin:g}), worst rel. error {worst:.2g}"
    return problems, detail

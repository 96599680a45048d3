"""The config, and the routed experts and MoE layers it promises."""

from __future__ import annotations

from ..errors import Message, Reason

REASONS = (
    # -- the config
    Reason(
        "no-quantization-config",
        rules={
            "source": Message("config has no quantization_config: this is not an MXFP4 checkpoint"),
            "output": Message("config has no quantization_config"),
        },
    ),
    # A converted checkpoint given as a source lacks every w1/w3 and holds w31.
    Reason(
        "already-marked",
        "config already carries the kimi_w31 markers: this checkpoint is converted "
        "already, or tampered with",
        expected="no kimi_w31 block or wrapper",
        found="{marks}",
        implies=frozenset(
            {"expert-tensor-unexpected", "expert-partner-missing", "layer-incomplete", "no-experts"}
        ),
    ),
    # A config field the layer rule cannot read makes every expert layer "not a MoE layer".
    Reason(
        "config-field",
        rules={
            "text-config": Message(
                "text_config must be an object (SGLang builds the text model from it)",
                found="{kind}",
            ),
            "top-level": Message(
                "config field {key} at the top level of a {model_type} config: SGLang takes it "
                "from text_config only and cannot load this config",
                found="{value!r}",
            ),
            "integer": Message(
                "config field {key} must be an integer >= {minimum}", found="{value}"
            ),
            "num-experts": Message(
                "config field {key} must be an integer >= {minimum} (without it SGLang builds "
                "no MoE layer)",
                found="{value}",
            ),
            "positive": Message(
                "config field {key} is missing or not a positive integer", found="{value}"
            ),
            "group": Message(
                "{key} is not a multiple of the MXFP4 group size {group}", found="{value}"
            ),
        },
        implies=frozenset(
            {
                "layer-unexpected",
                "layer-missing",
                "layer-incomplete",
                "expert-id-range",
                "expert-shape",
                "no-experts",
            }
        ),
    ),
    Reason(
        "pinned-mismatch",
        "config field {key} does not match manifest {manifest}",
        expected="{want!r}",
        found="{value!r}",
    ),
    Reason(
        "situ-mismatch",
        rules={
            "hidden-act": Message(
                "config's hidden_act is not 'situ': the converted block would announce an "
                "activation the model does not use",
                expected="'situ'",
                found="{act!r}",
            ),
            "not-numeric": Message(
                "config has no numeric {key}", expected="{want!r}", found="{value!r}"
            ),
            "value": Message(
                "{key} does not match manifest {manifest}", expected="{want!r}", found="{value!r}"
            ),
        },
    ),
    # one field said twice, two ways (alias, top level)
    Reason(
        "config-conflict",
        rules={
            "alias": Message(
                "config fields {first} and {second} give one value two ways (SGLang reads "
                "both, in different places)",
                expected="{first} = {first_value!r}",
                found="{second} = {second_value!r}",
            ),
            "top-level": Message(
                "config field {key} at the top level disagrees with what SGLang's Kimi-K3 "
                "model reads (text_config.{key}, or its default); it never reads the top-level "
                "copy",
                expected="{want!r}",
                found="{value!r}",
            ),
        },
    ),
    # a size beyond what the checkpoint can hold
    Reason(
        "config-bound",
        "config describes more routed experts than the checkpoint has tensors",
        expected="{field} <= {bound}",
        found="{value}",
    ),
    # -- routed experts and MoE layers
    Reason(
        "expert-name",
        rules={
            "source": Message(
                "tensor under an 'experts' component that is not a routed-expert tensor of the "
                "contract's grammar",
                expected="{grammar}",
                found="{tail!r}",
            ),
            "output": Message(
                "tensor under an 'experts' component is not a routed-expert tensor of the "
                "contract's grammar",
                expected="experts.<id>.<w31|w2>.<weight_packed|weight_scale>",
            ),
        },
    ),
    Reason(
        "expert-id-range",
        rules={
            "expert": Message("expert id out of range", expected="< {experts}", found="{expert}"),
            "layer": Message(
                "expert ids beyond the config's num_experts",
                expected="ids 0..{last}",
                found="ids {ids}",
            ),
        },
    ),
    # A w1/w3 left beside its w31: the names reaching one parameter follow.
    Reason(
        "expert-tensor-unexpected",
        rules={
            "source": Message("{why}", expected="{allowed}", found="{key}"),
            "output": Message(
                "w1/w3 expert tensor left in a converted checkpoint (it must be fused into w31)"
            ),
            "loaded": Message(
                "config.json announces the kimi_w31 layout, but the checkpoint also has "
                "unfused w1/w3 expert tensors under {layers}: it is a partial or mixed "
                "conversion",
                hint="convert it again from the source and run `kimi-convert verify`",
            ),
        },
        implies=frozenset({"no-experts", "name-collision"}),
    ),
    Reason("expert-dtype", "wrong dtype", expected="{want}", found="{dtype}"),
    Reason("expert-shape", "wrong shape", expected="{want}", found="{shape}"),
    Reason(
        "expert-partner-missing",
        rules={
            "expert": Message("expert tensor is missing (its partners exist)"),
            "plan": Message("w1/w3 half without its partner"),
            "source-half": Message(
                "the source lacks a half of this w31 (w3 = up, w1 = gate)",
                expected="both halves in the source",
                found="{missing}",
            ),
        },
    ),
    # Experts that exist but sit where no MoE layer loads them are not "no experts".
    Reason(
        "expert-outside-layer",
        "routed experts outside a 'layers.<i>.' component: no layer would load them",
        implies=frozenset({"no-experts"}),
    ),
    Reason(
        "layer-missing",
        "{count} MoE layer(s) have no routed experts at all",
        expected="experts in MoE layers {layers}",
        found="none in layers {missing}",
    ),
    Reason(
        "layer-incomplete",
        rules={
            # A checkpoint's layer lacks whole experts (convert, verify).
            "experts": Message(
                "MoE layer is missing {count} of {experts} experts",
                expected="ids 0..{last}",
                found="missing {missing}",
            ),
            # A serving process's layers did not receive every part of their local experts
            # (the adapter's load): `report` lists them, part by part.
            "loaded-converted": Message(
                "{report}\nThese experts would run with zero weights or default scales, so the "
                "load stops",
                hint="run `kimi-convert verify` on the checkpoint, or convert it again from "
                "the source",
            ),
            "loaded-source": Message(
                "{report}\nThese experts would run with zero weights or default scales, so the "
                "load stops",
                hint="download or copy the checkpoint again: some of its expert tensors are "
                "missing",
            ),
        },
    ),
    # Experts that exist but sit where no MoE layer loads them are not "no experts".
    Reason(
        "layer-unexpected",
        "layer {layer} is not a MoE layer under the config's rule (num_hidden_layers, "
        "first_k_dense_replace, moe_layer_freq) but has routed experts",
        implies=frozenset({"no-experts"}),
    ),
    # A layer's experts under two spellings: the names reaching one parameter follow.
    Reason(
        "layer-duplicated",
        "layer {layer} has routed experts under two prefixes",
        expected="only {prefix}experts.*",
        implies=frozenset({"no-experts", "name-collision"}),
    ),
    Reason(
        "no-experts",
        rules={
            "source": Message(
                "no routed-expert tensors found: not a Kimi-K3 MXFP4 checkpoint",
                expected="experts.<id>.<w1|w2|w3>.<weight_packed|weight_scale> tensors in "
                "every MoE layer",
            ),
            "output": Message(
                "no routed-expert tensors under the contract's grammar: not a converted "
                "Kimi-K3 MXFP4 checkpoint",
                expected="experts.<id>.<w31|w2>.<weight_packed|weight_scale> in every MoE layer",
            ),
        },
    ),
    Reason(
        "inventory-missing",
        "tensor the model loads is missing{where}",
        expected="present (manifest {manifest})",
    ),
    Reason(
        "inventory-dtype",
        "{place} tensor is not stored unquantized: the model loads it with an unquantized method",
        expected="{dtypes}",
        found="{dtype}",
    ),
    Reason(
        "inventory-shape",
        "{place} tensor has another shape than the config gives it: SGLang would copy it "
        "into part of its parameter, or refuse it",
        expected="{want}",
        found="{shape}",
    ),
)

"""Serving a checkpoint (the adapter's `kimi-convert serve`): its command line and the
checks it runs before it starts SGLang."""

from __future__ import annotations

from ...converter.errors import EXIT_USAGE, Message, Reason

REASONS = (
    Reason(
        "ambiguous-flag",
        "{name} after -- is ambiguous (it abbreviates {options}): write the option in full",
        exit=EXIT_USAGE,
    ),
    Reason(
        "bad-flag",
        rules={
            "no-value": Message("{flag} after -- has no value"),
            "not-integer": Message("{flag} {value!r} after -- is not an integer"),
            "not-number": Message("{flag} {value!r} after -- is not a number"),
            "at-least-one": Message("--{name} {value}: must be at least 1"),
            "ep-divides-tp": Message("--tp {tp} / --ep {ep}: --ep must divide --tp"),
            "moe-dp": Message(
                "--tp {tp} / --ep {ep} / --moe-dp-size {moe_dp}: SGLang needs --moe-dp-size "
                "to divide --tp, and --ep x --moe-dp-size to equal --tp when --ep > 1"
            ),
            "override-not-json": Message(
                "--json-model-override-args {value!r} after -- is not JSON"
            ),
            "override-not-object": Message(
                "--json-model-override-args after -- is not a JSON object"
            ),
        },
        exit=EXIT_USAGE,
    ),
    Reason(
        "expert-split",
        "--ep {ep}: the {experts} routed experts per layer do not split over {ep} "
        "expert-parallel ranks ({experts} / {ep} = {ratio:.2f}); --ep must divide {experts} "
        "(up to 64: {fits})",
        exit=EXIT_USAGE,
    ),
    Reason(
        "language-model-only",
        "--language-model-only after --: SGLang 0.5.23 refuses it for Kimi-K3; pass serve's "
        "--text-only (it sets --json-model-override-args '{override}')",
        exit=EXIT_USAGE,
    ),
    Reason("not-situ", "hidden_act is {act!r}, not 'situ'"),
    Reason(
        "moe-tp-alignment",
        "moe_intermediate_size {n} over moe-TP {moe_tp} ({over}) is not a multiple of "
        "{alignment}: the CUTLASS SiTU method does not pad",
        hint="pick another --tp/--ep (Kimi-K3: tp/ep in 1, 2, 3, 4, 6, 8, 12, 24), or "
        "--backend marlin",
    ),
    Reason(
        "not-converted",
        "not a converted checkpoint (no 'kimi_w31' block in config.json)",
        hint="convert it with `kimi-convert SRC OUT`, or pass --unconverted to serve the "
        "original with the adapter's SiTU method ({env}=1)",
    ),
    Reason(
        "capacity",
        "the GPUs cannot hold this checkpoint: {size} ({source}){whole} over tp {tp} x pp {pp} "
        "= {gpus} (on {nodes}) is {needed} per GPU at the least, more than the {each} each GPU "
        "has ({how}). It needs {need} for the weights alone, before KV cache and activations "
        "(Kimi-K3 on H200s: 16, two nodes; see the README)",
        hint="use more GPUs (a larger --tp, or -- --pp-size; across nodes with -- --nnodes), or "
        "give --gpu-memory when this machine is not the one that serves",
    ),
    Reason(
        "no-gpu",
        rules={
            "serve": Message(
                "no NVIDIA GPU on this machine (nvidia-smi and the driver show none)",
                hint="run serve on the serving nodes, or add --print (and --gpu-memory SIZE) "
                "to print their launch command from here",
            ),
            "prebuild": Message(
                "no CUDA GPU visible here: pass the serving GPU's architecture",
                hint="--arch sm90 (H100, H200) or --arch sm120 (RTX PRO 6000 class); "
                "building needs no GPU",
            ),
        },
    ),
    # What the serving stack lacks, one problem per finding (`check_stack`), its facts typed.
    Reason(
        "stack-unready",
        rules={
            "not-installed": Message(
                "{package} is not installed", expected="{want}", hint="{install}"
            ),
            "version": Message(
                "{package} {version} is installed, not a version the adapter runs",
                expected="{want}",
                found="{version}",
                hint="{install}",
            ),
            "no-entry-point": Message(
                "no '{plugin}' entry point in group {group}",
                hint="install kimi-w31 into the environment that runs SGLang",
            ),
            "plugin-import": Message("the {plugin} plugin does not import ({error})"),
            "plugins-filtered": Message(
                "SGLANG_PLUGINS={value!r} filters out '{plugin}'",
                hint="add {plugin} to SGLANG_PLUGINS, or unset it",
            ),
            "verify": Message("verify's {check} check failed ({detail})"),
        },
    ),
    Reason(
        "kernel-bundle-unchecked",
        "--kernels {kernels}: cannot read this machine's stack ({error})",
        hint="{install}",
    ),
    # The build's own failure, which no check of ours names: the compiler's exit status and
    # the last lines it printed (a refusal of ours passes on its own code instead).
    Reason(
        "prebuild-failed",
        "building {module} failed: {command} exited with status {status}; its last "
        "lines:\n{output}",
    ),
)

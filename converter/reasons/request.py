"""What the user asked for: options, a manifest, a path argument, a window."""

from __future__ import annotations

from ..errors import EXIT_USAGE, Message, Reason

REASONS = (
    Reason(
        "usage",
        rules={
            "ray-address": Message("--ray-address only applies with --executor ray"),
            "download-options": Message("{options} only apply with --download"),
            "download-with-ray": Message(
                "--download and --executor ray do not combine: download first (hf download ... "
                "--local-dir on shared storage), then convert on Ray"
            ),
            "synth-group": Message(
                "--k and --n must be multiples of {group} (the MXFP4 group size)"
            ),
            "synth-no-moe": Message(
                "no MoE layer: raise --layers or lower --dense-layers / --moe-every"
            ),
            "ray-missing": Message(
                "--executor ray needs Ray, an optional dependency: pip install ray (or install "
                "kimi-w31 with its 'ray' extra) on the driver and on every node of the cluster"
            ),
            "ray-version": Message(
                "kimi-w31 on this node differs from the driver's",
                expected="{driver}",
                found="{node}",
            ),
            "hub-repo-id": Message("--download needs a Hugging Face repo id (org/name)"),
            "revision-local": Message(
                "--revision {revision!r} applies to a Hugging Face repo id, not to a local "
                "directory"
            ),
            "hub-timeout": Message("{name} must be a positive number of seconds", found="{value}"),
            "hub-retries": Message(
                "{name} must be a whole number of retries (0 or more)", found="{value}"
            ),
            "max-shard-size": Message("--max-shard-size must be positive", found="{size}"),
            "numerics-source": Message(
                "--numerics needs --source SRC: it computes each expert from the source and "
                "from the output"
            ),
            "sample": Message(
                "the number of experts to sample must be at least 1 (or all)", found="{sample}"
            ),
            "workers": Message("workers must be at least 1", found="{workers}"),
            "numerics-options": Message("{options} only apply with --numerics"),
            "experts-with-all": Message(
                "--experts and --all do not combine: sample N experts, or check all"
            ),
            "source-is-output": Message("--source is the output directory itself"),
        },
        exit=EXIT_USAGE,
    ),
    Reason(
        "manifest-not-found",
        rules={
            "name": Message(
                "unknown manifest {name!r}",
                expected="{known} or a path to a .json file",
                found="{name}",
            ),
            "file": Message("manifest file not found"),
        },
        exit=EXIT_USAGE,
    ),
    Reason(
        "manifest-invalid",
        rules={
            "not-json": Message("manifest is malformed: not valid JSON ({error})"),
            "not-object": Message("manifest is malformed: not a JSON object"),
            "no-key": Message("manifest is malformed: it has no '{key}' ({meaning})"),
            "dims": Message("manifest is malformed: 'dims' must map symbols to config field names"),
            "dims-missing": Message(
                "manifest is malformed: 'dims' does not name the config field of {symbols}"
            ),
            "situ": Message(
                "manifest is malformed: 'situ' must give numbers 'beta' and 'linear_beta'"
            ),
            "group-size": Message("manifest is malformed: 'group_size' must be {group} (MXFP4)"),
            "pinned": Message("manifest is malformed: 'pinned' must map config fields to values"),
            "section-keys": Message("manifest is malformed: '{section}' must have exactly {want}"),
            "entry": Message(
                'manifest is malformed: \'{section}.{key}\' must be {{"dtype": str, "shape": '
                "[formula, ...]}} with formulas like N, 2*N, K/32 over the symbols in 'dims'"
            ),
            "name": Message("manifest is malformed: 'name' must be a string"),
            "inventory": Message(
                'manifest is malformed: \'inventory\' must be {{"dtypes": [str], "aliases": '
                '{{str: str}}, "layer_prefix": str with {{L}}, "vision_block_prefix": str with '
                '{{B}}, "vision_blocks": [field, default], "groups": [{{"place": one of '
                '{places}, "names": [str], optional "when"/"unless": config field}}]}}'
            ),
        },
        exit=EXIT_USAGE,
    ),
)

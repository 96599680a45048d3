"""A converted checkpoint (verify, serve), and what is served being what was verified."""

from __future__ import annotations

from ..errors import Message, Reason

REASONS = (
    # -- a converted checkpoint (verify, serve)
    Reason(
        "incomplete-output",
        rules={
            "no-index": Message(
                "no index: the conversion is incomplete (the index is written last) or this is "
                "not a converted checkpoint",
                expected="a complete conversion",
                found="no index",
            ),
            "running": Message(
                "no index: the conversion is incomplete (the index is written last) or this is "
                "not a converted checkpoint",
                expected="a complete conversion",
                found="a conversion in progress or interrupted ({state}/ is there): rerun "
                "kimi-convert to finish it",
            ),
        },
    ),
    # An unconverted checkpoint given to verify: no w31, every w1/w3 left.
    Reason(
        "block-missing",
        rules={
            "absent": Message("config has no 'kimi_w31' block: not a converted checkpoint"),
            # the adapter's reading (serve, and every config SGLang loads)
            "wrapped": Message(
                "quantization_config is wrapped as 'kimi_w31' but there is no 'kimi_w31' "
                "block: the checkpoint is half converted or was edited",
                hint="convert it again from the source",
            ),
        },
        implies=frozenset(
            {
                "not-wrapped",
                "checksums-invalid",
                "expert-tensor-unexpected",
                "expert-partner-missing",
                "layer-incomplete",
                "no-experts",
            }
        ),
    ),
    Reason(
        "block-field",
        rules={
            "not-object": Message(
                "'kimi_w31' must be an object", expected="an object", found="{kind}"
            ),
            "format-version": Message(
                "kimi_w31.format_version is not one this tool knows (a newer converter wrote "
                "it: upgrade kimi-w31)",
                expected="{known}",
                found="{value!r}",
            ),
            "value": Message("kimi_w31.{key} is wrong", expected="{want!r}", found="{value!r}"),
            "positive": Message(
                "kimi_w31.{key} is not a positive number",
                expected="a positive finite number",
                found="{value!r}",
            ),
            "source-files": Message("kimi_w31.source.files is not an object"),
        },
    ),
    Reason(
        "block-mismatch",
        rules={
            "activation": Message(
                "kimi_w31.activation is 'situ' but the model config's hidden_act is not",
                expected="'situ'",
                found="{act!r}",
            ),
            "config": Message(
                "kimi_w31.{key} disagrees with the model config's {config_key}",
                expected="{want!r}",
                found="{value!r}",
            ),
            "manifest": Message(
                "kimi_w31.{key} disagrees with manifest {manifest}",
                expected="{want!r}",
                found="{value!r}",
            ),
            "dims": Message(
                "kimi_w31.dims do not match the dimensions of the source config",
                expected="{want}",
                found="{value}",
            ),
            "manifest-hash": Message(
                "kimi_w31.manifest_sha256 is not the hash of manifest {manifest} (pass "
                "--manifest with the one the conversion used)",
                expected="{want}",
                found="{value}",
            ),
        },
    ),
    Reason(
        "not-wrapped",
        rules={
            "no-base": Message(
                "quantization_config with quant_method '{method}' must hold the original "
                "config under 'base' (an object with a 'quant_method')",
                found="{base!r}",
            ),
            "twice": Message("quantization_config is wrapped twice in '{method}'"),
            "not-wrapped": Message(
                "quantization_config is not wrapped: a loader without the adapter would not "
                "refuse it",
                expected="{method!r}",
                found="{value!r}",
            ),
        },
    ),
    Reason(
        "checksums-invalid",
        rules={
            "missing": Message(
                "the checksums file is missing: the output cannot be proven intact without the "
                "source"
            ),
            "not-file": Message("the checksums file is not a regular file"),
            "not-json": Message("the checksums file is not readable JSON ({error})"),
            "not-object": Message("the checksums file is not a JSON object"),
            "format": Message("unknown checksums file format", found="{value!r}"),
            "algorithm": Message("unknown tensor checksum algorithm", found="{value!r}"),
            "no-files": Message("the checksums file has no 'files' object"),
            "name": Message("recorded file name {why}; it is not opened", found="{name!r}"),
            "record": Message("malformed record", found="{record}"),
            "no-shard-record": Message("shard has no checksum record"),
            "no-tensor-record": Message("tensor has no recorded checksum"),
            "tensor-not-in-shard": Message("recorded tensor is not in the shard"),
        },
    ),
    Reason(
        "file-size-mismatch",
        rules={
            "file": Message(
                "file size differs from the conversion record", expected="{want}", found="{size}"
            ),
            "shard": Message(
                "shard size differs from the conversion record", expected="{want}", found="{size}"
            ),
        },
    ),
    Reason("header-hash-mismatch", "shard header differs from the conversion record (sha256)"),
    Reason(
        "checksum-mismatch",
        rules={
            "file": Message("file differs from the conversion record (sha256)"),
            "tensor": Message(
                "tensor bytes differ from the conversion record (CRC-32): corrupt",
                expected="{want}",
                found="{crc}",
            ),
        },
    ),
    Reason(
        "file-unrecorded",
        "file in the output that the checksums file does not record: the conversion did "
        "not write it",
    ),
    Reason("tensor-not-from-source", "tensor has no counterpart in the source"),
    Reason("tensor-missing", "tensor the source requires is not in the output"),
    Reason(
        "bytes-differ",
        rules={
            "tensor": Message(
                "tensor bytes differ from the source", found="first difference at byte {pos}"
            ),
            "file": Message("file differs from the source", found="first difference at byte {pos}"),
            "file-size": Message(
                "file differs from the source (size)", expected="{want}", found="{size}"
            ),
        },
    ),
    Reason(
        "w31-not-up-gate",
        "w31 is not concat([w3, w1]) of the source ([up; gate])",
        expected="w3 bytes then w1 bytes",
        found="first difference at byte {pos}, in the {half} half",
    ),
    Reason(
        "config-differs",
        rules={
            "beyond-block": Message(
                "config.json differs from the source config beyond the kimi_w31 block and the "
                "wrapped quantization_config",
                found="differs at {keys}",
            ),
            "unwrap": Message("the quantization_config wrapper cannot be undone ({error})"),
        },
    ),
    Reason(
        "source-changed-since",
        rules={
            "shard": Message(
                "source shard is not the one the output was converted from (the source changed "
                "since, or this is another source): not output corruption",
                expected="{then}",
                found="{now}",
            ),
            "tensor": Message(
                "tensor differs from the source, whose shard changed since the conversion",
                found="first difference at byte {pos}",
            ),
        },
    ),
    Reason(
        "numerics-differ",
        "the converted expert computes a different function than the source expert",
        expected="relative max error <= {rtol:g}",
        found="{rel_error:.3g} (cosine {cosine:.6f})",
    ),
    Reason(
        "numerics-unavailable",
        rules={
            "no-expert": Message(
                "no expert is complete in both the output and the source (see the checks above)"
            ),
            "fc1-order": Message(
                "kimi_w31.fc1_order does not name 'up' and 'gate' once each", found="{order!r}"
            ),
            "situ": Message("the {side} side has no numeric {key}", found="{value!r}"),
            "expert": Message("cannot compute this expert ({error})"),
        },
    ),
    Reason("numerics-self-test", "the MXFP4/SiTU reference fails a known answer: {case}"),
    Reason(
        "tensor-dtype-differs", "dtype differs from the source", expected="{want}", found="{dtype}"
    ),
    Reason(
        "tensor-shape-differs",
        rules={
            "source-halves": Message(
                "the source's w3 and w1 shapes differ: no w31 can be formed",
                expected="{want}",
                found="{shape}",
            ),
            "shape": Message("shape differs from the source", expected="{want}", found="{shape}"),
        },
    ),
    Reason(
        "file-not-from-source",
        "file in the output that the conversion of this source would not write",
    ),
    # -- what is served is what was verified (the adapter, at load)
    Reason(
        "not-verified",
        rules={
            "never": Message(
                "checkpoint was never verified with --checksums on this filesystem",
                hint="run `kimi-convert verify {root} --checksums` on this node (or once on a "
                "shared filesystem), or set {env}=1 to serve it unverified",
            ),
            "no-checksums": Message(
                "checkpoint was verified, but not with --checksums",
                found="levels {levels}",
                hint="run `kimi-convert verify {root} --checksums`, or set {env}=1 to serve it "
                "unverified",
            ),
            "not-local": Message(
                "model path is not a local directory: a converted checkpoint is served from a "
                "verified local copy",
                found="{root}",
                hint="download it, run `kimi-convert verify DIR --checksums` and serve DIR, or "
                "set {env}=1",
            ),
        },
    ),
    Reason(
        "verified-files-changed",
        rules={
            "changed": Message(
                "file changed since the last passing `verify --checksums` (size, mtime, ctime, "
                "inode or device)",
                expected="{want}",
                found="{identity}",
                hint="run `kimi-convert verify {root} --checksums` again (a copy needs its own "
                "verify), or set {env}=1 to serve it unverified",
            ),
            "added": Message(
                "file added since the last passing `verify --checksums`",
                hint="run `kimi-convert verify {root} --checksums` again, or set {env}=1 to "
                "serve it unverified",
            ),
            "removed": Message(
                "file removed since the last passing `verify --checksums`",
                hint="run `kimi-convert verify {root} --checksums` again, or set {env}=1 to "
                "serve it unverified",
            ),
        },
    ),
    # two checkpoint names reach one model parameter
    Reason(
        "name-collision",
        "two tensor names reach the same model parameter under SGLang's name mapping (the "
        "one loaded last would win)",
        expected="one of {first!r} and {second!r}",
        found="both, as {key!r}",
    ),
)

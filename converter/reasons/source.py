"""Finding and reading the source (local, cache, Hub), and its index."""

from __future__ import annotations

from ..errors import EXIT_USAGE, Message, Reason

REASONS = (
    # -- finding and reading the source
    Reason(
        "source-not-found",
        rules={
            "spec": Message(
                "source not found: expected a directory with model.safetensors.index.json or "
                "model.safetensors, or a Hugging Face repo id (org/name) in the local cache"
            ),
            "not-directory": Message("source is not a directory"),
        },
    ),
    Reason(
        "source-not-in-cache",
        "{where!r} is not a local directory and is not in the local Hugging Face cache",
        hint="download it first (`hf download {command}`), stream it with --download, or "
        "pass a directory",
    ),
    Reason(
        "output-inside-source",
        "output directory is the source or inside it",
        expected="a directory outside the source",
        found="{source}",
        exit=EXIT_USAGE,
    ),
    Reason(
        "file-missing",
        rules={
            "file": Message("file is missing"),
            "no-weights": Message(
                "no model.safetensors.index.json and no *.safetensors file in the source directory"
            ),
            "hub-config": Message("the repository has no config.json"),
            "hub-weights": Message(
                "the repository has no model.safetensors.index.json or model.safetensors"
            ),
            "recorded": Message("file recorded by the conversion is missing"),
            "from-source": Message(
                "file of the source is missing from the output (or not a regular file)"
            ),
            "served": Message("source: no index and no *.safetensors file"),
        },
    ),
    Reason(
        "file-unreadable",
        rules={
            "read": Message("cannot read ({error})"),
            "served": Message("source: cannot read ({error})"),
            "list": Message("cannot list ({error})"),
        },
    ),
    Reason(
        "json-invalid",
        rules={
            "not-json": Message("not valid JSON ({error})"),
            "config-not-object": Message("config.json is not a JSON object"),
        },
    ),
    Reason(
        "not-a-regular-file",
        rules={
            "file": Message("not a regular file", expected="a regular file", found="{kind}"),
            "shard": Message(
                "shard is not a regular file",
                expected="a regular file (a shard may be a symlink to one, e.g. on another disk)",
                found="{kind}",
            ),
            "publish": Message(
                "not a regular file: it cannot be copied into the output",
                expected="a regular file",
                found="{kind}",
            ),
            "output": Message(
                "not a regular file (a converted checkpoint holds only regular files)",
                found="{kind}",
            ),
            "served": Message("source: not a regular file"),
        },
    ),
    Reason(
        "link-escapes",
        rules={
            "output": Message("output path leads outside the output directory (a symlink?)"),
            "publish-inside": Message(
                "file is a symlink into a hidden or unpublished path of the source: it would "
                "publish a file that is not published directly",
                expected="a regular file, or a link to one of the source's own published files",
                found="{kind}",
            ),
            "publish-outside": Message(
                "file is a symlink outside the source: it would publish a file that is not "
                "published directly",
                expected="a regular file, or a link to one of the source's own published files",
                found="{kind}",
            ),
            "publish-loop": Message(
                "folder is a symlink to a folder that holds it: every file under it would be "
                "published under endless names",
                expected="a folder, or a link to a folder that does not hold the link",
                found="{kind}",
            ),
        },
    ),
    Reason(
        "hub-error",
        rules={
            "request": Message(
                "{action} failed: {error}",
                hint="rerun the same command once the cause is fixed: finished output shards "
                "and fully downloaded source shards are kept",
            ),
            "no-commit": Message("the Hub did not report a commit for this revision"),
            "no-size": Message("the Hub did not report size and content id for a file"),
            "short-range": Message("the server returned a short range for the header"),
            "bad-range": Message(
                "the server answered a range request with other bytes than asked",
                expected="bytes from {first}",
                found="{said}",
            ),
        },
    ),
    Reason(
        "hub-gated",
        "the repository is gated: accept its terms on the Hub and log in (hf auth login)",
    ),
    Reason(
        "hub-not-found",
        "repository not found (or private: log in with hf auth login or set HF_TOKEN)",
    ),
    Reason(
        "hub-revision",
        "revision not found in the repository",
        expected="a branch, tag or commit",
        found="{revision}",
        hint="check --revision (without it: the default branch, main)",
    ),
    Reason(
        "hub-timeout",
        rules={
            "request": Message(
                "{action}: the Hub did not answer within {timeout} s ({tries} tries)",
                hint="check the network and the endpoint (HF_ENDPOINT); KIMI_W31_HUB_TIMEOUT "
                "and KIMI_W31_HUB_RETRIES set the wait and the retries; rerun the same "
                "command: finished output shards and fully downloaded source shards are "
                "kept",
            ),
            "client": Message(
                "{action}: the Hub did not answer in time (huggingface_hub's own wait and "
                "retries were spent)",
                hint="check the network and the endpoint (HF_ENDPOINT); HF_HUB_ETAG_TIMEOUT "
                "and HF_HUB_DOWNLOAD_TIMEOUT set huggingface_hub's waits; rerun the same "
                "command: finished output shards and fully downloaded source shards are "
                "kept",
            ),
        },
    ),
    # -- the index
    Reason(
        "index-invalid",
        rules={
            "no-weight-map": Message("index has no weight_map object"),
            "served": Message("source: index without a readable weight_map"),
        },
    ),
    Reason("weight-map-entry-unsafe", "weight_map entry {why}", found="{shard!r}"),
    Reason(
        "shard-missing",
        rules={
            "local": Message("shard named in the index is missing"),
            "hub": Message("shard named in the index is missing from the repository"),
            "cache": Message(
                "the Hugging Face cache holds part of this repository: {missing} of {total} "
                "shards the index names are not in its snapshot {snapshot} (a download that "
                "did not finish)",
                hint="finish the download (`hf download {command}`: it fetches only what is "
                "missing), or stream it with --download",
            ),
            "served": Message("source: index names a shard that is not there"),
            "dangling": Message(
                "shard named in the index is a symlink to nothing",
                expected="a regular file (a shard may be a symlink to one, e.g. on another disk)",
                found="{kind}",
            ),
        },
    ),
    Reason("index-tensor-not-in-shard", "index names a tensor its shard does not hold"),
    Reason("index-tensor-missing", "tensor is missing from {index}"),
    Reason(
        "index-wrong-shard",
        "tensor is in a different shard than the index says",
        expected="{owner}",
        found="{file}",
    ),
    Reason(
        "index-total-size",
        "metadata.total_size is not the sum of the tensors' bytes",
        expected="{data}",
        found="{total!r}",
    ),
    Reason("shard-unreferenced", "safetensors file the index does not reference"),
    # a shard the index names that loaders never open
    Reason(
        "shard-not-loaded",
        rules={
            "index": Message(
                "index names {count} shard(s) that loaders never open: they load only "
                "top-level *.safetensors files, so these tensors would not be served",
                expected="top-level file names (move the shards, or links to them, to the top)",
                found="{shards}",
            ),
            "served": Message("source: index names a shard loaders never open"),
        },
    ),
    # no index: one name in two shards
    Reason(
        "tensor-in-two-shards",
        "tensor is in two shards and there is no index to say which one serves",
        expected="only in {first}",
    ),
)

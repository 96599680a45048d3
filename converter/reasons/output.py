"""The output directory and the run that writes it."""

from __future__ import annotations

from ..errors import EXIT_USAGE, Message, Reason

REASONS = (
    Reason(
        "output-not-directory",
        rules={
            "exists": Message("output path exists and is not a directory"),
            "folder": Message(
                "a folder of the output path is not a directory",
                expected="a directory",
                found="{kind}",
            ),
            "absent": Message("output path does not exist"),
            "not-directory": Message("output path is not a directory"),
        },
    ),
    Reason(
        "output-not-empty",
        rules={
            "convert": Message(
                "output directory is not empty and is not a resumable run of this conversion"
            ),
            "convert-owned": Message(
                "output directory is not empty and is not a resumable run of this conversion: "
                "it holds the conversion of {owner}"
            ),
            "synth": Message(
                "synth writes into an empty or new directory",
                hint="choose another directory or remove this one first",
            ),
        },
    ),
    Reason(
        "foreign-output",
        rules={
            "force": Message(
                "--force only removes files kimi-convert's own records (its ledger, journal or "
                "checksums file in this directory) say it wrote, unchanged since; these are "
                "not: {files}",
                hint="move them out or choose another output directory; nothing was deleted",
            ),
            "finalize": Message(
                "file in the output directory that this conversion did not write; the output "
                "is not finalized while it is there"
            ),
        },
    ),
    Reason(
        "output-locked",
        rules={
            "take": Message("could not take the output lock"),
            "busy": Message(
                "another conversion is writing this output directory ({who}); wait for it, or "
                "remove {lock} if you are sure it is gone"
            ),
        },
    ),
    Reason(
        "state-lost",
        "the state folder {state} was removed or replaced during the run: there is no "
        "longer a record of what this run wrote",
        expected="the state folder this run made",
        found="{kind}",
        hint="find what removed it, then rerun: files kimi-convert cannot prove it wrote "
        "are never deleted (choose an empty directory if it refuses)",
    ),
    Reason(
        "no-space",
        rules={
            "output": Message(
                "not enough free space for the output",
                expected="{need} free",
                found="{free} free",
                hint="free space or choose another output directory (--dry-run checks this "
                "before a run)",
            ),
            "downloads": Message(
                "not enough free space for the downloads and the output",
                expected="{need} free",
                found="{free} free",
                hint="pass --delete-source-shards and a smaller --max-source-window, or free "
                "space; --dry-run shows the peak",
            ),
            "device": Message(
                "no space left on the device (or file size limit reached)", found="{error}"
            ),
        },
    ),
    Reason("io-error", "I/O error: {error}"),
    Reason(
        "source-changed",
        rules={
            "copy": Message("source file changed while it was being copied"),
            "read": Message("source file {change}"),
        },
    ),
    Reason(
        "scale-nan",
        rules={
            "tensor": Message(
                "{count} E8M0 scale byte(s) are 0xFF (NaN); first at byte {first} of the tensor",
                expected="no 0xFF scale bytes",
                found="{count}",
            ),
            "source": Message(
                "{count} E8M0 scale byte(s) are 0xFF (NaN); first at byte {first} of the "
                "tensor (byte {at} of the file; it was being copied into {output})",
                expected="no 0xFF scale bytes",
                found="{count}",
            ),
            "numerics": Message(
                "{count} E8M0 scale byte(s) are 0xFF (NaN) in the {side}; first at byte "
                "{first} of the tensor"
            ),
        },
    ),
    Reason(
        "window-too-small",
        "--max-source-window is too small for this checkpoint's layout",
        expected="at least {need}",
        found="{window}",
        hint="rerun with --max-source-window {need}: downloaded in the order the output "
        "needs them, that many source shards must be present at once (--dry-run shows "
        "it before any download)",
        exit=EXIT_USAGE,
    ),
    Reason(
        "output-header-too-large",
        "planned shard header exceeds the safetensors limit",
        expected="<= {limit}",
        found="{length}",
    ),
    Reason(
        "state-folder-invalid",
        rules={
            "state": Message(
                "the state folder {state}/ is not a directory kimi-convert made",
                expected="a directory, or nothing",
                found="{kind}",
                hint="move or remove {file} yourself (it is not this tool's to delete), then "
                "rerun; nothing was changed",
            ),
            "lock": Message(
                "the lock file is not a regular file kimi-convert made",
                expected="a regular file, or nothing",
                found="{kind}",
                hint="remove {file} yourself if no conversion is running; nothing was changed",
            ),
        },
    ),
    Reason(
        "permission-denied",
        rules={
            "folder": Message(
                "no permission to write here",
                expected="a directory this user may write in",
                hint="make it writable for this user, or choose another output directory",
            ),
            "write": Message("no permission: {error}"),
        },
    ),
    Reason(
        "output-of-another-source",
        "output directory holds the conversion of another source: {owner}",
        hint="a rerun continues only the conversion of the same source; pass --force to "
        "replace it (only files kimi-convert recorded writing are removed), or choose "
        "another directory",
    ),
    Reason(
        "file-name-invalid",
        "file name {why}: the output could not be published or verified with it",
        expected="a plain name (UTF-8, no control characters or backslashes)",
        found="{file!r}",
    ),
    # a path argument the OS refuses to look up
    Reason(
        "path-unusable",
        rules={
            "loop": Message(
                "{argument}: the path cannot be looked up: a link on the way leads back to itself",
                found="{error}",
                hint="fix or remove the link named in the path (ls -l each folder on the way)",
            ),
            "too-long": Message(
                "{argument}: the path is too long to look up on this system",
                expected="names of at most {name_max} bytes, a path of at most {path_max}",
                found="{error}",
                hint="use a shorter path (a symlink with a short name to a folder on the way "
                "works)",
            ),
            "os": Message("{argument}: the path cannot be looked up", found="{error}"),
        },
        exit=EXIT_USAGE,
    ),
)

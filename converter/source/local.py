"""A source on local disk: a directory, or a repo id already in the Hugging Face cache."""

from __future__ import annotations

from pathlib import Path

from ..contract import CHECKSUMS_NAME
from ..errors import Code, Fatal, Problem, fail
from ..safetensors_format import ShardHeader, read_header
from . import Resolved, stays_inside


def resolve_local(spec: str, revision: str | None = None) -> Path:
    """A directory, or a repo id resolved offline from the Hugging Face cache."""
    path = Path(spec).expanduser()
    if path.exists():
        if revision is not None:
            raise fail(
                Code.USAGE,
                f"--revision {revision!r} applies to a Hugging Face repo id, "
                "not to a local directory",
                file=str(path.resolve()),
            )
        if not path.is_dir():
            raise fail(Code.SOURCE_NOT_FOUND, "source is not a directory", file=str(path))
        return path.resolve()
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return Path(snapshot_download(spec, revision=revision, local_files_only=True))
        except LocalEntryNotFoundError:
            where = f"{spec}@{revision}" if revision else spec
            raise fail(
                Code.SOURCE_NOT_IN_CACHE,
                f"'{where}' is not a local directory and is not in the local Hugging Face cache",
                hint=f"download it first (`hf download {spec}"
                f"{f' --revision {revision}' if revision else ''}`), stream it with "
                "--download, or pass a directory",
            ) from None
    raise fail(
        Code.SOURCE_NOT_FOUND,
        "source not found: expected a directory with "
        "model.safetensors.index.json or model.safetensors, or a Hugging Face repo id "
        "(org/name) in the local cache",
        file=spec,
    )


class LocalOrigin:
    """Headers and file list straight from the source directory."""

    header_workers = 1

    def resolve(self, spec: str, revision: str | None) -> Resolved:
        return Resolved(resolve_local(spec, revision), self)  # on disk: nothing more to learn

    def has_file(self, root: Path, name: str) -> bool:
        return (root / name).exists()

    def read_header(self, root: Path, file: str) -> ShardHeader:
        path = root / file
        if not path.exists():
            raise fail(Code.SHARD_MISSING, "shard named in the index is missing", file=file)
        if not path.is_file():  # a directory, or a FIFO that would block the read forever
            raise fail(Code.NOT_A_REGULAR_FILE, "shard is not a regular file", file=file)
        return read_header(path, display_name=file)

    def extra_files(self, root: Path, weight_files: set[str]) -> list[str]:
        """Every other file (tokenizer, chat template, custom code, ...), copied unchanged.

        Hidden paths are skipped, and so is a checksums file of ours: it describes some other
        output and would make this one fail its own verify.
        """
        extra = sorted(
            rel
            for p in root.rglob("*")
            if p.is_file()
            and (rel := str(p.relative_to(root))) not in weight_files
            and not p.name.endswith(".safetensors")
            and rel != CHECKSUMS_NAME
            and not any(part.startswith(".") for part in p.relative_to(root).parts)
        )
        # Extra files are copied into the output: a link to a file elsewhere (a hostile
        # download pointing at ~/.ssh/...) would publish that file with the converted model.
        escaping = [rel for rel in extra if not stays_inside(root, root / rel)]
        if escaping:
            raise Fatal(
                [
                    Problem(
                        Code.LINK_ESCAPES,
                        "file is a symlink that points outside the source directory",
                        file=rel,
                    )
                    for rel in escaping
                ]
            )
        return extra

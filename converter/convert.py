"""`kimi-convert SRC OUT`: resolve -> read headers -> plan + validate -> write -> finalize.

Everything up to the plan reads headers only and writes nothing, so every problem with the
source is reported before the first byte of output exists. The output directory carries a
state folder (`.kimi_w31/`: lock, ledger, temporaries) while a run is in progress; the index
is written last and the state folder removed after it, so a directory with an index is a
complete conversion and one without is a resumable run.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kimi_w31 import __version__

from . import faults
from .backends import Backend
from .config_rewrite import converted_config, layout_block
from .errors import ConvertError, Problem, fail
from .execute import SPACE_ERRNOS, Hooks, SourceFiles, fsync_dir, run_shards
from .ledger import Ledger
from .lock import OutputLock
from .manifest import load_manifest
from .plan import DEFAULT_MAX_SHARD_SIZE, Plan, plan_conversion
from .source import CONFIG_NAME, INDEX_NAME, Source, read_source, resolve_source
from .streaming import HASH_NAME, SourceChanged

STATE_DIR = ".kimi_w31"
CHECKSUMS_NAME = "kimi_w31.checksums.json"


@dataclass
class ConvertOptions:
    source: str
    out: Path
    manifest: str = "kimi-k3"
    revision: str | None = None
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE
    workers: int = 0  # 0: default
    dry_run: bool = False
    force: bool = False
    check_scales: bool = False
    # Hub download or Ray executor (converter.backends); None: local disk and threads.
    backend: Backend | None = None


@dataclass
class ConvertResult:
    plan: Plan
    source: Source
    out: Path
    seconds: float = 0.0
    written: int = 0
    reused: int = 0
    bytes_written: int = 0
    already_complete: bool = False
    warnings: list[str] = field(default_factory=list)
    scale_problems: list[Problem] = field(default_factory=list)

    def summary(self) -> dict:
        p = self.plan
        return {
            "source": self.source.label,
            "output": str(self.out),
            "dry_run": self.seconds == 0.0 and not self.already_complete and not self.written,
            "already_complete": self.already_complete,
            "output_shards": len(p.shards),
            "shards_written": self.written,
            "shards_reused": self.reused,
            "tensors": p.tensors_copied,
            "experts_fused": p.experts_fused,
            "moe_layers": len(p.layers),
            "output_bytes": p.output_bytes,
            "bytes_written": self.bytes_written,
            "seconds": round(self.seconds, 3),
            "throughput_mb_s": round(self.bytes_written / self.seconds / 1e6, 1)
            if self.seconds
            else None,
            "warnings": self.warnings,
        }


def default_workers() -> int:
    # Each shard stream keeps about two cores busy (the kernel copy and its checksum thread);
    # more streams than that only contend. Beyond 8 a single filesystem rarely gains.
    return max(1, min((os.cpu_count() or 1) // 2, 8))


def prepare(opts: ConvertOptions) -> tuple[Source, Plan]:
    """Resolve, read and plan: no writes. Raises ConvertError with every problem."""
    manifest = load_manifest(opts.manifest)
    b = opts.backend
    root = (b.resolve if b else resolve_source)(opts.source, opts.revision)
    out = opts.out.expanduser().resolve()
    if out == root or root in out.parents:
        raise ConvertError(
            [Problem("output directory is the source or inside it", file=str(out),
                     expected="a directory outside the source", found=str(root))],
            exit_code=2,
        )  # fmt: skip
    # Half a million small objects: the cyclic GC would rescan them all, over and over,
    # while nothing here forms a cycle. Pausing it cuts planning time by ~40%.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        source = (b.read_source if b else read_source)(root, opts.source)
        plan = plan_conversion(source, manifest, opts.max_shard_size, __version__)
    finally:
        if gc_was_enabled:
            gc.enable()
    gc.freeze()  # the plan lives until the end of the run: keep it out of future scans
    return source, plan


class Reporter:
    """What the CLI shows while a conversion runs; the default shows nothing."""

    def start(self, total_bytes: int, shards: int) -> None: ...
    def advance(self, nbytes: int) -> None: ...
    def shard_done(self, name: str, reused: bool) -> None: ...
    def warn(self, message: str) -> None: ...
    def stop(self) -> None: ...


def convert(opts: ConvertOptions, reporter: Reporter | None = None) -> ConvertResult:
    reporter = reporter or Reporter()
    source, plan = prepare(opts)
    out = opts.out.expanduser().resolve()
    result = ConvertResult(plan, source, out)
    if opts.dry_run:
        return result

    try:
        return _run(opts, reporter, source, plan, result)
    except SourceChanged as exc:
        raise ConvertError(
            [Problem(f"source file {exc.detail}", file=exc.file)],
            hint="nothing copied from it was marked done; make sure nothing writes to the "
            "source, then rerun the same command",
        ) from None
    except OSError as exc:  # disk full, permissions, I/O errors: say which file
        raise _os_error(exc, plan) from None


def _os_error(exc: OSError, plan: Plan) -> ConvertError:
    file = None if exc.filename is None else os.fsdecode(exc.filename)
    if exc.errno in SPACE_ERRNOS:
        return ConvertError(
            [Problem("no space left on the device (or file size limit reached)", file=file,
                     expected=f"room for the output ({plan.output_bytes} bytes in all)",
                     found=os.strerror(exc.errno))],
            hint="free some space, then rerun the same command: finished shards are kept",
        )  # fmt: skip
    return ConvertError(
        [Problem(f"I/O error: {exc.strerror or exc}", file=file)],
        hint="rerun the same command once the cause is fixed: finished shards are kept",
    )


def _run(opts: ConvertOptions, reporter: Reporter, source: Source, plan: Plan,
         result: ConvertResult) -> ConvertResult:  # fmt: skip
    out = result.out
    manifest = load_manifest(opts.manifest)
    final = _final_files(source, plan, manifest)
    state = out / STATE_DIR
    if _is_complete(out, plan.fingerprint):
        result.already_complete = True
        shutil.rmtree(state, ignore_errors=True)
        return result

    lock = _lock_and_claim(out, state, plan, source, opts.force)
    if lock.warning:
        result.warnings.append(lock.warning)
        reporter.warn(lock.warning)
    try:
        tmp = state / "tmp"
        shutil.rmtree(tmp, ignore_errors=True)  # stale temporaries of a crashed run
        tmp.mkdir(mode=0o755)
        (out / INDEX_NAME).unlink(missing_ok=True)  # never leave an index over new shards
        ledger = Ledger(state / "ledger.jsonl", plan.fingerprint)
        ledger.open()
        faults.fault_point("ledger.opened")
        _check_free_space(out, plan, ledger)

        b = opts.backend
        planned = {f: h.header_sha256 for f, h in source.headers.items()}
        sources = (
            b.source_files(source) if b else SourceFiles(source.root, source.shard_files, planned)
        )
        stop = threading.Event()
        written = [0]
        lock_bytes = threading.Lock()

        def on_bytes(n: int) -> None:
            with lock_bytes:
                written[0] += n
            reporter.advance(n)

        def on_nan(problem: Problem) -> None:
            result.scale_problems.append(problem)

        hooks = Hooks(on_bytes=on_bytes, on_shard=reporter.shard_done, on_scale_nan=on_nan)
        reporter.start(plan.output_bytes, len(plan.shards))
        started = time.perf_counter()
        try:
            outcome = (b.run_shards if b else run_shards)(
                plan.shards, sources, out, tmp, ledger, opts.workers or default_workers(),
                stop, hooks, opts.check_scales,
            )  # fmt: skip
        finally:
            sources.close()
            reporter.stop()
        if result.scale_problems:
            raise ConvertError(
                result.scale_problems,
                hint="the source has NaN scales; nothing was finalized (no index written)",
            )
        _finalize(out, tmp, source, plan, ledger, final)
        result.seconds = time.perf_counter() - started
        result.written = sum(1 for v in outcome.values() if v == "written")
        result.reused = sum(1 for v in outcome.values() if v == "reused")
        result.bytes_written = written[0]
    finally:
        lock.release()
    shutil.rmtree(state, ignore_errors=True)
    return result


def _final_files(source: Source, plan: Plan, manifest) -> dict[str, bytes]:
    """config.json and the index, computed before any write (they go to disk last)."""
    identity = {
        "path": source.label,
        "files": {f: {"size": h.file_size, "header_sha256": h.header_sha256}
                  for f, h in sorted(source.headers.items())},
    }  # fmt: skip
    block = layout_block(source.config, manifest, __version__, identity, plan.dims.values)
    config = converted_config(source.config, block)
    index = {"metadata": {"total_size": plan.total_size}, "weight_map": plan.weight_map()}
    return {
        CONFIG_NAME: (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode(),
        INDEX_NAME: (json.dumps(index, indent=2) + "\n").encode(),
    }


def _is_complete(out: Path, fingerprint: str) -> bool:
    try:
        data = json.loads((out / CHECKSUMS_NAME).read_text())
    except (OSError, ValueError):
        return False
    return data.get("plan_fingerprint") == fingerprint and (out / INDEX_NAME).exists()


_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors|model\.safetensors")


def _inside(out: Path, path: Path) -> bool:
    try:
        return out in path.parent.resolve().parents or path.parent.resolve() == out
    except OSError:
        return False


def _our_files(out: Path, state: Path, source: Source, plan: Plan) -> list[Path]:
    """Files this tool writes into an output directory (the only ones --force removes).

    The names of this plan, the files a previous conversion recorded in its checksums file
    or ledger, and shards named the way this tool names them; never anything else.
    """
    names = {s.name for s in plan.shards} | {CONFIG_NAME, INDEX_NAME, CHECKSUMS_NAME}
    names |= set(source.extra_files)
    bad = (OSError, ValueError, KeyError, TypeError)
    with contextlib.suppress(*bad):
        names |= set(json.loads((out / CHECKSUMS_NAME).read_text())["files"])
    with contextlib.suppress(OSError):
        for line in (state / "ledger.jsonl").read_text().splitlines()[1:]:
            with contextlib.suppress(*bad):
                names.add(json.loads(line)["shard"])
    names |= {p.name for p in out.iterdir() if _SHARD_NAME.fullmatch(p.name)}
    found = []
    for name in sorted(n for n in names if isinstance(n, str) and n):
        path = out / name
        # A recorded name is data from disk: never follow it out of the output directory.
        if os.path.isabs(name) or ".." in Path(name).parts or not _inside(out, path):
            continue
        if path.is_file() or path.is_symlink():
            found.append(path)
    return found


def _make_dir(path: Path) -> None:
    """mkdir -p, and 0755 on what we create whatever the umask (others must read it)."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    for p in missing:
        os.chmod(p, 0o755)


def _lock_and_claim(out: Path, state: Path, plan: Plan, source: Source,
                    force: bool) -> OutputLock:  # fmt: skip
    """Take the output lock, then make the directory ours (or refuse).

    The lock comes first so that a second run, even with --force, never deletes files a
    live run is writing; the state folder alone (a run killed early) counts as resumable.
    """
    if out.exists() and not out.is_dir():
        raise fail("output path exists and is not a directory", file=str(out))
    created_state = not state.exists()
    _make_dir(out)
    _make_dir(state)
    lock = OutputLock(state / "lock")
    try:
        lock.acquire()
    except ConvertError:
        if created_state:
            shutil.rmtree(state, ignore_errors=True)
        raise
    faults.fault_point("lock.acquired")
    try:
        others = [p for p in out.iterdir() if p.name != STATE_DIR]
        resumable = Ledger.read_fingerprint(state / "ledger.jsonl") == plan.fingerprint
        if others and not resumable:
            if not force:
                raise ConvertError(
                    [Problem("output directory is not empty and is not a resumable run of "
                             "this conversion", file=str(out))],
                    hint="pass --force to replace the files kimi-convert wrote there, or "
                    "choose another directory",
                )  # fmt: skip
            (out / INDEX_NAME).unlink(missing_ok=True)  # first: it marks an output complete
            for path in _our_files(out, state, source, plan):
                path.unlink()
        if not resumable:  # a previous plan's ledger and temporaries; keep our lock
            for path in state.iterdir():
                if path.name != "lock":
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
    except BaseException:
        lock.release()
        if created_state:
            shutil.rmtree(state, ignore_errors=True)
        raise
    return lock


def _check_free_space(out: Path, plan: Plan, ledger: Ledger) -> None:
    needed = sum(s.file_size for s in plan.shards if s.name not in ledger.done)
    free = shutil.disk_usage(out).free
    if needed > free:
        raise ConvertError(
            [Problem("not enough free space for the output", file=str(out),
                     expected=f"{needed} bytes free", found=f"{free} bytes free")],
            hint="free space or choose another output directory; --dry-run shows the size",
        )  # fmt: skip


def _write_atomic(path: Path, data: bytes, tmp_dir: Path) -> None:
    tmp = tmp_dir / (path.name + ".partial")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _finalize(out: Path, tmp: Path, source: Source, plan: Plan, ledger: Ledger,
              final: dict[str, bytes]) -> None:  # fmt: skip
    """Extra files, checksums, config, then the index last."""
    checksums: dict = {
        "format_version": 1,
        "tensor_checksum": HASH_NAME,  # per tensor; whole small files: sha256
        "plan_fingerprint": plan.fingerprint,
        "files": {},
    }
    for shard in plan.shards:
        entry = ledger.done[shard.name]
        checksums["files"][shard.name] = {
            "size": entry["size"], "header_sha256": entry["header_sha256"],
            "tensors": entry["tensors"],
        }  # fmt: skip
    for rel in source.extra_files:
        data = (source.root / rel).read_bytes()
        dest = out / rel
        if not _inside(out, dest):  # a symlinked folder in OUT must not lead writes elsewhere
            raise fail(
                "output path leads outside the output directory (a symlink?)", file=str(dest)
            )
        _make_dir(dest.parent)
        _write_atomic(dest, data, tmp)
        faults.fault_point("finalize.extra")
        checksums["files"][rel] = {"size": len(data), "sha256": _sha256(data)}
    for name, data in final.items():
        checksums["files"][name] = {"size": len(data), "sha256": _sha256(data)}
    _write_atomic(out / CHECKSUMS_NAME, (json.dumps(checksums) + "\n").encode(), tmp)
    faults.fault_point("finalize.checksums")
    _write_atomic(out / CONFIG_NAME, final[CONFIG_NAME], tmp)
    fsync_dir(out)
    faults.fault_point("finalize.config")
    _write_atomic(out / INDEX_NAME, final[INDEX_NAME], tmp)
    fsync_dir(out)
    faults.fault_point("finalize.index")

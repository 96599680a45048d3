"""`--executor ray`: each output shard is a Ray task; the driver keeps the books.

The driver plans, holds the output lock, records every finished shard in the ledger and
finalizes (checksums, config, index last) exactly as a local run does. A task runs the same
`write_shard` (or, for a shard the ledger already lists, the same `shard_still_valid`
re-hash) on whichever node has a free CPU, reading the source and writing the output
through a filesystem every node mounts at the same path. Since the ledger and the shard
files are the same as a local run's, a run started locally can be finished on Ray and the
other way round.

Tasks return plain data, never exceptions: our errors carry fields that do not survive
pickling through Ray, so a task reports what went wrong and the driver raises it here.
"""

from __future__ import annotations

import errno
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

from .backends import Backend
from .errors import ConvertError, Problem
from .execute import Hooks, SourceFiles, shard_still_valid, write_shard
from .ledger import Ledger
from .plan import OutputShard
from .streaming import Interrupted, SourceChanged

RAY_MISSING = (
    "--executor ray needs Ray, an optional dependency: pip install ray (or install kimi-w31 "
    "with its 'ray' extra) on the driver and on every node of the cluster"
)


def import_ray():
    try:
        import ray
    except ImportError:
        raise ConvertError([Problem(RAY_MISSING)], exit_code=2) from None
    return ray


def shard_task(
    shard: OutputShard,
    root: str,
    identity: dict[str, list[int]],
    headers: dict[str, str],
    out_dir: str,
    tmp_dir: str,
    entry: dict | None,
    check_scales: bool,
    version: str,
) -> dict:
    """Runs on a Ray worker: reuse or write one shard. Returns a plain dict, never raises."""
    from kimi_w31 import __version__

    try:
        if version != __version__:  # the plan fingerprint is only valid for one tool version
            raise ConvertError(
                [
                    Problem(
                        "kimi-w31 on this node differs from the driver's",
                        expected=version,
                        found=__version__,
                    )
                ]
            )
        sources = SourceFiles(Path(root), shard.source_files, header_sha256=headers)
        for f in shard.source_files:  # the same file as the driver saw, or nothing
            if list(sources.identity[f]) != list(identity[f]):
                raise SourceChanged(
                    f,
                    "differs on this node from the driver's view (is the "
                    "source on one shared filesystem at the same path?)",
                )
        stop = threading.Event()
        nan: list[Problem] = []
        hooks = Hooks(on_scale_nan=nan.append)
        try:
            if entry is not None and shard_still_valid(shard, entry, Path(out_dir), stop, hooks):
                return {"status": "reused"}
            done = write_shard(
                shard, sources, Path(out_dir), Path(tmp_dir), stop, hooks, check_scales
            )
        finally:
            sources.close()
        if done is None:
            return {"status": "rejected", "nan": nan}
        return {"status": "written", "entry": done}
    except ConvertError as exc:
        return {
            "status": "error",
            "kind": "convert",
            "problems": exc.problems,
            "hint": exc.hint,
            "exit_code": exc.exit_code,
        }
    except SourceChanged as exc:
        return {"status": "error", "kind": "source", "file": exc.file, "detail": exc.detail}
    except OSError as exc:
        return {
            "status": "error",
            "kind": "os",
            "errno": exc.errno,
            "strerror": exc.strerror,
            "filename": None if exc.filename is None else os.fsdecode(exc.filename),
        }


def _raise(result: dict) -> None:
    kind = result["kind"]
    if kind == "convert":
        raise ConvertError(result["problems"], result["exit_code"], result["hint"])
    if kind == "source":
        raise SourceChanged(result["file"], result["detail"])
    raise OSError(result["errno"] or errno.EIO, result["strerror"], result["filename"])


@dataclass
class RayBackend(Backend):
    address: str | None = None  # None: RAY_ADDRESS, else a local runtime on this machine
    num_cpus: int | None = None  # only for a local runtime

    def run_shards(
        self,
        shards: list[OutputShard],
        sources: SourceFiles,
        out_dir: Path,
        tmp_dir: Path,
        ledger: Ledger,
        workers: int,
        stop: threading.Event,
        hooks: Hooks,
        check_scales: bool = False,
    ) -> dict[str, str]:
        """Submit every shard; record results as they come. `workers` does not apply: Ray
        places one task per free CPU across the cluster."""
        ray = import_ray()
        from kimi_w31 import __version__

        started_here = not ray.is_initialized()
        if started_here:
            address = self.address or os.environ.get("RAY_ADDRESS") or None
            ray.init(
                address=address,
                num_cpus=None if address else self.num_cpus,
                include_dashboard=False,
                log_to_driver=False,
                logging_level="warning",
            )
        # A crashed worker is retried (a rewrite of the same shard is idempotent); an error
        # our code reports is not.
        task = ray.remote(num_cpus=1, max_retries=2)(shard_task)
        # Temporaries of this driver's tasks only: a task of a killed earlier driver that Ray
        # has not reaped yet can never write into, or rename from, the files of this run.
        run_tmp = tmp_dir / f"ray-{uuid.uuid4().hex[:12]}"
        run_tmp.mkdir()
        pending: dict = {}
        outcome: dict[str, str] = {}
        try:
            for shard in sorted(shards, key=lambda s: -s.file_size):  # largest first
                entry = ledger.done.get(shard.name)
                if entry is not None and entry.get("sources") != sources.fingerprint(
                    shard.source_files
                ):
                    entry = None  # copied from other files: redo, as the local executor does
                identity = sources.fingerprint(shard.source_files)
                planned = getattr(sources, "header_sha256", {})
                headers = {f: planned[f] for f in shard.source_files if f in planned}
                ref = task.remote(
                    shard,
                    str(sources.root),
                    identity,
                    headers,
                    str(out_dir),
                    str(run_tmp),
                    entry,
                    check_scales,
                    __version__,
                )
                pending[ref] = shard
            while pending:
                if stop.is_set():
                    raise Interrupted()
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
                for ref in ready:
                    shard = pending.pop(ref)
                    result = ray.get(ref)
                    status = result["status"]
                    if status == "error":
                        _raise(result)
                    if status == "reused":
                        outcome[shard.name] = "reused"
                    elif status == "rejected":
                        ledger.forget(shard.name)
                        outcome[shard.name] = "rejected"
                        for problem in result["nan"]:
                            if hooks.on_scale_nan:
                                hooks.on_scale_nan(problem)
                        continue
                    else:
                        ledger.forget(shard.name)
                        ledger.record(result["entry"])
                        outcome[shard.name] = "written"
                        if hooks.on_bytes:
                            hooks.on_bytes(shard.file_size)
                    if hooks.on_shard:
                        hooks.on_shard(shard.name, status == "reused")
        except BaseException:
            stop.set()
            for ref in pending:
                ray.cancel(ref, force=False)
            raise
        finally:
            if started_here:
                ray.shutdown()
        return outcome

"""Where a conversion's source bytes come from and who writes its shards.

The local backend is what `convert` always did: resolve a directory or a cached repo id,
read headers from disk, write shards on a thread pool. The Hub backend (`hub.py`) reads
headers over HTTP and downloads source shards as the schedule needs them; the Ray backend
(`ray_executor.py`) sends each shard to a cluster. All three share the planner, the
ledger, `write_shard` and finalization, so their outputs are byte-identical.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

from . import execute
from .source import Source, read_source, resolve_source

if TYPE_CHECKING:
    from .execute import Hooks, SourceFiles
    from .ledger import Ledger
    from .plan import OutputShard, Plan


class Backend:
    """The local defaults; subclasses override what they change."""

    def resolve(self, spec: str, revision: str | None) -> Path:
        return resolve_source(spec, revision)

    def read_source(self, root: Path, label: str) -> Source:
        return read_source(root, label)

    def source_files(self, source: Source) -> SourceFiles:
        planned = {f: h.header_sha256 for f, h in source.headers.items()}
        return execute.SourceFiles(source.root, source.shard_files, header_sha256=planned)

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
        return execute.run_shards(
            shards, sources, out_dir, tmp_dir, ledger, workers, stop, hooks, check_scales
        )

    def plan_rows(self, source: Source, plan: Plan) -> list[tuple[str, str]]:
        """Extra rows for the --dry-run table (label, value)."""
        return []

    def plan_summary(self, source: Source, plan: Plan) -> dict:
        """Extra keys for the --json summary."""
        return {}


LOCAL = Backend()


def hub_and_cluster_options(fn):
    """The `convert` command's options for Hub streaming and the Ray executor."""
    import click

    options = [
        click.option(
            "--download",
            is_flag=True,
            help="SOURCE is a Hub repo id: read headers over HTTP, download source "
            "shards as the plan needs them (token: HF_TOKEN or hf auth login).",
        ),
        click.option(
            "--download-dir",
            type=click.Path(path_type=Path),
            default=None,
            help="With --download: put source files here instead of the HF cache.",
        ),
        click.option(
            "--delete-source-shards",
            is_flag=True,
            help="With --download: delete each source shard once every output shard "
            "reading it is done (peak disk = output + window).",
        ),
        click.option(
            "--max-source-window",
            type=click.IntRange(1),
            default=None,
            help="With --download: source shards live at once (downloading or "
            "waiting to be used) [default: 4].",
        ),
        click.option(
            "--executor",
            type=click.Choice(["local", "ray"]),
            default="local",
            show_default=True,
            help="Who writes the shards: threads here, or Ray tasks on a cluster "
            "(source and output on storage every node sees).",
        ),
        click.option(
            "--ray-address",
            default=None,
            help="With --executor ray: the cluster to join (default: RAY_ADDRESS, "
            "else a local Ray runtime).",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def make_backend(
    download: bool,
    download_dir: Path | None,
    delete_source_shards: bool,
    max_source_window: int | None,
    executor: str,
    ray_address: str | None,
) -> Backend | None:
    """The backend the CLI's options ask for; None is the plain local run."""
    from .errors import ConvertError, Problem

    def usage(what: str) -> ConvertError:
        return ConvertError([Problem(what)], exit_code=2)

    if not download:
        given = [
            name
            for name, v in (
                ("--download-dir", download_dir),
                ("--delete-source-shards", delete_source_shards),
                ("--max-source-window", max_source_window),
            )
            if v
        ]
        if given:
            raise usage(f"{', '.join(given)} only apply with --download")
    if ray_address and executor != "ray":
        raise usage("--ray-address only applies with --executor ray")
    if executor == "ray":
        if download:
            raise usage(
                "--download and --executor ray do not combine: download first "
                "(hf download ... --local-dir on shared storage), then convert on Ray"
            )
        from .ray_executor import RayBackend, import_ray

        import_ray()  # say so before anything else happens
        return RayBackend(address=ray_address)
    if not download:
        return None
    from .hub import DEFAULT_WINDOW, HubBackend

    dd = download_dir.expanduser().resolve() if download_dir else None
    return HubBackend(
        download_dir=dd,
        delete_source_shards=delete_source_shards,
        window=max_source_window or DEFAULT_WINDOW,
    )

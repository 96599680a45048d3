"""`kimi-convert serve OUT [-- SGLANG ARGS...]`: check a checkpoint and the serving stack,
then exec SGLang's server with the adapter's backend.

Only importlib.metadata looks at SGLang/FlashInfer here (never an import): the checks run
before the interpreter that serves, and importing SGLang costs seconds.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import click

from ..converter import contract
from ..converter.console import progress_option
from ..converter.errors import Code
from .layout import OPT_IN_ENV, find_block, text_config

SGLANG_PIN = "0.5.23"
FLASHINFER_MIN = (0, 7, 0)
PLUGIN_GROUP, PLUGIN_NAME = "sglang.srt.plugins", "kimi_w31"
BACKEND = "flashinfer_mxfp4"
ALIGNMENT = 128


class ServeError(click.ClickException):
    """A reason not to start the server; the message says what to do instead."""


@dataclass
class ServePlan:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # variables to add for the server

    def shell(self) -> str:
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (prefix + " " if prefix else "") + shlex.join(self.argv)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
        if not piece.isdigit():
            break
    return tuple(parts)


def check_stack(
    version_of: Callable[[str], str] = md.version,
    entry_points: Callable[..., Sequence] = md.entry_points,
    environ: Mapping[str, str] = os.environ,
) -> list[str]:
    """Problems with the installed SGLang / FlashInfer / plugin (empty: all good)."""
    problems: list[str] = []
    for dist, check, want in (
        ("sglang", lambda v: v == SGLANG_PIN, f"== {SGLANG_PIN}"),
        ("flashinfer-python", lambda v: _version_tuple(v) >= FLASHINFER_MIN, ">= 0.7.0"),
    ):
        try:
            found = version_of(dist)
        except md.PackageNotFoundError:
            problems.append(
                f"{dist} is not installed (need {want}): pip install 'kimi-w31[sglang]'"
            )
            continue
        if not check(found):
            problems.append(
                f"{dist} {found} is installed, the adapter needs {want}: "
                "pip install 'kimi-w31[sglang]'"
            )
    names = {ep.name: ep for ep in entry_points(group=PLUGIN_GROUP)}
    if PLUGIN_NAME not in names:
        problems.append(
            f"no '{PLUGIN_NAME}' entry point in group {PLUGIN_GROUP}: install kimi-w31 into "
            "the environment that runs SGLang"
        )
    else:
        try:
            names[PLUGIN_NAME].load()
        except Exception as exc:  # the plugin itself must import without SGLang running
            problems.append(f"the {PLUGIN_NAME} plugin does not import: {exc!r}")
    allowed = environ.get("SGLANG_PLUGINS", "")
    if allowed.strip() and PLUGIN_NAME not in {x.strip() for x in allowed.split(",")}:
        problems.append(
            f"SGLANG_PLUGINS={allowed!r} filters out '{PLUGIN_NAME}': add it to the list"
        )
    return problems


def _flag_value(args: Sequence[str], *flags: str) -> str | None:
    """The value of the last of `flags` in `args` (`--flag V` or `--flag=V`), else None."""
    value = None
    for i, arg in enumerate(args):
        for flag in flags:
            if arg == flag and i + 1 < len(args):
                value = args[i + 1]
            elif arg.startswith(flag + "="):
                value = arg.split("=", 1)[1]
    if value is not None and flags[0] in ("--tp-size", "--ep-size") and not value.isdigit():
        raise ServeError(f"{flags[0]} {value!r} after -- is not a positive integer")
    return value


def _flag_given(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def check_checkpoint(
    root: Path, *, unconverted: bool, tp: int, ep: int, backend: str = BACKEND
) -> tuple[dict, bool]:
    """(config, converted?) after the config-level checks; raises ServeError."""
    cfg_path = root / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise ServeError(f"{cfg_path}: cannot read the model config ({exc})") from exc
    converted = find_block(cfg) is not None
    if converted:
        problems = contract.check_block(cfg) + contract.check_wrapped(cfg)
        if problems:
            raise ServeError(
                f"{cfg_path}: not a usable converted checkpoint (a server without the adapter "
                "must refuse it, and the adapter must agree with its block):\n  - "
                + "\n  - ".join(f"[{p.code.value}] {p.render()}" for p in problems)
                + "\nConvert it again from the source."
            )
    elif contract.marks(cfg):
        raise ServeError(
            f"{cfg_path}: [{Code.BLOCK_MISSING.value}] quantization_config is wrapped as "
            f"'{contract.WRAPPER_METHOD}' but there is no '{contract.BLOCK_KEY}' block: the "
            "checkpoint is half converted or was edited. Convert it again from the source."
        )
    elif not unconverted:
        raise ServeError(
            f"{root} is not a converted checkpoint (no '{contract.BLOCK_KEY}' block in "
            "config.json). Convert it with `kimi-convert SRC OUT`, or pass --unconverted to "
            f"serve the original with the adapter's SiTU method ({OPT_IN_ENV}=1)."
        )
    text = text_config(cfg)
    if text.get("hidden_act") != "situ":
        raise ServeError(f"{cfg_path}: hidden_act is {text.get('hidden_act')!r}, not 'situ'")
    if tp < 1 or ep < 1 or tp % ep:
        raise ServeError(f"--tp {tp} / --ep {ep}: both >= 1 and --ep must divide --tp")
    n = text.get("moe_intermediate_size")
    moe_tp = tp // ep
    aligned = isinstance(n, int) and n % moe_tp == 0 and (n // moe_tp) % ALIGNMENT == 0
    if backend == BACKEND and not aligned:
        raise ServeError(
            f"moe_intermediate_size {n} over moe-TP {moe_tp} (= tp/ep) is not a multiple of "
            f"{ALIGNMENT}: the CUTLASS SiTU method does not pad. Pick another --tp/--ep "
            "(Kimi-K3: tp/ep in 1, 2, 3, 4, 6, 8, 12, 24), or --backend marlin."
        )
    return cfg, converted


def plan_serve(
    root: Path,
    extra: Sequence[str] = (),
    *,
    tp: int = 1,
    ep: int = 1,
    backend: str = BACKEND,
    unconverted: bool = False,
    python: str = sys.executable,
) -> ServePlan:
    """The server command for `root`: config checks, no structure verify, no stack checks."""
    # SGLang's own flags after `--` win over ours: check the layout SGLang will really use.
    backend = _flag_value(extra, "--moe-runner-backend") or backend
    tp = int(_flag_value(extra, "--tp-size", "--tp") or tp)
    ep = int(_flag_value(extra, "--ep-size", "--ep") or ep)
    _, converted = check_checkpoint(root, unconverted=unconverted, tp=tp, ep=ep, backend=backend)
    argv = [python, "-m", "sglang.launch_server", "--model-path", str(root)]
    if not _flag_given(extra, "--moe-runner-backend"):
        argv += ["--moe-runner-backend", backend]
    if not _flag_given(extra, "--tp-size") and not _flag_given(extra, "--tp"):
        argv += ["--tp-size", str(tp)]
    if ep > 1 and not _flag_given(extra, "--ep-size") and not _flag_given(extra, "--ep"):
        argv += ["--ep-size", str(ep)]
    argv += list(extra)
    env = {OPT_IN_ENV: "1"} if (unconverted and not converted) else {}
    return ServePlan(argv=argv, env=env)


def verify_structure(root: Path) -> list[str]:
    """`kimi-convert verify`'s structure level (headers, index, block): rendered problems."""
    from ..converter.verify import verify

    report = verify(root)
    return [p.render() for c in report.checks if c.ok is False for p in c.problems] or (
        [] if report.ok else ["structure verification failed"]
    )


@click.command(
    "serve",
    context_settings={"ignore_unknown_options": True},
)
@click.argument(
    "checkpoint",
    metavar="CHECKPOINT_DIR",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
)
@click.option(
    "--tp",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    metavar="N",
    help="Tensor-parallel size (GPUs); --tp-size after -- is checked the same way.",
)
@click.option(
    "--ep",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    metavar="N",
    help="Expert-parallel size; must divide --tp (moe-TP = tp/ep).",
)
@click.option(
    "--backend",
    default=BACKEND,
    show_default=True,
    metavar="BACKEND",
    help="--moe-runner-backend for SGLang (marlin pads and is the fallback).",
)
@click.option(
    "--unconverted", is_flag=True, help=f"Serve an unconverted Kimi-K3 checkpoint ({OPT_IN_ENV}=1)."
)
@click.option(
    "--prebuild",
    "prebuild_first",
    is_flag=True,
    help="Build FlashInfer's fused-MoE module into its JIT cache first, with progress "
    "(a no-op once built), so no server rank pays the build inside its first forward.",
)
@click.option(
    "--kernels",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    metavar="DIR",
    help="Load the plugin's FlashInfer modules from this bundle (`prebuild --out DIR`) in "
    "every server process (sets KIMI_W31_KERNELS); a bundle that does not match the serving "
    "stack is refused, never loaded.",
)
@click.option("--print", "print_only", is_flag=True, help="Print the command, do not run it.")
@click.option("--skip-checks", is_flag=True, help="Skip the structure verify and stack checks.")
@click.argument("sglang_args", nargs=-1, type=click.UNPROCESSED)
def serve(
    checkpoint: Path,
    tp: int,
    ep: int,
    backend: str,
    unconverted: bool,
    prebuild_first: bool,
    kernels: Path | None,
    print_only: bool,
    skip_checks: bool,
    sglang_args: tuple[str, ...],
) -> None:
    """Check CHECKPOINT_DIR and the SGLang stack, then run SGLang's server on it.

    Before starting anything: verify's structure level on the checkpoint, the kimi_w31 block
    against the model config, the fail-closed wrapper, sglang 0.5.23 and flashinfer-python
    >= 0.7.0 with the kimi_w31 plugin installed, and a MoE tensor-parallel size the CUTLASS
    SiTU method can run. Arguments after `--` go to `python -m sglang.launch_server`
    unchanged (a --tp-size or --moe-runner-backend there wins, and is checked).

    \b
    Examples:
      kimi-convert serve out/ --tp 8                         check, then serve on 8 GPUs
      kimi-convert serve out/ --tp 8 --print                 show the server command only
      kimi-convert serve out/ --tp 16 --ep 2 -- --port 30000
      kimi-convert serve out/ --backend marlin               SGLang's marlin MoE instead
      kimi-convert serve SRC/ --unconverted                  the original checkpoint, SiTU
      kimi-convert serve out/ --tp 8 --prebuild              pay FlashInfer's build first
      kimi-convert serve out/ --tp 8 --kernels kernels/      load a prebuilt kernel bundle

    Exit codes: 0 (or the server's own), 1 a check failed, 2 usage error.
    """
    plan = plan_serve(
        checkpoint, sglang_args, tp=tp, ep=ep, backend=backend, unconverted=unconverted
    )
    if kernels is not None:
        plan.env.update(kernel_bundle_env(kernels))
    if not skip_checks:
        problems = check_stack()
        if not plan.env:  # a converted checkpoint: prove its structure first
            problems += [f"verify: {p}" for p in verify_structure(checkpoint)]
        if problems:
            raise ServeError("not starting the server:\n  - " + "\n  - ".join(problems))
    if print_only:
        click.echo(plan.shell())
        return
    if prebuild_first:
        run_prebuild(None, "auto")
    os.execvpe(plan.argv[0], plan.argv, {**os.environ, **plan.env})


def kernel_bundle_env(kernels: Path) -> dict[str, str]:
    """The variable that points every server process at a kernel bundle; its manifest must
    parse (the stack match is checked by the plugin, in the processes that serve)."""
    from .bundle import MANIFEST, BundleError, Manifest
    from .kernels import ENV_BUNDLE

    where = kernels / MANIFEST
    try:
        Manifest.from_json(where.read_text(), str(where))
    except OSError as exc:
        raise ServeError(f"--kernels {kernels}: no readable {MANIFEST} ({exc.strerror})") from None
    except BundleError as exc:
        raise ServeError(f"--kernels {kernels}: {exc}") from None
    return {ENV_BUNDLE: str(kernels.resolve())}


def run_prebuild(
    arch: str | None,
    progress_mode: str,
    *,
    out: Path | None = None,
    precision: tuple[str, ...] = (),
    jobs: int | None = None,
    plan_only: bool = False,
) -> None:
    """`adapter.prebuild.prebuild` with the converter's progress display; raises ServeError."""
    from ..converter import console
    from .flashinfer_moe import SituUnsupportedError
    from .prebuild import PrebuildError, prebuild

    shown: dict[str, console.Progress] = {}

    def report(p) -> None:  # called from this thread: compile progress in translation units
        if p.module not in shown:
            for bar in shown.values():
                bar.stop()
            shown[p.module] = console.Progress(
                console.resolve_mode(progress_mode),
                f"flashinfer build {p.module}".strip(),
                p.total,
                unit="sources",
            )
        bar = shown[p.module]
        bar.advance(p.done - bar.done)

    try:
        result = prebuild(
            report,
            arch=arch,  # type: ignore[arg-type]
            variants=precision or None,
            out=out,
            jobs=jobs,
            plan_only=plan_only,
        )
    except (PrebuildError, SituUnsupportedError) as exc:
        raise ServeError(f"prebuild: {exc}") from None
    finally:
        for bar in shown.values():
            bar.stop()
    for m in result.modules:
        what = "planned" if plan_only else "built" if m.built else "already built"
        click.echo(
            f"{m.module} ({result.arch} {m.variant}, {m.sources} sources, source hash "
            f"{m.source_hash[:16]}) {what} in {m.seconds:.0f} s with {result.jobs} jobs: "
            f"{m.library}",
            err=True,
        )
    if result.bundle is not None:
        click.echo(f"bundle: {result.bundle}", err=True)


@click.command("prebuild")
@click.option(
    "--arch",
    type=click.Choice(["sm90", "sm120"]),
    default=None,
    help="Build for this GPU architecture [default: the visible GPU's]; a build machine "
    "needs no GPU.",
)
@click.option(
    "--precision",
    "precision",
    type=click.Choice(["w4a16", "w4a8", "sm120"]),
    multiple=True,
    help="Which serving path's module (repeatable) [default: w4a16 on sm90, sm120 on sm120]; "
    "w4a8 is SM90 --flashinfer-mxfp4-moe-precision fp8.",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    metavar="DIR",
    help="Also write a relocatable bundle there (libraries + manifest) for `serve --kernels "
    "DIR` / KIMI_W31_KERNELS on serving nodes.",
)
@click.option(
    "--jobs",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Parallel nvcc processes [default: MAX_JOBS, else min(cores, available memory / 6 GiB)].",
)
@click.option("--list", "plan_only", is_flag=True, help="Print the modules and hashes only.")
@progress_option
def prebuild_command(
    arch: str | None,
    precision: tuple[str, ...],
    out: Path | None,
    jobs: int | None,
    plan_only: bool,
    progress_mode: str,
) -> None:
    """Build the plugin's FlashInfer MoE modules before serving, optionally as a bundle.

    The plugin runs on its own FlashInfer modules, one per serving path with only the runner
    it calls (SM90 W4A16: 60 translation units instead of FlashInfer's 248). Without them
    built, every cold server rank compiles one inside weight loading. This compiles them
    into FlashInfer's JIT cache here and, with --out, into a bundle that serving nodes
    load with no compiler (`serve --kernels DIR`). A second run returns at once.

    \b
    Examples:
      kimi-convert prebuild                          on the serving machine (its GPU)
      kimi-convert prebuild --arch sm90 --out kernels/ --progress lines > build.log 2>&1
      kimi-convert prebuild --arch sm90 --precision w4a16 --precision w4a8 --out kernels/
      kimi-convert serve out/ --tp 8 --kernels kernels/

    Exit codes: 0 built or already built, 1 it cannot be built here, 2 usage error.
    """
    run_prebuild(arch, progress_mode, out=out, precision=precision, jobs=jobs, plan_only=plan_only)

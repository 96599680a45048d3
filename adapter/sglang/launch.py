"""`kimi-convert serve OUT [-- SGLANG ARGS...]`: check a checkpoint and the serving stack,
then exec SGLang's server with the adapter's backend.

Only importlib.metadata looks at SGLang/FlashInfer here (never an import): the checks run
before the interpreter that serves, and importing SGLang costs seconds.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from ...converter import contract
from ...converter.arguments import PathArg
from ...converter.console import guard_paths, human, parse_size, progress_option
from ...converter.errors import Code
from ..kernels import VARIANTS
from ..layout import OPT_IN_ENV, find_block, text_config

SGLANG_PIN = "0.5.23"
FLASHINFER_MIN = (0, 7, 0)
PLUGIN_GROUP, PLUGIN_NAME = "sglang.srt.plugins", "kimi_w31"
BACKEND = "flashinfer_mxfp4"
ALIGNMENT = 128


class ServeError(click.ClickException):
    """A reason not to start the server; the message says what to do instead. `reason` is a
    stable name for tests and tools (the message text is for people)."""

    def __init__(self, message: str, reason: str = "check") -> None:
        super().__init__(message)
        self.reason = reason


# The pip install line of the README: the package is installed from a clone, not an index.
INSTALL_HINT = (
    "pip install '.[sglang]' from a clone of kimi-w31, in the environment that runs SGLang"
)


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
            problems.append(f"{dist} is not installed (need {want}): {INSTALL_HINT}")
            continue
        if not check(found):
            problems.append(
                f"{dist} {found} is installed, the adapter needs {want}: {INSTALL_HINT}"
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


# --- SGLang's flags after `--` ------------------------------------------------------------

# What serve reads of SGLang 0.5.23's ServerArgs command line: dest -> its option strings and
# type. argparse also takes `--name=value` and any unambiguous prefix of a long option
# (allow_abbrev), the last occurrence winning. tests/sglang/test_serve_flags.py holds this
# table and `sglang_flags` to SGLang's own parser on generated argument lists.
SGLANG_FLAGS: dict[str, tuple[tuple[str, ...], type]] = {
    "tp_size": (("--tp-size", "--tensor-parallel-size"), int),
    "ep_size": (("--ep-size", "--expert-parallel-size", "--ep"), int),
    "pp_size": (("--pp-size", "--pipeline-parallel-size"), int),
    "nnodes": (("--nnodes",), int),
    "mem_fraction_static": (("--mem-fraction-static",), float),
    "moe_runner_backend": (("--moe-runner-backend",), str),
}


def _dest_of(name: str) -> str | None:
    """The dest an option name means to argparse, among SGLANG_FLAGS: an exact option string,
    or a prefix of option strings of one dest only (a prefix of two dests' is ambiguous to
    argparse too). None for other options. A prefix that SGLang's other options share is
    refused by argparse itself, so reading it as ours never misreads what SGLang runs."""
    exact = [d for d, (names, _) in SGLANG_FLAGS.items() if name in names]
    if exact:
        return exact[0]
    if len(name) < 3 or not name.startswith("--"):
        return None
    dests = {d for d, (names, _) in SGLANG_FLAGS.items() if any(n.startswith(name) for n in names)}
    if len(dests) > 1:
        options = sorted(n for d in dests for n in SGLANG_FLAGS[d][0] if n.startswith(name))
        raise ServeError(
            f"{name} after -- is ambiguous (it abbreviates {', '.join(options)}): write the "
            "option in full",
            "ambiguous-flag",
        )
    return dests.pop() if dests else None


def sglang_flags(args: Sequence[str]) -> dict[str, Any]:
    """{dest: value} for the SGLANG_FLAGS given in `args` (SGLang's own command line), read as
    argparse reads them; raises ServeError for a missing or malformed value."""
    found: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":
            break  # argparse takes nothing after a bare `--` as an option
        if not arg.startswith("--"):
            continue
        name, eq, value = arg.partition("=")
        dest = _dest_of(name)
        if dest is None:
            continue
        if not eq:
            if i >= len(args) or (args[i].startswith("-") and not _is_number(args[i])):
                raise ServeError(f"{arg} after -- has no value", "bad-flag")
            value = args[i]
            i += 1
        kind = SGLANG_FLAGS[dest][1]
        try:
            found[dest] = kind(value)
        except ValueError:
            raise ServeError(
                f"{name} {value!r} after -- is not {'an integer' if kind is int else 'a number'}",
                "bad-flag",
            ) from None
    return found


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def read_config(root: Path) -> tuple[dict, bool]:
    """(config.json, converted?): what the command depends on, checked or not."""
    cfg_path = root / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise ServeError(f"{cfg_path}: cannot read the model config ({exc})", "config") from exc
    if not isinstance(cfg, dict):
        raise ServeError(f"{cfg_path}: not a JSON object", "config")
    return cfg, find_block(cfg) is not None


def check_config(root: Path, cfg: dict, *, converted: bool) -> None:
    """The config-level checks: a usable block and fail-closed wrapper, or a config that
    carries neither; SiTU experts."""
    cfg_path = root / "config.json"
    if converted:
        problems = contract.check_block(cfg) + contract.check_wrapped(cfg)
        if problems:
            raise ServeError(
                f"{cfg_path}: not a usable converted checkpoint (a server without the adapter "
                "must refuse it, and the adapter must agree with its block):\n  - "
                + "\n  - ".join(f"[{p.code.value}] {p.render()}" for p in problems)
                + "\nConvert it again from the source.",
                problems[0].code.value,
            )
    elif contract.marks(cfg):
        raise ServeError(
            f"{cfg_path}: [{Code.BLOCK_MISSING.value}] quantization_config is wrapped as "
            f"'{contract.WRAPPER_METHOD}' but there is no '{contract.BLOCK_KEY}' block: the "
            "checkpoint is half converted or was edited. Convert it again from the source.",
            Code.BLOCK_MISSING.value,
        )
    text = text_config(cfg)
    if text.get("hidden_act") != "situ":
        raise ServeError(
            f"{cfg_path}: hidden_act is {text.get('hidden_act')!r}, not 'situ'", "not-situ"
        )


def check_moe_tp(cfg: dict, *, tp: int, ep: int, backend: str) -> None:
    """A MoE tensor-parallel size the CUTLASS SiTU method can run (it does not pad)."""
    n = text_config(cfg).get("moe_intermediate_size")
    moe_tp = tp // ep
    aligned = isinstance(n, int) and n % moe_tp == 0 and (n // moe_tp) % ALIGNMENT == 0
    if backend == BACKEND and not aligned:
        raise ServeError(
            f"moe_intermediate_size {n} over moe-TP {moe_tp} (= tp/ep) is not a multiple of "
            f"{ALIGNMENT}: the CUTLASS SiTU method does not pad. Pick another --tp/--ep "
            "(Kimi-K3: tp/ep in 1, 2, 3, 4, 6, 8, 12, 24), or --backend marlin.",
            "moe-tp-alignment",
        )


def check_checkpoint(
    root: Path, *, unconverted: bool, tp: int, ep: int, backend: str = BACKEND
) -> tuple[dict, bool]:
    """(config, converted?) after the config-level and MoE-TP checks; raises ServeError."""
    cfg, converted = read_config(root)
    _require_converted_or_opt_in(root, cfg, converted=converted, unconverted=unconverted)
    check_config(root, cfg, converted=converted)
    if tp < 1 or ep < 1 or tp % ep:
        raise ServeError(f"--tp {tp} / --ep {ep}: both >= 1 and --ep must divide --tp", "bad-flag")
    check_moe_tp(cfg, tp=tp, ep=ep, backend=backend)
    return cfg, converted


def _require_converted_or_opt_in(root: Path, cfg: dict, *, converted: bool, unconverted: bool):
    # Not a check that --skip-checks skips: it decides what is served (and the opt-in).
    if not converted and not unconverted and not contract.marks(cfg):
        raise ServeError(
            f"{root} is not a converted checkpoint (no '{contract.BLOCK_KEY}' block in "
            "config.json). Convert it with `kimi-convert SRC OUT`, or pass --unconverted to "
            f"serve the original with the adapter's SiTU method ({OPT_IN_ENV}=1).",
            "not-converted",
        )


# --- capacity: can the GPUs hold the checkpoint? --------------------------------------------


def checkpoint_bytes(root: Path) -> tuple[int, str]:
    """(bytes, where from): the index's metadata.total_size (the tensors' bytes), else the
    sizes of the shards SGLang would load (those the index names, or every top-level
    *.safetensors without an index)."""
    index = root / "model.safetensors.index.json"
    shards: set[str] = set()
    if index.is_file():
        try:
            data = json.loads(index.read_text())
        except (OSError, ValueError):
            data = {}
        total = (data.get("metadata") or {}).get("total_size") if isinstance(data, dict) else None
        if isinstance(total, int) and not isinstance(total, bool) and total > 0:
            return total, "the index's total_size"
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if isinstance(weight_map, dict):
            shards = {str(v) for v in weight_map.values()}
    else:
        shards = {p.name for p in root.glob("*.safetensors")}
    size = 0
    for name in shards:
        try:
            size += (root / name).stat().st_size
        except OSError:
            continue  # a missing shard is verify's finding, not this check's
    return size, f"the sizes of its {len(shards)} shard file(s)"


def detect_gpu_memory(
    run: Callable[..., Any] = subprocess.run, which: Callable[[str], Any] = shutil.which
) -> tuple[int, str] | None:
    """(bytes of the smallest visible GPU, how it was read), or None without a GPU.

    nvidia-smi first (no CUDA context, no torch import); torch.cuda where it is missing."""
    if which("nvidia-smi"):
        try:
            out = run(
                ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            mib = [int(x) for x in out.stdout.split() if x.strip().isdigit()]
            if out.returncode == 0 and mib:
                return min(mib) * 2**20, f"nvidia-smi, {len(mib)} GPU(s)"
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count():
            sizes = [
                torch.cuda.get_device_properties(i).total_memory
                for i in range(torch.cuda.device_count())
            ]
            return min(sizes), f"torch.cuda, {len(sizes)} GPU(s)"
    except Exception:  # no torch, no driver: nothing to read
        pass
    return None


@dataclass(frozen=True)
class Capacity:
    """The arithmetic of the capacity check, for the message and for tests."""

    checkpoint: int
    source: str
    gpus: int
    nnodes: int
    per_gpu: int
    memory_source: str
    fraction: float | None

    @property
    def usable(self) -> float:
        return self.per_gpu * (self.fraction if self.fraction is not None else 1.0)

    @property
    def needed_per_gpu(self) -> float:
        return self.checkpoint / self.gpus

    @property
    def fits(self) -> bool:
        return self.needed_per_gpu <= self.usable

    @property
    def min_gpus(self) -> int:
        return max(1, math.ceil(self.checkpoint / self.usable))


def check_capacity(
    root: Path,
    *,
    tp: int,
    pp: int,
    nnodes: int,
    gpu_memory: int | None,
    mem_fraction: float | None,
    detect: Callable[[], tuple[int, str] | None] = detect_gpu_memory,
) -> Capacity | None:
    """Refuse a layout whose GPUs cannot hold the checkpoint even split evenly (the least
    any rank holds: a lower bound, so this never refuses a layout that could run).

    One model replica spans tp x pp GPUs (over `nnodes` nodes); data-parallel replicas each
    hold a whole copy. Returns the arithmetic, or None when the per-GPU memory is unknown."""
    size, source = checkpoint_bytes(root)
    if size <= 0:
        return None
    if gpu_memory is not None:
        per_gpu, how = gpu_memory, "--gpu-memory"
    else:
        found = detect()
        if found is None:
            click.echo(
                "serve: no GPU visible here and no --gpu-memory given: not checking that the "
                f"GPUs can hold the checkpoint ({human(size)})",
                err=True,
            )
            return None
        per_gpu, how = found
    cap = Capacity(size, source, tp * pp, nnodes, per_gpu, how, mem_fraction)
    if not cap.fits:
        each = human(per_gpu)
        if mem_fraction is not None:
            each += f" x --mem-fraction-static {mem_fraction} = {human(cap.usable)}"
        raise ServeError(
            f"the GPUs cannot hold this checkpoint: {human(size)} ({source}) over "
            f"tp {tp} x pp {pp} = {cap.gpus} GPU(s) (on {nnodes} node(s)) is "
            f"{human(cap.needed_per_gpu)} per GPU at the least, more than the {each} each GPU "
            f"has ({how}). It needs at least {cap.min_gpus} such GPUs for the weights alone, "
            "before KV cache and activations (Kimi-K3 on H200s: 16, two nodes; see the "
            "README). Use more GPUs (a larger --tp, or -- --pp-size; across nodes with -- "
            "--nnodes), or give --gpu-memory when this machine is not the one that serves.",
            "capacity",
        )
    return cap


def plan_serve(
    root: Path,
    extra: Sequence[str] = (),
    *,
    tp: int = 1,
    ep: int = 1,
    backend: str = BACKEND,
    unconverted: bool = False,
    python: str = sys.executable,
    checks: bool = True,
    gpu_memory: int | None = None,
    detect: Callable[[], tuple[int, str] | None] = detect_gpu_memory,
) -> ServePlan:
    """The server command for `root`, after the config, MoE-TP and capacity checks (all
    skipped with checks=False, as --skip-checks does); no structure verify, no stack checks.

    SGLang's own flags after `--` (any of their names and forms) win over ours: the checks
    look at the layout SGLang will really use."""
    given = sglang_flags(extra)
    backend = given.get("moe_runner_backend", backend)
    tp = given.get("tp_size", tp)
    ep = given.get("ep_size", ep)
    pp = given.get("pp_size", 1)
    nnodes = given.get("nnodes", 1)
    cfg, converted = read_config(root)
    _require_converted_or_opt_in(root, cfg, converted=converted, unconverted=unconverted)
    for name, value in (("tp", tp), ("ep", ep), ("pp", pp), ("nnodes", nnodes)):
        if value < 1:
            raise ServeError(f"--{name} {value}: must be at least 1", "bad-flag")
    if tp % ep:
        raise ServeError(f"--tp {tp} / --ep {ep}: --ep must divide --tp", "bad-flag")
    if checks:
        check_config(root, cfg, converted=converted)
        check_moe_tp(cfg, tp=tp, ep=ep, backend=backend)
        check_capacity(
            root,
            tp=tp,
            pp=pp,
            nnodes=nnodes,
            gpu_memory=gpu_memory,
            mem_fraction=given.get("mem_fraction_static"),
            detect=detect,
        )
    argv = [python, "-m", "sglang.launch_server", "--model-path", str(root)]
    if "moe_runner_backend" not in given:
        argv += ["--moe-runner-backend", backend]
    if "tp_size" not in given:
        argv += ["--tp-size", str(tp)]
    if ep > 1 and "ep_size" not in given:
        argv += ["--ep-size", str(ep)]
    argv += list(extra)
    env = {OPT_IN_ENV: "1"} if (unconverted and not converted) else {}
    return ServePlan(argv=argv, env=env)


def verify_structure(root: Path) -> list[str]:
    """`kimi-convert verify`'s structure level (headers, index, block): rendered problems."""
    from ...converter.audit import verify

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
    type=PathArg(exists=True, file_okay=False, path_type=Path),
)
@click.option(
    "--tp",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    metavar="N",
    help="Tensor-parallel size (GPUs); a --tp-size/--tensor-parallel-size after -- wins.",
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
    type=PathArg(exists=True, file_okay=False, path_type=Path),
    default=None,
    metavar="DIR",
    help="Load the plugin's FlashInfer modules from this bundle (`prebuild --out DIR`) in "
    "every server process (sets KIMI_W31_KERNELS); a bundle that does not match the serving "
    "stack is refused, never loaded.",
)
@click.option("--print", "print_only", is_flag=True, help="Print the command, do not run it.")
@click.option(
    "--gpu-memory",
    "gpu_memory",
    default=None,
    metavar="SIZE",
    help="Memory of each serving GPU (e.g. 141GB) [default: read from this machine's GPUs]; "
    "for a launch from a machine that is not the one that serves.",
)
@click.option(
    "--skip-checks",
    is_flag=True,
    help="Skip every check above (checkpoint, stack, MoE-TP alignment, capacity).",
)
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
    gpu_memory: str | None,
    skip_checks: bool,
    sglang_args: tuple[str, ...],
) -> None:
    """Check CHECKPOINT_DIR and the SGLang stack, then run SGLang's server on it.

    Before starting anything: verify's structure level on the checkpoint, the kimi_w31 block
    against the model config, the fail-closed wrapper, sglang 0.5.23 and flashinfer-python
    >= 0.7.0 with the kimi_w31 plugin installed, a MoE tensor-parallel size the CUTLASS
    SiTU method can run, and GPUs that can hold the checkpoint (its size over tp x pp GPUs
    against each GPU's memory, read from this machine's GPUs or given with --gpu-memory).
    Arguments after `--` go to `python -m sglang.launch_server` unchanged (its
    --tp-size/--tensor-parallel-size, --ep-size/--expert-parallel-size/--ep,
    --pp-size/--pipeline-parallel-size, --nnodes, --mem-fraction-static and
    --moe-runner-backend win over ours, in any form argparse takes, and are checked).

    Kimi-K3 needs 16 H200s on two nodes: run on each node, with its --node-rank.

    \b
    Examples:
      kimi-convert serve out/ --tp 16 --ep 2 -- --nnodes 2 --node-rank 0 \\
          --dist-init-addr HEAD:5000
      kimi-convert serve out/ --tp 16 --ep 2 --gpu-memory 141GB --print   from a login node
      kimi-convert serve out/ --tp 16 --ep 2 --backend marlin             SGLang's marlin MoE
      kimi-convert serve SRC/ --unconverted --tp 16 --ep 2                the original, SiTU
      kimi-convert serve out/ --tp 16 --ep 2 --prebuild                   FlashInfer's build first
      kimi-convert serve out/ --tp 16 --ep 2 --kernels kernels/           a prebuilt kernel bundle

    Exit codes: 0 (or the server's own), 1 a check failed, 2 usage error.
    """
    guard_paths()
    # A bundle that does not match this stack is refused first: nothing else runs for it.
    bundle_env = kernel_bundle_env(kernels) if kernels is not None else {}
    per_gpu = parse_size(gpu_memory) if gpu_memory is not None else None
    plan = plan_serve(
        checkpoint,
        sglang_args,
        tp=tp,
        ep=ep,
        backend=backend,
        unconverted=unconverted,
        checks=not skip_checks,
        gpu_memory=per_gpu,
    )
    if not skip_checks:
        problems = check_stack()
        if not plan.env:  # a converted checkpoint: prove its structure first
            problems += [f"verify: {p}" for p in verify_structure(checkpoint)]
        if problems:
            raise ServeError("not starting the server:\n  - " + "\n  - ".join(problems))
    plan.env.update(bundle_env)  # after the checks: they read plan.env as "unconverted"
    if print_only:
        click.echo(plan.shell())
        return
    if prebuild_first:
        run_prebuild(None, "auto")
    os.execvpe(plan.argv[0], plan.argv, {**os.environ, **plan.env})


def kernel_bundle_env(kernels: Path) -> dict[str, str]:
    """The variable that points every server process at a kernel bundle, once the bundle
    passes the plugin's own pre-flight here (there, safe to read, built for this machine's
    FlashInfer, torch, CUDA, Python and CPU: `kernels.preflight_bundle`), before anything
    else is checked or started. The plugin checks it again in every server process."""
    from ..bundle import BundleError
    from ..kernels import ENV_BUNDLE, preflight_bundle

    env = {ENV_BUNDLE: os.path.realpath(kernels)}
    try:
        preflight_bundle(env)
    except BundleError as exc:
        raise ServeError(f"--kernels {kernels}: {exc}", reason="kernel-bundle") from None
    except ImportError as exc:  # no torch here: the stack cannot be compared
        raise ServeError(
            f"--kernels {kernels}: cannot read this machine's stack ({exc}); {INSTALL_HINT}",
            reason="kernel-bundle",
        ) from None
    return env


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
    from ...converter import console
    from ..bundle import BundleError
    from ..flashinfer_moe import SituUnsupportedError
    from ..prebuild import PrebuildError, prebuild

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
    except (PrebuildError, SituUnsupportedError, BundleError) as exc:
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
    type=click.Choice(list(VARIANTS)),
    multiple=True,
    help="Which serving path's module (repeatable) [default: w4a16 on sm90, sm120 on sm120]; "
    "w4a8 is SM90 --flashinfer-mxfp4-moe-precision fp8; w4a16-all is W4A16 with every "
    "tactic FlashInfer lists instead of Kimi-K3's measured set (served with "
    "KIMI_W31_TACTICS=all).",
)
@click.option(
    "--out",
    type=PathArg(file_okay=False, path_type=Path),
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
    it calls and, for SM90 W4A16, only the kernels of the tactics measured fastest at
    Kimi-K3's shapes (25 translation units instead of FlashInfer's 248). Without them
    built, every cold server rank compiles one inside weight loading. This compiles them
    into FlashInfer's JIT cache here and, with --out, into a bundle that serving nodes
    load with no compiler (`serve --kernels DIR`). A second run returns at once.

    \b
    Examples:
      kimi-convert prebuild                          on the serving machine (its GPU)
      kimi-convert prebuild --arch sm90 --out kernels/ --progress lines > build.log 2>&1
      kimi-convert prebuild --arch sm90 --precision w4a16 --precision w4a8 --out kernels/
      kimi-convert serve out/ --tp 16 --ep 2 --kernels kernels/ -- --nnodes 2 ...

    Exit codes: 0 built or already built, 1 it cannot be built here, 2 usage error.
    """
    guard_paths()
    run_prebuild(arch, progress_mode, out=out, precision=precision, jobs=jobs, plan_only=plan_only)

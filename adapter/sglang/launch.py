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
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from ...converter import contract
from ...converter.cli.arguments import PathArg, json_option, progress_option
from ...converter.cli.console import (
    guard_paths,
    human,
    parse_size,
    render_error,
)
from ...converter.contract import STATE_DIR
from ...converter.errors import Fatal, Problem, fatal
from ...converter.reasons import Code
from ...converter.text import plural
from ..arch import ARCHES
from ..kernels import VARIANTS
from ..layout import OPT_IN_ENV, find_block, text_config
from ..reasons import AdapterCode
from ..refused import Refused, words

SGLANG_PIN = "0.5.23"
FLASHINFER_MIN = (0, 7, 0)
PLUGIN_GROUP, PLUGIN_NAME = "sglang.srt.plugins", "kimi_w31"
BACKEND = "flashinfer_mxfp4"
ALIGNMENT = 128
INDEX_NAME = "model.safetensors.index.json"


class ServeError(click.ClickException):
    """A reason not to start the server: the converter's `Fatal` (problems with reason codes,
    worded by their records, adapter/reasons/serve.py), raised through click.
    `reason` is the first cause's code, stable for tests and tools; the exit code is the one
    its record gives (usage reasons 2, the rest 1), as in convert and verify."""

    def __init__(self, error: Fatal) -> None:
        self.error = error
        super().__init__(words(error))
        self.reason = error.roots[0].code.value

    @property
    def exit_code(self) -> int:  # type: ignore[override]
        return self.error.exit_code


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
) -> list[Fatal]:
    """What the installed SGLang / FlashInfer / plugin lack, one coded refusal per finding
    (`stack-unready`, its rule the kind of finding; empty: all good)."""
    found: list[Fatal] = []
    for dist, check, want in (
        ("sglang", lambda v: v == SGLANG_PIN, f"== {SGLANG_PIN}"),
        ("flashinfer-python", lambda v: _version_tuple(v) >= FLASHINFER_MIN, ">= 0.7.0"),
    ):
        try:
            version = version_of(dist)
        except md.PackageNotFoundError:
            found.append(
                fatal(
                    AdapterCode.STACK_UNREADY,
                    rule="not-installed",
                    package=dist,
                    want=want,
                    install=INSTALL_HINT,
                )
            )
            continue
        if not check(version):
            found.append(
                fatal(
                    AdapterCode.STACK_UNREADY,
                    rule="version",
                    package=dist,
                    version=version,
                    want=want,
                    install=INSTALL_HINT,
                )
            )
    names = {ep.name: ep for ep in entry_points(group=PLUGIN_GROUP)}
    if PLUGIN_NAME not in names:
        found.append(
            fatal(
                AdapterCode.STACK_UNREADY,
                rule="no-entry-point",
                plugin=PLUGIN_NAME,
                group=PLUGIN_GROUP,
            )
        )
    else:
        try:
            names[PLUGIN_NAME].load()
        except Exception as exc:  # the plugin itself must import without SGLang running
            found.append(
                fatal(
                    AdapterCode.STACK_UNREADY,
                    rule="plugin-import",
                    plugin=PLUGIN_NAME,
                    error=repr(exc),
                )
            )
    allowed = environ.get("SGLANG_PLUGINS", "")
    if allowed.strip() and PLUGIN_NAME not in {x.strip() for x in allowed.split(",")}:
        found.append(
            fatal(
                AdapterCode.STACK_UNREADY,
                rule="plugins-filtered",
                value=allowed,
                plugin=PLUGIN_NAME,
            )
        )
    return found


def one_refusal(errors: Sequence[Fatal], problems: Sequence[Problem] = ()) -> Fatal | None:
    """One refusal of every problem found (None: nothing), hinted with each distinct hint
    of the refusals merged."""
    every = [p for e in errors for p in e.problems] + list(problems)
    hints = dict.fromkeys(e.hint for e in errors if e.hint)
    return Fatal(every, hint="; ".join(hints) or None) if every else None


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
    "moe_dp_size": (("--moe-dp-size", "--moe-data-parallel-size"), int),
    "reasoning_parser": (("--reasoning-parser",), str),
    "tool_call_parser": (("--tool-call-parser",), str),
    "json_model_override_args": (("--json-model-override-args",), str),
    "host": (("--host",), str),
    "port": (("--port",), int),
}

# SGLang's switches (store_true) that serve looks for after `--`, by their exact spelling.
SGLANG_SWITCHES = ("--skip-tokenizer-init", "--language-model-only", "--trust-remote-code")

# What every upstream Kimi-K3 recipe passes to serve real traffic: the tokenizer is the
# repository's own code (tokenization_kimi.py + tiktoken.model), and the chat output carries
# reasoning and tool calls in Kimi-K3's format. The parser names are keys of SGLang
# 0.5.23's registries (tests/sglang/test_serve_flags.py holds them there).
KIMI_PARSERS = {"reasoning_parser": "kimi_k3", "tool_call_parser": "kimi_k3"}
# SGLang builds Kimi-K3's multimodal processor even with --skip-tokenizer-init, and its
# --language-model-only refuses Kimi-K3; this override is what text-only serving needs.
TEXT_ONLY_OVERRIDE = {"language_model_only": True}
# Across nodes NCCL and Gloo must use the interface that reaches the other node (left to
# themselves they may pick a docker bridge or a loopback and hang at the rendezvous).
IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


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
        raise ServeError(fatal(AdapterCode.AMBIGUOUS_FLAG, name=name, options=", ".join(options)))
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
                raise ServeError(fatal(AdapterCode.BAD_FLAG, rule="no-value", flag=arg))
            value = args[i]
            i += 1
        kind = SGLANG_FLAGS[dest][1]
        try:
            found[dest] = kind(value)
        except ValueError:
            if kind is int:
                raise ServeError(
                    fatal(AdapterCode.BAD_FLAG, rule="not-integer", flag=name, value=value)
                ) from None
            raise ServeError(
                fatal(AdapterCode.BAD_FLAG, rule="not-number", flag=name, value=value)
            ) from None
    return found


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_finished(root: Path) -> None:
    """An output the converter has started but not finished (its state folder, no index yet:
    the index is written last) is refused as that, before any file in it is judged."""
    if (root / STATE_DIR).is_dir() and not (root / INDEX_NAME).exists():
        raise ServeError(fatal(Code.INCOMPLETE_OUTPUT, rule="running", file=root, state=STATE_DIR))


def read_config(root: Path) -> tuple[dict, bool]:
    """(config.json, converted?): what the command depends on, checked or not."""
    check_finished(root)
    cfg_path = root / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise ServeError(
            fatal(Code.FILE_UNREADABLE, rule="read", file=cfg_path, error=exc)
        ) from exc
    if not isinstance(cfg, dict):
        raise ServeError(fatal(Code.JSON_INVALID, rule="config-not-object", file=cfg_path))
    return cfg, find_block(cfg) is not None


def check_config(root: Path, cfg: dict, *, converted: bool) -> None:
    """The config-level checks: a usable block and fail-closed wrapper, or a config that
    carries neither; SiTU experts."""
    cfg_path = root / "config.json"
    if converted:
        problems = contract.check_block(cfg) + contract.check_wrapped(cfg)
        if problems:
            raise ServeError(Fatal(problems))
    elif contract.marks(cfg):
        raise ServeError(fatal(Code.BLOCK_MISSING, rule="wrapped", file=cfg_path))
    text = text_config(cfg)
    if text.get("hidden_act") != "situ":
        raise ServeError(fatal(AdapterCode.NOT_SITU, file=cfg_path, act=text.get("hidden_act")))


def moe_tp_size(tp: int, ep: int, moe_dp: int = 1) -> int:
    """The MoE's tensor-parallel size SGLang 0.5.23 runs (runtime_context.py's
    `derive_parallel_widths`: tp // ep // moe_dp), after its own refusals of the layout
    (parallel_hook.py), restated so a layout SGLang refuses is refused here first.
    tests/sglang/test_serve_flags.py holds both to SGLang's code."""
    for name, value in (("tp", tp), ("ep", ep), ("moe-dp-size", moe_dp)):
        if value < 1:
            raise ServeError(
                fatal(AdapterCode.BAD_FLAG, rule="at-least-one", name=name, value=value)
            )
    if tp % ep:
        raise ServeError(fatal(AdapterCode.BAD_FLAG, rule="ep-divides-tp", tp=tp, ep=ep))
    # SGLang, with moe_dp > 1: tp % moe_dp == 0, ep * moe_dp <= tp, and ep * moe_dp == tp
    # when ep > 1.
    if moe_dp > 1 and (tp % moe_dp or ep * moe_dp > tp or (ep > 1 and ep * moe_dp != tp)):
        raise ServeError(fatal(AdapterCode.BAD_FLAG, rule="moe-dp", tp=tp, ep=ep, moe_dp=moe_dp))
    return tp // ep // moe_dp


def check_expert_split(cfg: dict, *, ep: int) -> None:
    """Each expert-parallel rank holds num_experts / ep whole experts: ep must divide them."""
    experts = text_config(cfg).get("num_experts")
    if isinstance(experts, int) and experts > 0 and experts % ep:
        fits = [d for d in range(1, experts + 1) if experts % d == 0 and d <= 64]
        raise ServeError(
            fatal(
                AdapterCode.EXPERT_SPLIT,
                ep=ep,
                experts=experts,
                ratio=experts / ep,
                fits=", ".join(map(str, fits)),
            )
        )


def check_moe_tp(cfg: dict, *, tp: int, ep: int, backend: str, moe_dp: int = 1) -> None:
    """A MoE tensor-parallel size the CUTLASS SiTU method can run (it does not pad)."""
    n = text_config(cfg).get("moe_intermediate_size")
    moe_tp = moe_tp_size(tp, ep, moe_dp)
    aligned = isinstance(n, int) and n % moe_tp == 0 and (n // moe_tp) % ALIGNMENT == 0
    if backend == BACKEND and not aligned:
        over = f"tp/ep = {tp}/{ep}" + (f"/moe-dp {moe_dp}" if moe_dp > 1 else "")
        raise ServeError(
            fatal(AdapterCode.MOE_TP_ALIGNMENT, n=n, moe_tp=moe_tp, over=over, alignment=ALIGNMENT)
        )


def _require_converted_or_opt_in(root: Path, cfg: dict, *, converted: bool, unconverted: bool):
    # Not a check that --skip-checks skips: it decides what is served (and the opt-in).
    if not converted and not unconverted and not contract.marks(cfg):
        raise ServeError(fatal(AdapterCode.NOT_CONVERTED, file=root, env=OPT_IN_ENV))


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
    return size, f"the sizes of its {plural(len(shards), 'shard file')}"


def count_gpus(
    run: Callable[..., Any] = subprocess.run,
    which: Callable[[str], Any] = shutil.which,
    driver: Path = Path("/proc/driver/nvidia/gpus"),
) -> int:
    """NVIDIA GPUs this machine has, without importing torch (seconds) or opening a CUDA
    context: nvidia-smi's list, else the driver's /proc entries; 0 when neither shows one."""
    if which("nvidia-smi"):
        try:
            out = run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
            if out.returncode == 0:
                return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        return sum(1 for _ in driver.iterdir())
    except OSError:
        return 0


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
                return min(mib) * 2**20, f"nvidia-smi, {plural(len(mib), 'GPU')}"
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count():
            sizes = [
                torch.cuda.get_device_properties(i).total_memory
                for i in range(torch.cuda.device_count())
            ]
            return min(sizes), f"torch.cuda, {plural(len(sizes), 'GPU')}"
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
    replicated: int = 0  # bytes every rank holds whole (the latent projections)

    @property
    def usable(self) -> float:
        return self.per_gpu * (self.fraction if self.fraction is not None else 1.0)

    @property
    def needed_per_gpu(self) -> float:
        return (self.checkpoint - self.replicated) / self.gpus + self.replicated

    @property
    def fits(self) -> bool:
        return self.needed_per_gpu <= self.usable

    @property
    def min_gpus(self) -> int:
        room = self.usable - self.replicated
        if room <= 0:
            return 0  # no number of such GPUs holds what every rank holds whole
        return max(1, math.ceil((self.checkpoint - self.replicated) / room))


def replicated_bytes(cfg: dict) -> int:
    """Bytes every rank holds whole, from the config's dimensions: each MoE layer's two bf16
    latent projections (hidden x routed_expert_hidden_size each; SGLang builds them without
    tensor parallelism). 0 when the config has no latent MoE."""
    text = text_config(cfg)
    hidden, latent = text.get("hidden_size"), text.get("routed_expert_hidden_size")
    if not all(isinstance(v, int) and v > 0 for v in (hidden, latent)):
        return 0
    layers, problems = contract.moe_layer_ids(text)
    return 0 if problems else len(layers) * 2 * hidden * latent * 2


def check_capacity(
    root: Path,
    *,
    tp: int,
    pp: int,
    nnodes: int,
    gpu_memory: int | None,
    mem_fraction: float | None,
    detect: Callable[[], tuple[int, str] | None] = detect_gpu_memory,
    replicated: int = 0,
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
    cap = Capacity(size, source, tp * pp, nnodes, per_gpu, how, mem_fraction, min(replicated, size))
    if not cap.fits:
        each = human(per_gpu)
        if mem_fraction is not None:
            each += f" x --mem-fraction-static {mem_fraction} = {human(cap.usable)}"
        whole = (
            f" (of which {human(cap.replicated)} every GPU holds whole: the latent projections)"
            if cap.replicated
            else ""
        )
        need = (
            f"at least {cap.min_gpus} such GPUs"
            if cap.min_gpus
            else "GPUs with more memory than what every GPU holds whole"
        )
        raise ServeError(
            fatal(
                AdapterCode.CAPACITY,
                size=human(size),
                source=source,
                whole=whole,
                tp=tp,
                pp=pp,
                gpus=plural(cap.gpus, "GPU"),
                nodes=plural(nnodes, "node"),
                needed=human(cap.needed_per_gpu),
                each=each,
                how=how,
                need=need,
            )
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
    text_only: bool = False,
    ifname: str | None = None,
) -> ServePlan:
    """The server command for `root`, after the config, MoE-TP and capacity checks (all
    skipped with checks=False, as --skip-checks does); no structure verify, no stack checks.

    SGLang's own flags after `--` (any of their names and forms) win over ours: the checks
    look at the layout SGLang will really use."""
    given = sglang_flags(extra)
    switches = {a for a in extra if a in SGLANG_SWITCHES}
    backend = given.get("moe_runner_backend", backend)
    tp = given.get("tp_size", tp)
    ep = given.get("ep_size", ep)
    pp = given.get("pp_size", 1)
    nnodes = given.get("nnodes", 1)
    cfg, converted = read_config(root)
    _require_converted_or_opt_in(root, cfg, converted=converted, unconverted=unconverted)
    moe_dp = given.get("moe_dp_size", 1)
    for name, value in (("pp", pp), ("nnodes", nnodes)):
        if value < 1:
            raise ServeError(
                fatal(AdapterCode.BAD_FLAG, rule="at-least-one", name=name, value=value)
            )
    moe_tp_size(tp, ep, moe_dp)  # a layout SGLang refuses: a usage error before anything
    if "--language-model-only" in switches:
        raise ServeError(
            fatal(AdapterCode.LANGUAGE_MODEL_ONLY, override=json.dumps(TEXT_ONLY_OVERRIDE))
        )
    if checks:
        check_config(root, cfg, converted=converted)
        check_expert_split(cfg, ep=ep)
        check_moe_tp(cfg, tp=tp, ep=ep, backend=backend, moe_dp=moe_dp)
        check_capacity(
            root,
            tp=tp,
            pp=pp,
            nnodes=nnodes,
            gpu_memory=gpu_memory,
            mem_fraction=given.get("mem_fraction_static"),
            detect=detect,
            replicated=replicated_bytes(cfg),
        )
    argv = [python, "-m", "sglang.launch_server", "--model-path", str(root)]
    if "moe_runner_backend" not in given:
        argv += ["--moe-runner-backend", backend]
    if "tp_size" not in given:
        argv += ["--tp-size", str(tp)]
    if ep > 1 and "ep_size" not in given:
        argv += ["--ep-size", str(ep)]
    if "--trust-remote-code" not in switches:
        argv.append("--trust-remote-code")
    for dest, name in KIMI_PARSERS.items():
        if dest not in given:
            argv += [SGLANG_FLAGS[dest][0][0], name]
    argv += list(extra)
    if text_only or "--skip-tokenizer-init" in switches:  # after theirs: the last one wins
        argv += text_only_override(given.get("json_model_override_args"))
    env = {OPT_IN_ENV: "1"} if (unconverted and not converted) else {}
    if ifname:  # the interface NCCL and Gloo (SGLang's CPU group) reach the other node on
        env.update(dict.fromkeys(IFNAME_VARS, ifname))
    return ServePlan(argv=argv, env=env)


def text_only_override(theirs: str | None) -> list[str]:
    """The --json-model-override-args that text-only Kimi-K3 serving needs, merged into the
    user's own (given after `--`): ours comes after theirs on the command line and wins, so
    it keeps what they set and adds the key; nothing when they set the key themselves."""
    merged = dict(TEXT_ONLY_OVERRIDE)
    if theirs is not None:
        try:
            mine = json.loads(theirs)
        except ValueError:
            raise ServeError(
                fatal(AdapterCode.BAD_FLAG, rule="override-not-json", value=theirs)
            ) from None
        if not isinstance(mine, dict):
            raise ServeError(fatal(AdapterCode.BAD_FLAG, rule="override-not-object"))
        if "language_model_only" in mine:
            return []
        merged = {**mine, **merged}
    return ["--json-model-override-args", json.dumps(merged, separators=(",", ":"))]


def verify_structure(root: Path) -> list[Problem]:
    """`kimi-convert verify`'s structure level (headers, index, block): its problems, each
    with its own code (a failed check that kept none is named by a `stack-unready` one)."""
    from ...converter.audit import verify

    report = verify(root)
    return [
        p
        for c in report.checks
        if c.ok is False
        for p in c.problems
        or fatal(AdapterCode.STACK_UNREADY, rule="verify", check=c.name, detail=c.detail).problems
    ]


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
    help="Skip every check above (checkpoint, stack, GPUs here, MoE-TP alignment, capacity).",
)
@click.option(
    "--text-only",
    is_flag=True,
    help="Serve text only: pass --json-model-override-args '{\"language_model_only\": true}' "
    "(SGLang refuses --language-model-only for Kimi-K3); implied by -- --skip-tokenizer-init.",
)
@click.option(
    "--ifname",
    default=None,
    metavar="IFACE",
    help="With several nodes: the network interface that reaches the other nodes (sets "
    "NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME for the server), e.g. eth0 or ib0.",
)
@click.option(
    "--smoke",
    is_flag=True,
    help="Once the server answers /health, send one greedy streamed /generate request and "
    "print its first-token latency (stderr), then keep serving. Node 0 only.",
)
@json_option("a refusal, or with --print the plan (argv, env),")
@click.argument("sglang_args", nargs=-1, type=click.UNPROCESSED)
def serve(as_json: bool, **options: Any) -> None:
    """Check CHECKPOINT_DIR and the SGLang stack, then run SGLang's server on it.

    Before starting anything: a GPU on this machine (unless --print), a finished conversion,
    verify's structure level on the checkpoint, the kimi_w31 block against the model config,
    the fail-closed wrapper, sglang 0.5.23 and flashinfer-python >= 0.7.0 with the kimi_w31
    plugin installed, a layout SGLang runs (--ep dividing --tp and the experts; MoE-TP =
    tp / ep / moe-dp-size) with a MoE tensor-parallel size the CUTLASS SiTU method can run,
    and GPUs that can hold the checkpoint (its size over tp x pp GPUs against each GPU's
    memory, read from this machine's GPUs or given with --gpu-memory). It adds what Kimi-K3
    serving needs: --trust-remote-code and the kimi_k3 reasoning and tool-call parsers.
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
    with json_refusals(as_json):
        _serve(as_json=as_json, **options)  # the options by name: `_serve` types them


@contextmanager
def json_refusals(as_json: bool) -> Iterator[None]:
    """With --json, a refusal is the document convert and verify print (stdout, the same
    `problems_json`), and the exit code its records give; without, click prints it."""
    try:
        yield
    except ServeError as exc:
        if not as_json:
            raise
        render_error(exc.error, as_json=True)
        sys.exit(exc.exit_code)


def _serve(
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
    text_only: bool,
    ifname: str | None,
    smoke: bool,
    as_json: bool,
    sglang_args: tuple[str, ...],
) -> None:
    guard_paths(as_json)
    # A bundle that does not match this stack is refused first: nothing else runs for it.
    bundle_env = kernel_bundle_env(kernels) if kernels is not None else {}
    per_gpu = parse_size(gpu_memory) if gpu_memory is not None else None
    if not print_only and not skip_checks and count_gpus() == 0:  # before any other check
        raise ServeError(fatal(AdapterCode.NO_GPU, rule="serve"))
    plan = plan_serve(
        checkpoint,
        sglang_args,
        tp=tp,
        ep=ep,
        backend=backend,
        unconverted=unconverted,
        checks=not skip_checks,
        gpu_memory=per_gpu,
        text_only=text_only,
        ifname=ifname,
    )
    nodes = sglang_flags(sglang_args).get("nnodes", 1)
    if nodes > 1 and not ifname and not all(os.environ.get(v) for v in IFNAME_VARS):
        click.echo(
            f"serve: {nodes} nodes and no --ifname: NCCL and Gloo pick a network interface "
            "themselves and may pick one that does not reach the other nodes (a hang at the "
            "rendezvous); pass --ifname IFACE",
            err=True,
        )
    if not skip_checks:
        # A converted checkpoint: prove its structure first (verify's problems, its codes).
        structure = verify_structure(checkpoint) if not plan.env else []
        refusal = one_refusal(check_stack(), structure)
        if refusal is not None:
            raise ServeError(refusal)
    plan.env.update(bundle_env)  # after the checks: they read plan.env as "unconverted"
    if print_only:
        if as_json:
            click.echo(json.dumps({"ok": True, "argv": plan.argv, "env": plan.env}))
        else:
            click.echo(plan.shell())
        return
    if prebuild_first:
        run_prebuild(None, "auto")
    if smoke:
        sys.exit(serve_with_smoke(plan, sglang_flags(sglang_args)))
    os.execvpe(plan.argv[0], plan.argv, {**os.environ, **plan.env})


def server_url(given: Mapping[str, Any]) -> str:
    """Where the server listens, as SGLang's --host/--port say (its defaults otherwise); a
    wildcard host is reached on the loopback."""
    host = given.get("host", "127.0.0.1")
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://{host}:{given.get('port', 30000)}"


def serve_with_smoke(plan: ServePlan, given: Mapping[str, Any]) -> int:
    """Run the server as a child, report one request's first-token latency once it is up,
    then keep serving until it exits (Ctrl-C or SIGTERM stop it). Returns its exit code."""
    from .smoke import SmokeError, smoke

    child = subprocess.Popen(plan.argv, env={**os.environ, **plan.env})
    try:
        url = server_url(given)
        text_only = "--skip-tokenizer-init" in plan.argv
        try:
            result = smoke(
                url,
                alive=lambda: child.poll() is None,
                **({"input_ids": [1, 2, 3, 4]} if text_only else {}),
            )
        except SmokeError as exc:
            click.echo(f"smoke: failed ({exc.reason}): {exc}", err=True)
        else:
            click.echo(
                f"smoke: {url} ready after {result.ready_s:.1f} s; first token "
                f"{result.first_token_s * 1000:.0f} ms, {result.tokens} tokens in "
                f"{result.total_s:.2f} s: {result.text!r}",
                err=True,
            )
        return child.wait()
    finally:
        if child.poll() is None:  # an interrupt of ours: stop the server we started
            child.terminate()
            child.wait()


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
        raise ServeError(Fatal(exc.problems)) from None
    except ImportError as exc:  # no torch here: the stack cannot be compared
        raise ServeError(
            fatal(
                AdapterCode.KERNEL_BUNDLE_UNCHECKED,
                kernels=kernels,
                error=exc,
                install=INSTALL_HINT,
            )
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
    """`adapter.prebuild.prebuild` with the converter's progress display; raises ServeError
    with the refusal's own problems (a bundle's, FlashInfer's, the build's: their codes)."""
    from ...converter.cli import console
    from ..prebuild import prebuild

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
    except Refused as exc:  # the build's own refusal, its code passed on
        raise ServeError(exc.error) from None
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
    type=click.Choice(list(ARCHES)),
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

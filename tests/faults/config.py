"""Fault scenarios for the config as SGLang reads it, the file set as its loader opens it,
and bounds on config sizes (run by tools/fault_table.py, like the rest of this package).

Each case is judged by what a user sees: a clean error with its reason code, or (where the
source is valid) a correct output that `verify --source` passes and that holds every tensor
of every shard a loader opens.
"""

from __future__ import annotations

import json
import resource
import shutil
from collections.abc import Callable
from pathlib import Path

from cli_helpers import json_problems, run_cli
from kimi_w31.converter.reasons import Code
from safetensors import safe_open

from . import core as fl
from .planner import _config_edit

C = Code
TEXT_MOE = ("num_experts", "num_hidden_layers", "first_k_dense_replace", "moe_layer_freq")
MEMORY_LIMIT = 4 << 30  # a run that builds 10^10 layers fails fast instead of swapping
# Address space reserved unused grows with the core count (BLAS threads, malloc arenas).
QUIET_THREADS = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}


def _text(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    return _config_edit(lambda c: fn(c["text_config"]))


def _moe_fields_to_top(config: dict) -> None:
    for key in TEXT_MOE:
        config[key] = config["text_config"].pop(key)


def _unindexed(src: Path) -> None:
    (src / fl.INDEX).unlink()


def _index_entry(old: str, new: str) -> Callable[[Path], None]:
    """The index names shard `old` as `new` (the file moved there when `new` is a path)."""

    def mutate(src: Path) -> None:
        if "/" in new and not new.startswith("./"):
            (src / new).parent.mkdir(parents=True, exist_ok=True)
            (src / old).rename(src / new)
        index = json.loads((src / fl.INDEX).read_text())
        index["weight_map"] = {t: new if f == old else f for t, f in index["weight_map"].items()}
        (src / fl.INDEX).write_text(json.dumps(index))

    return mutate


def _copy_unindexed(name: str) -> Callable[[Path], None]:
    def mutate(src: Path) -> None:
        shutil.copy(src / fl.VICTIM, src / name)
        _unindexed(src)

    return mutate


CONFIG_CASES: dict[str, tuple[Callable[[Path], None], Code]] = {
    "MoE fields only at the top level (SGLang reads text_config)": (
        _config_edit(_moe_fields_to_top),
        C.CONFIG_CONFLICT,
    ),
    "top-level num_hidden_layers disagrees with text_config": (
        _config_edit(
            lambda c: c.update(num_hidden_layers=c["text_config"]["num_hidden_layers"] + 1)
        ),
        C.CONFIG_CONFLICT,
    ),
    "n_routed_experts disagrees with num_experts": (
        _text(lambda t: t.update(n_routed_experts=t["num_experts"] * 2)),
        C.CONFIG_CONFLICT,
    ),
    "num_experts_per_tok disagrees with num_experts_per_token": (
        _text(lambda t: t.update(num_experts_per_tok=t["num_experts_per_token"] + 1)),
        C.CONFIG_CONFLICT,
    ),
    "num_hidden_layers written 3.0": (
        _text(lambda t: t.update(num_hidden_layers=float(t["num_hidden_layers"]))),
        C.CONFIG_FIELD,
    ),
    "moe_layer_freq written true": (_text(lambda t: t.update(moe_layer_freq=True)), C.CONFIG_FIELD),
    "no num_experts in text_config (SGLang builds no MoE layer)": (
        _text(lambda t: t.pop("num_experts")),
        C.CONFIG_FIELD,
    ),
}

FILE_SET_CASES: dict[str, tuple[Callable[[Path], None], Code]] = {
    "index names a shard in a subfolder (never loaded)": (
        _index_entry(fl.VICTIM, "sub/" + fl.VICTIM),
        C.SHARD_NOT_LOADED,
    ),
    "index names a shard as ./name (never loaded)": (
        _index_entry(fl.VICTIM, "./" + fl.VICTIM),
        C.SHARD_NOT_LOADED,
    ),
    "no index, a tensor in two top-level shards": (
        _copy_unindexed("extra.safetensors"),
        C.TENSOR_IN_TWO_SHARDS,
    ),
}


def config_cases(template: Path, work: Path) -> list[fl.Case]:
    """Class 2: config values the converter would read differently from SGLang."""
    return fl.hostile_cases(template, work, "config as SGLang reads it", CONFIG_CASES)


def file_set_cases(template: Path, work: Path) -> list[fl.Case]:
    """Class 3: refused file sets, and a source without index converted whole."""
    fault = "file set as the loader opens it"
    rows = fl.hostile_cases(template, work / "refused", fault, FILE_SET_CASES)
    src = fl.copy_source(template, work / "src")
    _unindexed(src)
    out = work / "out"
    proc = run_cli(fl.convert_args(src, out))
    check = run_cli(["verify", out, "--source", src, "--json"])
    served = _names(src.glob("*.safetensors"))
    held = _names(out.glob("*.safetensors"))
    lost = {n for n in served if ".experts." not in n} - held
    name = "no index, several top-level shards: every shard converted"
    if fl.looks_like_crash(proc.stdout + proc.stderr + check.stdout):
        rows.append(fl.Case(fault, name, fl.CRASH, (proc.stderr or check.stdout)[-300:]))
    elif proc.returncode or check.returncode or lost:
        detail = f"convert {proc.returncode}, verify {check.returncode}, {len(lost)} lost"
        rows.append(fl.Case(fault, name, fl.WRONG, detail))
    else:
        rows.append(fl.Case(fault, name, fl.CORRECT, f"{len(served)} tensors from 4 shards"))
    return rows


def _names(files) -> set[str]:
    names: set[str] = set()
    for path in files:
        with safe_open(path, "np") as fh:
            names |= set(fh.keys())
    return names


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


HUGE = {
    "num_hidden_layers 10^10": {"num_hidden_layers": 10**10},
    "num_experts and n_routed_experts 10^12": {"num_experts": 10**12, "n_routed_experts": 10**12},
    "n_routed_experts 10^12 alone": {"n_routed_experts": 10**12},
    "num_nextn_predict_layers 10^9": {"num_nextn_predict_layers": 10**9},
}


def bound_cases(template: Path, work: Path) -> list[fl.Case]:
    """Class 8: sizes far beyond any model, in convert, --dry-run and verify (--json)."""
    fault = "config sizes beyond the checkpoint"
    ref = work / "ref"
    fl.reference_output(fl.copy_source(template, work / "clean"), ref)
    rows = []
    for i, (name, sizes) in enumerate(HUGE.items()):
        src = fl.copy_source(template, work / f"s{i}")
        _text(lambda t, sizes=sizes: t.update(sizes))(src)
        out = work / f"o{i}"
        edited = work / f"v{i}"
        shutil.copytree(ref, edited)
        _text(lambda t, sizes=sizes: t.update(sizes))(edited)
        for how, args in (
            ("convert --dry-run", fl.convert_args(src, out, "--dry-run", "--json")),
            ("convert", fl.convert_args(src, out, "--json")),
            ("verify", ["verify", edited, "--json"]),
        ):
            proc = run_cli(args, env=QUIET_THREADS, preexec_fn=_limited)
            text = proc.stdout
            if fl.looks_like_crash(text + proc.stderr):
                outcome, detail = fl.CRASH, (text + proc.stderr)[-300:]
            elif proc.returncode != 1 or not json_problems(text):
                outcome, detail = fl.WRONG, f"exit {proc.returncode}, not a JSON report"
            elif not fl.codes(text) & {C.CONFIG_BOUND.value, C.CONFIG_CONFLICT.value}:
                outcome, detail = fl.WRONG, f"refused for another reason: {sorted(fl.codes(text))}"
            elif how == "convert" and (out / fl.INDEX).exists():
                outcome, detail = fl.WRONG, "an index (complete-looking output) was written"
            else:
                outcome, detail = fl.CLEAN, fl._first_problem(text)
            rows.append(fl.Case(fault, f"{name}: {how}", outcome, detail))
    return rows

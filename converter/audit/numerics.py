"""Level 4, `--numerics`: sampled experts computed with source and converted semantics agree.

Source semantics: `w1` is gate, `w3` is up, SiTU betas from the source config. Converted
semantics: `w31` split by the block's `fc1_order`, betas from the block. Both dequantize
MXFP4 with the numpy reference (`reference.py`) and run the SiTU expert MLP in fp32 on the
same random inputs; identical bytes through identical fp32 operations may differ only by
rounding, so the relative max error must be <= 1e-5. Swapped halves, a wrong `fc1_order` or
swapped betas fail here even where every byte "moved right". Both sides share one decoder,
so before any expert the reference must reproduce the spec's known answers
(`known_answers.py`): a decoder wrong in the same way on both sides agrees with itself.

One expert at a time, each side computed and freed before the next (~0.2 GB at the real
model's dims); tensors are read with `safetensors.safe_open(framework="numpy")`. No torch.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import contract
from .. import reference as ref
from ..errors import Problem, problem
from ..reasons import Code
from ..reference import known_answers
from ..source import Source
from .meter import MeterFactory
from .report import VerifyReport
from .structure import Output

LEVEL = "numerics"
RTOL = 1e-5  # identical bytes through identical fp32 ops: only rounding may differ
TOKENS = 16  # input rows per expert


@dataclass(frozen=True)
class Semantics:
    """How one side reads an expert: fc1 order (None: separate w1/w3) and SiTU betas."""

    order: tuple[str, str] | None
    beta: float
    linear_beta: float


def check_numerics(
    out: Output,
    source: Source,
    sample: int | None,
    seed: int,
    meter: MeterFactory,
    report: VerifyReport,
) -> None:
    title = "numerics: source vs converted semantics"
    failed = self_test()
    if failed:  # a wrong decoder agrees with itself: compare nothing through it
        report.add("numerics", LEVEL, title, failed, "not run")
        return
    sides, problems = _semantics(out, source)
    chosen = _choose(out, source, sample, seed)
    if sides is None or not chosen:
        if not chosen:
            problems.append(problem(Code.NUMERICS_UNAVAILABLE, rule="no-expert"))
        report.add("numerics", LEVEL, title, problems, "not run")
        return
    src, conv = sides
    out_files, src_files = out.tensor_files(), _source_tensor_files(source)
    rng = np.random.default_rng(seed)
    worst = 0.0
    with meter("verify --numerics", len(chosen), "experts") as progress:
        for i, (prefix, expert) in enumerate(chosen, start=1):
            progress.note(expert=f"{i} of {len(chosen)} ({prefix}experts.{expert})")
            err, found = _compare_expert(
                out, source, out_files, src_files, prefix, expert, src, conv, rng
            )
            worst = max(worst, err) if math.isfinite(err) else worst
            if found is not None:
                problems.append(found)
            progress.advance(1)
    report.add(
        "numerics",
        LEVEL,
        title,
        problems,
        f"{len(chosen)} experts, SiTU({conv.beta:g}, {conv.linear_beta:g}) vs SiTU({src.beta:g}, "
        f"{src.linear_beta:g}), worst rel. error {worst:.2g}",
    )


def self_test() -> list[Problem]:
    """The numpy reference against the spec's known answers (docs/format.md, section 11).

    Source and converted experts go through the same decoder, so a decoder with swapped
    nibbles or an off-by-one scale bias would pass the comparison below; answers fixed in
    advance do not.
    """
    return [problem(Code.NUMERICS_SELF_TEST, case=m) for m in known_answers.self_test()]


def _semantics(
    out: Output, source: Source
) -> tuple[tuple[Semantics, Semantics] | None, list[Problem]]:
    """(source, converted) semantics, or the problems that make numerics impossible."""
    block, problems = out.block, []
    order = block.get("fc1_order")
    if not isinstance(order, list) or len(order) != 2 or set(order) != {"up", "gate"}:
        problems.append(
            problem(
                Code.NUMERICS_UNAVAILABLE, rule="fc1-order", file=contract.CONFIG_NAME, order=order
            )
        )
    betas = {}
    for side, get in (
        ("source", lambda k: contract.config_value(source.config, contract.SITU_CONFIG_KEYS[k])),
        ("converted", block.get),
    ):
        for key in contract.SITU_CONFIG_KEYS:
            value = get(key)
            if not _number(value):
                problems.append(
                    problem(
                        Code.NUMERICS_UNAVAILABLE,
                        rule="situ",
                        file=contract.CONFIG_NAME,
                        side=side,
                        key=key,
                        value=value,
                    )
                )
            betas[side, key] = value
    if problems:
        return None, problems
    src = Semantics(
        None, float(betas["source", "situ_beta"]), float(betas["source", "situ_linear_beta"])
    )
    conv = Semantics(
        (order[0], order[1]),
        float(betas["converted", "situ_beta"]),
        float(betas["converted", "situ_linear_beta"]),
    )
    return (src, conv), []


def _number(value: object) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def _names(prefix: str, expert: int, projs: tuple[str, ...]) -> list[str]:
    return [contract.expert_name(prefix, expert, p, s) for p in projs for s in contract.SUFFIXES]


SOURCE_PROJS = (contract.GATE, contract.UP, contract.DOWN)
OUTPUT_PROJS = (contract.FUSED, contract.DOWN)


def _choose(out: Output, source: Source, sample: int | None, seed: int) -> list[tuple[str, int]]:
    """The experts to compare: complete on both sides, a seeded sample unless `sample` is
    None (all)."""
    if out.layout is None:
        return []
    have_out = {n for h in out.headers.values() for n in h.tensors}
    have_src = {n for h in source.headers.values() for n in h.tensors}
    candidates = [
        (p, e)
        for p, e in out.layout.expert_prefixes()
        if all(n in have_out for n in _names(p, e, OUTPUT_PROJS))
        and all(n in have_src for n in _names(p, e, SOURCE_PROJS))
    ]
    if sample is None or sample >= len(candidates):
        return candidates
    return sorted(random.Random(seed).sample(candidates, sample))


def _source_tensor_files(source: Source) -> dict[str, str]:
    return {n: f for f, h in source.headers.items() for n in h.tensors}


def _compare_expert(
    out: Output,
    source: Source,
    out_files: dict[str, str],
    src_files: dict[str, str],
    prefix: str,
    expert: int,
    src: Semantics,
    conv: Semantics,
    rng: np.random.Generator,
) -> tuple[float, Problem | None]:
    where = f"{prefix}experts.{expert}.*"
    try:
        gate, up, down = (
            _load(source.root, src_files, n, "source") for n in _pairs(prefix, expert, SOURCE_PROJS)
        )
        k = gate[0].shape[1] * 2
        x = rng.standard_normal((TOKENS, k), dtype=np.float32)
        want = ref.expert_forward(x, ref.dequant_expert(gate, up, down), src.beta, src.linear_beta)
        del gate, up, down  # one side in memory at a time
        w31, down = (
            _load(out.root, out_files, n, "output") for n in _pairs(prefix, expert, OUTPUT_PROJS)
        )
        weights = ref.dequant_converted_expert(w31, down, conv.order or ("up", "gate"))
        del w31, down
        got = ref.expert_forward(x, weights, conv.beta, conv.linear_beta)
        del weights
    except Finding as exc:  # a NaN scale, a file the library refuses: reported, never raised
        return math.nan, exc.problem
    except (TypeError, ValueError, OSError, KeyError) as exc:
        return math.nan, problem(Code.NUMERICS_UNAVAILABLE, rule="expert", tensor=where, error=exc)
    err = relative_error(got, want)
    if err <= RTOL:
        return err, None
    stats = ref.compare(got, want)
    return err, problem(
        Code.NUMERICS_DIFFER, tensor=where, rtol=RTOL, rel_error=err, cosine=stats["cosine"]
    )


def _pairs(prefix: str, expert: int, projs: tuple[str, ...]) -> list[tuple[str, str]]:
    """(packed, scale) tensor names per projection."""
    names = _names(prefix, expert, projs)
    return list(zip(names[::2], names[1::2], strict=True))


class Finding(Exception):
    def __init__(self, finding: Problem) -> None:
        super().__init__(finding.render())
        self.problem = finding


def _load(
    root: Path, files: dict[str, str], pair: tuple[str, str], side: str
) -> tuple[np.ndarray, np.ndarray]:
    from safetensors import SafetensorError, safe_open

    arrays = []
    for name in pair:
        try:
            with safe_open(str(root / files[name]), framework="numpy") as fh:
                arrays.append(fh.get_tensor(name))
        except SafetensorError as exc:  # loaders cannot read it: the library's own verdict
            raise Finding(
                problem(
                    Code.HEADER_LIBRARY_REFUSES,
                    rule="tensor",
                    file=files[name],
                    tensor=name,
                    side=side,
                    error=exc,
                )
            ) from None
    scale = arrays[1].reshape(-1)
    nan = np.flatnonzero(scale == 0xFF) if scale.dtype == np.uint8 else ()
    if len(nan):  # E8M0 NaN: both sides would compute NaN and compare equal
        raise Finding(
            problem(
                Code.SCALE_NAN,
                rule="numerics",
                file=files[pair[1]],
                tensor=pair[1],
                count=len(nan),
                side=side,
                first=nan[0],
            )
        )
    return arrays[0], arrays[1]


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want| (0 for identical outputs, NaN positions included)."""
    if np.array_equal(got, want, equal_nan=True):
        return 0.0
    scale = float(np.nanmax(np.abs(want))) if want.size else 0.0
    diff = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
    return diff / (scale or 1.0)

"""Run every fault class against the real converter and write the reliability table.

    python tools/fault_table.py --out .reports/reliability.md    # make faults
    python tools/fault_table.py --out docs/reliability.md        # make faults UPDATE_DOCS=1

Each scenario (shared with the `tests/test_fault_*.py` suites, in the `tests/faults/` package) runs
`kimi-convert` on small synthetic checkpoints and classifies every case by what a user
would see: a clean error, an output resumed byte-identical to an uninterrupted run, a
correct result, a crash (traceback / unexpected exception), or a silently wrong output.
The hypothesis property tests run too, with more examples than in `make test`.
Exit status 1 if any case crashed or was silently wrong.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import faults as fl  # noqa: E402  (lives beside the tests that share it)

OUTCOMES = fl.OUTCOMES
PROPERTY_FILES = [
    "tests/test_fault_headers.py",
    "tests/test_header_differential.py",
    "tests/test_fault_index.py",
    "tests/test_fault_planner.py",
    "tests/test_contract.py",
    "tests/test_units.py",
]


def scenarios(per_label: int) -> list[tuple[str, Callable[[Path, Path], list[fl.Case]]]]:
    return [
        ("headers", fl.header_cases),
        ("index", fl.index_cases),
        ("plan", fl.plan_cases),
        ("kill1", lambda t, w: fl.crash_cases(t, w, 1, per_label)),
        ("kill2", lambda t, w: fl.crash_cases(t, w, 2, per_label)),
        ("sigint", fl.sigint_cases),
        ("torn", fl.torn_ledger_cases),
        ("diskfull", fl.disk_full_cases),
        ("freespace", fl.free_space_cases),
        ("dryrun", fl.dry_run_space_cases),
        ("locks", fl.concurrency_cases),
        ("lockrace", fl.lock_race_cases),
        ("change", fl.source_change_cases),
        ("paths", fl.path_cases),
        ("nan", fl.data_fault_cases),
        ("shapes", fl.shape_cases),
        ("verify", fl.verify_hostile_cases),
        ("verifyfifo", fl.verify_fifo_case),
        ("headerbound", fl.header_bound_cases),
        *(("fs-" + name, scenario) for name, scenario in fl.filesystem.SCENARIOS),
        ("config", fl.config_cases),
        ("fileset", fl.file_set_cases),
        ("bounds", fl.bound_cases),
        ("library", fl.library_cases),
        ("aliases", fl.alias_cases),
        ("publish", fl.publish_proof_cases),
        ("arguments", fl.argument_cases),
        ("hub", fl.hub_cases),
        ("bundle", fl.bundle_cases),
    ]


def run_properties(scale: int) -> tuple[int, int, str, float]:
    """Run the hypothesis properties; (examples, failed tests, pytest's last line, seconds)."""
    env = dict(os.environ, KIMI_W31_FUZZ_SCALE=str(scale))
    started = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            "not cli",
            "--hypothesis-show-statistics",
            *PROPERTY_FILES,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    examples = sum(int(n) for n in re.findall(r"(\d+) passing(?: examples)?,", proc.stdout))
    failed = sum(int(n) for n in re.findall(r"(\d+) failed", proc.stdout.splitlines()[-1]))
    return (
        examples,
        failed or (proc.returncode != 0),
        proc.stdout.splitlines()[-1],
        (time.perf_counter() - started),
    )


def summary_rows(cases: list[fl.Case]) -> list[list[str]]:
    rows = []
    for fault in dict.fromkeys(c.fault for c in cases):
        mine = [c for c in cases if c.fault == fault]
        counts = [sum(c.outcome == o for c in mine) for o in OUTCOMES]
        rows.append([fault, str(len(mine)), *(str(n) if n else "" for n in counts)])
    totals = [sum(c.outcome == o for c in cases) for o in OUTCOMES]
    rows.append(["**total**", f"**{len(cases)}**", *(f"**{n}**" for n in totals)])
    return rows


def open_items(cases: list[fl.Case]) -> str:
    bad = [c for c in cases if c.outcome in (fl.CRASH, fl.WRONG)]
    if not bad:
        return "\nNo case crashed or produced a silently wrong output.\n"
    lines = [f"\n**Open: {len(bad)} case(s) still fail** (also in the full list below):\n"]
    lines += [f"- {c.fault} / {c.name}: {c.outcome}: {cell(c.detail)}" for c in bad]
    return "\n".join(lines) + "\n"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def scrub(text: str, prefix: str) -> str:
    """Replace the temporary directory, also where a detail was cut off inside its name."""
    text = text.replace(prefix, "<tmp>")
    for k in range(len(prefix) - 1, 3, -1):
        if text.endswith(prefix[:k]):
            return text[:-k] + "<tmp>..."
    return text


def cell(text: str) -> str:
    return " ".join(text.replace("|", "\\|").split())[:140]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the markdown report here")
    parser.add_argument(
        "--per-label",
        type=int,
        default=3,
        help="SIGKILL points per fault label and worker count [3]",
    )
    parser.add_argument(
        "--fuzz-scale",
        type=int,
        default=10,
        help="property-test examples, times the `make test` count [10]",
    )
    parser.add_argument(
        "--only",
        default="",
        help="run only these scenarios (comma-separated keys, e.g. publish,paths) and no "
        "property tests: to check a few new cases, never to write the committed report",
    )
    args = parser.parse_args()
    only = {k for k in args.only.split(",") if k}

    started = time.perf_counter()
    cases: list[fl.Case] = []
    with tempfile.TemporaryDirectory(prefix="kimi-w31-faults-") as tmp:
        work = Path(tmp)
        template = fl.make_source(work / "template")
        for key, scenario in scenarios(args.per_label):
            if only and key not in only:
                continue
            t0 = time.perf_counter()
            (work / key).mkdir()
            rows = scenario(template, work / key)
            cases += rows
            bad = sum(r.outcome in (fl.CRASH, fl.WRONG) for r in rows)
            print(
                f"{rows[0].fault if rows else key:<36} {len(rows):>4} cases "
                f"{time.perf_counter() - t0:6.1f} s  {'FAIL ' + str(bad) if bad else 'ok'}",
                flush=True,
            )
        for c in cases:  # temporary paths say nothing in a committed report
            c.detail = scrub(c.detail, str(work))
    if only:  # a partial run: the cases' verdicts only
        bad = [c for c in cases if c.outcome in (fl.CRASH, fl.WRONG)]
        for c in cases:
            print(f"  [{c.outcome}] {c.fault} / {c.name}: {cell(c.detail)}")
        return 1 if bad else 0
    examples, failed, last, fuzz_s = run_properties(args.fuzz_scale)
    print(
        f"{'property tests (hypothesis)':<36} {examples:>4} examples {fuzz_s:5.1f} s  "
        f"{'FAIL' if failed else 'ok'}"
    )
    seconds = time.perf_counter() - started

    header = ["fault class", "cases", *OUTCOMES]
    summary = summary_rows(cases)
    print()
    print(markdown_table(header, summary))
    bad = [c for c in cases if c.outcome in (fl.CRASH, fl.WRONG)]
    for c in bad:
        print(f"  [{c.outcome}] {c.fault} / {c.name}: {c.detail}")

    if args.out:
        command = "python tools/fault_table.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        detail = markdown_table(
            ["fault class", "case", "outcome", "what the user sees / why"],
            [[c.fault, cell(c.name), c.outcome, cell(c.detail)] for c in cases],
        )
        verdict = "FAILED: " + last if failed else "no other exception, no wrong result"
        text = f"""# Reliability: the fault table

Generated {dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")} by
`{command}` (also `make faults`) in {seconds:.0f} s, kimi-w31 on Python
{sys.version.split()[0]}. Every case runs the real `kimi-convert` on a small synthetic
Kimi-K3-format checkpoint in the published layout (3 layers: one dense, two MoE, x 8 experts,
6 source shards: one per layer plus three; `--max-shard-size 300KB` so the output has 14
shards); the same scenarios are the
`tests/test_fault_*.py` suites in `make test` (with fewer kill points and examples).

Outcomes: **clean error**: exit 1 (2 for usage errors), the expected reason code in the
`--json` report, with the file (and tensor) named, no traceback, no
`model.safetensors.index.json`, nothing written outside the output directory (and not even
an empty output directory when the input is refused). **resumed identical**: after the
fault, rerunning the same command gave an output byte-identical (every file, hidden ones
included) to an uninterrupted run, which itself passes `kimi-convert verify --checksums`.
**correct**: a case that must simply work. **crash**: a traceback or unexpected exception.
**silently wrong**: exit 0 on bad input, or an output that differs from the reference.

{markdown_table(header, summary)}
{open_items(cases)}
Property tests (hypothesis, `KIMI_W31_FUZZ_SCALE={args.fuzz_scale}`): {examples} generated
examples over the safetensors header parser, the file header reader, the index reader and
the validator, the planner and the name grammar ({len(PROPERTY_FILES)} files); every
example ended in a valid result (checked against the format rules and, for accepted headers,
the safetensors library) or problems with reason codes: {verdict} ({fuzz_s:.0f} s).

How the faults are made: SIGKILL/SIGINT/SIGSTOP at exact points through the test-only hook
`KIMI_W31_FAULT_AT=<label>:<n>[:kill|int|stop]` (`converter/faults.py`; inert when unset);
disk full through `RLIMIT_FSIZE` (writes fail with EFBIG, as on a full disk) and, for the
up-front check, a patched `shutil.disk_usage`; a source changing mid-run by stopping the
converter after a shard header and truncating, rewriting or replacing a source shard before
letting it continue.

## Every case

{detail}
"""
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"\nwrote {args.out}")
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())

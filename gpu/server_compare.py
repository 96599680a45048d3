"""The same requests to several running SGLang servers, compared (gpu/server_h200.sh).

Servers are named ROUTE-MODE (`marlin-graph`, `plugin-eager`, ...). Each one gets, once its
`/health` answers:
- teacher-forced prompt logprobs (`input_token_logprobs`) for every prompt;
- greedy continuations of every prompt, one request at a time (batch 1) and all together
  (batch 8), with the top-2 logprobs at every step, twice at batch 1 (repeatability);
- then, one server at a time while the others idle, speed: time to first token and decode
  tokens/s at batch 1, 8 and 32.

The plugin's servers are compared with the Marlin route's in the same mode (the upstream
route is the reference a user would otherwise run), and each route's graph server with its
eager one. Only the standard library: this runs beside the servers.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

PROMPTS = 8
PROMPT_LEN = 48
NEW_TOKENS = 64
# Teacher-forced logprobs of one token, plugin vs Marlin: both dequantize the same MXFP4
# weights and run bf16 activations, so they differ only by accumulation order and rounding,
# compounded through the layers; the MoE layer gate holds each MoE output to ~1e-2 relative.
TOL_MAX_ABS = 0.1  # nats, any single token
TOL_MEAN_ABS = 0.02  # nats, mean over every prompt token


def post(port: int, path: str, body: dict, timeout: float = 600) -> dict | list:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def alive(out: Path, name: str) -> bool:
    pid_file = out / f"server-{name}.pid"
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        return True  # not started by the script: only /health can tell
    return Path(f"/proc/{pid}").exists()


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    top = min(vocab - 256, vocab)  # below the special tokens synth counts from the end
    return [[rng.randrange(1, top) for _ in range(PROMPT_LEN)] for _ in range(PROMPTS)]


def generate(port: int, ids: list[list[int]] | list[int], new: int, **extra) -> list[dict]:
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": new, "ignore_eos": True},
        **extra,
    }
    out = post(port, "/generate", body)
    return out if isinstance(out, list) else [out]


def _lp(entries: list | None) -> list[float | None]:
    return [e[0] for e in entries or []]


def correctness(port: int, batch: list[list[int]]) -> dict:
    logprob = {"return_logprob": True, "top_logprobs_num": 2}
    forced = [
        generate(port, p, 1, logprob_start_len=0, return_logprob=True)[0]["meta_info"]
        for p in batch
    ]
    runs = {}
    for label in ("bs1", "bs1-again"):
        runs[label] = [generate(port, p, NEW_TOKENS, **logprob)[0] for p in batch]
    runs["bs8"] = generate(port, batch, NEW_TOKENS, **logprob)
    result = {"prompt_logprobs": [_lp(m["input_token_logprobs"])[1:] for m in forced]}
    for label, outs in runs.items():
        result[label] = [
            {
                "ids": o["output_ids"],
                "logprobs": _lp(o["meta_info"]["output_token_logprobs"]),
                "top2": [[e[:2] for e in step] for step in o["meta_info"]["output_top_logprobs"]],
            }
            for o in outs
        ]
    return result


def speed(port: int, vocab: int) -> dict:
    rng = random.Random(1)
    rows = {}
    for bs in (1, 8, 32):
        batch = [[rng.randrange(1, vocab - 256) for _ in range(32)] for _ in range(bs)]
        generate(port, batch, 8)  # warm this batch size
        one, many = [], []
        for _ in range(3):
            t = time.perf_counter()
            generate(port, batch, 1)
            one.append(time.perf_counter() - t)
            t = time.perf_counter()
            generate(port, batch, 129)
            many.append(time.perf_counter() - t)
        t1, t129 = statistics.median(one), statistics.median(many)
        rows[str(bs)] = {
            "first_token_s": t1,
            "decode_tokens_per_s": bs * 128 / (t129 - t1) if t129 > t1 else None,
            "runs_1_s": one,
            "runs_129_s": many,
        }
    return rows


def _finite(xs: list[float | None]) -> bool:
    return all(x is not None and math.isfinite(x) for x in xs)


def compare_tokens(a: list[dict], b: list[dict]) -> dict:
    """Greedy agreement of two servers' continuations, prompt by prompt; at the first
    difference, both servers' top-2 there (a near-tie is a difference that may happen)."""
    rows = []
    for x, y in zip(a, b, strict=True):
        pairs = zip(x["ids"], y["ids"], strict=False)  # a server may stop early
        first = next((i for i, (p, q) in enumerate(pairs) if p != q), None)
        row = {"identical": first is None, "first_difference": first}
        if first is not None:
            row["top2_a"], row["top2_b"] = x["top2"][first], y["top2"][first]
            gaps = [abs(t[0][0] - t[1][0]) for t in (x["top2"][first], y["top2"][first])]
            row["top2_gap"] = max(gaps)
        same = first if first is not None else len(x["ids"])
        both = zip(x["logprobs"][:same], y["logprobs"][:same], strict=False)
        diffs = [abs(p - q) for p, q in both if p is not None and q is not None]
        row["logprob_max_abs"] = max(diffs, default=0.0)
        rows.append(row)
    return {
        "identical": sum(r["identical"] for r in rows),
        "prompts": len(rows),
        "rows": rows,
    }


def compare_forced(a: list[list], b: list[list]) -> dict:
    diffs = [abs(p - q) for x, y in zip(a, b, strict=True) for p, q in zip(x, y, strict=True)]
    return {
        "tokens": len(diffs),
        "max_abs": max(diffs),
        "mean_abs": statistics.fmean(diffs),
        "within_tolerance": max(diffs) <= TOL_MAX_ABS and statistics.fmean(diffs) <= TOL_MEAN_ABS,
    }


def compare(a: dict, b: dict) -> dict:
    """Server a against server b: teacher-forced prompt logprobs and greedy tokens."""
    return {
        "forced": compare_forced(a["prompt_logprobs"], b["prompt_logprobs"]),
        "greedy": compare_tokens(a["bs1"], b["bs1"]),
    }


def mean_top1(result: dict) -> float:
    probs = [math.exp(step[0][0]) for row in result["bs1"] for step in row["top2"]]
    return statistics.fmean(probs)


def render(report: dict) -> str:
    lines = ["# Real server: plugin vs SGLang's Marlin route", ""]
    lines.append(
        f"Model: `{report['model']}`. Prompts: {PROMPTS} x {PROMPT_LEN} random ids, "
        f"{NEW_TOKENS} greedy tokens."
    )
    lines += [
        "",
        "| server | ready (s) | finite | repeatable (bs1 twice) | bs1 = bs8 |",
        "|---|---|---|---|---|",
    ]
    for name, s in report["servers"].items():
        if "error" in s:
            lines.append(f"| {name} | - | {s['error']} | | |")
            continue
        lines.append(
            f"| {name} | {s['ready_s']:.0f} | {s['finite']} | "
            f"{s['repeatable']['identical']}/{PROMPTS} | "
            f"{s['batch_invariant']['identical']}/{PROMPTS} |"
        )
    lines += [
        "",
        "| pair | prompt logprobs max / mean abs (nats) | within tolerance | "
        "greedy identical | first differences |",
        "|---|---|---|---|---|",
    ]
    for pair, c in report["pairs"].items():
        f, t = c["forced"], c["greedy"]
        firsts = [r["first_difference"] for r in t["rows"] if not r["identical"]]
        lines.append(
            f"| {pair} | {f['max_abs']:.4f} / {f['mean_abs']:.5f} | {f['within_tolerance']} | "
            f"{t['identical']}/{t['prompts']} | {firsts} |"
        )
    lines += ["", "| server | TTFT bs1 (ms) | decode tok/s bs1 | bs8 | bs32 |"]
    lines.append("|---|---|---|---|---|")
    for name, s in report["servers"].items():
        sp = s.get("speed")
        if not sp:
            continue
        d = [sp[b]["decode_tokens_per_s"] for b in ("1", "8", "32")]
        lines.append(
            f"| {name} | {sp['1']['first_token_s'] * 1e3:.1f} | "
            + " | ".join(f"{x:.0f}" if x else "-" for x in d)
            + " |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--server", action="append", required=True, help="NAME=PORT")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True, help="the source checkpoint")
    ap.add_argument("--deadline-s", type=float, default=1500, help="wait for servers this long")
    ap.add_argument("--no-speed", action="store_true")
    args = ap.parse_args(argv)
    servers = dict(s.split("=", 1) for s in args.server)
    ports = {n: int(p) for n, p in servers.items()}
    cfg = json.loads((args.model / "config.json").read_text())
    vocab = (cfg.get("text_config") or cfg)["vocab_size"]
    batch = prompts(vocab)
    report: dict = {"model": str(args.model), "servers": {}, "pairs": {}}
    results: dict[str, dict] = {}
    pending, start = set(ports), time.monotonic()
    while pending and time.monotonic() - start < args.deadline_s:
        for name in sorted(pending):
            if healthy(ports[name]):
                started = float((args.out / f"server-{name}.started").read_text())
                entry = {"ready_s": time.time() - started}
                print(f"== {name} ready after {entry['ready_s']:.0f} s", flush=True)
                try:
                    res = correctness(ports[name], batch)
                except (urllib.error.URLError, OSError, KeyError, ValueError) as exc:
                    entry["error"] = f"{type(exc).__name__}: {exc}"
                else:
                    results[name] = res
                    flat = [x for k in ("bs1", "bs8") for r in res[k] for x in r["logprobs"]]
                    entry["finite"] = _finite(flat) and _finite(
                        [x for r in res["prompt_logprobs"] for x in r]
                    )
                    entry["repeatable"] = compare_tokens(res["bs1"], res["bs1-again"])
                    entry["batch_invariant"] = compare_tokens(res["bs1"], res["bs8"])
                    entry["mean_top1_probability"] = mean_top1(res)
                    print(
                        f"   finite {entry['finite']}, repeatable "
                        f"{entry['repeatable']['identical']}/{PROMPTS}",
                        flush=True,
                    )
                report["servers"][name] = entry
                pending.discard(name)
            elif not alive(args.out, name):
                report["servers"][name] = {"error": "the server exited before /health"}
                pending.discard(name)
        time.sleep(2)
    for name in pending:
        report["servers"][name] = {"error": f"not ready after {args.deadline_s:.0f} s"}
    couples = [(f"plugin-{m}", f"marlin-{m}") for m in ("graph", "eager")]
    couples += [(f"{r}-graph", f"{r}-eager") for r in ("plugin", "marlin")]
    for a, b in couples:
        if a in results and b in results:
            report["pairs"][f"{a} vs {b}"] = compare(results[a], results[b])
    if not args.no_speed:
        for name in sorted(results):
            print(f"== speed {name}", flush=True)
            try:
                report["servers"][name]["speed"] = speed(ports[name], vocab)
            except (urllib.error.URLError, OSError, KeyError, ValueError) as exc:
                report["servers"][name]["speed_error"] = f"{type(exc).__name__}: {exc}"
    (args.out / "report-server.json").write_text(json.dumps(report, indent=1))
    (args.out / "report-server.md").write_text(render(report))
    print(render(report))
    ok = (
        len(results) == len(ports)
        and all(s.get("finite") for s in report["servers"].values())
        and all(c["forced"]["within_tolerance"] for c in report["pairs"].values())
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""What each install the README gives costs on a fresh virtualenv: time, size, and the
versions it resolved. Writes docs/install.md and docs/install.json.

    python tools/install_cost.py                 # the converter, [ray] and [sglang]
    python tools/install_cost.py --extra ray     # one of them

Each install goes into a new virtualenv with pip's cache off (a first-time user's install:
every wheel is downloaded), from this clone, with whatever package index pip is set up for.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("", "ray", "sglang")
WATCHED = ("torch", "flashinfer-python", "sglang", "sglang-kernel", "triton", "ray", "numpy")


def du(path: Path) -> int:
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def measure(extra: str, work: Path) -> dict:
    venv = work / f"venv-{extra or 'base'}"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    target = f"{ROOT}[{extra}]" if extra else str(ROOT)
    env = {**os.environ, "PIP_NO_CACHE_DIR": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    started = time.monotonic()
    pip = str(venv / "bin" / "pip")
    proc = subprocess.run([pip, "install", "-q", target], env=env, capture_output=True, text=True)
    seconds = time.monotonic() - started
    row = {"extra": extra, "ok": proc.returncode == 0, "seconds": round(seconds, 1)}
    if proc.returncode != 0:
        row["error"] = proc.stderr[-2000:]
    else:
        row["bytes"] = du(venv)
        freeze = subprocess.run(
            [str(venv / "bin" / "pip"), "list", "--format", "json"], capture_output=True, text=True
        )
        versions = {p["name"].lower(): p["version"] for p in json.loads(freeze.stdout)}
        row["versions"] = {name: versions[name] for name in WATCHED if name in versions}
    shutil.rmtree(venv, ignore_errors=True)
    return row


def render(report: dict) -> str:
    lines = [
        "# What installing costs",
        "",
        f"Measured {report['date']} by `python tools/install_cost.py` on {report['machine']}: "
        "each install into a new virtualenv, pip's cache off (every wheel fetched from the "
        "package index pip is set up for).",
        "",
        "| install | size | time | resolved |",
        "|---|---|---|---|",
    ]
    for row in report["rows"]:
        what = f"`pip install '.[{row['extra']}]'`" if row["extra"] else "`pip install .`"
        if not row["ok"]:
            lines.append(f"| {what} | failed | {row['seconds']} s | see install.json |")
            continue
        size = row["bytes"] / 1e9
        size_text = f"{size:.1f} GB" if size >= 1 else f"{row['bytes'] / 1e6:.0f} MB"
        minutes, secs = divmod(round(row["seconds"]), 60)
        took = f"{minutes} min {secs} s" if minutes else f"{secs} s"
        versions = ", ".join(f"{k} {v}" for k, v in row["versions"].items())
        lines.append(f"| {what} | {size_text} | {took} | {versions} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--extra", action="append", choices=["base", *EXTRAS[1:]])
    ap.add_argument("--docs", type=Path, default=ROOT / "docs")
    args = ap.parse_args()
    extras = [("" if e == "base" else e) for e in args.extra] if args.extra else list(EXTRAS)
    with tempfile.TemporaryDirectory(prefix="kimi-w31-install-") as tmp:
        rows = []
        for extra in extras:
            rows.append(measure(extra, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    report = {
        "date": date.today().isoformat(),
        "machine": f"{platform.system()}, Python {platform.python_version()}, "
        f"{os.cpu_count()} cores",
        "rows": rows,
    }
    (args.docs / "install.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.docs / "install.md").write_text(render(report))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

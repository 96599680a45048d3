"""Fault scenarios for the filesystem and for what a rerun may claim or destroy.

The classes (each row runs the real CLI in a subprocess with a timeout: a hang is a crash):
- `state folder`: the output's `.kimi_w31/` is a link, a file, a FIFO: refused, nothing
  changed anywhere (never a deletion through a link);
- `special files`: a FIFO, a device link or a link loop in place of a file convert or verify
  reads: refused within seconds, with the file named;
- `links`: the link policy: linked shards are read (shards spread over disks), a linked
  extra file is published only when it is what would be published directly;
- `owner`: a finished or interrupted output continues only with its own source;
- `claims`: a rerun that kept shards without re-reading them does not say "repaired";
- `publish`: no machine path in a published file; upload tools' hidden folders ignored;
- `blame`: a file the source dropped is removed as ours, not called foreign.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

from cli_helpers import CliResult, json_problems, run_cli
from kimi_w31.converter.reasons import Code

from .core import (
    CLEAN,
    CORRECT,
    CRASH,
    INDEX,
    MANIFEST,
    SHARD_SIZE,
    STATE,
    WRONG,
    Case,
    codes,
    convert_args,
    copy_source,
    looks_like_crash,
    reference_output,
    tree,
    tree_diff,
)

TIMEOUT = 60  # seconds: far beyond any of these runs; reaching it means a hang


def run(args: list, env: dict[str, str] | None = None) -> CliResult:
    """The CLI, or a result with returncode None when it hung."""
    try:
        return run_cli(args, env=env, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        return CliResult(None, "", "hung: timeout")  # type: ignore[arg-type]


def judge_refusal(
    proc: CliResult,
    want: set[Code],
    before: dict[str, str],
    after: dict[str, str],
    index: Path | None = None,
) -> tuple[str, str]:
    """A refusal: exit 1, one of the wanted codes, nothing changed, no complete-looking output."""
    if proc.returncode is None:
        return CRASH, "hung"
    if looks_like_crash(proc.stderr + proc.stdout):
        return CRASH, proc.stderr[-300:]
    if proc.returncode == 0:
        return WRONG, "exit 0"
    if before != after:
        return WRONG, "changed: " + tree_diff(before, after)
    if index is not None and index.exists():
        return WRONG, "an index was written"
    got = codes(proc.stdout)
    if not got & {c.value for c in want}:
        return CRASH, f"codes {sorted(got)} (want {sorted(c.value for c in want)})"
    first = json_problems(proc.stdout)[0]
    what = re.sub(r"/[^\s'\"]+", "<path>", first.get("what", ""))  # no machine path in a table
    return CLEAN, f"[{first.get('code')}] {what}"[:160]


# ------------------------------------------------------------------- the state folder


def _victim(work: Path) -> Path:
    victim = work / "victim"
    victim.mkdir(parents=True)
    (victim / "precious.txt").write_text("the user's, not the tool's\n")
    (victim / "ledger.jsonl").write_text("not a ledger\n")
    return victim


STATE_KINDS: dict[str, Callable[[Path, Path], None]] = {
    "a symlink to a directory with files": lambda p, w: p.symlink_to(_victim(w)),
    "a symlink to a file": lambda p, w: p.symlink_to(_victim(w) / "precious.txt"),
    "a dangling symlink": lambda p, w: p.symlink_to(w / "nowhere"),
    "a regular file": lambda p, w: p.write_text("a file of the user's\n"),
    "a FIFO": lambda p, w: os.mkfifo(p),
}


def state_folder_cases(template: Path, work: Path) -> list[Case]:
    rows = []
    src = copy_source(template, work / "src")
    finished = work / "finished"
    reference_output(src, finished)
    for n, (kind, make) in enumerate(STATE_KINDS.items()):
        for over in ("an empty directory", "a finished output"):
            for extra in ([], ["--force"], ["--dry-run"]):
                case = work / f"s{n}-{over[:3]}-{len(extra)}{extra[0][2:] if extra else ''}"
                out = case / "out"
                if over == "a finished output":
                    shutil.copytree(finished, out)
                else:
                    out.mkdir(parents=True)
                make(out / STATE, case)
                before = tree(case)
                proc = run(convert_args(src, out, "--json", *extra))
                outcome, detail = judge_refusal(
                    proc, {Code.STATE_FOLDER_INVALID}, before, tree(case)
                )
                name = f"state folder is {kind}, over {over}{' ' if extra else ''}{' '.join(extra)}"
                rows.append(Case("state folder", name, outcome, detail))
    return rows


# ------------------------------------------------------------------- special files


def _fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _device_link(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.symlink_to("/dev/zero")


def _fifo_link(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path.parent / (path.name + ".fifo-target"))
    path.symlink_to(path.name + ".fifo-target")


def _loop(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.symlink_to(path.name)


def _socket(path: Path) -> None:
    path.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX)
    here = os.getcwd()
    try:
        os.chdir(path.parent)  # a relative name: socket paths are limited to ~108 bytes
        sock.bind(path.name)
    finally:
        os.chdir(here)
        sock.close()


SPECIALS: dict[str, Callable[[Path], None]] = {
    "a FIFO": _fifo,
    "a link to /dev/zero": _device_link,
    "a link to a FIFO": _fifo_link,
    "a link loop": _loop,
    "a socket": _socket,
}
UNREADABLE = {Code.NOT_A_REGULAR_FILE, Code.FILE_UNREADABLE, Code.SHARD_MISSING}


def special_file_cases(template: Path, work: Path) -> list[Case]:
    rows = []
    out_ref = work / "converted"
    reference_output(template, out_ref)
    victims = {
        "config.json": "config.json",
        "the index": INDEX,
        "a shard": "model-00002-of-000006.safetensors",
        "an extra file": "tokenizer_config.json",
    }
    for n, (kind, make) in enumerate(SPECIALS.items()):
        for what, name in victims.items():
            if os.uname().sysname != "Linux" and kind == "a socket":
                continue
            src = copy_source(template, work / f"src{n}-{name}")
            make(src / name)
            out = work / f"out{n}-{name}"
            before = tree(src)
            proc = run(convert_args(src, out, "--json"))
            outcome, detail = judge_refusal(proc, UNREADABLE, before, tree(src), out / INDEX)
            rows.append(Case("special files", f"convert: {what} is {kind}", outcome, detail))
        for what, name in {
            "config.json": "config.json",
            "the index": INDEX,
            "the checksums file": "kimi_w31.checksums.json",
        }.items():
            out = work / f"v{n}-{name}"
            shutil.copytree(out_ref, out, symlinks=True)
            make(out / name)
            before = tree(out)
            proc = run(["verify", out, "--checksums", "--json"])
            want = UNREADABLE | {Code.CHECKSUMS_INVALID}
            outcome, detail = judge_refusal(proc, want, before, tree(out))
            rows.append(Case("special files", f"verify: {what} is {kind}", outcome, detail))
    return rows


# ------------------------------------------------------------------- the link policy


def _link_extra(target: Callable[[Path, Path], Path]) -> Callable[[Path, Path], None]:
    def make(src: Path, work: Path) -> None:
        (src / "notes.txt").symlink_to(target(src, work))

    return make


def _hidden_target(src: Path, work: Path) -> Path:
    (src / ".git").mkdir(exist_ok=True)
    (src / ".git" / "config").write_text("[remote] url = https://user:secret@example\n")
    return Path(".git/config")


def _outside_target(src: Path, work: Path) -> Path:
    (work / "secret.txt").write_text("a file outside the source\n")
    return work / "secret.txt"


def _linked_folder(src: Path, work: Path) -> None:
    elsewhere = work / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "private.txt").write_text("not the model's\n")
    (src / "extra").symlink_to(elsewhere, target_is_directory=True)


def _shards_on_other_disks(src: Path, work: Path) -> None:
    for i, shard in enumerate(sorted(src.glob("*.safetensors"))):
        disk = work / f"disk{i % 2}"
        disk.mkdir(exist_ok=True)
        shutil.move(shard, disk / shard.name)
        shard.symlink_to(disk / shard.name)


def _shard_folder_on_other_disk(src: Path, work: Path) -> None:
    """The index names shards under a folder that is a link to another disk (loaders never
    open them: they list only the top level)."""
    disk = work / "disk"
    disk.mkdir()
    index = json.loads((src / INDEX).read_text())
    for shard in sorted(set(index["weight_map"].values())):
        shutil.move(src / shard, disk / shard)
    index["weight_map"] = {t: f"d/{f}" for t, f in index["weight_map"].items()}
    (src / INDEX).write_text(json.dumps(index))
    (src / "d").symlink_to(disk, target_is_directory=True)


def _folder_loop(src: Path, work: Path) -> None:
    """A folder holding a link to its own parent: its files would have names without end."""
    (src / "assets").mkdir(exist_ok=True)  # synth ships assets/ as published
    (src / "assets" / "notes.txt").write_text("notes\n")
    (src / "assets" / "up").symlink_to("..", target_is_directory=True)


def _folder_and_alias(src: Path, work: Path) -> None:
    (src / "assets").mkdir(exist_ok=True)  # synth ships assets/ as published
    (src / "assets" / "notes.txt").write_text("notes\n")
    (src / "alias").symlink_to("assets", target_is_directory=True)


def _inside_link(src: Path, work: Path) -> None:
    (src / "tokenizer.model.json").symlink_to("tokenizer_config.json")


LINK_REFUSED = {
    "an extra file links into .git/": (_link_extra(_hidden_target), Code.LINK_ESCAPES),
    "an extra file links outside the source": (_link_extra(_outside_target), Code.LINK_ESCAPES),
    "an extra file links to a device": (
        _link_extra(lambda s, w: Path("/dev/zero")),
        Code.NOT_A_REGULAR_FILE,
    ),
    "an extra file is a dangling link": (
        _link_extra(lambda s, w: w / "gone"),
        Code.NOT_A_REGULAR_FILE,
    ),
    "a folder links outside the source": (_linked_folder, Code.LINK_ESCAPES),
    "a folder links to its own parent (a loop)": (_folder_loop, Code.LINK_ESCAPES),
    # Loaders open only top-level shards: one under a folder (linked or not) is never served.
    "the shards' folder links to another disk": (
        _shard_folder_on_other_disk,
        Code.SHARD_NOT_LOADED,
    ),
}
LINK_ACCEPTED = {
    "every shard links to another disk": _shards_on_other_disks,
    "an extra file links to a published file": _inside_link,
}


def link_cases(template: Path, work: Path) -> list[Case]:
    rows = []
    for n, (name, (make, code)) in enumerate(LINK_REFUSED.items()):
        case = work / f"r{n}"
        src = copy_source(template, case / "src")
        make(src, case)
        out = case / "out"
        before = tree(src)
        proc = run(convert_args(src, out, "--json"))
        outcome, detail = judge_refusal(proc, {code}, before, tree(src), out / INDEX)
        if outcome == CLEAN and len(json_problems(proc.stdout)) != 1:
            outcome, detail = WRONG, "not said once: " + proc.stdout[-200:]
        rows.append(Case("links", name, outcome, detail))
    for n, (name, make) in enumerate(LINK_ACCEPTED.items()):
        case = work / f"a{n}"
        src = copy_source(template, case / "src")
        make(src, case)
        out = case / "out"
        proc = run(convert_args(src, out, "--json"))
        checked = run(["verify", out, "--source", src, "--json"])
        ok = proc.returncode == 0 and checked.returncode == 0
        rows.append(
            Case(
                "links",
                name,
                CORRECT if ok else CRASH if proc.returncode is None else WRONG,
                "" if ok else (proc.stdout + proc.stderr + checked.stdout)[-300:],
            )
        )
    # One folder under two names (a folder and a link to it): published under both, and
    # verify --source agrees (a copy, or a loader, sees both).
    case = work / "alias"
    src = copy_source(template, case / "src")
    _folder_and_alias(src, case)
    out = case / "out"
    proc = run(convert_args(src, out, "--json"))
    checked = run(["verify", out, "--source", src, "--json"])
    both = all((out / d / "notes.txt").is_file() for d in ("assets", "alias"))
    ok = proc.returncode == 0 and checked.returncode == 0 and both
    rows.append(
        Case(
            "links",
            "a folder and a link to it: published under both names, verify --source agrees",
            CORRECT if ok else CRASH if looks_like_crash(proc.stderr) else WRONG,
            "" if ok else f"both={both} " + (proc.stdout + proc.stderr + checked.stdout)[-260:],
        )
    )
    # A linked shard whose target is a FIFO: refused once for the file, saying "symlink".
    case = work / "fifo-shard"
    src = copy_source(template, case / "src")
    _fifo_link(src / "model-00003-of-000006.safetensors")
    proc = run(convert_args(src, case / "out", "--json"))
    problems = json_problems(proc.stdout)
    outcome, detail = judge_refusal(proc, {Code.NOT_A_REGULAR_FILE}, {}, {})
    if outcome == CLEAN and (len(problems) != 1 or "symlink" not in problems[0].get("found", "")):
        outcome, detail = WRONG, f"not said once with the link named: {problems[:3]}"
    rows.append(Case("links", "a linked shard leads to a FIFO", outcome, detail))
    return rows


# ------------------------------------------------------------------- whose output


def _same_headers_other_data(template: Path, dest: Path) -> Path:
    """A fine-tune of the template: every header identical, one byte of data changed in
    every shard (what a rerun's header proof cannot tell apart)."""
    ft = copy_source(template, dest)
    for shard in sorted(ft.glob("*.safetensors")):
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0x01
        shard.write_bytes(bytes(data))
    return ft


def owner_cases(template: Path, work: Path) -> list[Case]:
    rows = []
    base = copy_source(template, work / "base")
    finetune = _same_headers_other_data(template, work / "finetune")
    moved = copy_source(template, work / "moved")  # the same bytes, another directory
    for state in ("finished", "interrupted"):
        for name, other in (("a fine-tune (same headers)", finetune), ("a copy elsewhere", moved)):
            out = work / f"{state}-{other.name}"
            if state == "finished":
                reference_output(base, out)
            else:
                run(convert_args(base, out), env={"KIMI_W31_FAULT_AT": "ledger.appended:1"})
            for extra in ([], ["--dry-run"]):
                before = tree(out)
                proc = run(convert_args(other, out, "--json", *extra))
                outcome, detail = judge_refusal(
                    proc, {Code.OUTPUT_OF_ANOTHER_SOURCE}, before, tree(out)
                )
                if outcome == CLEAN and "base" not in json_problems(proc.stdout)[0]["what"]:
                    outcome, detail = WRONG, "the refusal does not name the owner: " + detail
                label = f"{state} output of a source, then {name} {' '.join(extra)}"
                rows.append(Case("owner", label.strip(), outcome, detail))
        forced = run(convert_args(finetune, work / f"{state}-finetune", "--force", "--json"))
        want = reference_output(finetune, work / f"fresh-{state}")
        got = {k: v for k, v in tree(work / f"{state}-finetune").items()}
        ok = forced.returncode == 0 and got == want
        rows.append(
            Case(
                "owner",
                f"{state} output of a source, then a fine-tune with --force: replaced",
                CORRECT if ok else WRONG,
                "" if ok else tree_diff(got, want) + forced.stderr[-200:],
            )
        )
    return rows


# ------------------------------------------------------------------- what a rerun claims


def claim_cases(template: Path, work: Path) -> list[Case]:
    """One shard deleted and one byte flipped in another: a plain rerun rewrites the first,
    keeps the second unread and must say so; --rehash rewrites both."""
    rows = []
    src = copy_source(template, work / "src")
    for extra in ([], ["--rehash"]):
        out = work / f"out{len(extra)}"
        reference_output(src, out)
        shards = sorted(out.glob("*.safetensors"))
        shards[0].unlink()
        data = bytearray(shards[1].read_bytes())
        data[-3] ^= 0x10
        shards[1].write_bytes(bytes(data))
        proc = run(convert_args(src, out, "--json", *extra))
        checked = run(["verify", out, "--checksums", "--json"])
        summary = proc.json if proc.returncode == 0 else {}
        intact = checked.returncode == 0
        if proc.returncode != 0:
            outcome, detail = CRASH, proc.stderr[-300:]
        elif summary.get("kept_data_reread") is not intact:  # claims what verify disproves
            outcome = WRONG
            detail = f"kept_data_reread={summary.get('kept_data_reread')}, verify ok={intact}"
        else:
            outcome, detail = CORRECT, summary.get("kept_proven_by", "")
        rows.append(
            Case("claims", f"a shard deleted, a byte flipped, rerun {extra}", outcome, detail)
        )
    return rows


# ------------------------------------------------------------------- safe to publish


def publish_cases(template: Path, work: Path) -> list[Case]:
    rows = []
    src = copy_source(template, work / "data" / "hf_models" / "Kimi-K3")
    (work / "link").symlink_to(src, target_is_directory=True)
    spellings = {
        "absolute": str(src),
        "absolute with a trailing slash": str(src) + "/",
        "relative": os.path.relpath(src),
        "through a symlink": str(work / "link"),
    }
    for n, (name, spelling) in enumerate(spellings.items()):
        out = work / f"out{n}"
        proc = run([spelling, out, *MANIFEST, *SHARD_SIZE, "-q"])
        leaks = (
            [
                f
                for f in ("config.json", "kimi_w31.checksums.json", INDEX)
                if any(
                    s in (out / f).read_text() for s in (str(work), str(src), str(out), "hf_models")
                )
            ]
            if proc.returncode == 0
            else ["(convert failed)"]
        )
        rows.append(
            Case(
                "publish",
                f"source given {name}: no machine path published",
                CORRECT if not leaks else WRONG,
                ", ".join(leaks)
                or json.loads((out / "config.json").read_text())["kimi_w31"]["source"]["path"],
            )
        )
    out = work / "out0"
    for rel, text in {
        ".cache/huggingface/upload/model.safetensors.metadata": "upload state\n",
        ".cache/huggingface/.gitignore": "*\n",
        ".gitattributes": "*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
        ".git/HEAD": "ref: refs/heads/main\n",
    }.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(text)
    checked = run(["verify", out, "--checksums", "--json"])
    rerun = run(convert_args(src, out, "--json"))
    report = checked.json if checked.stdout.startswith("{") else {}
    files = next((c for c in report.get("checks", []) if c.get("name") == "files"), {})
    ok = (
        checked.returncode == 0
        and ".cache" in str(files.get("detail"))
        and rerun.returncode == 0
        and rerun.json.get("already_complete")
        and (out / ".git" / "HEAD").exists()
    )
    rows.append(
        Case(
            "publish",
            "an upload tool's hidden folders in the output: ignored, and said",
            CORRECT if ok else WRONG,
            str(files.get("detail")) if ok else (checked.stdout + rerun.stdout)[-300:],
        )
    )
    return rows


# ------------------------------------------------------------------- blame the right thing


def blame_cases(template: Path, work: Path) -> list[Case]:
    rows = []
    src = copy_source(template, work / "src")
    (src / "docs").mkdir()
    (src / "docs" / "notes.md").write_text("a file the source later drops\n")
    out = work / "out"
    reference_output(src, out)
    shutil.rmtree(src / "docs")
    (src / "README.md").unlink()
    proc = run(convert_args(src, out, "--json"))
    checked = run(["verify", out, "--source", src, "--json"])
    want = reference_output(src, work / "fresh")
    # what the passing verify recorded aside (`verified.json` in the state folder)
    got = {k: v for k, v in tree(out).items() if k.split("/")[0] != STATE}
    ok = proc.returncode == 0 and checked.returncode == 0 and got == want
    rows.append(
        Case(
            "blame",
            "the source dropped files: a rerun removes the output's copies as its own",
            CORRECT if ok else WRONG,
            "" if ok else (proc.stdout + checked.stdout)[-300:] + tree_diff(got, want),
        )
    )
    # A file the user put there is still refused, and never removed.
    (out / "mine.txt").write_text("the user's\n")
    (src / "extra.txt").write_text("a new file of the source\n")
    before = tree(out)
    proc = run(convert_args(src, out, "--json"))
    after = tree(out)
    ok = (
        proc.returncode == 1
        and codes(proc.stdout) == {Code.FOREIGN_OUTPUT.value}
        and after.get("mine.txt") == before["mine.txt"]
    )
    rows.append(
        Case(
            "blame",
            "a file the user added is named as not written by the tool, and kept",
            CLEAN if ok else WRONG,
            "" if ok else proc.stdout[-300:],
        )
    )
    return rows


def filesystem_cases(template: Path, work: Path) -> list[Case]:
    """Every scenario of this module (what `tools/fault_table.py` runs)."""
    rows = []
    for name, scenario in SCENARIOS:
        rows += scenario(template, work / name)
    return rows


SCENARIOS: list[tuple[str, Callable[[Path, Path], list[Case]]]] = [
    ("statefolder", state_folder_cases),
    ("special", special_file_cases),
    ("links", link_cases),
    ("owner", owner_cases),
    ("claims", claim_cases),
    ("publish", publish_cases),
    ("blame", blame_cases),
]

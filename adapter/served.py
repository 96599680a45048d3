"""What a server may load: the checks made before a checkpoint's weights load. Engine-neutral.

Two rules, each one place, both over what stands on disk (stat calls and shard headers:
seconds for hundreds of shards, never a tensor byte):

- a converted checkpoint is served only as it was verified: a passing `verify --checksums`
  where it stands, no file changed since (`converter.output.verified`). Operators may opt out with
  `KIMI_W31_SKIP_VERIFIED_CHECK=1` (logged loudly in every process);
- the tensors a loader would read are each where the index puts them and in one shard only
  (else the copy read last wins), every routed-expert tensor has the shape its parameter
  takes under the config (a loader zero-fills a short one: every gate row would shift), and
  no two names reach one model parameter (`contract.served_keys`). A passing verify proved
  these on the very files (its structure level has the same rules): read from the headers
  only when no proof covers them (the opt-out, an unconverted checkpoint).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..converter import contract
from ..converter.audit.served import served_headers
from ..converter.errors import Fatal, Problem, problem
from ..converter.manifest import expect, load_manifest
from ..converter.output import verified
from ..converter.reasons import Code
from ..converter.safetensors_format import ShardHeader
from ..converter.source import (
    check_each_tensor_once,
    check_index_against_headers,
    read_index,
    read_json,
)

MAX_SHOWN = 20  # problems listed in one refusal
MANIFEST = "kimi-k3-any"  # the rules, with every dimension read from the config


@dataclass(frozen=True)
class Refusal:
    """Why a checkpoint must not load: its problems (with codes) and what to do."""

    problems: list[Problem]
    hint: str

    @property
    def codes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.code.value for p in self.problems))

    def render(self, root: Path) -> str:
        lines = [f"kimi_w31: refusing to load {root}:"]
        lines += [f"  - [{p.code.value}] {p.render()}" for p in self.problems[:MAX_SHOWN]]
        if len(self.problems) > MAX_SHOWN:
            lines.append(f"  ... and {len(self.problems) - MAX_SHOWN} more")
        if self.hint:
            lines.append(self.hint)
        return "\n".join(lines)


def verified_refusal(root: Path, env: dict[str, str] | None = None) -> Refusal | None:
    """Rule 1, for a converted checkpoint (None: verified and unchanged, or opted out)."""
    if verified.skipped(env):
        return None
    fatal = verified.served_refusal(root)
    return None if fatal is None else Refusal(fatal.problems, fatal.hint or "")


def structure_refusal(root: Path, converted: bool) -> Refusal | None:
    """Rule 2: shards, index, expert shapes and name folds, from headers alone."""
    root = Path(root)
    if not os.path.isdir(root):
        return None  # not a local folder: the loader fetches it, and says what it finds
    headers, problems = served_headers(root)
    problems += _index_problems(root, headers)
    try:
        config = read_json(root / contract.CONFIG_NAME)
    except Fatal as exc:
        problems += exc.problems
    else:
        problems += _shape_problems(headers, config, converted)
    names = {name: file for file, h in headers.items() for name in h.tensors}
    problems += contract.collision_problems(names, names.get)
    if not problems:
        return None
    hint = (
        "Run `kimi-convert verify` on the checkpoint, or convert it again from the source."
        if converted
        else "Download or copy the checkpoint again: its shards are not what its index says."
    )
    return Refusal(problems, hint)


def _index_problems(root: Path, headers: dict[str, ShardHeader]) -> list[Problem]:
    index = root / contract.INDEX_NAME
    if not os.path.isfile(index):
        return check_each_tensor_once(headers)
    try:
        weight_map, _ = read_index(index)
    except Fatal as exc:
        return exc.problems
    # Only the shards a loader opens (served_headers): a tensor it reads twice, or from a
    # shard the index does not give it to.
    loaded = {t: s for t, s in weight_map.items() if s in headers}
    return check_index_against_headers(loaded, headers, contract.INDEX_NAME)


def _shape_problems(headers: dict[str, ShardHeader], config: Any, converted: bool) -> list[Problem]:
    """Every routed-expert tensor with the dtype and shape its parameter takes (the same
    expectation `validate` and `verify` use, from the manifest over the config)."""
    bound = sum(len(h.tensors) for h in headers.values())
    expected, _ = expect(load_manifest(MANIFEST), config, bound, converted)
    if not expected.bounded:
        return []
    specs: dict[str, Any] = {}  # tail -> its spec (or None): a few thousand tails
    problems = []
    for file, header in headers.items():
        for name, info in header.tensors.items():
            split = contract.expert_prefix_and_tail(name)
            if split is None:
                continue
            tail = split[1]
            if tail not in specs:
                parsed = contract.parse_expert_tail(tail)
                specs[tail] = parsed and expected.tensors.get(f"{parsed.proj}.{parsed.suffix}")
            spec = specs[tail]
            if not spec or spec.shape is None or tuple(info.shape) == spec.shape:
                continue
            problems.append(
                problem(
                    Code.EXPERT_SHAPE,
                    file=file,
                    tensor=name,
                    want=list(spec.shape),
                    shape=list(info.shape),
                )
            )
    return problems

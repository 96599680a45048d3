"""The tensors a source serves, derived here, apart from the converter's source reader.

`verify --source` must not trust the converter's choice of source shards: if that choice
dropped a file, the output lacks its tensors and a check that made the same choice would
pass it. So the loader's rule is restated here, from SGLang 0.5.23 itself
(`_prepare_weights`, `filter_duplicate_safetensors_files`): it opens the top-level
`*.safetensors` files (the glob's `*` skips hidden names; subfolders are never searched),
only those the index names when `model.safetensors.index.json` exists, all of them when it
does not (save that a lone pair `…consolidated.safetensors` + `…model.safetensors` loads the
second). An index entry the glob cannot list is never loaded. The converter's reader is held
to this one by tests/test_file_set.py, and both to SGLang by
tests/sglang/test_file_set_differential.py.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from ..contract import INDEX_NAME
from ..errors import Fatal, Problem, problem
from ..reasons import Code
from ..safetensors_format import ShardHeader, read_header

_SUFFIX = ".safetensors"


def loaded_files(root: Path) -> tuple[list[str], list[Problem]]:
    """The shard files a loader opens from `root`, sorted, and why they cannot all be."""
    top = sorted(n for n in os.listdir(root) if n.endswith(_SUFFIX) and not n.startswith("."))
    index = root / INDEX_NAME
    if not os.path.isfile(index):
        pair = len(top) == 2 and top[0].endswith("consolidated" + _SUFFIX)
        if pair and top[1].endswith("model" + _SUFFIX):
            return top[1:], []
        if not top:
            return [], [problem(Code.FILE_MISSING, rule="served", file=".")]
        return top, []
    try:
        with open(index, encoding="utf-8") as fh:
            named = set(json.load(fh)["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return [], [problem(Code.INDEX_INVALID, rule="served", file=INDEX_NAME)]
    problems = [
        problem(Code.SHARD_MISSING, rule="served", file=n)
        if isinstance(n, str) and not os.path.lexists(root / n)
        else problem(Code.SHARD_NOT_LOADED, rule="served", file=repr(n))
        for n in sorted(named - set(top), key=repr)
    ]
    return [n for n in top if n in named], problems


def served_headers(root: Path) -> tuple[dict[str, ShardHeader], list[Problem]]:
    """file -> header of every shard a loader opens; any that cannot be read is a problem."""
    files, problems = loaded_files(root)
    headers = {}
    for name in files:
        path = root / name
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block the read
                problems.append(problem(Code.NOT_A_REGULAR_FILE, rule="served", file=name))
                continue
            headers[name] = read_header(path, display_name=name)
        except OSError as exc:
            error = exc.strerror
            problems.append(problem(Code.FILE_UNREADABLE, rule="served", file=name, error=error))
        except Fatal as exc:
            problems += exc.problems
    return headers, problems

"""Level 3, `--source SRC`, the data: every output tensor and file against the source's bytes.

Each output tensor is matched with what the source's names make it (`derive.py`): its
dtype and shape, then its bytes, streamed through two bounded buffers and compared chunk by
chunk (a `w31` against the source's `w3` bytes followed by its `w1` bytes). Every other
source file must be in the output, byte-identical, and the output may hold no file the
conversion of this source would not write. No checksum is involved anywhere.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .. import contract
from ..errors import Problem, problem
from ..hashing import CHUNK_SIZE, ShortRead
from ..reasons import Code
from ..safetensors_format import ShardHeader, TensorInfo
from ..source import Source
from .derive import Expected, expected_tensors
from .files import is_regular
from .meter import MeterFactory
from .report import VerifyReport
from .streams import Buffers, OpenFiles, compare_ranges, run_jobs
from .structure import Output

LEVEL = "source"


@dataclass
class _ShardComparison:
    """The tensors of one output shard to compare, and how many bytes they hold."""

    file: str
    tensors: list[tuple[str, Expected]] = field(default_factory=list)
    nbytes: int = 0


def compare_with_source(
    out: Output,
    source: Source,
    served: tuple[dict[str, ShardHeader], list[Problem]],
    changed: set[str],
    workers: int,
    meter: MeterFactory,
    report: VerifyReport,
) -> None:
    """Two checks: every tensor, then every other file. `served`: the header of every source
    shard a loader opens, and why some cannot be (`served.py`); `changed`: the shards that
    changed since the conversion (a difference there is blamed on the source)."""
    expected = expected_tensors(served[0])
    problems, comparisons = _match_tensors(out, expected)
    problems = served[1] + problems
    del expected
    files, file_problems = _match_files(out, source)
    total = sum(comparison.nbytes for comparison in comparisons) + sum(size for _, size in files)
    compared = sum(len(j.tensors) for j in comparisons)
    with meter("verify --source", total, "bytes") as progress:
        problems += run_jobs(
            lambda comparison, stop: _compare_shard(
                out, source, changed, comparison, stop, progress.advance
            ),
            comparisons,
            workers,
        )
        file_problems += run_jobs(
            lambda item, stop: _compare_file(out, source, item, stop, progress.advance),
            files,
            workers,
        )
    report.add(
        "source-tensors",
        LEVEL,
        "every tensor equals its source bytes",
        problems,
        f"{compared} tensors compared byte for byte with {source.label}",
    )
    report.add(
        "source-files",
        LEVEL,
        "other files equal the source's",
        file_problems,
        f"{len(files)} files compared",
    )


def _match_tensors(
    out: Output, expected: dict[str, Expected]
) -> tuple[list[Problem], list[_ShardComparison]]:
    """Names, dtypes and shapes; the tensors whose bytes are to be compared, by shard."""
    problems, comparisons, seen = [], [], set()
    for file, header in out.headers.items():
        comparison = _ShardComparison(file)
        for name, info in header.tensors.items():
            seen.add(name)
            want = expected.get(name)
            if want is None:
                problems.append(problem(Code.TENSOR_NOT_FROM_SOURCE, file=file, tensor=name))
                continue
            unlike = _unlike(file, name, info, want)
            if unlike is not None:
                problems.append(unlike)
                continue
            comparison.tensors.append((name, want))
            comparison.nbytes += info.nbytes
        comparisons.append(comparison)
    # Tensors of shards that did not parse are not counted missing: structure said why.
    unread = set(out.shard_names) - out.headers.keys()
    if not unread:
        problems += [
            problem(Code.TENSOR_MISSING, tensor=name) for name in sorted(expected.keys() - seen)
        ]
    return problems, comparisons


def _unlike(file: str, name: str, info: TensorInfo, want: Expected) -> Problem | None:
    """Why an output tensor cannot be what the source says (dtype, shape), or None."""
    if want.missing:
        missing = ", ".join(want.missing)
        return problem(
            Code.EXPERT_PARTNER_MISSING, rule="source-half", file=file, tensor=name, missing=missing
        )
    infos = [p.info for p in want.parts]
    dtypes = {i.dtype for i in infos}
    if dtypes != {info.dtype}:
        return problem(
            Code.TENSOR_DTYPE_DIFFERS,
            file=file,
            tensor=name,
            want=" / ".join(sorted(dtypes)),
            dtype=info.dtype,
        )
    shapes, found = [list(i.shape) for i in infos], list(info.shape)
    if len(infos) == 2 and (shapes[0] != shapes[1] or not shapes[0]):
        return problem(
            Code.TENSOR_SHAPE_DIFFERS,
            rule="source-halves",
            file=file,
            tensor=name,
            want=shapes,
            shape=found,
        )
    shape = shapes[0] if len(infos) == 1 else [2 * shapes[0][0], *shapes[0][1:]]
    if found != shape:
        return problem(
            Code.TENSOR_SHAPE_DIFFERS, rule="shape", file=file, tensor=name, want=shape, shape=found
        )
    return None


def _compare_shard(
    out: Output,
    source: Source,
    changed: set[str],
    comparison: _ShardComparison,
    stop: threading.Event,
    advance,
) -> list[Problem]:
    header = out.headers[comparison.file]
    bufs, problems = Buffers(), []
    with OpenFiles() as files:
        try:
            fd = files.fd(out.root / comparison.file)
            for name, want in comparison.tensors:
                info = header.tensors[name]
                right = [
                    (files.fd(source.root / p.file), p.info.begin, p.info.nbytes, p.file)
                    for p in want.parts
                ]
                pos = compare_ranges(
                    (fd, info.begin, info.nbytes, comparison.file), right, bufs, stop, advance
                )
                if pos is not None:
                    problems.append(_differs(comparison.file, name, want, pos, changed))
        except ShortRead as exc:
            problems.append(
                problem(Code.FILE_TRUNCATED, rule="read", file=exc.file, offset=exc.offset)
            )
        except OSError as exc:
            problems.append(
                problem(
                    Code.FILE_UNREADABLE,
                    rule="read",
                    file=exc.filename or comparison.file,
                    error=exc.strerror or exc,
                )
            )
    return problems


def _differs(file: str, name: str, want: Expected, pos: int, changed: set[str]) -> Problem:
    if any(p.file in changed for p in want.parts):
        return problem(Code.SOURCE_CHANGED_SINCE, rule="tensor", file=file, tensor=name, pos=pos)
    if want.fused:
        half = "up (w3)" if pos < want.parts[0].info.nbytes else "gate (w1)"
        return problem(Code.W31_NOT_UP_GATE, file=file, tensor=name, pos=pos, half=half)
    return problem(Code.BYTES_DIFFER, rule="tensor", file=file, tensor=name, pos=pos)


def _match_files(out: Output, source: Source) -> tuple[list[tuple[str, int]], list[Problem]]:
    """The source's other files to compare (name, size), and what is missing or extra."""
    problems, todo = [], []
    for rel in source.extra_files:
        path = out.root / rel
        if not is_regular(path):
            problems.append(problem(Code.FILE_MISSING, rule="from-source", file=rel))
            continue
        size, want = path.stat().st_size, (source.root / rel).stat().st_size
        if size != want:
            problems.append(
                problem(Code.BYTES_DIFFER, rule="file-size", file=rel, want=want, size=size)
            )
        else:
            todo.append((rel, size))
    allowed = {
        *out.shard_names,
        *source.extra_files,
        contract.CONFIG_NAME,
        contract.INDEX_NAME,
        contract.CHECKSUMS_NAME,
    }
    problems += [
        problem(Code.FILE_NOT_FROM_SOURCE, file=rel) for rel in out.files if rel not in allowed
    ]
    return todo, problems


def _compare_file(
    out: Output, source: Source, item: tuple[str, int], stop: threading.Event, advance
) -> list[Problem]:
    rel, size = item
    bufs = Buffers(min(CHUNK_SIZE, max(size, 1)))  # most are a few kB
    try:
        with OpenFiles() as files:
            mine, theirs = files.fd(out.root / rel), files.fd(source.root / rel)
            pos = compare_ranges(
                (mine, 0, size, rel), [(theirs, 0, size, rel)], bufs, stop, advance
            )
    except (OSError, ShortRead) as exc:
        return [problem(Code.FILE_UNREADABLE, rule="read", file=rel, error=exc)]
    if pos is None:
        return []
    return [problem(Code.BYTES_DIFFER, rule="file", file=rel, pos=pos)]

"""NaN scales: reported where they are, and judged the same by every run.

Class 9: a NaN scale found while converting is reported against the source file and the
source tensor that hold it, with its byte in that tensor, never the output shard or the
fused `w31` it was being copied into. Class 3: a shard kept from an earlier run is proven
to the standard a written one is, under this run's options: a rerun's verdict on scales is
a fresh run's (`--check-scales`, `--rehash` or not), whatever the earlier run checked.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import faults as fl
import pytest
from faults.library import _add_tensor
from hypothesis import given
from hypothesis import strategies as st
from kimi_w31.converter import contract
from kimi_w31.converter.errors import Fatal
from kimi_w31.converter.pipeline import ConvertOptions, convert
from kimi_w31.converter.reasons import Code
from kimi_w31.converter.synth import SynthSpec, synth_checkpoint

DENSE_SCALE = "language_model.model.norm.weight_scale"  # U8, not an expert's: --check-scales only


@pytest.fixture(scope="module")
def scaled_source(tmp_path_factory) -> Path:
    """A small source with, besides its experts' scales, one non-expert U8 scale."""
    root = tmp_path_factory.mktemp("scales") / "src"
    synth_checkpoint(root, SynthSpec(layers=2, experts=2, shards=2))
    _add_tensor(root, _first_shard(root), DENSE_SCALE, "U8", [64], bytes(64))
    return root


def _first_shard(root: Path) -> str:
    return sorted(p.name for p in root.glob("*.safetensors"))[0]


def _scales(src: Path) -> list[tuple[str, str, int]]:
    """(file, tensor, size) of every tensor --check-scales scans."""
    found = []
    for path in sorted(src.glob("*.safetensors")):
        header, _ = fl.read_shard(path)
        for name in fl.tensor_names(header):
            info = header[name]
            if contract.is_e8m0_scale(name, info["dtype"], True):
                begin, end = info["data_offsets"]
                found.append((path.name, name, end - begin))
    return found


def _plant(src: Path, file: str, tensor: str, pos: int) -> None:
    header, data = fl.read_shard(src / file)
    begin = header[tensor]["data_offsets"][0] + pos
    (src / file).write_bytes(fl.shard_bytes(header, data[:begin] + b"\xff" + data[begin + 1 :]))


def _verdict(src: Path, out: Path, check_scales: bool, rehash: bool = False) -> set[str]:
    """What a run says: the codes it refuses with ({} when it succeeds)."""
    opts = ConvertOptions(
        str(src),
        out,
        manifest="kimi-k3-any",
        max_shard_size=200_000,
        check_scales=check_scales,
        rehash=rehash,
    )
    try:
        convert(opts)
    except Fatal as exc:
        return {p.code.value for p in exc.problems}
    return set()


@fl.fuzz(12)
@given(data=st.data())
def test_a_nan_scale_is_named_by_the_source_file_and_tensor_that_hold_it(
    scaled_source, tmp_path_factory, data
):
    work = tmp_path_factory.mktemp("nan")
    src = Path(shutil.copytree(scaled_source, work / "src"))
    file, tensor, size = data.draw(st.sampled_from(_scales(src)), label="scale tensor")
    pos = data.draw(st.integers(0, size - 1), label="byte")
    _plant(src, file, tensor, pos)
    with pytest.raises(Fatal) as caught:
        convert(ConvertOptions(str(src), work / "out", manifest="kimi-k3-any", check_scales=True))
    nan = [p for p in caught.value.problems if p.code is Code.SCALE_NAN]
    assert [(p.file, p.tensor) for p in nan] == [(file, tensor)]
    assert f"first at byte {pos} of the tensor" in nan[0].what
    assert not (work / "out" / fl.INDEX).exists()


@fl.fuzz(12)
@given(
    nan_in=st.sampled_from([None, DENSE_SCALE]),
    first_checks=st.booleans(),
    check_scales=st.booleans(),
    rehash=st.booleans(),
)
def test_a_rerun_judges_scales_as_a_fresh_run_does(
    scaled_source, tmp_path_factory, nan_in, first_checks, check_scales, rehash
):
    """Differential: rerun on an earlier run's output == fresh run, same options."""
    work = tmp_path_factory.mktemp("rerun")
    src = Path(shutil.copytree(scaled_source, work / "src"))
    if nan_in is not None:
        _plant(src, _first_shard(src), nan_in, 5)
    _verdict(src, work / "out", first_checks)
    rerun = _verdict(src, work / "out", check_scales, rehash)
    fresh = _verdict(src, work / "fresh", check_scales, rehash)
    assert rerun == fresh
    assert (work / "out" / fl.INDEX).exists() == (work / "fresh" / fl.INDEX).exists()
    # Negative control: the planted NaN is what a --check-scales run refuses.
    assert (Code.SCALE_NAN.value in fresh) == (nan_in is not None and check_scales)

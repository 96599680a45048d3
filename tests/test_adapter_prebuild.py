"""adapter/prebuild.py against a fake FlashInfer: what it builds, progress, cache, errors."""

from __future__ import annotations

import enum
import sys
import time
import types
from pathlib import Path

import pytest
from kimi_w31.adapter import prebuild as pb


class _Act(enum.IntEnum):
    Swiglu = 3
    Situ = 10


def _cutlass(input, *, situ_beta=None, situ_linear_beta=None):  # noqa: A002
    return input


class FakeSpec:
    def __init__(self, root: Path, name: str, n: int, fail: bool = False) -> None:
        self.name, self.sources, self.fail = name, [root / f"s{i}.cu" for i in range(n)], fail
        self.build_dir = root / "build" / name
        self.builds = 0

    @property
    def is_compiled(self) -> bool:
        return self.get_library_path().exists()

    def get_library_path(self) -> Path:
        return self.build_dir / f"{self.name}.so"

    def build(self) -> None:
        self.builds += 1
        self.build_dir.mkdir(parents=True, exist_ok=True)
        for i, _ in enumerate(self.sources):
            time.sleep(0.02)
            if self.fail and i == 1:
                raise RuntimeError("nvcc exited with 1")
            (self.build_dir / f"s{i}.cuda.o").write_bytes(b"")
        self.get_library_path().write_bytes(b"\x7fELF")


@pytest.fixture
def fake_flashinfer(monkeypatch, tmp_path):
    specs: dict[str, FakeSpec] = {}
    root = types.ModuleType("flashinfer")
    root.__version__ = "0.7.2.post1"
    fused = types.ModuleType("flashinfer.fused_moe")
    fused.ActivationType, fused.cutlass_fused_moe = _Act, _cutlass
    core = types.ModuleType("flashinfer.fused_moe.core")
    for arch, name in (("sm90", "fused_moe_90"), ("sm120", "fused_moe_120")):
        specs[arch] = FakeSpec(tmp_path, name, 6)
        setattr(core, pb._GENERATOR[arch], lambda fast, s=specs[arch]: s)
    fused.core, root.fused_moe = core, fused
    for mod in (root, fused, core):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    return specs


def test_builds_the_module_once_with_progress(fake_flashinfer) -> None:
    seen: list[pb.Progress] = []
    result = pb.prebuild(seen.append, arch="sm90", poll_s=0.01)
    spec = fake_flashinfer["sm90"]
    assert result.built and result.module == "fused_moe_90" and result.sources == 6
    assert result.library == spec.get_library_path() and result.library.exists()
    assert seen[0].stage == "compile" and seen[-1] == pb.Progress("done", 6, 6, seen[-1].elapsed_s)
    dones = [p.done for p in seen if p.stage == "compile"]
    assert dones == sorted(dones) and all(p.total == 6 for p in seen)  # monotone progress
    again: list[pb.Progress] = []
    cached = pb.prebuild(again.append, arch="sm90")
    assert not cached.built and spec.builds == 1 and [p.stage for p in again] == ["cached"]
    assert fake_flashinfer["sm120"].builds == 0


def test_sm120_and_unknown_arch(fake_flashinfer) -> None:
    assert pb.prebuild(arch="sm120", poll_s=0.01).module == "fused_moe_120"
    with pytest.raises(pb.PrebuildError, match="unknown arch"):
        pb.prebuild(arch="sm100")  # type: ignore[arg-type]


def test_build_failure_is_reported(fake_flashinfer) -> None:
    fake_flashinfer["sm90"].fail = True
    with pytest.raises(pb.PrebuildError, match="fused_moe_90 failed: nvcc exited"):
        pb.prebuild(arch="sm90", poll_s=0.01)


def test_refuses_a_flashinfer_without_situ(fake_flashinfer, monkeypatch) -> None:
    from kimi_w31.adapter.flashinfer_moe import SituUnsupportedError

    monkeypatch.setattr(sys.modules["flashinfer.fused_moe"], "cutlass_fused_moe", lambda input: 0)
    with pytest.raises(SituUnsupportedError):
        pb.prebuild(arch="sm90")
    assert fake_flashinfer["sm90"].builds == 0


def test_without_a_gpu_flashinfer_must_not_be_imported_first(fake_flashinfer, monkeypatch):
    # FlashInfer picks its cache directory at import; without a GPU and without the arch
    # list, that directory would not be the one a server on the GPU reads.
    monkeypatch.delenv("FLASHINFER_CUDA_ARCH_LIST")
    with pytest.raises(pb.PrebuildError, match="fresh process"):
        pb.prebuild(arch="sm90")
    with pytest.raises(pb.PrebuildError, match="no CUDA GPU"):
        pb.prebuild()


def test_the_prebuild_command_shows_progress_and_maps_errors(monkeypatch, tmp_path):
    """`kimi-convert prebuild`: progress lines for a log, exit 0 when built, 1 when not."""
    from click.testing import CliRunner

    from kimi_w31.cli import main

    def fake(report, *, arch=None, poll_s=5.0):
        for done in (0, 5, 10):
            report(pb.Progress("compile", done, 10, float(done)))
        return pb.PrebuildResult(arch or "sm90", "fused_moe_90", tmp_path / "m.so", True, 10, 3.0)

    monkeypatch.setattr(pb, "prebuild", fake)
    result = CliRunner().invoke(main, ["prebuild", "--arch", "sm90", "--progress", "lines"])
    assert result.exit_code == 0, result.output
    lines = [x for x in result.output.splitlines() if x.startswith("flashinfer build: ")]
    assert lines and lines[-1].startswith("flashinfer build: 10/10 (100%)")

    def broken(report, *, arch=None, poll_s=5.0):
        raise pb.PrebuildError("no CUDA GPU visible: pass arch='sm90' or arch='sm120'")

    monkeypatch.setattr(pb, "prebuild", broken)
    assert CliRunner().invoke(main, ["prebuild"]).exit_code == 1

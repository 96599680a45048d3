"""adapter/prebuild.py against a fake FlashInfer: what it builds, progress, cache, jobs,
bundles, errors, and the off-GPU `--arch` path in a fresh process."""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path

import pytest
from cli_helpers import run_cli
from hypothesis import given
from hypothesis import strategies as st
from kimi_w31.adapter import bundle as B
from kimi_w31.adapter import kernels as K
from kimi_w31.adapter import prebuild as pb
from kimi_w31.adapter.reasons import AdapterCode
from test_kernel_bundle import STACK  # noqa: E402


class _Act(enum.IntEnum):
    Swiglu = 3
    Situ = 10


def _cutlass(input, *, situ_beta=None, situ_linear_beta=None, use_wfp4afp8_humming=False):  # noqa: A002
    return input


class FakeSpec:
    def __init__(self, root: Path, name: str, n: int, fail: bool = False) -> None:
        self.name, self.sources, self.fail = name, [root / f"s{i}.cu" for i in range(n)], fail
        self.build_dir = root / "build" / name
        self.builds = 0
        self.max_jobs_seen: str | None = None

    @property
    def is_compiled(self) -> bool:
        return self.get_library_path().exists()

    def get_library_path(self) -> Path:
        return self.build_dir / f"{self.name}.so"

    def build(self) -> None:
        self.builds += 1
        self.max_jobs_seen = os.environ.get("MAX_JOBS")
        self.build_dir.mkdir(parents=True, exist_ok=True)
        for i, _ in enumerate(self.sources):
            time.sleep(0.02)
            if self.fail == "status" and i == 1:  # as FlashInfer's run_ninja raises it
                output = "".join(f"[{n}/9] nvcc s{n}.cu\n" for n in range(40)) + "error: x\n"
                try:
                    raise subprocess.CalledProcessError(2, ["/usr/bin/ninja", "-v"], output)
                except subprocess.CalledProcessError as exc:
                    raise RuntimeError("Ninja build failed. Ninja output:\n" + output) from exc
            if self.fail == "other" and i == 1:
                raise RuntimeError("no ninja file")
            (self.build_dir / f"s{i}.cuda.o").write_bytes(b"")
        self.get_library_path().write_bytes(b"\x7fELF" + self.name.encode())


@pytest.fixture
def fake_flashinfer(monkeypatch, tmp_path):
    """A FlashInfer with SiTU and Humming; the plugin's recipes replaced by fake specs."""
    root = types.ModuleType("flashinfer")
    root.__version__ = "0.7.2.post1"
    fused = types.ModuleType("flashinfer.fused_moe")
    fused.ActivationType, fused.cutlass_fused_moe = _Act, _cutlass
    fused.preprocess_moe_weights_for_sm90_mixed_gemm_humming = lambda *a: a
    root.fused_moe = fused
    for mod in (root, fused):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.delenv("MAX_JOBS", raising=False)
    sources = {"w4a16": 6, "w4a16-all": 7, "w4a8": 9, "sm120": 4}
    specs = {
        key: FakeSpec(tmp_path, f"{v.module_name}", sources[key]) for key, v in K.VARIANTS.items()
    }
    monkeypatch.setattr(K, "recipe", lambda v, **_: v.key)
    monkeypatch.setattr(K, "jit_spec", lambda key, write=True: specs[key])
    monkeypatch.setattr(K, "source_hash", lambda key, spec: f"hash-of-{key}")
    monkeypatch.setattr(
        B, "current_stack", lambda arch, build=False: dataclasses.replace(STACK, arch=arch)
    )
    monkeypatch.setattr(pb, "_gpu_arch", lambda: None)
    monkeypatch.setenv("CUDA_HOME", str(fake_toolkit(tmp_path / "cuda")))
    return specs


def fake_toolkit(home, nvcc: bool = True, curand: bool = True):
    """A CUDA toolkit folder with what the build checks for."""
    (home / "bin").mkdir(parents=True, exist_ok=True)
    (home / "include").mkdir(parents=True, exist_ok=True)
    if nvcc:
        (home / "bin" / "nvcc").write_text("")
    if curand:
        (home / "include" / "curand.h").write_text("")
    return home


def test_builds_the_default_module_once_with_progress(fake_flashinfer) -> None:
    seen: list[pb.BuildProgress] = []
    result = pb.prebuild(seen.append, arch="sm90", jobs=3, poll_s=0.01)
    spec = fake_flashinfer["w4a16"]
    (m,) = result.modules
    assert m.built and m.variant == "w4a16" and m.module == spec.name and m.sources == 6
    assert m.library == spec.get_library_path() and m.library.exists()
    assert m.source_hash == "hash-of-w4a16" and result.jobs == 3 and result.bundle is None
    assert seen[0].stage == "compile" and seen[-1].stage == "done" and seen[-1].done == 6
    dones = [p.done for p in seen if p.stage == "compile"]
    assert dones == sorted(dones) and all(p.total == 6 and p.module == spec.name for p in seen)
    # MAX_JOBS reaches FlashInfer's ninja for the build only
    assert spec.max_jobs_seen == "3" and "MAX_JOBS" not in os.environ
    again: list[pb.BuildProgress] = []
    cached = pb.prebuild(again.append, arch="sm90")
    assert not cached.modules[0].built and spec.builds == 1
    assert [p.stage for p in again] == ["cached"]
    assert fake_flashinfer["w4a8"].builds == 0 and fake_flashinfer["sm120"].builds == 0


def test_several_precisions_and_a_bundle(fake_flashinfer, tmp_path) -> None:
    out = tmp_path / "kernels"
    result = pb.prebuild(arch="sm90", variants=["w4a16", "w4a8"], out=out, jobs=2, poll_s=0.01)
    assert [m.variant for m in result.modules] == ["w4a16", "w4a8"]
    assert result.bundle == out / B.MANIFEST
    manifest = B.BundleManifest.from_json(result.bundle.read_text())
    assert manifest.stack == STACK and manifest.build["jobs"] == 2
    for m in manifest.modules:
        lib = out / m.file
        assert lib.read_bytes() == fake_flashinfer[m.variant].get_library_path().read_bytes()
        assert m.sha256 == B.sha256_file(lib) and m.source_hash == f"hash-of-{m.variant}"
        # what a serving node on the same stack accepts
        assert B.check(out, m.variant, STACK, m.source_hash)[1].path == lib
    # a later run for one precision keeps the other's entry
    pb.prebuild(arch="sm90", variants=["w4a8"], out=out)
    again = B.BundleManifest.from_json(result.bundle.read_text())
    assert {m.variant for m in again.modules} == {"w4a16", "w4a8"}


def test_sm120_wrong_precision_and_unknown_arch(fake_flashinfer) -> None:
    assert pb.prebuild(arch="sm120", poll_s=0.01).modules[0].variant == "sm120"
    with pytest.raises(pb.PrebuildError, match="unknown arch") as err:
        pb.prebuild(arch="sm100")  # type: ignore[arg-type]
    assert err.value.reason == "prebuild-arch" and err.value.exit_code == 1
    with pytest.raises(pb.PrebuildError, match="not a sm120 module") as err:
        pb.prebuild(arch="sm120", variants=["w4a16"])
    assert err.value.reason == "prebuild-arch"
    with pytest.raises(pb.PrebuildError, match="not a sm90 module") as err:
        pb.prebuild(arch="sm90", variants=["w4a32"])
    assert err.value.reason == "prebuild-arch"


def test_a_compiler_exit_is_prebuild_failed_with_its_status(fake_flashinfer) -> None:
    """The build's own failure, which no check of ours names: its exit status and its last
    lines are the refusal's facts."""
    from kimi_w31.converter.errors import problem

    spec = fake_flashinfer["w4a16"]
    spec.fail = "status"
    with pytest.raises(pb.PrebuildError) as err:
        pb.prebuild(arch="sm90", poll_s=0.01)
    assert err.value.reason == AdapterCode.PREBUILD_FAILED.value and err.value.exit_code == 1
    lines = [f"[{n}/9] nvcc s{n}.cu" for n in range(40)] + ["error: x"]
    facts = {"module": spec.name, "command": "ninja", "status": 2}
    tail = "\n".join(lines[-pb.OUTPUT_LINES :])
    assert err.value.error.problems == [problem(AdapterCode.PREBUILD_FAILED, **facts, output=tail)]
    assert "MAX_JOBS" not in os.environ


def test_another_build_failure_is_prebuild_build(fake_flashinfer) -> None:
    """Negative control: a failure that is no process's exit keeps the build's own code."""
    fake_flashinfer["w4a16"].fail = "other"
    with pytest.raises(pb.PrebuildError) as err:
        pb.prebuild(arch="sm90", poll_s=0.01)
    assert err.value.reason == "prebuild-build" and err.value.exit_code == 1


def test_plan_only_builds_nothing(fake_flashinfer, tmp_path) -> None:
    result = pb.prebuild(arch="sm90", variants=["w4a8"], plan_only=True, out=tmp_path / "b")
    assert result.modules[0].source_hash == "hash-of-w4a8" and not result.modules[0].built
    assert fake_flashinfer["w4a8"].builds == 0 and not (tmp_path / "b").exists()


def test_refuses_a_flashinfer_without_situ(fake_flashinfer, monkeypatch) -> None:
    from kimi_w31.adapter.flashinfer_moe import SituUnsupportedError

    monkeypatch.setattr(sys.modules["flashinfer.fused_moe"], "cutlass_fused_moe", lambda input: 0)
    with pytest.raises(SituUnsupportedError):
        pb.prebuild(arch="sm90")
    assert fake_flashinfer["w4a16"].builds == 0


def test_without_flashinfer_the_message_says_how_to_install(monkeypatch) -> None:
    from kimi_w31.adapter.flashinfer_moe import SituUnsupportedError

    monkeypatch.setattr(pb, "_gpu_arch", lambda: None)
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    with pytest.raises(SituUnsupportedError) as err:
        pb.prebuild(arch="sm90")
    msg = str(err.value)
    assert "not installed" in msg and "pip install '.[sglang]'" in msg
    assert "Upgrade" not in msg  # nothing to upgrade


def test_without_a_gpu_flashinfer_must_not_be_imported_first(fake_flashinfer, monkeypatch):
    # FlashInfer picks its target and cache directory at import; without a GPU and without
    # the arch list, that directory would not be the one a server on the GPU reads.
    monkeypatch.delenv("FLASHINFER_CUDA_ARCH_LIST")
    with pytest.raises(pb.PrebuildError, match="fresh process") as err:
        pb.prebuild(arch="sm90")
    assert err.value.reason == "prebuild-flashinfer-imported"
    with pytest.raises(pb.PrebuildError, match="no CUDA GPU"):
        pb.prebuild()


_FAKE_FLASHINFER = """
import enum, os
from pathlib import Path
Path(os.environ["SEEN"]).write_text(os.environ.get("FLASHINFER_CUDA_ARCH_LIST", "<unset>"))
__version__ = "0.7.2.post1"
"""
_FAKE_FUSED = """
import dataclasses
import enum
class ActivationType(enum.IntEnum):
    Situ = 10
def cutlass_fused_moe(input, *, situ_beta=None, situ_linear_beta=None):
    return input
"""
_DRIVER = """
import sys
from kimi_w31.adapter import kernels as K, prebuild as pb
class Spec:
    name, sources, is_compiled = "m", [], False
    def get_library_path(self):
        return "m.so"
K.recipe = lambda v, **_: v
K.jit_spec = lambda rec, write=True: Spec()
K.source_hash = lambda rec, spec: "h"
pb._gpu_arch = lambda: None  # a build machine without a GPU
r = pb.prebuild(arch=sys.argv[1], plan_only=True)
print(r.arch, r.modules[0].variant)
"""


@pytest.mark.parametrize(("arch", "want"), [("sm90", "9.0a"), ("sm120", "12.0")])
def test_off_gpu_arch_in_a_fresh_process(tmp_path, arch, want) -> None:
    """`prebuild --arch` on a machine without the GPU, in a new interpreter: the arch list is
    set before anything imports FlashInfer (its own guard would trip otherwise)."""
    pkg = tmp_path / "site" / "flashinfer"
    (pkg / "fused_moe").mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(_FAKE_FLASHINFER))
    (pkg / "fused_moe" / "__init__.py").write_text(textwrap.dedent(_FAKE_FUSED))
    env = {k: v for k, v in os.environ.items() if k != "FLASHINFER_CUDA_ARCH_LIST"}
    env["SEEN"] = str(tmp_path / "seen")
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", _DRIVER, arch], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [arch, K.DEFAULT_VARIANTS[arch][0]]
    assert (tmp_path / "seen").read_text() == want


@given(
    cores=st.integers(1, 256),
    gib=st.floats(0, 2048, allow_nan=False),
    per_job=st.floats(0.5, 16),
    max_jobs=st.one_of(st.none(), st.integers(1, 512)),
)
def test_jobs_are_bounded_by_memory_and_cores(cores, gib, per_job, max_jobs) -> None:
    environ = {} if max_jobs is None else {"MAX_JOBS": str(max_jobs)}
    jobs = pb.default_jobs(cores, int(gib * 2**30), per_job, environ)
    if max_jobs is not None:
        assert jobs == max_jobs  # the user's word wins
    else:
        assert 1 <= jobs <= cores
        assert jobs == 1 or jobs * per_job <= gib + 1e-9  # never more nvcc than memory holds
        assert jobs == cores or (jobs + 1) * per_job > gib - 1e-9  # no fewer than it holds


def test_the_prebuild_command_shows_progress_and_maps_errors(monkeypatch, tmp_path):
    """`kimi-convert prebuild`: progress lines for a log, exit 0 when built, 1 when not."""
    from cli_helpers import run_cli

    calls = []

    def fake(report, *, arch=None, variants=None, out=None, jobs=None, plan_only=False):
        calls.append((arch, variants, out, jobs, plan_only))
        for done in (0, 5, 10):
            report(pb.BuildProgress("compile", done, 10, float(done), "m"))
        lib = tmp_path / "m.so"
        mod = pb.ModuleResult("w4a16", "m", lib, True, 10, 3.0, "ab" * 32)
        return pb.PrebuildResult(arch or "sm90", [mod], 4, None)

    monkeypatch.setattr(pb, "prebuild", fake)
    args = ["prebuild", "--arch", "sm90", "--progress", "lines", "--precision", "w4a8"]
    result = run_cli([*args, "--jobs", "4", "--out", str(tmp_path / "k")], inprocess=True)
    assert result.returncode == 0, result.output
    assert calls[-1] == ("sm90", ("w4a8",), tmp_path / "k", 4, False)
    lines = [x for x in result.output.splitlines() if x.startswith("flashinfer build m: ")]
    assert lines and lines[-1].startswith("flashinfer build m: 10/10 (100%)")

    def broken(report, **kw):
        raise pb.PrebuildError("no CUDA GPU visible: pass arch='sm90' or arch='sm120'")

    monkeypatch.setattr(pb, "prebuild", broken)
    assert run_cli(["prebuild"], inprocess=True).returncode == 1


# -- publishing into --out: atomic, under a lock, into a folder servers accept -------------

_PUBLISHER = """
import dataclasses, json, os, sys, time
from pathlib import Path
from kimi_w31.adapter import bundle as B, kernels as K, prebuild as pb
out, variant, lib, go = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
class Spec:  # the seam that produces the library: already built, at `lib`
    name, sources, is_compiled = K.VARIANTS[variant].module_name, [], True
    def get_library_path(self):
        return lib
K.recipe = lambda v, **_: v
K.jit_spec = lambda rec, write=True: Spec()
K.source_hash = lambda rec, spec: "h-" + lib.name
K.recipe_key = lambda v, cuda, environ=None: None
stack = B.Stack(**json.loads(os.environ["STACK"]))
B.current_stack = lambda arch, build=False: stack
pb._gpu_arch = lambda: None
Path(str(go) + "." + lib.name).touch()  # ready
while not go.exists():
    time.sleep(0.001)
pb.prebuild(arch="sm90", variants=[variant], out=out)
"""


def _publishers(tmp_path: Path, out: Path, jobs: list[tuple[str, Path]]) -> None:
    """Run one `prebuild --out OUT` process per (variant, library), released at once."""
    pkg = tmp_path / "site" / "flashinfer"
    (pkg / "fused_moe").mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(_FAKE_FLASHINFER))
    (pkg / "fused_moe" / "__init__.py").write_text(textwrap.dedent(_FAKE_FUSED))
    env = {k: v for k, v in os.environ.items() if k != "FLASHINFER_CUDA_ARCH_LIST"}
    env["SEEN"] = str(tmp_path / "seen")
    env["STACK"] = json.dumps(dataclasses.asdict(STACK))
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), env.get("PYTHONPATH", "")])
    go = tmp_path / "go"
    go.unlink(missing_ok=True)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PUBLISHER, str(out), variant, str(lib), str(go)],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for variant, lib in jobs
    ]
    deadline = time.monotonic() + 120
    while not all(Path(f"{go}.{lib.name}").exists() for _, lib in jobs):  # all started
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.01)
    go.touch()
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err


def _libraries(tmp_path: Path, n: int, size: int = 8 << 20) -> list[Path]:
    libs = []
    for i in range(n):
        lib = tmp_path / f"lib{i}.so"
        lib.write_bytes(b"\x7fELF" + bytes([65 + i]) * size)
        libs.append(lib)
    return libs


def test_two_builds_into_one_bundle_never_mix_bytes(tmp_path) -> None:
    """Two `prebuild --out` of one precision at once: the bundle holds one build's library
    whole, with that library's digest in the manifest, and a server accepts it."""
    out = tmp_path / "kernels"
    libs = _libraries(tmp_path, 2)
    _publishers(tmp_path, out, [("w4a16", lib) for lib in libs])
    manifest = B.BundleManifest.from_json((out / B.MANIFEST).read_text())
    (module,) = manifest.modules
    data = (out / module.file).read_bytes()
    assert data in (libs[0].read_bytes(), libs[1].read_bytes())
    assert module.sha256 == B.sha256_file(out / module.file)
    assert B.check(out, "w4a16", STACK, module.source_hash)[1].sha256 == module.sha256
    assert sorted(p.name for p in out.iterdir()) == sorted([B.MANIFEST, module.file])


def test_two_precisions_at_once_both_land_in_the_manifest(tmp_path) -> None:
    out = tmp_path / "kernels"
    libs = _libraries(tmp_path, 2)
    _publishers(tmp_path, out, [("w4a16", libs[0]), ("w4a16-all", libs[1])])
    manifest = B.BundleManifest.from_json((out / B.MANIFEST).read_text())
    assert {m.variant for m in manifest.modules} == {"w4a16", "w4a16-all"}
    ordered = sorted(manifest.modules, key=lambda m: m.variant == "w4a16-all")
    for m, lib in zip(ordered, libs, strict=True):
        assert (out / m.file).read_bytes() == lib.read_bytes()
        assert B.check(out, m.variant, STACK, m.source_hash)[1].sha256 == m.sha256


def test_a_publish_waits_for_the_lock_then_refuses(tmp_path) -> None:
    from kimi_w31.converter.output.lock import OutputLock

    out = tmp_path / "kernels"
    out.mkdir()
    held = OutputLock(out / pb.PUBLISH_LOCK)
    held.acquire()
    t0 = time.monotonic()
    with pytest.raises(B.BundleError) as err, pb.publish_lock(out, wait_s=0.3):
        pass
    assert (
        err.value.error.codes == [AdapterCode.KERNEL_BUNDLE_BUSY] and time.monotonic() - t0 >= 0.3
    )
    releaser = threading.Timer(0.2, held.release)
    t1 = time.monotonic()
    releaser.start()
    with pb.publish_lock(out, wait_s=10):  # waits for the holder, then publishes
        # (the timer thread may still be exiting after its release: judge by the wait)
        assert time.monotonic() - t1 >= 0.2
    releaser.join()
    assert not (out / pb.PUBLISH_LOCK).exists()


@pytest.mark.parametrize("why", ["group-writable", "a-file"])
def test_an_out_folder_servers_would_refuse_is_refused_before_building(
    fake_flashinfer, tmp_path, why
) -> None:

    out = tmp_path / "kernels"
    if why == "group-writable":
        out.mkdir()
        out.chmod(0o775)
    else:
        out.write_text("")
    with pytest.raises(B.BundleError) as err:
        pb.prebuild(arch="sm90", out=out)
    want = (
        AdapterCode.KERNEL_BUNDLE_WRITABLE
        if why == "group-writable"
        else AdapterCode.KERNEL_BUNDLE_MISSING
    )
    assert err.value.error.codes == [want] and fake_flashinfer["w4a16"].builds == 0


def test_a_bundle_is_published_with_modes_servers_accept_whatever_the_umask(
    fake_flashinfer, tmp_path
) -> None:
    out = tmp_path / "kernels"
    old = os.umask(0o002)
    try:
        pb.prebuild(arch="sm90", out=out, poll_s=0.01)
    finally:
        os.umask(old)
    for path in out.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert B.check(out, "w4a16", STACK, "hash-of-w4a16")


# -- what to install or pass, before any build starts -----------------------------------------


@pytest.mark.parametrize(
    ("nvcc", "curand", "missing"),
    [(True, True, 0), (False, True, 1), (True, False, 1), (False, False, 2)],
)
def test_the_toolkit_is_checked_for_nvcc_and_curand(tmp_path, nvcc, curand, missing):
    home = fake_toolkit(tmp_path / "cuda", nvcc=nvcc, curand=curand)
    assert len(pb.toolkit_problems(home)) == missing
    if missing:
        with pytest.raises(pb.PrebuildError) as err:
            pb.check_toolkit(home)
        assert err.value.reason == "no-cuda-toolkit"
    else:
        pb.check_toolkit(home)


def test_curand_under_targets_counts(tmp_path):
    home = fake_toolkit(tmp_path / "cuda", curand=False)
    (home / "targets" / "x86_64-linux" / "include").mkdir(parents=True)
    (home / "targets" / "x86_64-linux" / "include" / "curand.h").write_text("")
    assert pb.toolkit_problems(home) == []


def test_cuda_home_is_found_as_flashinfer_finds_it(tmp_path):
    nvcc = fake_toolkit(tmp_path / "cuda") / "bin" / "nvcc"
    assert pb.cuda_home({"CUDA_HOME": "/a", "CUDA_PATH": "/b"}, lambda n: None) == Path("/a")
    assert pb.cuda_home({"CUDA_PATH": "/b"}, lambda n: None) == Path("/b")
    assert pb.cuda_home({}, lambda n: str(nvcc)) == (tmp_path / "cuda").resolve()
    assert pb.cuda_home({}, lambda n: None) == Path("/usr/local/cuda")


def test_a_missing_toolkit_refuses_before_building(fake_flashinfer, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_HOME", str(fake_toolkit(tmp_path / "bare", curand=False)))
    with pytest.raises(pb.PrebuildError) as err:
        pb.prebuild(arch="sm90", poll_s=0.01)
    assert err.value.reason == "no-cuda-toolkit"
    assert fake_flashinfer["w4a16"].builds == 0
    pb.prebuild(arch="sm90", plan_only=True)  # planning needs no compiler


def test_without_torch_it_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(pb.PrebuildError) as err:
        pb.prebuild(arch="sm90")
    assert err.value.reason == "no-torch"


def test_without_torch_the_cli_exits_1_without_a_traceback():
    got = run_cli(
        ["prebuild", "--arch", "sm90"], prelude="import sys; sys.modules['torch'] = None\n"
    )
    assert got.returncode == 1 and "Traceback" not in got.stderr
    assert "pip install" in got.stderr


def test_without_a_gpu_it_names_the_flag_to_pass(monkeypatch):
    monkeypatch.setattr(pb, "_gpu_arch", lambda: None)
    with pytest.raises(pb.PrebuildError) as err:
        pb.prebuild()
    assert err.value.reason == "no-gpu" and "--arch sm90" in str(err.value)

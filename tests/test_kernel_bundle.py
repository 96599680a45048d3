"""Kernel bundles (adapter/bundle.py): the manifest round trip, and every reason a serving
node refuses a bundle, by code, one field at a time. No torch, no FlashInfer."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kimi_w31.adapter import bundle as B
from kimi_w31.adapter.reasons import AdapterCode
from kimi_w31.converter.errors import message
from kimi_w31.converter.reasons import Code

STACK = B.Stack(
    arch="sm90",
    flashinfer="0.7.2.post1",
    cuda="13.0",
    torch="2.11.0",
    python="3.12",
    machine="x86_64",
    libc="glibc 2.35",
    abi="cpython-312-x86_64-linux-gnu",
)
SOURCE_HASH = "5e" * 32
RECIPE_KEY = "4b" * 32


def write_bundle(root: Path, stack: B.Stack = STACK, variants=("w4a16",), data=None) -> Path:
    """A bundle as `prebuild --out` writes it (library bytes are arbitrary here)."""
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    modules = []
    for v in variants:
        lib = root / f"fused_moe_90_kimi_w31_{v}.so"
        lib.write_bytes(data if data is not None else b"\x7fELF" + v.encode() * 100)
        lib.chmod(0o644)
        modules.append(
            B.Module(
                v,
                lib.stem,
                lib.name,
                B.sha256_file(lib),
                lib.stat().st_size,
                SOURCE_HASH,
                60,
                recipe_key=RECIPE_KEY,
            )
        )
    B.write(root, B.BundleManifest(stack, tuple(modules), "0.1.0", "2026-12-01T00:00:00+00:00"))
    return root


def library_of(root: Path, variant: str = "w4a16") -> Path:
    return root / f"fused_moe_90_kimi_w31_{variant}.so"


def refused(root: Path, *args, **kw) -> list[Code]:
    with pytest.raises(B.BundleError) as err:
        B.check(root, *(args or ("w4a16", STACK, SOURCE_HASH)), **kw)
    return err.value.error.codes


_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20)


@given(
    stack=st.builds(B.Stack, *[_text] * len(B.STACK_FIELDS)),
    modules=st.lists(
        st.builds(
            B.Module,
            variant=_text,
            name=_text,
            file=st.from_regex(r"[A-Za-z0-9_]{1,20}\.so", fullmatch=True),
            sha256=_text,
            size=st.integers(0, 2**40),
            source_hash=_text,
            units=st.integers(0, 10**4),
            build_seconds=st.one_of(st.none(), st.floats(0, 1e6, allow_nan=False)),
            recipe_key=st.one_of(st.none(), _text),
        ),
        max_size=4,
    ),
    build=st.dictionaries(_text, st.integers(), max_size=3),
)
def test_manifest_round_trip(stack, modules, build) -> None:
    m = B.BundleManifest(stack, tuple(modules), "0.1.0", "2026-12-01T00:00:00+00:00", build)
    assert B.BundleManifest.from_json(m.to_json()) == m


@pytest.mark.parametrize(
    "text",
    [
        "",
        "[]",
        "{}",
        json.dumps({"format": "kimi-w31-kernels/0"}),
        # a manifest of the first format: no platform tags
        json.dumps({"format": "kimi-w31-kernels/1", "stack": {}, "modules": []}),
        # a field missing, a module file that is a path, a module that is not a record
        json.dumps({"format": B.FORMAT, "stack": {}, "modules": []}),
        json.dumps(
            {
                "format": B.FORMAT,
                "stack": dataclasses.asdict(STACK),
                "modules": [{"file": "../x.so"}],
                "kimi_w31": "0.1.0",
                "created_utc": "",
            }
        ),
    ],
)
def test_a_bad_manifest_is_invalid(tmp_path, text) -> None:
    root = write_bundle(tmp_path / "b")
    (root / B.MANIFEST).write_text(text)
    assert refused(root) == [AdapterCode.KERNEL_BUNDLE_INVALID]


def test_a_manifest_not_utf8_is_invalid(tmp_path) -> None:
    root = write_bundle(tmp_path / "b")
    (root / B.MANIFEST).write_bytes(b"\xff\xfe{}")
    assert refused(root) == [AdapterCode.KERNEL_BUNDLE_INVALID]


def test_a_path_as_module_file_is_invalid(tmp_path) -> None:
    root = write_bundle(tmp_path / "b")
    data = json.loads((root / B.MANIFEST).read_text())
    data["modules"][0]["file"] = "../../elsewhere.so"
    (root / B.MANIFEST).write_text(json.dumps(data))
    assert refused(root) == [AdapterCode.KERNEL_BUNDLE_INVALID]


def test_no_manifest_is_invalid(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    assert refused(tmp_path / "empty") == [AdapterCode.KERNEL_BUNDLE_INVALID]


@pytest.mark.parametrize("what", ["missing", "file"])
def test_no_bundle_directory_is_refused_by_its_code(tmp_path, what) -> None:
    root = tmp_path / "kernels"
    if what == "file":
        root.write_text("not a folder")
    assert refused(root) == [AdapterCode.KERNEL_BUNDLE_MISSING]
    with pytest.raises(B.BundleError) as err:
        B.preflight(root, STACK)
    assert err.value.error.codes == [AdapterCode.KERNEL_BUNDLE_MISSING]


def test_a_matching_bundle_gives_its_library_open(tmp_path) -> None:
    root = write_bundle(tmp_path / "b", variants=("w4a16", "w4a8"))
    for v in ("w4a16", "w4a8"):
        manifest, lib = B.check(root, v, STACK, SOURCE_HASH)
        assert lib.path == library_of(root, v) and manifest.stack == STACK
        assert os.pread(lib.fd, 1 << 20, 0) == library_of(root, v).read_bytes()
        lib.close()
    assert B.check(root, "w4a16", STACK, None)[1].path.exists()  # hash unknown: not checked
    assert B.preflight(root, STACK).stack == STACK


FIELD_CODES = B.FIELD_CODES
# A running value each field refuses a STACK bundle on (libc: an older or another one).
OTHER = {
    "arch": "sm120",
    "flashinfer": "0.6.18",
    "cuda": "12.8",
    "torch": "2.10.0",
    "python": "3.11",
    "machine": "aarch64",
    "libc": "glibc 2.31",
    "abi": "cpython-312-aarch64-linux-gnu",
}

# A bundle built elsewhere that a STACK machine refuses (libc: built against a newer one).
BUILT_ELSEWHERE = {**OTHER, "libc": "glibc 2.39"}


def test_every_stack_field_has_a_code_of_its_own() -> None:
    """Every field of a Stack is compared, each refused with a bundle code no other field
    has, whose record states the running value as expected and the built one as found."""
    fields = [f.name for f in dataclasses.fields(B.Stack)]
    assert list(FIELD_CODES) == list(B.STACK_FIELDS) == fields and set(OTHER) == set(fields)
    codes = list(FIELD_CODES.values())
    assert len(set(codes)) == len(codes)
    for code in codes:
        assert code.value.startswith("kernel-bundle-")
        assert (message(code).expected, message(code).found) == ("{running}", "{built}")


@pytest.mark.parametrize("name", sorted(FIELD_CODES))
def test_each_stack_mismatch_is_refused_by_its_code(tmp_path, name) -> None:
    root = write_bundle(tmp_path / "b")
    running = dataclasses.replace(STACK, **{name: OTHER[name]})
    with pytest.raises(B.BundleError) as err:
        B.check(root, "w4a16", running, SOURCE_HASH)
    assert err.value.error.codes == [FIELD_CODES[name]]
    (problem,) = err.value.problems
    assert (problem.expected, problem.found) == (getattr(running, name), getattr(STACK, name))
    assert err.value.error.hint == message(FIELD_CODES[name]).hint is not None  # the record's
    with pytest.raises(B.BundleError) as early:  # the pre-flight refuses it the same way
        B.preflight(root, running)
    assert early.value.error.codes == [FIELD_CODES[name]]


def test_a_bundle_of_another_cpu_architecture_is_refused_by_the_running_tags(tmp_path) -> None:
    """The platform tags of this interpreter: a bundle tagged for another CPU is refused."""
    here = dataclasses.replace(STACK, **B.platform_tags())
    other = "aarch64" if here.machine != "aarch64" else "x86_64"
    root = write_bundle(tmp_path / "b", stack=dataclasses.replace(here, machine=other))
    assert refused(root, "w4a16", here, SOURCE_HASH) == [AdapterCode.KERNEL_BUNDLE_CPU]
    assert B.check(write_bundle(tmp_path / "c", stack=here), "w4a16", here, SOURCE_HASH)


@pytest.mark.parametrize(
    ("built", "want"),
    [
        ({"arch": "sm120"}, AdapterCode.KERNEL_BUNDLE_ARCH),
        ({"python": "3.11"}, AdapterCode.KERNEL_BUNDLE_PYTHON),
    ],
)
def test_a_bundle_for_another_gpu_or_python_is_refused(tmp_path, built, want) -> None:
    """An SM120 bundle on an SM90 server, a Python 3.11 bundle under 3.12."""
    root = write_bundle(tmp_path / "b", stack=dataclasses.replace(STACK, **built))
    assert refused(root) == [want]


@given(st.sets(st.sampled_from(sorted(FIELD_CODES))))
def test_every_differing_field_is_named_once(names) -> None:
    manifest = B.BundleManifest(STACK, (), "0.1.0", "")
    running = dataclasses.replace(STACK, **{n: OTHER[n] for n in names})
    codes = [p.code for p in B.stack_problems(manifest, running)]
    assert sorted(codes) == sorted(FIELD_CODES[n] for n in names)


@given(st.sets(st.sampled_from(sorted(FIELD_CODES))))
def test_a_field_this_process_cannot_know_yet_is_not_compared(names) -> None:
    manifest = B.BundleManifest(STACK, (), "0.1.0", "")
    running = dataclasses.replace(STACK, **dict.fromkeys(names, ""))
    assert B.stack_problems(manifest, running) == []


_libc = st.tuples(st.sampled_from(["glibc", "musl"]), st.integers(0, 3), st.integers(0, 40))


@given(built=_libc, running=_libc)
def test_a_library_runs_on_its_c_library_and_later_versions_only(built, running) -> None:
    def tag(t):
        return f"{t[0]} {t[1]}.{t[2]}"

    manifest = B.BundleManifest(dataclasses.replace(STACK, libc=tag(built)), (), "0.1.0", "")
    codes = [
        p.code for p in B.stack_problems(manifest, dataclasses.replace(STACK, libc=tag(running)))
    ]
    ok = built[0] == running[0] and built[1:] <= running[1:]
    assert codes == ([] if ok else [AdapterCode.KERNEL_BUNDLE_LIBC])


def test_a_missing_module_is_refused(tmp_path) -> None:
    root = write_bundle(tmp_path / "b", variants=("w4a16",))
    with pytest.raises(B.BundleError) as err:
        B.check(root, "w4a8", STACK, SOURCE_HASH)
    assert err.value.error.codes == [AdapterCode.KERNEL_BUNDLE_NO_MODULE]


def test_other_sources_or_flags_are_refused(tmp_path) -> None:
    root = write_bundle(tmp_path / "b")
    with pytest.raises(B.BundleError) as err:
        B.check(root, "w4a16", STACK, "00" * 32)
    assert err.value.error.codes == [AdapterCode.KERNEL_BUNDLE_SOURCES]


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_library_is_refused(tmp_path, damage) -> None:
    root = write_bundle(tmp_path / "b")
    lib = root / "fused_moe_90_kimi_w31_w4a16.so"
    data = lib.read_bytes()
    if damage == "flip":
        lib.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "truncate":
        lib.write_bytes(data[:-1])
    else:
        lib.unlink()
    with pytest.raises(B.BundleError) as err:
        B.check(root, "w4a16", STACK, SOURCE_HASH)
    assert err.value.error.codes == [AdapterCode.KERNEL_BUNDLE_LIBRARY]


def test_a_stack_mismatch_is_refused_before_the_library_is_read(tmp_path) -> None:
    root = write_bundle(tmp_path / "b")
    (root / "fused_moe_90_kimi_w31_w4a16.so").unlink()
    running = dataclasses.replace(STACK, torch="2.12.0")
    with pytest.raises(B.BundleError) as err:
        B.check(root, "w4a16", running, SOURCE_HASH)
    assert err.value.error.codes == [AdapterCode.KERNEL_BUNDLE_TORCH]


# -- a bundle is hostile input: what is checked is what is loaded -------------------------


def test_a_library_swapped_after_the_check_is_never_loaded(tmp_path) -> None:
    """The library is hashed from one descriptor and loaded through that descriptor: bytes
    put at its path after the check (a rename over it, or a rewrite in place of a new
    file) are not what the loader reads."""
    root = write_bundle(tmp_path / "b")
    lib_path = library_of(root)
    checked = lib_path.read_bytes()
    _, lib = B.check(root, "w4a16", STACK, SOURCE_HASH)
    evil = tmp_path / "evil.so"
    evil.write_bytes(b"\x7fELF" + b"evil" * 100)
    os.replace(evil, lib_path)  # swapped in between check and load
    with lib.loadable() as path:
        assert Path(path).name == lib_path.name  # loaders pick the format by suffix
        assert Path(path).read_bytes() == checked
        folder = Path(path).parent
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert not folder.exists()  # the private link is gone after the load
    lib.close()


_LIB_DIRS = ("/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu", "/lib64", "/usr/lib64", "/usr/lib")


def test_a_real_library_loads_through_the_checked_descriptor(tmp_path) -> None:
    """The dynamic loader accepts the descriptor's link: a real shared library, checked,
    then its path replaced by garbage, still loads and runs."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("m")
    found = [Path(d) / name for d in _LIB_DIRS if name and (Path(d) / name).is_file()]
    if not found:
        pytest.skip("no libm on this system to load")
    root = write_bundle(tmp_path / "c", data=found[0].read_bytes())
    _, lib = B.check(root, "w4a16", STACK, SOURCE_HASH)
    junk = tmp_path / "junk"
    junk.write_bytes(b"not a library")
    os.replace(junk, library_of(root))
    with lib.loadable() as path:
        cos = ctypes.CDLL(path).cos
        cos.restype, cos.argtypes = ctypes.c_double, [ctypes.c_double]
        assert cos(0.0) == 1.0
    lib.close()


TARGETS = ("directory", "manifest", "library")


def _target(root: Path, which: str) -> Path:
    return {"directory": root, "manifest": root / B.MANIFEST, "library": library_of(root)}[which]


@pytest.mark.parametrize("which", TARGETS)
@pytest.mark.parametrize("bits", [0o020, 0o002, 0o022])
def test_a_bundle_writable_by_others_is_refused(tmp_path, which, bits) -> None:
    root = write_bundle(tmp_path / "b")
    target = _target(root, which)
    target.chmod(stat.S_IMODE(target.stat().st_mode) | bits)
    assert AdapterCode.KERNEL_BUNDLE_WRITABLE in refused(root)
    if which != "library":  # the pre-flight reads the directory and the manifest
        with pytest.raises(B.BundleError) as err:
            B.preflight(root, STACK)
        assert err.value.error.codes == [AdapterCode.KERNEL_BUNDLE_WRITABLE]
        assert err.value.error.hint == message(AdapterCode.KERNEL_BUNDLE_WRITABLE).hint  # its own
    target.chmod(stat.S_IMODE(target.stat().st_mode) & ~bits)  # negative control
    assert B.check(root, "w4a16", STACK, SOURCE_HASH)


@pytest.mark.parametrize("which", TARGETS)
def test_a_bundle_owned_by_another_user_is_refused(tmp_path, which, monkeypatch) -> None:
    root = write_bundle(tmp_path / "b")
    if os.geteuid() == 0:  # as root: really hand the file to another uid
        os.chown(_target(root, which), 4242, 4242)
    else:  # otherwise: the files are ours, so make "us" someone else for this check
        if which != "directory":
            pytest.skip("chown to another uid needs root")
        monkeypatch.setattr(B.os, "geteuid", lambda: os.getuid() + 1)
    assert AdapterCode.KERNEL_BUNDLE_OWNER in refused(root)


def test_files_of_root_or_of_this_user_are_trusted(tmp_path) -> None:
    root = write_bundle(tmp_path / "b")
    for which in TARGETS:
        st_ = _target(root, which).stat()
        assert st_.st_uid in (0, os.geteuid())
    assert B.check(root, "w4a16", STACK, SOURCE_HASH)


def _valid_copy(tmp_path: Path, which: str) -> Path:
    """A file outside the bundle with the exact bytes the bundle's own would have."""
    elsewhere = write_bundle(tmp_path / "elsewhere")
    return elsewhere / (B.MANIFEST if which == "manifest" else library_of(elsewhere).name)


@pytest.mark.parametrize("which", ["manifest", "library"])
@pytest.mark.parametrize("to", ["outside", "inside", "dev-zero"])
def test_a_link_in_the_bundle_is_refused(tmp_path, which, to) -> None:
    """Even a link to a file with the right bytes: it could be re-pointed after the check."""
    root = write_bundle(tmp_path / "b")
    target = _target(root, which)
    if to == "outside":
        dest = _valid_copy(tmp_path, which)
    elif to == "inside":
        dest = root / f".{target.name}.real"
        target.rename(dest)
    else:
        dest = Path("/dev/zero")
    target.unlink(missing_ok=True)
    target.symlink_to(dest)
    assert AdapterCode.KERNEL_BUNDLE_LINK in _refused_quickly(root)


def _refused_quickly(root: Path, seconds: float = 10.0) -> list[Code]:
    """The check's codes, from a thread given `seconds`: a check that blocks (a FIFO, a
    device) fails the test instead of hanging it."""
    out: list = []

    def run() -> None:
        try:
            B.check(root, "w4a16", STACK, SOURCE_HASH)
            out.append([])
        except B.BundleError as exc:
            out.append(exc.error.codes)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), "the bundle check blocked"
    return out[0]


@pytest.mark.parametrize("which", ["manifest", "library"])
@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_a_fifo_device_or_folder_in_the_bundle_is_refused_at_once(tmp_path, which, kind):
    root = write_bundle(tmp_path / "b")
    target = _target(root, which)
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target, 0o644)
    elif kind == "device":
        if os.geteuid() != 0:
            pytest.skip("making a device node needs root")
        os.mknod(target, 0o644 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero's numbers
    else:
        target.mkdir(0o755)
    assert _refused_quickly(root) == [AdapterCode.KERNEL_BUNDLE_NOT_REGULAR]


@pytest.mark.parametrize("which", ["manifest", "library"])
def test_reads_are_bounded(tmp_path, which, monkeypatch) -> None:
    root = write_bundle(tmp_path / "b")
    size = _target(root, which).stat().st_size
    monkeypatch.setitem(B._LIMITS, which, size - 1)
    assert refused(root) == [AdapterCode.KERNEL_BUNDLE_TOO_LARGE]
    monkeypatch.setitem(B._LIMITS, which, size)  # negative control: at the limit is fine
    assert B.check(root, "w4a16", STACK, SOURCE_HASH)


def test_a_file_that_grows_while_read_is_refused(tmp_path, monkeypatch) -> None:
    root = write_bundle(tmp_path / "b")
    lib = library_of(root)
    monkeypatch.setitem(B._LIMITS, "library", lib.stat().st_size)
    real_pread = os.pread

    def growing(fd, n, offset):  # someone appends after the size was read
        if offset == 0:
            with lib.open("ab") as fh:
                fh.write(b"more")
        return real_pread(fd, n, offset)

    monkeypatch.setattr(B.os, "pread", growing)
    assert AdapterCode.KERNEL_BUNDLE_TOO_LARGE in refused(root)


# -- the recipe: a recorded key at start-up, the full regeneration on request --------------


def test_a_matching_recipe_key_skips_the_regeneration(tmp_path) -> None:
    root = write_bundle(tmp_path / "b")
    calls = []

    def regenerate() -> str:
        calls.append(1)
        return SOURCE_HASH

    assert B.check(root, "w4a16", STACK, regenerate, RECIPE_KEY) and calls == []
    # another key: the recipe is regenerated and compared (equal here: accepted)
    assert B.check(root, "w4a16", STACK, regenerate, "00" * 32) and calls == [1]
    # no key (not computable here, or the full check asked for): regenerated too
    assert B.check(root, "w4a16", STACK, regenerate, None) and calls == [1, 1]
    # a key miss whose regeneration differs is refused
    assert refused(root, "w4a16", STACK, lambda: "00" * 32, "00" * 32) == [
        AdapterCode.KERNEL_BUNDLE_SOURCES
    ]


def test_the_recipe_key_names_every_input_of_the_recipe(monkeypatch) -> None:
    """Each input changes the key: FlashInfer's files, this plugin's recipe code, the
    variant, CUDA, the flag variables; the arch list a GPU picks by itself does not."""
    from kimi_w31.adapter import kernels as K

    monkeypatch.setattr(K, "_flashinfer_files", lambda: "flashinfer/x.cu,sha256=a,1\n")
    base = K.recipe_key(K.W4A16, "13.0", {})
    assert base == K.recipe_key(K.W4A16, "13.0", {"FLASHINFER_CUDA_ARCH_LIST": "9.0a"})
    others = {
        K.recipe_key(K.W4A16_ALL, "13.0", {}),
        K.recipe_key(K.W4A16, "12.8", {}),
        K.recipe_key(K.W4A16, "13.0", {"FLASHINFER_JIT_DEBUG": "1"}),
        K.recipe_key(K.W4A16, "13.0", {"FLASHINFER_JIT_LINEINFO": "1"}),
        K.recipe_key(K.W4A16, "13.0", {"FLASHINFER_CUDA_ARCH_LIST": "9.0a 10.0a"}),
    }
    monkeypatch.setattr(K, "_flashinfer_files", lambda: "flashinfer/x.cu,sha256=b,1\n")
    others.add(K.recipe_key(K.W4A16, "13.0", {}))
    assert base not in others and len(others) == 6
    monkeypatch.setattr(K, "_flashinfer_files", lambda: None)  # an editable FlashInfer
    assert K.recipe_key(K.W4A16, "13.0", {}) is None


def _plugin_env(monkeypatch, root: Path, running: B.Stack, key: str | None = RECIPE_KEY):
    from kimi_w31.adapter import kernels as K

    monkeypatch.setenv(K.ENV_BUNDLE, str(root))
    monkeypatch.setattr(B, "current_stack", lambda arch, build=False: running)
    monkeypatch.setattr(K, "recipe_key", lambda v, cuda, environ=None: key)
    regenerated = []
    monkeypatch.setattr(
        K, "regenerated_source_hash", lambda v: regenerated.append(v) or SOURCE_HASH
    )
    installed = []
    monkeypatch.setattr(K, "install", lambda v, lib=None: installed.append((v, lib)))
    monkeypatch.setattr(K, "_installed", {})
    return installed, regenerated


def test_the_plugin_refuses_a_mismatched_bundle_and_loads_nothing(tmp_path, monkeypatch) -> None:
    """kernels.ensure with KIMI_W31_KERNELS: the refusal reaches the caller, nothing installs."""
    from kimi_w31.adapter import kernels as K

    root = write_bundle(tmp_path / "b")
    installed, regenerated = _plugin_env(monkeypatch, root, dataclasses.replace(STACK, cuda="12.8"))
    with pytest.raises(B.BundleError) as err:
        K.ensure("sm90")
    assert err.value.error.codes == [AdapterCode.KERNEL_BUNDLE_CUDA] and installed == []
    monkeypatch.setattr(B, "current_stack", lambda arch, build=False: STACK)
    assert K.ensure("sm90") is K.W4A16 and regenerated == []  # the key matched
    ((variant, lib),) = installed
    assert variant is K.W4A16 and lib.path == library_of(root)


def test_the_full_check_regenerates_the_recipe_on_request(tmp_path, monkeypatch) -> None:
    from kimi_w31.adapter import kernels as K

    root = write_bundle(tmp_path / "b")
    installed, regenerated = _plugin_env(monkeypatch, root, STACK)
    monkeypatch.setenv(K.ENV_FULL_CHECK, "1")
    assert K.ensure("sm90") is K.W4A16 and regenerated == [K.W4A16] and installed


def test_the_plugin_refuses_before_any_weight_loads(tmp_path, monkeypatch) -> None:
    """The plugin's first action in a process: the pre-flight; its refusal raised by the
    first hooked call (SGLang only logs what `register` raises)."""
    from kimi_w31.adapter.sglang import plugin

    root = write_bundle(tmp_path / "b")
    _plugin_env(monkeypatch, root, dataclasses.replace(STACK, flashinfer="0.6.18"))
    plugin.check_bundle_now()
    with pytest.raises(B.BundleError) as err:
        plugin.refuse_bad_bundle("config-path")
    assert err.value.error.codes == [AdapterCode.KERNEL_BUNDLE_FLASHINFER]
    monkeypatch.setattr(B, "current_stack", lambda arch, build=False: STACK)
    assert plugin.refuse_bad_bundle("config-path") is None  # negative control
    monkeypatch.setenv("KIMI_W31_KERNELS", str(tmp_path / "gone"))
    with pytest.raises(B.BundleError) as err:
        plugin.refuse_bad_bundle("config-path")
    assert err.value.error.codes == [AdapterCode.KERNEL_BUNDLE_MISSING]
    monkeypatch.delenv("KIMI_W31_KERNELS")
    assert plugin.refuse_bad_bundle("config-path") is None  # no bundle named: nothing


def _serve_ckpt(tmp_path: Path) -> list[str]:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    cfg = {"hidden_act": "situ", "moe_intermediate_size": 3072}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    return ["serve", str(ckpt), "--unconverted", "--skip-checks", "--print"]


def test_serve_points_every_process_at_the_bundle(tmp_path, monkeypatch) -> None:
    """`serve --kernels DIR` sets KIMI_W31_KERNELS for the server; a directory without a
    valid manifest is refused before anything starts."""
    from cli_helpers import run_cli
    from kimi_w31.adapter.kernels import ENV_BUNDLE

    monkeypatch.setattr(B, "current_stack", lambda arch, build=False: STACK)
    base = _serve_ckpt(tmp_path)
    bundle = write_bundle(tmp_path / "kernels")
    ok = run_cli([*base, "--kernels", str(bundle)], inprocess=True)
    assert ok.returncode == 0, ok.output
    assert f"{ENV_BUNDLE}={bundle.resolve()}" in ok.output
    (bundle / B.MANIFEST).write_text("{}")
    bad = run_cli([*base, "--kernels", str(bundle)], inprocess=True)
    assert bad.returncode == 1 and AdapterCode.KERNEL_BUNDLE_INVALID.value in bad.output


@pytest.mark.parametrize("name", sorted(FIELD_CODES))
def test_serve_refuses_a_bundle_of_another_stack_before_anything_else(tmp_path, monkeypatch, name):
    """A manifest claiming another FlashInfer, CUDA, ... : exit 1, and no other check (not
    even the checkpoint's) and no plan ran first."""
    from cli_helpers import run_cli
    from kimi_w31.adapter.sglang import launch

    here = dataclasses.replace(STACK, arch="")  # no GPU on this machine: arch not compared
    monkeypatch.setattr(B, "current_stack", lambda arch, build=False: here)
    ran = []
    monkeypatch.setattr(launch, "plan_serve", lambda *a, **k: ran.append("plan"))
    monkeypatch.setattr(launch, "check_stack", lambda: ran.append("stack") or [])
    stack = dataclasses.replace(STACK, **{name: BUILT_ELSEWHERE[name]})
    bundle = write_bundle(tmp_path / "kernels", stack=stack)
    result = run_cli([*_serve_ckpt(tmp_path), "--kernels", str(bundle)], inprocess=True)
    if name == "arch":  # the GPU is not known here: the server's processes compare it
        assert ran == ["plan"]
        return
    assert result.returncode == 1 and FIELD_CODES[name].value in result.output
    assert ran == []


def test_serve_refuses_a_missing_bundle_directory(tmp_path, monkeypatch) -> None:
    from cli_helpers import run_cli

    monkeypatch.setattr(B, "current_stack", lambda arch, build=False: STACK)
    result = run_cli([*_serve_ckpt(tmp_path), "--kernels", str(tmp_path / "no")], inprocess=True)
    assert result.returncode == 2 and "does not exist" in result.output  # click's usage check


def test_a_bundle_does_not_skip_the_checks_of_a_converted_checkpoint(tmp_path, monkeypatch):
    """--kernels adds a variable for the server; the structure verify still runs first."""
    from cli_helpers import run_cli
    from kimi_w31.adapter.sglang import launch
    from test_adapter_launch import ckpt

    verified = []
    monkeypatch.setattr(B, "current_stack", lambda arch, build=False: STACK)
    monkeypatch.setattr(launch, "check_stack", lambda: [])
    found = B.problem(Code.SHARD_UNREFERENCED, file="model-00001-of-00001.safetensors")
    monkeypatch.setattr(launch, "verify_structure", lambda root: verified.append(root) or [found])
    bundle = write_bundle(tmp_path / "kernels")
    args = [str(ckpt(tmp_path)), "--print", "--kernels", str(bundle)]
    refused_ = run_cli(args, inprocess=True, command=launch.serve)
    assert refused_.returncode == 1 and verified
    assert f"[{Code.SHARD_UNREFERENCED.value}]" in refused_.output
    monkeypatch.setattr(launch, "verify_structure", lambda root: [])
    ok = run_cli(args, inprocess=True, command=launch.serve)
    assert ok.returncode == 0, ok.output
    assert "KIMI_W31_KERNELS=" in ok.output


def _fake_core(monkeypatch):
    import functools
    import sys
    import types

    core = types.ModuleType("flashinfer.fused_moe.core")
    stock = {
        "gen_cutlass_fused_moe_sm90_module": lambda fast=False: "stock-90",
        "gen_cutlass_fused_moe_sm120_module": lambda fast=False: "stock-120",
        "gen_cutlass_fused_moe_sm100_module": lambda fast=False: "stock-100",
    }
    for name, fn in stock.items():
        setattr(core, name, fn)

    @functools.cache
    def get_cutlass_fused_moe_module(backend="100"):
        gen = {"90": "sm90", "120": "sm120", "100": "sm100"}[backend]
        return getattr(core, f"gen_cutlass_fused_moe_{gen}_module")(False)

    core.get_cutlass_fused_moe_module = get_cutlass_fused_moe_module
    fused = types.ModuleType("flashinfer.fused_moe")
    fused.core = core
    root = types.ModuleType("flashinfer")
    root.fused_moe = fused
    for mod in (root, fused, core):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return core, stock


def test_install_routes_only_the_served_architectures_module(tmp_path, monkeypatch) -> None:
    """The plugin replaces FlashInfer's fused-MoE generator of its own architecture only, and
    drops FlashInfer's cached module so the next lookup loads the plugin's."""
    from kimi_w31.adapter import kernels as K

    core, stock = _fake_core(monkeypatch)
    monkeypatch.setattr(K, "_installed", {})
    monkeypatch.delenv(K.ENV_BUNDLE, raising=False)
    assert core.get_cutlass_fused_moe_module("90") == "stock-90"  # cached before install
    lib = tmp_path / "m.so"
    K.install(K.W4A16, lib)
    spec = core.gen_cutlass_fused_moe_sm90_module(False)
    assert isinstance(spec, K._Library) and spec.library == lib
    assert isinstance(core.get_cutlass_fused_moe_module("90"), K._Library)  # cache dropped
    # SGLang's other FlashInfer MoE uses keep FlashInfer's own modules
    assert core.gen_cutlass_fused_moe_sm120_module is stock["gen_cutlass_fused_moe_sm120_module"]
    assert core.get_cutlass_fused_moe_module("100") == "stock-100"
    assert K.ensure("sm90") is K.W4A16 and K._installed["sm90"] == ("w4a16", lib)  # kept


def test_without_the_hook_point_flashinfer_keeps_its_module(monkeypatch, caplog) -> None:
    import sys
    import types

    from kimi_w31.adapter import flashinfer_moe as fm
    from kimi_w31.adapter import kernels as K

    fused = types.ModuleType("flashinfer.fused_moe")  # no .core: a layout we do not know
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setitem(sys.modules, "flashinfer.fused_moe", fused)
    monkeypatch.setattr(K, "_installed", {})
    with caplog.at_level("WARNING", logger="kimi_w31.adapter"):
        fm.use_plugin_kernels("sm90")
    assert K._installed == {} and "whole module" in caplog.text


def test_the_fault_table_cases_are_refused_or_load_what_was_checked(tmp_path) -> None:
    """`make faults`' bundle rows: each hostile bundle refused with its code, quickly."""
    import faults as fl

    cases = fl.bundle_cases(tmp_path / "unused", tmp_path)
    bad = [(c.name, c.outcome, c.detail) for c in cases if c.outcome not in (fl.CLEAN, fl.CORRECT)]
    assert bad == [] and len(cases) >= 17

"""`kimi-convert serve`: checks and the command it runs (no SGLang needed)."""

from __future__ import annotations

import importlib.metadata as md
import json
import math
import shlex
import types
from pathlib import Path

import pytest
from cli_helpers import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kimi_w31.adapter.reasons import AdapterCode
from kimi_w31.adapter.sglang import launch
from kimi_w31.adapter.sglang.launch import ServeError, check_stack, plan_serve, serve
from kimi_w31.converter import contract
from kimi_w31.converter.errors import Fatal, fatal, problem, reason
from kimi_w31.converter.reasons import Code
from kimi_w31.converter.synth import SynthSpec, make_config

SOURCE = make_config(SynthSpec(k=3584, n=3072, experts=896))
# What serve adds for Kimi-K3 to serve real traffic, as upstream recipes do.
UPSTREAM = ["--trust-remote-code", "--reasoning-parser", "kimi_k3", "--tool-call-parser", "kimi_k3"]
QC = SOURCE["text_config"]["quantization_config"]  # published: inside text_config only


def ckpt(tmp_path: Path, *, converted: bool = True, **text) -> Path:
    cfg = (
        contract.converted_config(SOURCE, contract.make_block(4.0, 25.0))
        if converted
        else json.loads(json.dumps(SOURCE))
    )
    cfg["text_config"].update(text)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_default_command(tmp_path):
    plan = plan_serve(ckpt(tmp_path), python="py")
    assert plan.argv == [
        "py",
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(tmp_path),
        "--moe-runner-backend",
        "flashinfer_mxfp4",
        "--tp-size",
        "1",
        *UPSTREAM,
    ]
    assert plan.env == {}


def test_tp_ep_and_extra_args(tmp_path):
    plan = plan_serve(ckpt(tmp_path), ["--port", "30000"], tp=8, ep=4, python="py")
    assert plan.argv[-11:] == ["--tp-size", "8", "--ep-size", "4", *UPSTREAM, "--port", "30000"]


def test_user_flags_win_over_defaults(tmp_path):
    extra = ["--moe-runner-backend", "marlin", "--tp-size=4"]
    plan = plan_serve(ckpt(tmp_path), extra, tp=5, python="py")
    assert plan.argv.count("--moe-runner-backend") == 1 and "--tp-size" not in plan.argv
    assert plan.argv[-3:] == extra


@pytest.mark.parametrize(("tp", "ep"), [(5, 1), (16, 1), (32, 2)])
def test_unaligned_moe_tp_is_refused_for_the_cutlass_backend(tmp_path, tp, ep):
    with pytest.raises(ServeError, match="multiple of 128"):
        plan_serve(ckpt(tmp_path), tp=tp, ep=ep)
    # marlin pads: no such limit
    plan_serve(ckpt(tmp_path), ["--moe-runner-backend", "marlin"], tp=tp, ep=ep)


@pytest.mark.parametrize(("tp", "ep"), [(8, 1), (8, 8), (24, 1), (16, 2)])
def test_aligned_moe_tp_is_accepted(tmp_path, tp, ep):
    plan_serve(ckpt(tmp_path), tp=tp, ep=ep)


@pytest.mark.parametrize(
    "extra",
    [["--tp-size", "5"], ["--tp-size=16"], ["--tp", "5"], ["--tp-size", "32", "--ep-size", "2"]],
)
def test_sglang_flags_after_the_dashes_are_checked_too(tmp_path, extra):
    with pytest.raises(ServeError, match="multiple of 128"):
        plan_serve(ckpt(tmp_path), extra, tp=8)


def test_ep_must_divide_tp(tmp_path):
    with pytest.raises(ServeError, match="--ep must divide --tp"):
        plan_serve(ckpt(tmp_path), tp=8, ep=3)


def test_unconverted_needs_the_flag_and_sets_the_opt_in(tmp_path):
    root = ckpt(tmp_path, converted=False)
    with pytest.raises(ServeError, match="--unconverted"):
        plan_serve(root)
    assert plan_serve(root, unconverted=True).env == {"KIMI_W31_SERVE_UNCONVERTED": "1"}


def test_bad_block_is_refused_before_launch(tmp_path):
    with pytest.raises(ServeError, match=Code.BLOCK_MISMATCH.value):
        plan_serve(ckpt(tmp_path, activation_situ_beta=3.0))


def test_wrapper_without_a_block_is_refused(tmp_path):
    root = ckpt(tmp_path)
    cfg = json.loads((root / "config.json").read_text())
    del cfg["kimi_w31"]
    (root / "config.json").write_text(json.dumps(cfg))
    for unconverted in (False, True):
        with pytest.raises(ServeError, match=Code.BLOCK_MISSING.value):
            plan_serve(root, unconverted=unconverted)


def test_block_without_wrapped_quantization_is_refused(tmp_path):
    root = ckpt(tmp_path)
    cfg = json.loads((root / "config.json").read_text())
    cfg["text_config"]["quantization_config"] = QC
    (root / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ServeError, match=Code.NOT_WRAPPED.value):
        plan_serve(root)


def _stack(versions: dict[str, str], eps=(), environ=None) -> list[Fatal]:
    def version_of(name: str) -> str:
        if name not in versions:
            raise md.PackageNotFoundError(name)
        return versions[name]

    return check_stack(version_of, lambda group: list(eps), environ or {})


def _ep(loads: bool = True):
    def load():
        if not loads:
            raise ImportError("boom")
        return lambda: None

    return types.SimpleNamespace(name="kimi_w31", load=load)


def _unready(rule: str, **facts) -> Fatal:
    """The refusal check_stack gives for one finding: its rule and its typed facts."""
    return fatal(AdapterCode.STACK_UNREADY, rule=rule, **facts)


def test_stack_ok():
    assert _stack({"sglang": "0.5.23", "flashinfer-python": "0.7.2.post1"}, [_ep()]) == []


SGLANG = {"package": "sglang", "want": "== 0.5.23", "install": launch.INSTALL_HINT}
FLASHINFER = {"package": "flashinfer-python", "want": ">= 0.7.0", "install": launch.INSTALL_HINT}


@pytest.mark.parametrize(
    ("versions", "rule", "facts"),
    [
        ({"flashinfer-python": "0.7.2"}, "not-installed", SGLANG),
        ({"sglang": "0.5.24", "flashinfer-python": "0.7.2"}, "version", SGLANG),
        ({"sglang": "0.5.23", "flashinfer-python": "0.6.18.post1"}, "version", FLASHINFER),
    ],
)
def test_stack_version_problems(versions, rule, facts):
    (found,) = _stack(versions, [_ep()])
    version = versions.get(facts["package"])
    more = {"version": version} if version else {}
    assert found == _unready(rule, **facts, **more)
    (p,) = found.problems
    assert (p.code, p.expected, p.found) == (AdapterCode.STACK_UNREADY, facts["want"], version)


def test_stack_plugin_problems():
    ok = {"sglang": "0.5.23", "flashinfer-python": "0.7.0"}
    names = {"plugin": "kimi_w31"}
    assert _stack(ok, []) == [_unready("no-entry-point", group="sglang.srt.plugins", **names)]
    assert _stack(ok, [_ep(loads=False)]) == [
        _unready("plugin-import", error=repr(ImportError("boom")), **names)
    ]
    assert _stack(ok, [_ep()], {"SGLANG_PLUGINS": "other"}) == [
        _unready("plugins-filtered", value="other", **names)
    ]
    assert _stack(ok, [_ep()], {"SGLANG_PLUGINS": "other, kimi_w31"}) == []


def test_every_stack_finding_is_one_problem_and_their_hints_are_merged():
    found = _stack({}, [], {"SGLANG_PLUGINS": "other"})
    assert [len(f.problems) for f in found] == [1, 1, 1, 1]
    refusal = launch.one_refusal(found)
    assert refusal.codes == [AdapterCode.STACK_UNREADY] * 4 and refusal.exit_code == 1
    hints = refusal.hint.split("; ")
    assert hints == list(dict.fromkeys(f.hint for f in found if f.hint))  # each once
    assert launch.one_refusal([]) is None


def test_cli_print_shows_the_command(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "check_stack", lambda: [])
    monkeypatch.setattr(launch, "verify_structure", lambda root: [])
    root = ckpt(tmp_path)
    result = run_cli(
        [str(root), "--tp", "2", "--print", "--", "--port", "1"], inprocess=True, command=serve
    )
    assert result.returncode == 0, result.output
    argv = shlex.split(result.output.strip())
    assert argv[1:] == [
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(root),
        "--moe-runner-backend",
        "flashinfer_mxfp4",
        "--tp-size",
        "2",
        *UPSTREAM,
        "--port",
        "1",
    ]


def test_cli_refuses_on_failed_checks(tmp_path, monkeypatch):
    """The stack's findings and verify's problems in one refusal, each with its code."""
    monkeypatch.setattr(launch, "check_stack", lambda: [_unready("not-installed", **SGLANG)])
    shard = problem(Code.SHARD_UNREFERENCED, file="model-00001-of-00001.safetensors")
    monkeypatch.setattr(launch, "verify_structure", lambda root: [shard])
    result = run_cli([str(ckpt(tmp_path)), "--print", "--json"], inprocess=True, command=serve)
    assert result.returncode == 1, result.output
    document = json.loads(result.stdout)
    codes = [p["code"] for p in document["problems"]]
    assert codes == [AdapterCode.STACK_UNREADY.value, Code.SHARD_UNREFERENCED.value]


def test_each_serve_refusal_carries_its_code_and_its_records_exit(tmp_path, monkeypatch):
    """A table over the refusals serve words through its records (adapter/reasons/serve.py)."""
    from kimi_w31.adapter import kernels, prebuild

    def refused(call) -> ServeError:
        with pytest.raises(ServeError) as err:
            call()
        assert err.value.exit_code == err.value.error.exit_code
        return err.value

    def no_torch(*a, **k):
        raise ImportError("no torch")

    def no_build(*a, **k):
        raise prebuild.PrebuildError(fatal(AdapterCode.NO_TORCH, install=prebuild.INSTALL_SERVING))

    monkeypatch.setattr(kernels, "preflight_bundle", no_torch)
    monkeypatch.setattr(prebuild, "require_torch", no_build)
    roots = {name: tmp_path / name for name in ("plain", "silu")}
    for root in roots.values():
        root.mkdir()
    cases = {
        AdapterCode.NOT_CONVERTED: lambda: plan_serve(ckpt(roots["plain"], converted=False)),
        AdapterCode.NOT_SITU: lambda: plan_serve(
            ckpt(roots["silu"], converted=False, hidden_act="silu"), unconverted=True
        ),
        AdapterCode.KERNEL_BUNDLE_UNCHECKED: lambda: launch.kernel_bundle_env(tmp_path),
        AdapterCode.NO_TORCH: lambda: launch.run_prebuild(None, "lines"),  # prebuild's own code
        AdapterCode.BAD_FLAG: lambda: launch.text_only_override("[1]"),
    }
    for code, call in cases.items():
        err = refused(call)
        assert err.reason == code.value and f"[{code.value}]" in err.message
        assert err.exit_code == reason(code).exit


def test_cli_runs_the_real_structure_verify(tmp_path, monkeypatch):
    """A config alone is not a checkpoint: the converter's verify must complain, with its
    own codes."""
    monkeypatch.setattr(launch, "check_stack", lambda: [])
    root = ckpt(tmp_path)
    want = {p.code.value for p in launch.verify_structure(root)}
    result = run_cli([str(root), "--print", "--json"], inprocess=True, command=serve)
    assert result.returncode == 1 and want
    assert {p["code"] for p in json.loads(result.stdout)["problems"]} <= want


def test_cli_execs_sglang(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "check_stack", lambda: [])
    monkeypatch.setattr(launch, "count_gpus", lambda: 1)
    calls = []
    monkeypatch.setattr(launch.os, "execvpe", lambda f, argv, env: calls.append((argv, env)))
    result = run_cli(
        [str(ckpt(tmp_path, converted=False)), "--unconverted"], inprocess=True, command=serve
    )
    assert result.returncode == 0, result.output
    ((argv, env),) = calls
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert env["KIMI_W31_SERVE_UNCONVERTED"] == "1"


def test_importing_the_converter_and_launch_never_imports_sglang():
    import subprocess
    import sys

    code = (
        "import sys, kimi_w31.converter, kimi_w31.converter.cli.convert, "
        "kimi_w31.adapter.sglang.launch, "
        "kimi_w31.adapter.sglang.plugin, kimi_w31.adapter.sglang.hooks; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('sglang', 'flashinfer')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------------------
# SGLang's flags after `--`: every name and form argparse takes
# --------------------------------------------------------------------------------------

VALUES = {
    "tp_size": st.integers(1, 64),
    "ep_size": st.integers(1, 64),
    "pp_size": st.integers(1, 8),
    "nnodes": st.integers(1, 8),
    "mem_fraction_static": st.sampled_from([0.5, 0.8, 0.88, 0.9]),
    "moe_runner_backend": st.sampled_from(["marlin", "flashinfer_mxfp4", "auto"]),
    "moe_dp_size": st.integers(1, 8),
    "reasoning_parser": st.sampled_from(["kimi_k3", "kimi"]),
    "tool_call_parser": st.sampled_from(["kimi_k3", "kimi_k2"]),
    "json_model_override_args": st.sampled_from(['{"a":1}', "{}"]),
    "host": st.sampled_from(["0.0.0.0", "127.0.0.1"]),
    "port": st.integers(1, 65535),
}
OTHER = [
    ["--log-level", "info"],
    ["--trust-remote-code"],
    ["--skip-tokenizer-init"],
    ["--dist-init-addr=a:1"],
]


@st.composite
def _command_lines(draw):
    """SGLang argument lists: our flags under every option string (and the short prefix
    `--tp` that argparse expands), `--x y` or `--x=y`, among flags serve does not read."""
    args: list[str] = []
    want: dict = {}
    for _ in range(draw(st.integers(0, 8))):
        if draw(st.booleans()):
            args += draw(st.sampled_from(OTHER))
            continue
        dest = draw(st.sampled_from(sorted(launch.SGLANG_FLAGS)))
        names = list(launch.SGLANG_FLAGS[dest][0]) + (["--tp"] if dest == "tp_size" else [])
        name = draw(st.sampled_from(names))
        value = draw(VALUES[dest])
        args += [f"{name}={value}"] if draw(st.booleans()) else [name, str(value)]
        want[dest] = value
    return args, want


@given(_command_lines())
def test_sglang_flags_reads_every_name_and_form_last_one_wins(case):
    args, want = case
    assert launch.sglang_flags(args) == want


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["--tp-size"], "bad-flag"),
        (["--tensor-parallel-size", "--port"], "bad-flag"),
        (["--ep=two"], "bad-flag"),
        (["--mem-fraction-static", "x"], "bad-flag"),
        (["--x", "2"], None),  # not a prefix of any flag serve reads: SGLang's business
    ],
)
def test_sglang_flags_refuses_what_argparse_refuses(args, reason):
    if reason is None:
        assert launch.sglang_flags(args) == {}
        return
    with pytest.raises(ServeError) as err:
        launch.sglang_flags(args)
    assert err.value.reason == reason


def test_a_prefix_of_two_flags_is_ambiguous():
    with pytest.raises(ServeError) as err:
        launch.sglang_flags(["--mem", "0.5", "--m", "1"])
    assert err.value.reason == "ambiguous-flag"


@pytest.mark.parametrize(
    "extra",
    [
        ["--tensor-parallel-size", "16", "--expert-parallel-size", "2"],
        ["--tp-size=16", "--ep=2"],
        ["--tp", "16", "--ep-size", "2"],
    ],
)
def test_long_and_short_names_drive_the_command_and_the_checks(tmp_path, extra):
    root = ckpt(tmp_path)
    plan = plan_serve(root, extra, tp=1, python="py")
    head = ["py", "-m", "sglang.launch_server", "--model-path", str(root)]
    assert plan.argv == [*head, "--moe-runner-backend", "flashinfer_mxfp4", *UPSTREAM, *extra]
    bad = [x.replace("16", "32").replace("=2", "=1") for x in extra]  # moe-TP 32 or 16
    bad = [x if x != "2" else "1" for x in bad]
    with pytest.raises(ServeError) as err:
        plan_serve(ckpt(tmp_path), bad, python="py")
    assert err.value.reason == "moe-tp-alignment"


# --------------------------------------------------------------------------------------
# capacity: the GPUs must hold the checkpoint
# --------------------------------------------------------------------------------------

H200 = 143771 * 2**20  # what nvidia-smi reports for an H200 (MiB)


def _with_index(root: Path, total_size: int | None, shards: dict[str, int] | None = None) -> Path:
    shards = shards or {}
    for name, size in shards.items():
        (root / name).write_bytes(b"\0" * size)
    index = {"weight_map": {f"t{i}": name for i, name in enumerate(shards)}}
    if total_size is not None:
        index["metadata"] = {"total_size": total_size}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return root


@pytest.mark.parametrize(("tp", "ep", "fits"), [(1, 1, False), (8, 1, False), (16, 2, True)])
def test_a_real_size_replica_needs_two_h200_nodes(tmp_path, tp, ep, fits):
    """1.4 TB: not on one GPU, not on one 8 x H200 node (the old first README example)."""
    root = _with_index(ckpt(tmp_path), 1_400_000_000_000)
    if fits:
        plan_serve(root, tp=tp, ep=ep, gpu_memory=H200)
        return
    with pytest.raises(ServeError) as err:
        plan_serve(root, tp=tp, ep=ep, gpu_memory=H200)
    assert err.value.reason == AdapterCode.CAPACITY.value


@given(
    size=st.integers(1, 10**13),
    tp=st.sampled_from([1, 2, 4, 8, 16, 24, 32]),
    pp=st.integers(1, 4),
    per_gpu=st.integers(10**9, 2 * 10**11),
    fraction=st.one_of(st.none(), st.sampled_from([0.5, 0.85, 0.9])),
)
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_capacity_refuses_exactly_when_an_even_split_does_not_fit(
    tmp_path, size, tp, pp, per_gpu, fraction
):
    root = _with_index(ckpt(tmp_path), size)
    extra = ["--pp-size", str(pp)] + ([f"--mem-fraction-static={fraction}"] if fraction else [])
    usable = per_gpu * (fraction if fraction else 1.0)
    # every GPU holds the latent projections whole, its share of the rest
    whole = min(launch.replicated_bytes(SOURCE), size)
    fits = (size - whole) / (tp * pp) + whole <= usable
    try:
        plan_serve(root, extra, tp=tp, ep=math.gcd(tp, 896), gpu_memory=per_gpu, python="py")
        refused = False
    except ServeError as exc:
        assert exc.reason == AdapterCode.CAPACITY.value
        refused = True
    assert refused == (not fits)


def test_capacity_reads_shard_sizes_without_total_size_and_the_gpus_where_present(tmp_path):
    # no latent MoE in this config: every byte splits over the GPUs
    root = _with_index(
        ckpt(tmp_path, routed_expert_hidden_size=None),
        None,
        {"a.safetensors": 600, "b.safetensors": 500},
    )
    assert launch.checkpoint_bytes(root)[0] == 1100
    seen = {}

    def smi(cmd, **kw):
        seen["cmd"] = cmd
        return types.SimpleNamespace(returncode=0, stdout="143771\n81559\n")

    detected = launch.detect_gpu_memory(run=smi, which=lambda name: "/usr/bin/nvidia-smi")
    assert detected[0] == 81559 * 2**20 and "nvidia-smi" in seen["cmd"][0]
    # the smallest GPU decides; 1100 bytes over 2 GPUs of 500 bytes: refused
    with pytest.raises(ServeError) as err:
        plan_serve(root, tp=2, ep=2, detect=lambda: (500, "test"))
    assert err.value.reason == AdapterCode.CAPACITY.value
    plan_serve(root, tp=4, ep=4, detect=lambda: (500, "test"))
    plan_serve(root, tp=2, ep=2, detect=lambda: None)  # unknown memory: not checked


def test_capacity_counts_pipeline_stages_and_shows_nodes(tmp_path):
    root = _with_index(ckpt(tmp_path, routed_expert_hidden_size=None), 2000)  # no latent MoE
    extra = ["--pipeline-parallel-size", "2", "--nnodes", "2"]
    plan_serve(root, extra, tp=2, ep=2, gpu_memory=500, python="py")  # 4 GPUs x 500
    with pytest.raises(ServeError) as err:
        plan_serve(root, ["--nnodes", "2"], tp=2, ep=2, gpu_memory=500)
    assert err.value.reason == AdapterCode.CAPACITY.value


def test_gpu_memory_option_parses_sizes(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "check_stack", lambda: [])
    monkeypatch.setattr(launch, "verify_structure", lambda root: [])
    root = _with_index(ckpt(tmp_path), 1_400_000_000_000)

    def run(args: list[str]):
        return run_cli(args, inprocess=True, command=serve)

    assert run([str(root), "--tp", "8", "--gpu-memory", "141GB", "--print"]).returncode == 1
    ok = run([str(root), "--tp", "16", "--ep", "2", "--gpu-memory", "141GB", "--print"])
    assert ok.returncode == 0, ok.output
    assert run([str(root), "--gpu-memory", "lots", "--print"]).returncode == 2


# --------------------------------------------------------------------------------------
# --skip-checks skips every check the README lists
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setup", "args"),
    [
        ("alignment", ["--tp", "16"]),
        ("capacity", ["--tp", "8", "--gpu-memory", "141GB"]),
        ("block", []),
        ("stack", []),
    ],
)
def test_skip_checks_skips_each_check(tmp_path, monkeypatch, setup, args):
    root = _with_index(ckpt(tmp_path), 1_400_000_000_000)
    monkeypatch.setattr(launch, "verify_structure", lambda root: [])
    monkeypatch.setattr(launch, "check_stack", lambda: [])
    if setup == "block":
        root = _with_index(ckpt(tmp_path, activation_situ_beta=3.0), 10)
    if setup == "stack":
        monkeypatch.setattr(launch, "check_stack", lambda: [_unready("not-installed", **SGLANG)])
    base = [str(root), "--print", "--gpu-memory", "10TB", *args]
    refused = run_cli(base, inprocess=True, command=serve)
    assert refused.returncode == 1, refused.output
    skipped = run_cli([*base, "--skip-checks"], inprocess=True, command=serve)
    assert skipped.returncode == 0, skipped.output
    assert "sglang.launch_server" in skipped.output


def test_the_install_hint_is_the_readmes(monkeypatch):
    """No package index carries kimi-w31: the hint is the README's install line."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    found = _stack({}, [_ep()])
    assert len(found) == 2
    for refusal in found:
        assert refusal.hint == launch.INSTALL_HINT and "kimi-w31[" not in refusal.hint
    assert launch.INSTALL_HINT.split(" from ")[0] in readme


def test_a_failed_verify_check_without_problems_is_still_a_coded_refusal(monkeypatch):
    from kimi_w31.converter import audit
    from kimi_w31.converter.audit.report import Check, VerifyReport

    failed = Check("index", "structure", "index", False, "unreadable")
    passed = Check("files", "structure", "files", True, "")
    report = VerifyReport("out", ["structure"], [passed, failed])
    monkeypatch.setattr(audit, "verify", lambda root: report)
    assert (
        launch.verify_structure(Path("out"))
        == fatal(
            AdapterCode.STACK_UNREADY, rule="verify", check="index", detail="unreadable"
        ).problems
    )
    failed.ok = True  # negative control: a passing report has nothing to say
    assert launch.verify_structure(Path("out")) == []


@pytest.mark.parametrize(
    ("where", "cls", "code", "facts"),
    [
        (
            "prebuild",
            "PrebuildError",
            AdapterCode.PREBUILD_ARCH,
            {"rule": "other-gpu", "gpu": "sm120"},
        ),
        (
            "flashinfer_moe",
            "SituUnsupportedError",
            AdapterCode.SITU_UNSUPPORTED,
            {"rule": "missing"},
        ),
        ("bundle", "BundleError", AdapterCode.KERNEL_BUNDLE_BUSY, {"who": "pid 1", "seconds": 1}),
    ],
)
def test_prebuild_passes_on_the_code_of_a_refusal_from_below(monkeypatch, where, cls, code, facts):
    """`serve --prebuild` and `prebuild` refuse with the build's own code and exit code,
    not one wrapping code (prebuild-failed is the compiler's exit only)."""
    import importlib

    from kimi_w31.adapter import prebuild

    error = fatal(code, **facts)
    module = importlib.import_module(f"kimi_w31.adapter.{where}")

    def refuse(*a, **k):
        raise getattr(module, cls)(error)

    monkeypatch.setattr(prebuild, "prebuild", refuse)
    with pytest.raises(ServeError) as err:
        launch.run_prebuild("sm90", "lines")
    assert err.value.error is error and err.value.reason == code.value
    assert err.value.exit_code == reason(code).exit

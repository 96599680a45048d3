"""`kimi-convert serve`: checks and the command it runs (no SGLang needed)."""

from __future__ import annotations

import importlib.metadata as md
import json
import shlex
import types
from pathlib import Path

import pytest
from click.testing import CliRunner
from kimi_w31.adapter import launch
from kimi_w31.adapter.launch import ServeError, check_stack, plan_serve, serve
from kimi_w31.converter import contract
from kimi_w31.converter.errors import Code
from kimi_w31.converter.synth import SynthSpec, make_config

SOURCE = make_config(SynthSpec(k=3584, n=3072))
QC = SOURCE["quantization_config"]


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
    ]
    assert plan.env == {}


def test_tp_ep_and_extra_args(tmp_path):
    plan = plan_serve(ckpt(tmp_path), ["--port", "30000"], tp=8, ep=4, python="py")
    assert plan.argv[-6:] == ["--tp-size", "8", "--ep-size", "4", "--port", "30000"]


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
    cfg["quantization_config"] = QC
    (root / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ServeError, match=Code.NOT_WRAPPED.value):
        plan_serve(root)


def _stack(versions: dict[str, str], eps=(), environ=None) -> list[str]:
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


def test_stack_ok():
    assert _stack({"sglang": "0.5.23", "flashinfer-python": "0.7.2.post1"}, [_ep()]) == []


@pytest.mark.parametrize(
    ("versions", "fragment"),
    [
        ({"flashinfer-python": "0.7.2"}, "sglang is not installed"),
        ({"sglang": "0.5.24", "flashinfer-python": "0.7.2"}, "sglang 0.5.24"),
        ({"sglang": "0.5.23", "flashinfer-python": "0.6.18.post1"}, "flashinfer-python 0.6.18"),
    ],
)
def test_stack_version_problems(versions, fragment):
    problems = _stack(versions, [_ep()])
    assert len(problems) == 1 and fragment in problems[0]


def test_stack_plugin_problems():
    ok = {"sglang": "0.5.23", "flashinfer-python": "0.7.0"}
    assert "no 'kimi_w31' entry point" in _stack(ok, [])[0]
    assert "does not import" in _stack(ok, [_ep(loads=False)])[0]
    assert "SGLANG_PLUGINS" in _stack(ok, [_ep()], {"SGLANG_PLUGINS": "other"})[0]
    assert _stack(ok, [_ep()], {"SGLANG_PLUGINS": "other, kimi_w31"}) == []


def test_cli_print_shows_the_command(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "check_stack", lambda: [])
    monkeypatch.setattr(launch, "verify_structure", lambda root: [])
    root = ckpt(tmp_path)
    result = CliRunner().invoke(serve, [str(root), "--tp", "2", "--print", "--", "--port", "1"])
    assert result.exit_code == 0, result.output
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
        "--port",
        "1",
    ]


def test_cli_refuses_on_failed_checks(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "check_stack", lambda: ["sglang is not installed"])
    monkeypatch.setattr(launch, "verify_structure", lambda root: ["index: missing shard"])
    result = CliRunner().invoke(serve, [str(ckpt(tmp_path)), "--print"])
    assert result.exit_code != 0
    assert "sglang is not installed" in result.output and "verify: index" in result.output


def test_cli_runs_the_real_structure_verify(tmp_path, monkeypatch):
    """A config alone is not a checkpoint: the converter's verify must complain."""
    monkeypatch.setattr(launch, "check_stack", lambda: [])
    result = CliRunner().invoke(serve, [str(ckpt(tmp_path)), "--print"])
    assert result.exit_code != 0 and "verify:" in result.output


def test_cli_execs_sglang(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "check_stack", lambda: [])
    calls = []
    monkeypatch.setattr(launch.os, "execvpe", lambda f, argv, env: calls.append((argv, env)))
    result = CliRunner().invoke(serve, [str(ckpt(tmp_path, converted=False)), "--unconverted"])
    assert result.exit_code == 0, result.output
    ((argv, env),) = calls
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert env["KIMI_W31_SERVE_UNCONVERTED"] == "1"


def test_importing_the_converter_and_launch_never_imports_sglang():
    import subprocess
    import sys

    code = (
        "import sys, kimi_w31.converter, kimi_w31.converter.cli, kimi_w31.adapter.launch, "
        "kimi_w31.adapter.plugin, kimi_w31.adapter.hooks; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('sglang', 'flashinfer')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

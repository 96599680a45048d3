"""`kimi-convert serve --json`: a refusal is the JSON document convert and verify print
(`problems_json`: ok, exit_code, problems with their codes), the process exits with the code
the reasons' records give, and `--print --json` is the same plan as `--print` as data.
Asserted by reason code, never by text."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from cli_helpers import run_cli
from kimi_w31.adapter.reasons import AdapterCode
from kimi_w31.adapter.sglang import launch
from kimi_w31.adapter.sglang.launch import ServeError, plan_serve, serve
from kimi_w31.converter import contract
from kimi_w31.converter.cli.console import problems_json
from kimi_w31.converter.reasons import Code
from kimi_w31.converter.synth import SynthSpec, make_config

SOURCE = make_config(SynthSpec(k=3584, n=3072, experts=896))
CONVERTED = contract.converted_config(SOURCE, contract.make_block(4.0, 25.0))


def ckpt(root: Path, cfg: dict | list) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    return root


@pytest.fixture
def quiet_checks(monkeypatch):
    """The stack and structure checks pass; this machine has one GPU."""
    monkeypatch.setattr(launch, "check_stack", lambda: [])
    monkeypatch.setattr(launch, "verify_structure", lambda root: [])
    monkeypatch.setattr(launch, "count_gpus", lambda: 1)


# (config, serve's options, the reason, its exit code): data reasons exit 1, usage reasons 2.
REFUSALS = [
    (SOURCE, ["--tp", "8"], AdapterCode.NOT_CONVERTED, 1),
    ([], ["--tp", "8"], Code.JSON_INVALID, 1),
    (CONVERTED, ["--tp", "16", "--ep", "3"], AdapterCode.BAD_FLAG, 2),
    (CONVERTED, ["--tp", "12", "--ep", "12"], AdapterCode.EXPERT_SPLIT, 2),
    (CONVERTED, ["--tp", "8", "--", "--language-model-only"], AdapterCode.LANGUAGE_MODEL_ONLY, 2),
]


@pytest.mark.parametrize(("cfg", "args", "code", "exit_code"), REFUSALS)
def test_a_refusal_is_the_converters_json_document(
    tmp_path, quiet_checks, cfg, args, code, exit_code
):
    root = ckpt(tmp_path / "c", cfg)
    got = run_cli([root, "--print", "--json", *args], inprocess=True, command=serve)
    doc = got.json
    assert doc is not None, got.output
    assert got.codes == [code.value]
    assert got.returncode == doc["exit_code"] == exit_code
    assert doc["ok"] is False and set(doc) == set(problems_json([], hint=None))


@pytest.mark.parametrize(("cfg", "args", "code", "exit_code"), REFUSALS)
def test_json_and_plain_refuse_alike(tmp_path, quiet_checks, cfg, args, code, exit_code):
    """The same reason and exit code as the plain run, which prints text (negative control:
    no JSON on stdout without --json)."""
    root = ckpt(tmp_path / "c", cfg)
    plain = run_cli([root, "--print", *args], inprocess=True, command=serve)
    assert plain.returncode == exit_code and plain.json is None
    assert f"[{code.value}]" in plain.output


def test_a_refusal_from_a_check_is_json_too(tmp_path, monkeypatch, quiet_checks):
    """A reason raised after planning (no GPU here) goes through the same path."""
    monkeypatch.setattr(launch, "count_gpus", lambda: 0)
    got = run_cli(
        [ckpt(tmp_path / "c", CONVERTED), "--tp", "8", "--json"], inprocess=True, command=serve
    )
    assert got.codes == [AdapterCode.NO_GPU.value] and got.returncode == 1


def test_the_json_refusal_is_what_plan_serve_raises(tmp_path, quiet_checks):
    root = ckpt(tmp_path / "c", CONVERTED)
    with pytest.raises(ServeError) as err:
        plan_serve(root, [], tp=16, ep=3)
    got = run_cli(
        [root, "--tp", "16", "--ep", "3", "--print", "--json"], inprocess=True, command=serve
    )
    assert got.codes == list(err.value.error.codes) and got.returncode == err.value.exit_code


@pytest.mark.parametrize(
    "args",
    [
        ["--tp", "8"],
        ["--tp", "16", "--ep", "2", "--ifname", "eth0", "--", "--port", "1"],
        ["--tp", "8", "--text-only"],
    ],
)
def test_print_json_is_the_printed_plan_as_data(tmp_path, quiet_checks, args):
    root = ckpt(tmp_path / "c", CONVERTED)
    shell = run_cli([root, "--print", *args], inprocess=True, command=serve)
    data = run_cli([root, "--print", "--json", *args], inprocess=True, command=serve)
    assert shell.returncode == data.returncode == 0, data.output
    doc = data.json
    assert doc["ok"] is True and isinstance(doc["argv"], list) and isinstance(doc["env"], dict)
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(doc["env"].items()))
    assert shell.stdout.strip() == ((prefix + " ") if prefix else "") + shlex.join(doc["argv"])

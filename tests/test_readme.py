"""The README's serve examples are launches of the whole Kimi-K3 that `kimi-convert serve`
accepts: at least 16 GPUs (the model does not fit one 8 x H200 node), over as many nodes as
SGLang is told, with a MoE layout the CUTLASS SiTU method can run.

Each `kimi-convert serve` command in a code block is parsed by the serve command's own option
parser and planned (`plan_serve`) against a converted config with Kimi-K3's dimensions.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from kimi_w31.adapter.sglang.launch import plan_serve, serve
from kimi_w31.converter import contract
from kimi_w31.converter.manifest import load_manifest
from kimi_w31.converter.synth import SynthSpec, make_config

README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
GPUS_PER_NODE = 8  # an H200 node
MIN_GPUS = 16  # 1.46 TB of routed experts; 8 x 141 GB = 1.13 TB


def _serve_examples() -> list[str]:
    """Every `kimi-convert serve CHECKPOINT ...` command of the README's code blocks, with
    line continuations joined and comments cut (the usage synopsis, with brackets, is not
    a command)."""
    commands = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", README, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("kimi-convert serve ") and "[" not in line:
                commands.append(line)
    return commands


EXAMPLES = _serve_examples()


def test_the_readme_has_two_node_serve_examples():
    assert len(EXAMPLES) >= 3
    ranks = {_sglang_flag(shlex.split(c), "--node-rank") for c in EXAMPLES}
    assert {"0", "1"} <= ranks, "a command for each of the two nodes"


def _sglang_flag(argv: list[str], flag: str) -> str | None:
    after = argv[argv.index("--") + 1 :] if "--" in argv else []
    return next((after[i + 1] for i, a in enumerate(after[:-1]) if a == flag), None)


@pytest.fixture(scope="module")
def kimi_k3_checkpoint(tmp_path_factory) -> Path:
    """A converted config with Kimi-K3's dimensions (serve's plan reads the config only)."""
    config = make_config(SynthSpec(layers=3, experts=8))
    dims = load_manifest("kimi-k3").pinned
    config["text_config"].update(dims)
    block = contract.make_block(4.0, 25.0)
    root = tmp_path_factory.mktemp("k3") / "Kimi-K3-w31"
    root.mkdir()
    converted = contract.converted_config(config, block)
    (root / contract.CONFIG_NAME).write_text(json.dumps(converted))
    return root


@pytest.mark.parametrize("command", EXAMPLES)
def test_a_serve_example_launches_the_whole_model(command, kimi_k3_checkpoint):
    argv = [a for a in shlex.split(command)[2:] if a != "..."]
    argv[0] = str(kimi_k3_checkpoint)  # the example's checkpoint path
    if "--kernels" in argv:  # a bundle directory of the reader's machine
        argv[argv.index("--kernels") + 1] = str(kimi_k3_checkpoint.parent)
    params = serve.make_context("serve", argv).params
    plan = plan_serve(
        params["checkpoint"],
        params["sglang_args"],
        tp=params["tp"],
        ep=params["ep"],
        backend=params["backend"],
        unconverted=params["unconverted"],
    )
    server = plan.argv
    tp = int(server[server.index("--tp-size") + 1])
    nnodes = int(_flag(server, "--nnodes") or 1)
    assert tp >= MIN_GPUS, f"{command}: Kimi-K3 needs {MIN_GPUS} H200s or more"
    assert nnodes * GPUS_PER_NODE >= tp, f"{command}: {tp} GPUs on {nnodes} node(s)"


def _flag(argv: list[str], flag: str) -> str | None:
    return next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag), None)

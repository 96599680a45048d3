"""Generated source directory layouts: which shard files exist where, and what the index
names (shared by the file-set tests with and without SGLang)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from hypothesis import strategies as st
from kimi_w31.converter.contract import CONFIG_NAME, INDEX_NAME
from safetensors.numpy import save_file

TOP = [
    "model.safetensors",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "consolidated.safetensors",
    "extra.safetensors",
    ".hidden.safetensors",
]
NESTED = ["sub/model-00003-of-00003.safetensors", "sub/extra.safetensors"]
# How an index may name a file beyond its plain name (not listed by a loader's glob).
FORMS = ["plain", "plain", "plain", "dot-slash"]


@st.composite
def layouts(draw) -> dict:
    files = draw(st.lists(st.sampled_from(TOP + NESTED), min_size=1, max_size=6, unique=True))
    index = None
    if draw(st.booleans()):
        named = draw(st.lists(st.sampled_from(files), max_size=len(files), unique=True))
        index = {f: draw(st.sampled_from(FORMS)) for f in named}
        if draw(st.integers(0, 5)) == 0:
            index["missing.safetensors"] = "plain"
        if not index:
            index = {files[0]: "plain"}
    shared = draw(st.integers(0, 6)) == 0  # one tensor name in every file
    return {"files": files, "index": index, "shared": shared}


def tensors_of(file: str, shared: bool) -> list[str]:
    stem = file.replace("/", "_").removesuffix(".safetensors")
    return [f"{stem}.a", f"{stem}.b"] + (["shared.weight"] if shared else [])


def write_layout(root: Path, layout: dict) -> Path:
    """A source directory with the layout's shards (tiny U8 tensors), index and config."""
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    (root / CONFIG_NAME).write_text(json.dumps({"model_type": "kimi_k3"}))
    for file in layout["files"]:
        (root / file).parent.mkdir(parents=True, exist_ok=True)
        names = tensors_of(file, layout["shared"])
        save_file({n: np.full(4, i, dtype=np.uint8) for i, n in enumerate(names)}, root / file)
    if layout["index"] is not None:
        weight_map = {}
        for file, form in layout["index"].items():
            entry = f"./{file}" if form == "dot-slash" else file
            names = tensors_of(file, layout["shared"]) if file in layout["files"] else ["gone"]
            weight_map.update((n, entry) for n in names)
        (root / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root

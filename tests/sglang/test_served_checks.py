"""What is served is what was verified, through SGLang's real loader on CPU.

A checkpoint converted by kimi-convert is loaded from disk the way SGLang loads it (its own
shard filter and safetensors iterator, the VL wrapper's mapper, Kimi-K3's `load_weights`
with the plugin's hook). Before any weight is read the plugin refuses:
- a converted checkpoint never verified with --checksums where it stands, or any file of it
  changed since (the damaged cases a loader takes without a word: NaN scale, swapped halves,
  a duplicated expert, experts swapped between layers), unless the operator opts out;
- shards that disagree with the index (a tensor in two shards, or in one the index does not
  give it), a routed-expert tensor of the wrong shape (SGLang zero-fills a short one), two
  names that reach one parameter; with or without the opt-out.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from harness import FakeK3Text, build_moe, kimi_convert, load_with_real_loader, sglang_process
from kimi_w31.converter.output import verified
from kimi_w31.converter.reasons import Code
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.sglang

E, K, N, LAYERS = 4, 256, 128, 2
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("served")
    src, out = root / "src", root / "out"
    kimi_convert(
        "synth", str(src), "--layers", str(LAYERS), "--dense-layers", "0",
        "--experts", str(E), "--k", str(K), "--n", str(N), "--shards", "3",
    )  # fmt: skip
    kimi_convert(str(src), str(out), "--manifest", "kimi-k3-any", "--max-shard-size", "400KB")
    assert len(list(out.glob("*.safetensors"))) >= 3
    return out


def _verify(path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kimi_w31", "verify", str(path), "--checksums", "-q"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture
def copy(converted, tmp_path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(converted, dst)
    return dst


def _load_from_disk(path: Path) -> list:
    """SGLang's own file filter and iterator over the checkpoint; the routed experts go to
    the real Kimi-K3 loader (the only modules this model has)."""
    from sglang.srt.model_loader.weight_utils import (
        filter_duplicate_safetensors_files,
        safetensors_weights_iterator,
    )
    from sglang.srt.runtime_context import process_model_config

    with sglang_process(path, arch="sm90", moe_runner_backend="marlin"):
        moes = [build_moe(experts=E, hidden=K, inter=N, layer_id=i) for i in range(LAYERS)]
        model = FakeK3Text(process_model_config().hf_config.text_config, moes)
        files = filter_duplicate_safetensors_files(
            sorted(str(p) for p in path.glob("*.safetensors")), str(path), INDEX
        )
        experts = {n: t for n, t in safetensors_weights_iterator(files) if ".experts." in n}
        load_with_real_loader(model, experts)
        return moes


def _refused(path: Path) -> set[str]:
    from kimi_w31.adapter.sglang.hooks import W31LoadError

    with pytest.raises(W31LoadError) as err:
        _load_from_disk(path)
    assert "kimi-convert verify" in str(err.value)
    return set(err.value.codes)


# -- damage, as a hostile user plants it -------------------------------------------------------


def _index(path: Path) -> dict:
    return json.loads((path / INDEX).read_text())


def _shard_of(path: Path, tensor: str) -> Path:
    return path / _index(path)["weight_map"][tensor]


def _rewrite(shard: Path, change: Callable[[dict], None]) -> None:
    tensors = load_file(str(shard))
    change(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})


def _w31(layer: int, expert: int, suffix: str = "weight_packed") -> str:
    return f"language_model.model.layers.{layer}.block_sparse_moe.experts.{expert}.w31.{suffix}"


def _nan_scale(path: Path) -> None:
    name = _w31(0, 1, "weight_scale")

    def change(t: dict) -> None:
        t[name] = t[name].clone()
        t[name].view(-1)[5] = 0xFF

    _rewrite(_shard_of(path, name), change)


def _swap_halves(path: Path) -> None:
    name = _w31(1, 0)

    def change(t: dict) -> None:
        up, gate = t[name].chunk(2)
        t[name] = torch.cat([gate, up]).contiguous()

    _rewrite(_shard_of(path, name), change)


def _duplicate_expert(path: Path) -> None:
    name, other = _w31(0, 2), _w31(0, 3)
    data = load_file(str(_shard_of(path, other)))[other].clone()
    _rewrite(_shard_of(path, name), lambda t: t.__setitem__(name, data))


def _swap_layers(path: Path) -> None:
    a, b = _w31(0, 0), _w31(1, 0)
    ta, tb = load_file(str(_shard_of(path, a)))[a], load_file(str(_shard_of(path, b)))[b]
    _rewrite(_shard_of(path, a), lambda t: t.__setitem__(a, tb.clone()))
    _rewrite(_shard_of(path, b), lambda t: t.__setitem__(b, ta.clone()))


def _two_rows_short(path: Path) -> None:
    name = _w31(1, 2)
    _rewrite(_shard_of(path, name), lambda t: t.__setitem__(name, t[name][:-2].clone()))


def _other_shard(path: Path, tensor: str) -> Path:
    mine = _shard_of(path, tensor)
    return next(p for p in sorted(path.glob("*.safetensors")) if p != mine)


def _duplicate_in_second_shard(path: Path) -> None:
    name = _w31(0, 1)
    data = load_file(str(_shard_of(path, name)))[name]
    _rewrite(_other_shard(path, name), lambda t: t.__setitem__(name, (data ^ 0x11).clone()))


def _duplicate_without_index(path: Path) -> None:
    name = _w31(1, 3)
    other = _other_shard(path, name)
    data = load_file(str(_shard_of(path, name)))[name]
    (path / INDEX).unlink()  # SGLang then loads every top-level shard
    _rewrite(other, lambda t: t.__setitem__(name, (data ^ 0x33).clone()))


def _moved_to_unassigned_shard(path: Path) -> None:
    name = _w31(1, 1)
    home, other = _shard_of(path, name), _other_shard(path, name)
    data = load_file(str(home))[name].clone()
    _rewrite(home, lambda t: t.pop(name))
    _rewrite(other, lambda t: t.__setitem__(name, data))


def _second_spelling(path: Path) -> None:
    name = _w31(0, 0)
    alias = name.replace("language_model.model.layers.", "language_model.layers.")
    home = _shard_of(path, name)
    data = load_file(str(home))[name]
    _rewrite(home, lambda t: t.__setitem__(alias, (data ^ 0x22).clone()))
    index = _index(path)
    index["weight_map"][alias] = home.name
    (path / INDEX).write_text(json.dumps(index))


# Damage that only the bytes show: refused because the files changed since verify.
CONTENT_DAMAGE = {
    "NaN scale": _nan_scale,
    "swapped halves": _swap_halves,
    "duplicated expert": _duplicate_expert,
    "experts swapped between layers": _swap_layers,
}
# Damage the headers show: refused with its own code, opt-out or not.
STRUCTURE_DAMAGE = {
    "w31 two rows short": (_two_rows_short, Code.EXPERT_SHAPE),
    "tensor duplicated in a second shard": (_duplicate_in_second_shard, Code.INDEX_WRONG_SHARD),
    "tensor in two shards, no index": (_duplicate_without_index, Code.TENSOR_IN_TWO_SHARDS),
    "tensor in a shard the index does not give it": (
        _moved_to_unassigned_shard,
        Code.INDEX_WRONG_SHARD,
    ),
    "two spellings of one parameter": (_second_spelling, Code.NAME_COLLISION),
}


@pytest.fixture
def checked(monkeypatch):
    """The load-time check against verify's record is on (no opt-out)."""
    monkeypatch.delenv(verified.SKIP_ENV, raising=False)


def test_a_verified_checkpoint_loads(plugins, checked, copy):
    _verify(copy)
    moes = _load_from_disk(copy)
    assert all(m.w13_weight.abs().sum() > 0 for m in moes)


def test_a_never_verified_checkpoint_is_refused(plugins, checked, copy):
    assert _refused(copy) == {Code.NOT_VERIFIED.value}


@pytest.mark.parametrize("damage", sorted(CONTENT_DAMAGE))
def test_damage_after_verify_is_refused(plugins, checked, copy, damage):
    _verify(copy)
    CONTENT_DAMAGE[damage](copy)
    assert _refused(copy) == {Code.VERIFIED_FILES_CHANGED.value}


@pytest.mark.parametrize("damage", sorted(CONTENT_DAMAGE))
def test_verify_refuses_the_same_damage(copy, damage):
    """The record is worth trusting: verify --checksums catches each content damage."""
    CONTENT_DAMAGE[damage](copy)
    proc = subprocess.run(
        [sys.executable, "-m", "kimi_w31", "verify", str(copy), "--checksums", "-q"],
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == 1


@pytest.mark.parametrize("damage", sorted(STRUCTURE_DAMAGE))
def test_structure_damage_is_refused_with_its_own_code(plugins, copy, damage):
    """With the opt-out (the suite's default) too: the headers are checked whatever."""
    plant, code = STRUCTURE_DAMAGE[damage]
    plant(copy)
    codes = _refused(copy)
    assert code.value in codes
    assert not codes & {Code.NOT_VERIFIED.value, Code.VERIFIED_FILES_CHANGED.value}


@pytest.mark.parametrize("damage", sorted(STRUCTURE_DAMAGE))
def test_structure_damage_after_verify_names_both_reasons(plugins, checked, copy, damage):
    _verify(copy)
    plant, code = STRUCTURE_DAMAGE[damage]
    plant(copy)
    assert {code.value, Code.VERIFIED_FILES_CHANGED.value} <= _refused(copy)


def test_the_opt_out_loads_an_unverified_checkpoint_and_says_so(plugins, copy, caplog):
    with caplog.at_level(logging.WARNING, logger="kimi_w31.adapter"):
        _load_from_disk(copy)
    assert any(verified.SKIP_ENV in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("damage", sorted(STRUCTURE_DAMAGE))
def test_without_the_check_sglang_loads_the_damage(plugins, copy, monkeypatch, damage):
    """Negative control: each planted case is one SGLang itself loads without a word."""
    from kimi_w31.adapter.sglang import hooks

    monkeypatch.setattr(hooks, "structure_refusal", lambda *a, **k: None)
    STRUCTURE_DAMAGE[damage][0](copy)
    _load_from_disk(copy)


@pytest.mark.parametrize("damage", sorted(CONTENT_DAMAGE))
def test_without_the_record_sglang_loads_the_content_damage(plugins, copy, damage):
    CONTENT_DAMAGE[damage](copy)
    _load_from_disk(copy)  # the suite's opt-out: nothing compares the bytes

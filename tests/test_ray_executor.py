"""The Ray executor against a real local Ray runtime, compared byte for byte with local runs.

One Ray runtime (2 CPUs, loopback only) serves the module; conversions run as the real CLI in
subprocess drivers that join it with --ray-address, so a driver can be SIGKILLed mid-run
(after its second ledger append, by the fault hook) while the runtime lives on.
"""

from __future__ import annotations

import json
import os

import pytest
from cli_helpers import run_cli
from kimi_w31.converter.output.directory import OutputDir

# Ray binds to the machine's address unless told that this is a one-node, loopback setup.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray", reason="Ray is an optional extra (kimi-w31[ray])")

ARGS = ["--manifest", "kimi-k3-any", "--max-shard-size", "600000"]
KILL_AFTER_TWO = {"KIMI_W31_FAULT_AT": "ledger.appended:2"}  # SIGKILL the driver right there


@pytest.fixture(scope="module")
def ray_address():
    ctx = ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="warning"
    )
    address = ctx.address_info["address"]
    assert address.startswith("127.0.0.1:")
    yield address
    ray.shutdown()


def _files(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _ray(address):
    return ["--executor", "ray", "--ray-address", address]


def _run(src, out, *args, env_extra=None):
    return run_cli([src, out, *ARGS, *args], env=env_extra)


def _killed_after_two(src, out, *args):
    r = _run(src, out, *args, env_extra=KILL_AFTER_TWO)
    assert r.returncode == -9, (r.returncode, r.stderr)
    assert not (out / "model.safetensors.index.json").exists()
    ledger = OutputDir(out).ledger_path.read_text().splitlines()
    assert len(ledger) == 3  # the fingerprint and two finished shards


def test_ray_output_is_byte_identical_to_the_local_executor(
    small_source, converted, tmp_path, ray_address
):
    out = tmp_path / "out"
    r = _run(small_source, out, *_ray(ray_address), "--json")
    assert r.returncode == 0, r.stderr
    summary = r.json
    assert summary["shards_written"] == summary["output_shards"] > 1
    assert _files(out) == _files(converted)  # config, index, checksums and every shard


def test_killed_ray_driver_resumes_on_ray(small_source, converted, tmp_path, ray_address):
    out = tmp_path / "out"
    _killed_after_two(small_source, out, *_ray(ray_address))
    r = _run(small_source, out, *_ray(ray_address), "--json")
    assert r.returncode == 0, r.stderr
    summary = r.json
    assert summary["shards_kept"] == 2
    assert summary["shards_written"] == summary["output_shards"] - 2
    assert _files(out) == _files(converted)


def test_local_run_finished_on_ray_and_ray_run_finished_locally(
    small_source, converted, tmp_path, ray_address
):
    local_first, ray_first = tmp_path / "a", tmp_path / "b"
    _killed_after_two(small_source, local_first, "--workers", "1")
    _killed_after_two(small_source, ray_first, *_ray(ray_address))
    for out, finish in ((local_first, _ray(ray_address)), (ray_first, ["--workers", "1"])):
        r = _run(small_source, out, *finish, "--json")
        assert r.returncode == 0, r.stderr
        assert r.json["shards_kept"] == 2
        assert _files(out) == _files(converted)


def test_corrupted_shard_is_found_by_a_ray_task_and_redone(
    small_source, converted, tmp_path, ray_address
):
    out = tmp_path / "out"
    _killed_after_two(small_source, out, "--workers", "1")
    done = json.loads(OutputDir(out).ledger_path.read_text().splitlines()[1])["shard"]
    data = bytearray((out / done).read_bytes())
    data[-1] ^= 0xFF  # same size, same header: only the re-hash (--rehash) can tell
    (out / done).write_bytes(bytes(data))
    r = _run(small_source, out, *_ray(ray_address), "--json", "--rehash")
    assert r.returncode == 0, r.stderr
    summary = r.json
    assert summary["shards_kept"] == 1 and list(summary["redone"]) == [done]
    assert _files(out) == _files(converted)


def test_what_a_task_raises_reaches_the_driver_as_it_was_raised(ray_address, tmp_path):
    """A worker's refusal pickles by its fields: the driver re-raises the same coded error
    (here the version check: a node running another kimi-w31)."""
    from kimi_w31.converter.errors import Fatal
    from kimi_w31.converter.execute.ray import shard_task
    from kimi_w31.converter.plan import OutputShard
    from kimi_w31.converter.reasons import Code

    shard = OutputShard("model-00001-of-00001.safetensors", [])
    task = ray.remote(shard_task)
    ref = task.remote(shard, str(tmp_path), {}, {}, str(tmp_path), str(tmp_path), None,
                      False, False, "0.0.0-other")  # fmt: skip
    with pytest.raises(ray.exceptions.RayTaskError) as err:
        ray.get(ref)
    cause = err.value.cause
    assert isinstance(cause, Fatal) and [p.code for p in cause.problems] == [Code.USAGE]


def test_the_errors_a_task_raises_pickle_by_their_fields():
    import pickle

    from kimi_w31.converter.errors import Fatal, problem
    from kimi_w31.converter.execute.shard import SourceChanged
    from kimi_w31.converter.reasons import Code

    exc = Fatal([problem(Code.USAGE, rule="workers", workers=0)], hint="h")
    back = pickle.loads(pickle.dumps(exc))
    assert (back.problems, back.hint, str(back)) == (exc.problems, exc.hint, str(exc))
    changed = pickle.loads(pickle.dumps(SourceChanged("f", "why")))
    assert (changed.file, changed.detail) == ("f", "why")

"""Every failure says how to recover: damage verify finds names the command that repairs
it, a plain rerun (which cannot see damaged data) names the same, and that command repairs."""

from __future__ import annotations

import struct

from cli_helpers import run_cli
from kimi_w31.converter.reasons import Code

ANY = ["--manifest", "kimi-k3-any", "--max-shard-size", "600000"]


def _flip_a_data_byte(out):
    shard = sorted(out.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])
    at = 8 + header_len + (len(data) - 8 - header_len) // 2  # inside the tensor data
    data[at] ^= 0xFF
    shard.write_bytes(bytes(data))


def test_damage_found_by_verify_is_repaired_by_the_command_it_names(small_source, output_copy):
    out = output_copy
    assert run_cli(["verify", out, "--checksums", "--json"]).json["repair"] is None  # intact
    _flip_a_data_byte(out)
    failed = run_cli(["verify", out, "--checksums", "--json"])
    assert failed.returncode == 1
    assert Code.CHECKSUM_MISMATCH.value in failed.json["codes"]
    repair = failed.json["repair"]
    assert repair.split() == ["kimi-convert", "SRC", str(out), "--rehash"]

    # The plain rerun proves kept shards without their data: it finds nothing to do, and
    # says which command would see and repair the damage.
    rerun = run_cli([small_source, out, *ANY, "--json"])
    assert rerun.returncode == 0 and rerun.json["already_complete"] is True
    assert rerun.json["repair"] == repair.replace("SRC", str(small_source))
    human = run_cli([small_source, out, *ANY])
    assert "--rehash" in human.stderr

    fixed = run_cli([small_source, out, *ANY, "--rehash", "--json"])
    assert fixed.returncode == 0 and fixed.json["shards_written"] == 1
    assert "repair" not in fixed.json  # every kept shard's data was re-read
    assert run_cli(["verify", out, "--checksums"]).returncode == 0

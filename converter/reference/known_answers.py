"""Known answers for MXFP4 decoding and the SiTU expert MLP (docs/format.md, section 11).

`verify --numerics` compares source and converted experts through one decoder: a decoder
with its nibbles swapped or its exponent bias off by one computes the same wrong function on
both sides and passes. Only answers fixed in advance catch it, so the values here are
literals, written out from the spec (a test holds them to docs/format.md), never computed
by the decoder they check. `self_test()` runs the numpy reference on them.
"""

from __future__ import annotations

import math

import numpy as np

from .. import reference as ref

# The spec's relative tolerance for the expert output (rounding of transcendental functions
# and of summation order; the decoded weights and the first GEMM are exact).
OUTPUT_RTOL = 1e-5

_INF = math.inf
_NAN = math.nan
# OCP MX e2m1 by code, written out here rather than taken from the decoder's table.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_CODES_0_TO_15 = "1032547698badcfe"  # bytes whose low nibble comes first: codes 0, 1, ..., 15

# E8M0 byte -> scale.
E8M0 = {
    0x00: 2.0**-127,
    0x01: 2.0**-126,
    0x7E: 0.5,
    0x7F: 1.0,
    0x80: 2.0,
    0xFE: 2.0**127,
    0xFF: _NAN,
}


DECODE = (
    {
        "what": "nibble order: element 2j is the low nibble of byte j (codes 0..15, twice)",
        "packed": (_CODES_0_TO_15 * 2,),
        "scale": ("7f",),
        "values": (_E2M1 * 2,),
    },
    {
        "what": "one scale per group of 32 (2.0, then 0.25)",
        "packed": (_CODES_0_TO_15 * 4,),
        "scale": ("807d",),
        "values": (tuple(v * 2.0 for v in _E2M1) * 2 + tuple(v * 0.25 for v in _E2M1) * 2,),
    },
    {
        "what": "the extreme scales, decoded in fp32: 0xFE overflows for |code value| >= 2, "
        "0x00 and 0x01 give fp32 subnormals and 2^-126, 0xFF makes every element NaN",
        "packed": ("73fb" * 8, "2101" * 8, "21" * 16, "77" * 16),
        "scale": ("fe", "00", "01", "ff"),
        "values": (
            (1.5 * 2.0**127, _INF, -1.5 * 2.0**127, -_INF) * 8,
            (2.0**-128, 2.0**-127, 2.0**-128, 0.0) * 8,
            (2.0**-127, 2.0**-126) * 16,
            (_NAN,) * 32,
        ),
    },
)

_W31_PACKED = (
    "40c3626d162da9aa177c103bc3c5610e",
    "2886668a47557863eb87675512ea725a",
    "e30574d5bb7c829ffd6c8f6a7baea827",
    "11feac6d8caae259b86162d64358df7e",
    "81c96110392d1e300f0774e1ed989480",
    "7c97423d6bd2cb14f8caa99e9a631a3e",
    "15542b184f3eab497a28fb4f4943f6ed",
    "0dbc956074e086832ab70be32d1f1034",
    "2f7da2fce02000855b117eade6bbd089",
    "6c76eb7ed26c78aa8ee149c29cbfe16a",
    "0e22d3fe67067eb7dc7443696b5c5e88",
    "ca5c728fe19b574b36b7beee9e817b58",
    "2ae03b5daff3666bae9a36bfdf6d5ccb",
    "9fb3b728f6de74d2d467b9af8464edaa",
    "24cd21896ef61d79ff08dea8d35ad544",
    "32a7caf4a5bad841ead19956036d7ae7",
    "c39c8eeac36a2bde76cb9aee08997ddf",
    "fa0bbcd1448fbe039ca63b3840ac0419",
    "313b3847a92f9a2c48d3d0b6cf953f21",
    "b8af0b1132f51117d5cb771aab07aade",
    "b42259dddf144466be6d89e596b622a2",
    "3e55efe0a5b5f2edc9813d09da8a5d09",
    "6171f9f89cb11a763c58a4697298e441",
    "89a4908da68da05130be8ecec9fc7d56",
    "bfbbd46a90d3266c0ee1f94846b2e958",
    "9554005d688a2e59610734413d1ba7ce",
    "b6ace59c18ad99cc34958cca01ad5f0a",
    "2970eef96c15c127099c27d4bba0eac1",
    "06dd0e82fc90b46e5ece5b1edd508009",
    "f6081753f720a35f4b41a7d78c7f790a",
    "11d2c038daac80850d8d21cf83dec9f4",
    "180f4309044983f9457fefdeba33da19",
    "70b7453b3048f9d5458fe78e590c8e91",
    "065b5c163807be4073dd13248426fd7b",
    "5843d62ad158c8c952bdcb46420fa2f7",
    "28bc820162b5fb577940794e3d92347c",
    "807e298646061c3a3d59b7f50617c5f5",
    "9d1b2c3ffc2c47afa8b7c8cebf81bc7e",
    "3595092e611a8aeb7a182dc057767585",
    "22d04952c35127c9b700b5c38f586bc4",
    "e3c2fdc40c687317b18b9468d09895fc",
    "147265f743abb7acf07728b388256e05",
    "00dea651914df265f548371c11bf7e7e",
    "4c1b0bee028a973e1b122289eeb85124",
    "55e30f8098c9190d1df60953f908c5c1",
    "ab5936eba93b7d9b0ea63b04def5c994",
    "ad781ad57722bc95d880894d965ef2ec",
    "547f541751af0955d45bac0c3376c85d",
    "fb25afe5d9a0b490d9e20bb9768f9a2d",
    "e720f82909ac0e3165768a630997b8df",
    "f8a25f3c14c8646e685358b6d7c3f367",
    "8b4300dfb2cf4ad9331d6057c2d2666d",
    "14605b549db6a723d58c9bb0b6192218",
    "257714a3ac6357a67ca2e3b885497fc0",
    "2dd78d88bd8ae58e41a2197d1f06ed14",
    "5e5112e1accf926a303d55edc51a9e8a",
    "66bfece580cbf188d8f96ae6ee1481ab",
    "697f7166e9c65339ed9fbe80d8bf4068",
    "25e343cb9d3be6cab93b5d599348890f",
    "be52c0ca0e79e1b97d989144e9fddfa1",
    "2ed0be34f02add5a7190c73e93e148d9",
    "ebf7aa2492a9c089576b8f6eb2f1fcd3",
    "db0429237ca44a39e7eae36d2a66a72f",
    "b9a2de662b3f34b8b9ec85458d3344e6",
)
_W31_SCALE = (
    "7c7d7c7d7e7e7e7c7e7e7d7d7c7b7e7d7d7e7c7b7d7e7d7c7e7d7c7d7b7e7d7c"
    "7d7e7b7d7e7d7c7b7b7b7d7c7c7c7c7e7e7e7e7e7b7b7e7e7b7c7e7e7b7d7b7b"
)
_W2_PACKED = (
    "716dcf856c57759cf49816ba0a174bce",
    "29372c7044d0d9d2bd6c16dcd7b559e8",
    "f7cb92ddb0a1b68153a9bf4b132151b1",
    "ac028ad3b200e450bc3d10ce8dd0a259",
    "7d660592bf68fcdb2527c09295433114",
    "fc10e5a0142d083e4eebfcbeef50708e",
    "17d054cbf373264fc739f9622eb161e5",
    "bbd21139b52d135cbdee671ff642be46",
    "9796dac09272ffeb23a8a05d95a11a8f",
    "faca2023052fa5a063d34edb4e4b74d7",
    "4a3a6c99d4cc102036b9771dfc0a753b",
    "13a41d740db6026a4c788891c834e8ca",
    "35fb82963b358d3ceaa4ffd74ab0a13e",
    "3b0af686d337709d17de61344723b1f7",
    "a339aacc12fc724faf41c308769ebaf5",
    "dcf5cad70fbe1e277f377286426aab97",
    "c956388da3c5c4047ccdb443b9dadb7f",
    "d6bd933bc80c8ef5c8409c01dc7ca73c",
    "9b2e820df79a1ae120d93d64cf9d9102",
    "1d3e7764b38f9f01e3f022fe8d801ef8",
    "1be0e158ec5b154f8d328791888cfecf",
    "4c927f87eabf94cbe12777fdc93ab8f0",
    "a2f0b69b40368cc1af891901156f5f19",
    "00b1cfd7f2e01975b981abb1aee31dba",
    "24c47f2ffe17a7aad63dae6911ef989d",
    "af3d8eb0687bf6fa924959913e776e9b",
    "bf1542da381f77e8946abc98691e1b43",
    "0c0d68249611598462e24e8932ea5c14",
    "5b8fdcdbd02cae8297cf22f358c999bd",
    "2e99c4447aeba223e9ee45171b0ec38b",
    "a1a746933608632566e370c20478f319",
    "1c819ad8f2093f90ea71f46ab4005ed6",
)
_W2_SCALE = "7b7c7c7c7b7c7c7c7c7c7c7d7d7c7b7b7b7c7b7c7b7d7c7b7d7d7b7d7b7b7c7d"
_X = (
    (
        -0.25,
        -0.25,
        1.0,
        2.0,
        -0.5,
        -2.0,
        -0.75,
        0.0,
        1.5,
        -1.25,
        -0.25,
        -1.0,
        1.0,
        -1.0,
        -2.0,
        1.25,
        -1.75,
        2.0,
        0.75,
        -0.5,
        -1.5,
        -0.5,
        -2.0,
        0.5,
        -1.5,
        -1.5,
        0.25,
        -0.75,
        -0.75,
        -2.0,
        -1.0,
        0.75,
    ),
    (
        -1.5,
        -1.0,
        1.75,
        -0.5,
        1.75,
        1.75,
        -1.5,
        -1.5,
        0.25,
        0.25,
        -1.0,
        -1.25,
        2.0,
        -1.5,
        -0.25,
        0.25,
        -1.5,
        1.75,
        1.5,
        -0.5,
        -0.75,
        1.0,
        1.5,
        2.0,
        -0.25,
        -0.25,
        0.25,
        1.75,
        -0.25,
        0.25,
        2.0,
        1.25,
    ),
)
_GATE = (
    (
        -4.46875,
        6.125,
        -0.296875,
        2.71875,
        -7.1875,
        14.5625,
        -2.640625,
        -1.921875,
        -1.1171875,
        -0.8125,
        -7.59375,
        3.75,
        2.96875,
        2.59375,
        0.859375,
        -6.6875,
        2.8125,
        12.0625,
        8.5,
        -2.0625,
        -0.9453125,
        0.1328125,
        23.1875,
        8.0,
        0.203125,
        -0.078125,
        -1.875,
        19.3125,
        1.171875,
        7.28125,
        -1.0703125,
        -1.265625,
    ),
    (
        -1.46875,
        -5.1875,
        0.59375,
        5.09375,
        -15.875,
        3.4375,
        3.625,
        -0.3828125,
        -2.265625,
        1.9921875,
        -4.28125,
        4.0,
        1.296875,
        2.046875,
        -1.625,
        -9.9375,
        -1.75,
        -10.125,
        15.9375,
        14.5,
        -0.8984375,
        0.9453125,
        21.5,
        3.4375,
        -1.0,
        -3.578125,
        10.0,
        9.625,
        -1.34375,
        0.8125,
        -1.25,
        -0.265625,
    ),
)
_UP = (
    (
        -1.84375,
        -8.03125,
        -1.578125,
        -2.28125,
        -1.0,
        -1.9375,
        17.0,
        0.15625,
        17.875,
        22.4375,
        -5.59375,
        6.03125,
        1.515625,
        1.1796875,
        -1.0625,
        -4.4375,
        2.375,
        2.625,
        1.6875,
        -1.5703125,
        -6.25,
        19.8125,
        5.875,
        3.140625,
        17.75,
        3.5,
        1.34375,
        0.34375,
        2.5,
        -0.25,
        1.53125,
        0.625,
    ),
    (
        -1.296875,
        4.5,
        3.40625,
        0.65625,
        7.8125,
        0.8125,
        -6.375,
        3.625,
        7.25,
        -7.5625,
        2.75,
        7.53125,
        0.484375,
        0.6640625,
        0.1875,
        10.0625,
        -9.09375,
        7.0,
        0.265625,
        -1.765625,
        0.3125,
        4.5625,
        -0.625,
        1.03125,
        9.3125,
        0.0,
        -0.421875,
        -4.90625,
        -0.015625,
        11.125,
        -6.28125,
        -3.21875,
    ),
)
_Y = (
    (
        -12.800235,
        -29.394852,
        25.797781,
        -17.882242,
        -1.6337833,
        8.059847,
        23.081028,
        -12.848669,
        11.558917,
        19.69789,
        -17.006786,
        -0.5419308,
        11.273052,
        17.02599,
        -5.3740444,
        17.045925,
        5.6641197,
        12.423803,
        5.8934393,
        -38.411278,
        8.486925,
        -57.699608,
        5.564893,
        -5.1559887,
        5.091427,
        24.336136,
        3.1779773,
        -3.155634,
        -6.0278864,
        -1.3239818,
        13.085239,
        -8.865822,
    ),
    (
        -1.8489721,
        -12.432118,
        6.8207498,
        4.4741654,
        3.8503404,
        -0.31386113,
        36.125885,
        4.4467916,
        19.26421,
        4.2136297,
        11.700809,
        -42.936554,
        -20.906734,
        -1.031086,
        -7.829597,
        -14.08112,
        4.4148583,
        -11.356893,
        10.025339,
        4.444028,
        2.332243,
        -25.743895,
        -6.4638176,
        -3.2917624,
        71.63191,
        -5.756525,
        0.22465587,
        29.618382,
        6.3179617,
        -11.912007,
        -17.542095,
        9.784842,
    ),
)

# One converted expert, K = N = 32, two tokens: w31 = [up; gate] (rows [0, N) are the
# source's w3, rows [N, 2N) its w1); `gate`/`up` are x @ gate.T and x @ up.T (exact in fp32: the
# inputs are multiples of 1/4 and the weights small dyadic numbers); `y` is the fp32 output.
EXPERT = {
    "K": 32,
    "N": 32,
    "situ_beta": 4.0,
    "situ_linear_beta": 25.0,
    "fc1_order": ("up", "gate"),
    "w31.weight_packed": _W31_PACKED,
    "w31.weight_scale": _W31_SCALE,
    "w2.weight_packed": _W2_PACKED,
    "w2.weight_scale": _W2_SCALE,
    "x": _X,
    "gate": _GATE,
    "up": _UP,
    "y": _Y,
}


def _bytes(rows: tuple[str, ...] | str, width: int) -> np.ndarray:
    """Hex rows (or one row-major hex string) -> uint8 [R, width]."""
    data = bytes.fromhex("".join(rows) if not isinstance(rows, str) else rows)
    return np.frombuffer(data, dtype=np.uint8).reshape(-1, width)


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    """Bit for bit as values: equal, NaN where NaN, and the sign of zero kept."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    return (
        got.shape == want.shape
        and bool(np.array_equal(got, want, equal_nan=True))
        and bool(np.array_equal(np.signbit(got), np.signbit(want)))
    )


def _decode_mismatches() -> list[str]:
    found = []
    scales = np.array(list(E8M0), dtype=np.uint8)
    if not _same(ref.e8m0_to_float(scales), np.array(list(E8M0.values()))):
        found.append("E8M0 bytes 0x00, 0x01, 0x7E, 0x7F, 0x80, 0xFE, 0xFF decode wrongly")
    for vector in DECODE:
        packed = _bytes(vector["packed"], len(vector["packed"][0]) // 2)
        scale = _bytes(vector["scale"], len(vector["scale"][0]) // 2)
        got = ref.dequant_mxfp4(packed, scale)
        if not _same(got, np.array(vector["values"])):
            found.append(f"MXFP4 vector '{vector['what']}' decodes wrongly")
    return found


def _expert_mismatches() -> list[str]:
    e, k, n = EXPERT, EXPERT["K"], EXPERT["N"]
    w31 = (_bytes(e["w31.weight_packed"], k // 2), _bytes(e["w31.weight_scale"], k // 32))
    w2 = (_bytes(e["w2.weight_packed"], n // 2), _bytes(e["w2.weight_scale"], n // 32))
    weights = ref.dequant_converted_expert(w31, w2, e["fc1_order"])
    x = np.array(e["x"], dtype=np.float32)
    found = []
    for what in ("gate", "up"):
        if not _same(x @ getattr(weights, what).T, np.array(e[what], dtype=np.float32)):
            found.append(f"the expert vector's x @ {what}.T is not the known answer")
    y = ref.expert_forward(x, weights, e["situ_beta"], e["situ_linear_beta"])
    want = np.array(e["y"], dtype=np.float32).astype(np.float64)
    err = float(np.max(np.abs(y.astype(np.float64) - want))) / float(np.max(np.abs(want)))
    if not err <= OUTPUT_RTOL:  # NaN fails too
        found.append(f"the expert vector's output is off by {err:.3g} (at most {OUTPUT_RTOL:g})")
    return found


def self_test() -> list[str]:
    """What the numpy reference gets wrong on the known answers (empty: nothing)."""
    try:
        with np.errstate(all="ignore"):  # a wrong decoder may overflow: that is a finding
            return _decode_mismatches() + _expert_mismatches()
    except (TypeError, ValueError, IndexError, ArithmeticError) as exc:  # or raise
        return [f"the reference cannot decode the known answers ({exc})"]

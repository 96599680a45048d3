"""The load-time completeness bookkeeping (adapter/completeness.py), engine-neutral: which
parts of which local experts a MoE layer received, and what the refusal names."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st
from kimi_w31.adapter import completeness as c
from kimi_w31.converter.text import id_ranges

PAIRS = [(p, k) for p in c.PROJECTIONS for k in (c.PACKED, c.SCALE)]


def _parse_ranges(text: str) -> set[int]:
    out: set[int] = set()
    for part in filter(None, text.removesuffix(" ...").split(", ")):
        if part == "(none)":
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


@given(st.sets(st.integers(0, 2000), max_size=60))
def test_id_ranges_round_trip_and_are_maximal(ids) -> None:
    """The one id_ranges (converter/text.py), as the refusals here use it: every id."""
    text = id_ranges(ids, limit=None)
    assert _parse_ranges(text) == ids
    runs = [p for p in text.split(", ") if p and p != "(none)"]
    bounds = [tuple(map(int, p.split("-"))) if "-" in p else (int(p), int(p)) for p in runs]
    # sorted, disjoint, and never two runs that touch (they would be one range)
    assert all(a[1] + 1 < b[0] for a, b in itertools.pairwise(bounds))


@given(st.sets(st.integers(0, 2000), max_size=60), st.integers(1, 12))
def test_id_ranges_with_a_limit_shows_the_first_runs_and_says_when_it_cut(ids, limit) -> None:
    whole = id_ranges(ids, limit=None).split(", ")
    text = id_ranges(ids, limit=limit)
    cut = len(whole) > limit
    assert text.endswith(" ...") == cut
    assert text.removesuffix(" ...").split(", ") == whole[:limit]


@st.composite
def _loads(draw):
    first = draw(st.integers(0, 64))
    n = draw(st.integers(1, 12))
    required = frozenset(draw(st.sets(st.sampled_from(PAIRS), min_size=1)))
    writes = draw(
        st.lists(
            st.tuples(
                st.integers(-2, n + 2),
                st.sampled_from(c.PROJECTIONS),
                st.sampled_from([c.PACKED, c.SCALE, None]),
            ),
            max_size=80,
        )
    )
    return list(range(first, first + n)), required, writes


@given(_loads(), st.booleans())
def test_missing_is_required_minus_received_per_local_expert(load, converted) -> None:
    gids, required, writes = load
    ledger = c.ExpertLedger("model.layers.3.mlp.experts", gids, required)
    for slot, proj, kind in writes:
        ledger.record(slot, proj, kind)
    got = {(p, k, e) for (p, k), ids in ledger.missing().items() for e in ids}
    done = {(s, p, k) for s, p, k in writes if k is not None and 0 <= s < len(gids)}
    want = {(p, k, gids[s]) for s in range(len(gids)) for p, k in required if (s, p, k) not in done}
    assert got == want
    parts = c.missing_parts(ledger, converted)
    flat = {(part, e) for part, ids in parts.items() for e in ids}
    assert flat == {(c.checkpoint_part(p, k, converted), e) for p, k, e in want}
    report = c.incomplete_report([ledger], converted)
    assert (report is None) == (not want)


def test_converted_checkpoints_name_w31_for_either_half() -> None:
    assert c.checkpoint_part("w1", c.PACKED, True) == "w31.weight_packed"
    assert c.checkpoint_part("w3", c.SCALE, True) == "w31.weight_scale"
    assert c.checkpoint_part("w1", c.PACKED, False) == "w1.weight_packed"
    assert c.checkpoint_part("w2", c.SCALE, True) == "w2.weight_scale"


def test_kind_of_loader_buffer_names() -> None:
    assert c.kind_of("model.layers.0.mlp.experts.w13_weight") == c.PACKED
    assert c.kind_of("model.layers.0.mlp.experts.w2_weight_scale") == c.SCALE
    assert c.kind_of("experts.0.w2.weight_packed") == c.PACKED
    assert c.kind_of("model.layers.0.mlp.experts.w13_weight_bias") is None
    assert c.kind_of("model.layers.0.mlp.experts.w2_input_scale") is None


def test_the_report_is_one_message_for_many_layers() -> None:
    ledgers = [
        c.ExpertLedger(f"model.layers.{i}.mlp.experts", [0, 1], frozenset(PAIRS)) for i in range(12)
    ]
    report = c.incomplete_report(ledgers, converted=True, max_layers=3)
    assert report is not None and report.count("\n") < 20  # bounded, not one line per layer

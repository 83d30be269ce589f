"""`workers.engine.packing.layout`: every datum once, within the budget, one segment per slot and pass."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from workers.engine.packing import layout

ITEMS = st.lists(
    st.tuples(st.integers(0, 5), st.lists(st.integers(1, 40), min_size=1, max_size=6)),
    min_size=1,
    max_size=8,
)


@settings(max_examples=300, deadline=None)
@given(items=ITEMS, budget=st.integers(1, 200), pack=st.booleans())
def test_layout_invariants(items: list[tuple[int, list[int]]], budget: int, pack: bool) -> None:
    passes = layout(items, budget, pack=pack)
    seen = [piece for one in passes for piece in one.pieces()]
    expected = {(i, d) for i, (_, lengths) in enumerate(items) for d in range(len(lengths))}
    assert sorted((p.item, p.datum) for p in seen) == sorted(expected)  # each exactly once
    for one in passes:
        assert one.cost <= budget or len(one.pieces()) == 1
        slots_here = [slot for slot, _, _ in one.segments]
        assert len(slots_here) == len(set(slots_here))  # one segment per slot and pass
        position = 0
        for slot, start, stop in one.segments:
            assert start == position and stop > start
            position = stop
            for row in one.rows[start:stop]:
                assert all(items[p.item][0] == slot for p in row)
        assert position == len(one.rows)
        for index, row in enumerate(one.rows):
            assert row, "no empty row"
            end = 0
            for piece in row:
                assert piece.row == index and piece.offset >= end
                assert piece.length == items[piece.item][1][piece.datum]
                end = piece.offset + piece.length
            assert end <= one.width
            if not pack:
                assert len(row) == 1


def test_short_sequences_share_rows_when_packed() -> None:
    [packed] = layout([(0, [8, 3, 3, 2])], budget=64, pack=True)
    assert len(packed.rows) == 2 and packed.width == 8  # [8] and [3, 3, 2]
    [padded] = layout([(0, [8, 3, 3, 2])], budget=64, pack=False)
    assert len(padded.rows) == 4 and padded.cost == 32


def test_a_call_over_the_budget_splits_and_a_long_datum_runs_alone() -> None:
    passes = layout([(0, [4, 4, 4]), (1, [50]), (2, [4])], budget=8, pack=False)
    assert [len(p.pieces()) for p in passes] == [2, 1, 1, 1]
    assert passes[2].width == 50 and passes[2].segments == [(1, 0, 1)]

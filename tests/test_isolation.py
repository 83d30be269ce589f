"""Bisection (`workers.engine.isolation`) on plain values: a fake batch runner that fails whenever a
poisoned item is in its group. Only poisoned items fail, each with its own error (category kept)
or a server error naming it; every other item's result equals running it alone; the number of
calls stays within 1 + 2·k·⌈log2 n⌉ for k poisoned items among n."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.errors import ErrorCategory, ServerError, TwinkleError, UserError
from workers.engine.isolation import isolate


@dataclass(frozen=True)
class Item:
    request_id: str
    value: int
    poison: str | None = None  # None, "user" (raises UserError) or "crash" (raises RuntimeError)


class FakeRunner:
    """Results are pure functions of each item; a group with any poisoned item raises."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, group: list[Item]) -> list[int]:
        self.calls.append([item.request_id for item in group])
        for item in group:
            if item.poison == "user":
                raise UserError(f"bad value {item.value}")
            if item.poison == "crash":
                raise RuntimeError(f"crash on {item.value}")
        return [solo(item) for item in group]


def solo(item: Item) -> int:
    return 3 * item.value + 1


items_strategy = st.lists(
    st.tuples(st.integers(-1000, 1000), st.sampled_from([None, None, None, "user", "crash"])),
    max_size=64,
).map(
    lambda pairs: [
        Item(f"req-{index}", value, poison) for index, (value, poison) in enumerate(pairs)
    ]
)


@given(items_strategy)
def test_only_poisoned_items_fail_and_calls_are_bounded(items: list[Item]) -> None:
    runner = FakeRunner()
    results = isolate(runner, items, describe=lambda item: item.request_id)

    assert len(results) == len(items)
    for item, result in zip(items, results, strict=True):
        if item.poison is None:
            assert result == solo(item)
        elif item.poison == "user":
            assert isinstance(result, UserError) and result.category == ErrorCategory.USER
            assert result.message == f"bad value {item.value}"
        else:
            assert isinstance(result, ServerError) and result.category == ErrorCategory.SERVER
            assert item.request_id in result.message and "crash" not in result.message
    n, k = len(items), sum(item.poison is not None for item in items)
    if n == 0:
        assert runner.calls == []
    elif k == 0:
        assert len(runner.calls) == 1
    else:
        assert len(runner.calls) <= 1 + 2 * k * math.ceil(math.log2(n))
    # Every poisoned item was run alone exactly once before it was blamed.
    alone = [call[0] for call in runner.calls if len(call) == 1]
    for item in items:
        if item.poison is not None:
            assert alone.count(item.request_id) == 1


def test_errors_returned_per_item_pass_through() -> None:
    """A runner that fails one item itself (the engine's non-finite loss) is not bisected."""
    error = UserError("loss is not finite")
    calls: list[list[int]] = []

    def run(group: list[int]) -> list[int | TwinkleError]:
        calls.append(group)
        return [error if value == 2 else value for value in group]

    assert isolate(run, [1, 2, 3], describe=str) == [1, error, 3]
    assert calls == [[1, 2, 3]]


def test_a_fault_needing_two_items_fails_nobody() -> None:
    def run(group: list[int]) -> list[int]:
        if 1 in group and 2 in group:
            raise RuntimeError("only together")
        return group

    assert isolate(run, [1, 2], describe=str) == [1, 2]


def test_a_crashing_culprit_is_logged_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def run(group: list[str]) -> list[str]:
        if "req-bad" in group:
            raise RuntimeError("device fault")
        return group

    with caplog.at_level(logging.INFO, logger="workers.engine.isolation"):
        results = isolate(run, ["req-1", "req-bad", "req-2"], describe=str)
    assert results[0] == "req-1" and results[2] == "req-2"
    assert isinstance(results[1], ServerError) and "req-bad" in results[1].message
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "req-bad" in record.getMessage() and record.exc_info is not None

"""Fault isolation by bisection: when a batch fails as a whole, find the items that make it fail.

Job: `isolate(run, items, describe=...)` calls `run(items)`. If that raises, the items are run
again in two halves, each half recursively, until every failing item is alone. An item that
fails alone gets an error: the `TwinkleError` it raised, category kept, or for any other
exception a `ServerError` naming the request (the traceback goes to the log, never to the
client). Every other item gets its result from the call it last ran in.

Pure: no torch, no I/O but logging; the service runs it on the engine thread around one engine
transaction at a time (`Engine.sub_calls`).

What `run` must guarantee:
- a call that raises has changed nothing, so re-running its items is safe (the engine's passes
  and steps are transactions);
- an item's result does not depend on which other items share its call (the pass's loss is the
  sum of per-tenant losses; the fused step is per slot), so a result from a half is the result.

Cost: with k culprits among n items, at most 1 + 2·k·⌈log2 n⌉ calls; one call when nothing
fails. A fault that needs two items together (neither fails alone) fails nobody: both halves
succeed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

from protocol.errors import ServerError, TwinkleError

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


def isolate(
    run: Callable[[list[T]], Sequence[R]],
    items: Sequence[T],
    *,
    describe: Callable[[T], str],
) -> list[R | TwinkleError]:
    """`run(items)`'s results, with the items that make it raise failed alone; see the module.

    `run` returns one result per item, in order. `describe(item)` names an item's request in
    logs and in the `ServerError` of a culprit whose exception was not a `TwinkleError`.
    """
    results: dict[int, R | TwinkleError] = {}

    def attempt(indices: list[int]) -> None:
        group = [items[index] for index in indices]
        try:
            outputs = run(group)
        except Exception as error:  # a batch boundary: bisect, or report the culprit
            if len(indices) == 1:
                results[indices[0]] = _culprit_error(group[0], error, describe)
                return
            log.warning(
                "a group of %d requests failed (%s: %s); re-running it in halves: %s",
                len(indices),
                type(error).__name__,
                error,
                ", ".join(describe(item) for item in group),
            )
            middle = len(indices) // 2
            attempt(indices[:middle])
            attempt(indices[middle:])
            return
        if len(outputs) != len(indices):
            raise ValueError(f"run returned {len(outputs)} results for {len(indices)} items")
        results.update(zip(indices, outputs, strict=True))

    if items:
        attempt(list(range(len(items))))
    return [results[index] for index in range(len(items))]


def _culprit_error(item: T, error: Exception, describe: Callable[[T], str]) -> TwinkleError:
    """The error an item that fails alone reports: its own if ours, else a `ServerError`."""
    name = describe(item)
    if isinstance(error, TwinkleError):
        log.info("request %s failed alone: %s (%s)", name, error.message, error.category.value)
        return error
    log.error("request %s failed alone", name, exc_info=error)
    return ServerError(f"the worker failed while running request {name}; see the worker log")

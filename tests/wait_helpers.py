"""Waiting for a condition a test cannot be told about (a process restarted, a message seen by
a service): poll it until it holds, and fail with what was awaited once a deadline passes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `condition` every 50 ms until it holds; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.05)


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    """Await `check()` every 20 ms until it is true; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)

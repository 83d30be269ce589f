"""Pure views of a tenant's usage per UTC day and per training run, priced at the operator's
prices: `usage_view` builds the answer of `GET /api/v1/usage` (and of the operator's view of any
tenant) from records `usage_routes` read; `price_change` applies an operator's change to the
price list.

Where the numbers come from:
- per day: the hourly usage history the billing API reads (`twinkle_async/usage_history.py`):
  all of the tenant's work on every worker (training, forward passes, sampling), by the hour a
  worker flushed its counters;
- per run: the run's metric history (`protocol/metric_history.py`): one entry per finished
  pass or step, with the pass's tokens, by the UTC day it finished. Sampling belongs to sampling
  sessions, not to runs, so a run costs its training and forward passes only;
- a cost is `tokens / 1e6 * price`, summed over the kinds, at the prices in force when asked
  (not when the work ran).

Invariants: days are UTC, oldest first, every day of the window listed (zeros too); at most
`MAX_RUNS` runs are read, the most recently active first (loaded runs, newest first, then the
others by when they were unloaded), and `runs_truncated` says when some were left out.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import date, timedelta
from typing import Annotated, Any

import msgspec

from protocol.errors import UserError
from protocol.metric_history import MetricEntry
from protocol.records import PriceList, RunRecord, UsageHistory
from twinkle_async.usage_history import hourly_usage

DAY_S = 24 * 3600
DEFAULT_DAYS = 7
MAX_DAYS = 14  # the hourly history keeps 15 days (`usage_history.MAX_HOURS`)
MAX_RUNS = 50  # runs whose metric history one answer reads
MAX_PRICE = 1e6  # per million tokens, in any currency
PER_TOKENS = 1_000_000
PRICE_KINDS = ("train", "forward", "sample")
# an op still running when its run was unloaded finishes after it: a run unloaded this long
# before the window began has no entry in it
UNLOAD_GRACE_S = 3600.0
_EPOCH = date(1970, 1, 1)

Price = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_PRICE)]
Currency = Annotated[str, msgspec.Meta(pattern="^[A-Z]{1,8}$")]


class PriceChange(msgspec.Struct, forbid_unknown_fields=True):
    """The body of `PUT /admin/v1/prices`: prices per million tokens (0 to 1e6) and a currency
    code (1 to 8 capital letters); the fields given change, the others keep their value."""

    currency: Currency | msgspec.UnsetType = msgspec.UNSET
    train: Price | msgspec.UnsetType = msgspec.UNSET
    forward: Price | msgspec.UnsetType = msgspec.UNSET
    sample: Price | msgspec.UnsetType = msgspec.UNSET


def price_change(current: PriceList, change: PriceChange) -> PriceList:
    """`current` with every field `change` gives."""
    given = {
        name: getattr(change, name)
        for name in ("currency", *PRICE_KINDS)
        if getattr(change, name) is not msgspec.UNSET
    }
    return msgspec.structs.replace(current, **given)


def prices_view(prices: PriceList) -> dict[str, Any]:
    """The price list as `GET /admin/v1/prices` answers it (and `PUT` takes it back)."""
    return {"currency": prices.currency, **{kind: getattr(prices, kind) for kind in PRICE_KINDS}}


def days_param(raw: str | None) -> int:
    """`days`: how many UTC days, today included (1 to `MAX_DAYS`, `DEFAULT_DAYS` if absent)."""
    if raw is None:
        return DEFAULT_DAYS
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 2) or not 1 <= int(raw) <= MAX_DAYS:
        raise UserError(
            f"query parameter days: {raw[:20]!r} is not a whole number in 1..{MAX_DAYS}"
        )
    return int(raw)


# -- the window ---------------------------------------------------------------------------------


def day_of(ts: float) -> int:
    """The UTC day (days since the epoch) a Unix time falls in."""
    return int(ts // DAY_S)


def day_name(day: int) -> str:
    """A UTC day as `YYYY-MM-DD`."""
    return (_EPOCH + timedelta(days=day)).isoformat()


@dataclass(frozen=True)
class Window:
    """The UTC days `first_day..last_day` (both included): the last `days` days up to today."""

    first_day: int
    last_day: int

    @classmethod
    def ending(cls, now: float, days: int) -> Window:
        today = day_of(now)
        return cls(today - days + 1, today)

    @property
    def days(self) -> range:
        return range(self.first_day, self.last_day + 1)

    @property
    def start_s(self) -> float:
        return float(self.first_day * DAY_S)


def cost(prices: PriceList, *, trained: int = 0, forward: int = 0, sampled: int = 0) -> float:
    """What the tokens of each kind cost at `prices`."""
    return (
        trained / PER_TOKENS * prices.train
        + forward / PER_TOKENS * prices.forward
        + sampled / PER_TOKENS * prices.sample
    )


# -- per day ------------------------------------------------------------------------------------


def daily_usage(
    histories: Iterable[UsageHistory], prices: PriceList, window: Window
) -> list[dict[str, Any]]:
    """The tenant's tokens of each kind and their cost, a row per day of `window`."""
    counted: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for history in histories:
        for usage in hourly_usage(history):
            day = usage.hour // 24
            if window.first_day <= day <= window.last_day:
                for name in ("tokens_trained", "tokens_forward", "sampled_tokens"):
                    counted[day][name] += usage.counts[name]
    rows = []
    for day in window.days:
        trained = counted[day]["tokens_trained"]
        forward = counted[day]["tokens_forward"]
        sampled = counted[day]["sampled_tokens"]
        rows.append(
            {
                "day": day_name(day),
                "tokens_trained": trained,
                "tokens_forward": forward,
                "sampled_tokens": sampled,
                "cost": cost(prices, trained=trained, forward=forward, sampled=sampled),
            }
        )
    return rows


# -- per run ------------------------------------------------------------------------------------


def runs_to_read(
    runs: Iterable[RunRecord], window: Window, max_runs: int = MAX_RUNS
) -> tuple[list[RunRecord], bool]:
    """The runs whose history may hold entries in `window`, at most `max_runs` of them, the most
    recently active first; and whether some were left out.

    A run unloaded well before the window began (its later calls are refused) and a run made by
    `copy_weights` (never trained) have none, so they are not read.
    """
    candidates = [
        run
        for run in runs
        if not run.copied_from
        and (run.unloaded_at is None or run.unloaded_at >= window.start_s - UNLOAD_GRACE_S)
    ]

    def activity(run: RunRecord) -> tuple[int, float]:
        if run.unloaded_at is None:
            return (1, max(run.created_at, run.last_request_time))
        return (0, run.unloaded_at)

    candidates.sort(key=activity, reverse=True)
    return candidates[:max_runs], len(candidates) > max_runs


def run_usage(
    run: RunRecord, entries: Iterable[MetricEntry], prices: PriceList, window: Window
) -> dict[str, Any]:
    """One run's tokens, optimizer steps and cost in `window`, in all and per day."""
    counted: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for entry in entries:
        day = day_of(entry.time)
        if not window.first_day <= day <= window.last_day:
            continue
        if entry.kind == "forward_backward":
            counted[day]["tokens_trained"] += entry.tokens
        elif entry.kind == "forward":
            counted[day]["tokens_forward"] += entry.tokens
        else:
            counted[day]["optim_steps"] += 1
    days = []
    for day in window.days:
        trained = counted[day]["tokens_trained"]
        forward = counted[day]["tokens_forward"]
        days.append(
            {
                "day": day_name(day),
                "tokens_trained": trained,
                "tokens_forward": forward,
                "optim_steps": counted[day]["optim_steps"],
                "cost": cost(prices, trained=trained, forward=forward),
            }
        )
    totals = {
        name: sum(counted[day][name] for day in window.days)
        for name in ("tokens_trained", "tokens_forward", "optim_steps")
    }
    return {
        "run_id": run.model_id,
        "base_model": run.base_model,
        **totals,
        "cost": cost(prices, trained=totals["tokens_trained"], forward=totals["tokens_forward"]),
        "days": days,
    }


def usage_view(
    tenant_id: str,
    prices: PriceList,
    histories: Iterable[UsageHistory],
    runs: Iterable[tuple[RunRecord, list[MetricEntry]]],
    window: Window,
    runs_truncated: bool,
) -> dict[str, Any]:
    """The answer of `GET /api/v1/usage`: the prices, the tenant's days and its runs' usage
    (`runs` in the order `runs_to_read` chose them, each with its metric history)."""
    return {
        "tenant": tenant_id,
        "currency": prices.currency,
        "prices": {kind: getattr(prices, kind) for kind in PRICE_KINDS},
        "days": daily_usage(histories, prices, window),
        "runs": [run_usage(run, entries, prices, window) for run, entries in runs],
        "runs_truncated": runs_truncated,
    }

"""Usage per day and per run, priced (`twinkle_async/gateway/usage_views.py`): pure, on records
built here."""

from __future__ import annotations

import msgspec
import pytest

from protocol import api, metric_history
from protocol.errors import UserError
from protocol.metric_history import MetricEntry
from protocol.records import PriceList, RunRecord, UsageHistory, UsageRecord
from twinkle_async.gateway import usage_views as views

DAY = views.DAY_S
TODAY = 20_000  # a UTC day number: 2024-10-04
NOW = TODAY * DAY + 15 * 3600.0  # 15:00 UTC that day
PRICES = PriceList(currency="EUR", train=2.0, forward=0.5, sample=8.0)


def _run(model_id: str, **fields: object) -> RunRecord:
    base = {
        "model_id": model_id,
        "tenant_id": "acme",
        "session_id": "s",
        "base_model": "tiny",
        "lora": api.LoraConfig(rank=4),
        "created_at": (TODAY - 30) * DAY,
        "last_request_time": (TODAY - 30) * DAY,
    }
    return RunRecord(**{**base, **fields})  # type: ignore[arg-type]


def _entry(kind: metric_history.Kind, time: float, tokens: int = 0) -> MetricEntry:
    return MetricEntry(step=0, kind=kind, time=time, metrics={}, tokens=tokens)


def test_the_window_is_the_last_n_utc_days_today_included() -> None:
    window = views.Window.ending(NOW, 3)
    assert list(window.days) == [TODAY - 2, TODAY - 1, TODAY]
    assert window.start_s == (TODAY - 2) * DAY
    assert views.day_name(TODAY) == "2024-10-04" and views.day_name(0) == "1970-01-01"
    assert list(views.Window.ending(TODAY * DAY, 1).days) == [TODAY]  # midnight is today
    assert list(views.Window.ending(TODAY * DAY - 0.001, 1).days) == [TODAY - 1]


def test_days_count_each_kind_of_the_hourly_history_and_price_it() -> None:
    def at(ts: float, trained: int, forward: int, sampled: int) -> UsageRecord:
        return UsageRecord(
            "acme",
            "w1",
            tokens_trained=trained,
            tokens_forward=forward,
            sampled_tokens=sampled,
            optim_steps=trained // 10,
            updated_at=ts,
        )

    history = UsageHistory(
        "acme",
        "w1",
        snapshots=[
            at((TODAY - 5) * DAY + 60, 1_000, 0, 0),  # before the window: only a baseline
            at((TODAY - 2) * DAY + 60, 4_000, 500, 0),  # the window's first minute
            at((TODAY - 2) * DAY + 23 * 3600, 5_000, 500, 100),
            at(TODAY * DAY + 3600, 5_000, 1_500, 2_100),
        ],
    )
    other_worker = UsageHistory(
        "acme", "w2", snapshots=[UsageRecord("acme", "w2", tokens_trained=7, updated_at=NOW)]
    )
    days = views.daily_usage([history, other_worker], PRICES, views.Window.ending(NOW, 3))
    assert [d["day"] for d in days] == ["2024-10-02", "2024-10-03", "2024-10-04"]
    assert [(d["tokens_trained"], d["tokens_forward"], d["sampled_tokens"]) for d in days] == [
        (4_000, 500, 100),
        (0, 0, 0),
        (7, 1_000, 2_000),
    ]
    assert days[0]["cost"] == pytest.approx(4_000 / 1e6 * 2.0 + 500 / 1e6 * 0.5 + 100 / 1e6 * 8.0)
    assert days[1]["cost"] == 0
    assert days[2]["cost"] == pytest.approx(7 / 1e6 * 2.0 + 1_000 / 1e6 * 0.5 + 2_000 / 1e6 * 8.0)
    # no prices set: everything costs nothing
    assert all(
        d["cost"] == 0
        for d in views.daily_usage([history], PriceList(), views.Window.ending(NOW, 3))
    )


def test_a_runs_usage_sums_its_entries_by_kind_and_day_within_the_window() -> None:
    window = views.Window.ending(NOW, 2)
    entries = [
        _entry("forward_backward", window.start_s - 0.001, 999),  # the day before: out
        _entry("forward_backward", window.start_s, 100),  # the window's first instant: in
        _entry("optim_step", window.start_s + 10),
        _entry("forward", window.start_s + 20, 40),
        _entry("forward_backward", NOW, 300),
        _entry("forward_backward", (TODAY + 1) * DAY - 0.001, 5),  # today's last instant: in
        _entry("optim_step", NOW + 1),
        _entry("forward_backward", (TODAY + 1) * DAY, 777),  # tomorrow (a clock ahead): out
    ]
    usage = views.run_usage(_run("run-a"), entries, PRICES, window)
    assert (usage["run_id"], usage["base_model"]) == ("run-a", "tiny")
    assert (usage["tokens_trained"], usage["tokens_forward"], usage["optim_steps"]) == (405, 40, 2)
    assert usage["cost"] == pytest.approx(405 / 1e6 * 2.0 + 40 / 1e6 * 0.5)
    assert [
        (d["day"], d["tokens_trained"], d["tokens_forward"], d["optim_steps"])
        for d in usage["days"]
    ] == [("2024-10-03", 100, 40, 1), ("2024-10-04", 305, 0, 1)]
    assert usage["days"][1]["cost"] == pytest.approx(305 / 1e6 * 2.0)


def test_an_entry_written_before_tokens_were_kept_counts_no_tokens() -> None:
    old = msgspec.json.encode(
        {"step": 3, "kind": "forward_backward", "time": NOW, "metrics": {"loss:sum": 1.5}}
    )
    entry = metric_history.decode(old)
    assert entry.tokens == 0
    stepped = metric_history.decode(
        msgspec.json.encode({"step": 4, "kind": "optim_step", "time": NOW, "metrics": {}})
    )
    usage = views.run_usage(_run("old"), [entry, stepped], PRICES, views.Window.ending(NOW, 1))
    assert (usage["tokens_trained"], usage["optim_steps"], usage["cost"]) == (0, 1, 0)


def test_runs_read_are_capped_the_most_recently_active_first() -> None:
    window = views.Window.ending(NOW, 7)
    loaded_old = _run("loaded-old")
    loaded_new = _run("loaded-new", created_at=NOW - 60, last_request_time=NOW - 60)
    unloaded_in = _run("unloaded-in", unloaded_at=window.start_s + 5)
    unloaded_late = _run("unloaded-late", unloaded_at=NOW - 5)
    # unloaded within the grace before the window: an op in flight may have finished in it
    unloaded_grace = _run("unloaded-grace", unloaded_at=window.start_s - 60)
    unloaded_before = _run("unloaded-before", unloaded_at=window.start_s - views.UNLOAD_GRACE_S - 1)
    copied = _run("copied", unloaded_at=NOW, copied_from="tinker://x/weights/y")
    runs = [loaded_old, unloaded_in, copied, unloaded_before, unloaded_grace, loaded_new]
    runs.append(unloaded_late)
    chosen, truncated = views.runs_to_read(runs, window)
    assert [run.model_id for run in chosen] == [
        "loaded-new",
        "loaded-old",
        "unloaded-late",
        "unloaded-in",
        "unloaded-grace",
    ]
    assert not truncated
    chosen, truncated = views.runs_to_read(runs, window, max_runs=5)
    assert len(chosen) == 5 and not truncated
    chosen, truncated = views.runs_to_read(runs, window, max_runs=2)
    assert [run.model_id for run in chosen] == ["loaded-new", "loaded-old"] and truncated
    many = [
        _run(f"r{i}", created_at=float(i), last_request_time=float(i))
        for i in range(views.MAX_RUNS + 1)
    ]
    chosen, truncated = views.runs_to_read(many, window)
    assert len(chosen) == views.MAX_RUNS and truncated
    assert "r0" not in {run.model_id for run in chosen}


def test_the_answer_holds_prices_days_and_runs() -> None:
    window = views.Window.ending(NOW, 1)
    answer = views.usage_view(
        "acme",
        PRICES,
        [],
        [(_run("run-a"), [_entry("forward_backward", NOW, 1_000_000)])],
        window,
        runs_truncated=True,
    )
    assert answer["currency"] == "EUR"
    assert answer["prices"] == {"train": 2.0, "forward": 0.5, "sample": 8.0}
    assert answer["days"] == [
        {
            "day": "2024-10-04",
            "tokens_trained": 0,
            "tokens_forward": 0,
            "sampled_tokens": 0,
            "cost": 0.0,
        }
    ]
    [run] = answer["runs"]
    assert run["tokens_trained"] == 1_000_000 and run["cost"] == 2.0
    assert answer["runs_truncated"] is True and answer["tenant"] == "acme"
    assert api.decode(api.encode(answer), dict) == answer  # plain JSON


@pytest.mark.parametrize("raw", ["1", "7", "14", "03"])
def test_days_in_range_are_taken(raw: str) -> None:
    assert views.days_param(raw) == int(raw)
    assert views.days_param(None) == views.DEFAULT_DAYS


@pytest.mark.parametrize("raw", ["0", "15", "-1", "+3", "1.5", "", " 7", "abc", "७", "1e1", "999"])
def test_days_out_of_range_or_not_a_number_are_refused(raw: str) -> None:
    with pytest.raises(UserError, match="query parameter days"):
        views.days_param(raw)


def test_a_price_change_sets_only_the_fields_it_gives() -> None:
    current = PriceList(currency="USD", train=1.0, forward=2.0, sample=3.0)
    change = api.decode(b'{"train": 4, "currency": "EUR"}', views.PriceChange)
    assert views.price_change(current, change) == PriceList("EUR", 4.0, 2.0, 3.0)
    assert views.price_change(current, api.decode(b"{}", views.PriceChange)) == current
    top = api.decode(b'{"sample": 1000000, "forward": 0}', views.PriceChange)
    assert views.price_change(current, top) == PriceList("USD", 1.0, 0.0, 1e6)
    assert views.prices_view(current) == {
        "currency": "USD",
        "train": 1.0,
        "forward": 2.0,
        "sample": 3.0,
    }


@pytest.mark.parametrize(
    "body",
    [
        b'{"train": -1}',
        b'{"train": -0.000001}',
        b'{"forward": 1000000.5}',
        b'{"sample": 1e400}',
        b'{"train": NaN}',
        b'{"train": Infinity}',
        b'{"train": "NaN"}',
        b'{"train": "1"}',
        b'{"train": null}',
        b'{"train": true}',
        b'{"train": [1]}',
        b'{"price": 1}',
        b'{"currency": "usd"}',
        b'{"currency": ""}',
        b'{"currency": "ABCDEFGHI"}',
        b'{"currency": "US D"}',
        b'{"currency": 840}',
        b"[]",
        b"not json",
    ],
)
def test_a_bad_price_change_is_refused(body: bytes) -> None:
    with pytest.raises(UserError, match="invalid PriceChange body"):
        api.decode(body, views.PriceChange)

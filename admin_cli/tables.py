"""What people see: the admin API's JSON answers as `rich` tables and field lists.

Pure functions from an answer (the decoded JSON of one call) to a renderable; nothing here does
I/O. Every value is shown as plain `Text`, so a label like `[red]` is printed, not styled.
Missing values are `-`; times are UTC; sizes are in binary units.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

LIMIT_NAMES = (
    "max_adapters",
    "max_rank",
    "max_tokens_per_request",
    "tokens_per_minute",
    "max_concurrent_samples",
    "max_checkpoint_bytes",
)
"""The per-tenant limits `PUT /admin/v1/quotas/{tenant}` accepts, in the API's order."""


# -- cells --------------------------------------------------------------------------------------


def when(ts: float | None) -> str:
    """An epoch time as `YYYY-MM-DD HH:MM:SSZ`, or `-`."""
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def ago(ts: float | None, now: float | None = None) -> str:
    """How long ago an epoch time was: `4.2 s ago`, `3 min ago`."""
    if ts is None:
        return "-"
    age_s = (time.time() if now is None else now) - ts
    if age_s < 120:
        return f"{age_s:.1f} s ago"
    if age_s < 7200:
        return f"{age_s / 60:.0f} min ago"
    return f"{age_s / 3600:.1f} h ago"


def size(n_bytes: int | None) -> str:
    """A byte count for people: `512 B`, `1.5 KiB`, `3.0 GiB`."""
    if n_bytes is None:
        return "-"
    value = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n_bytes} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def yes_no(flag: Any) -> str:
    return "yes" if flag else "no"


def _cell(value: Any) -> Text:
    return Text("-" if value is None or value == "" else str(value))


# -- building blocks ----------------------------------------------------------------------------


def table(
    title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]], empty: str
) -> RenderableType:
    """A table with a title; `empty` (one line) when there are no rows."""
    shown = list(rows)
    if not shown:
        return Text(empty)
    grid = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for name in columns:
        grid.add_column(name, overflow="fold")
    for row in shown:
        grid.add_row(*(_cell(v) for v in row))
    return grid


def fields(title: str, pairs: Iterable[tuple[str, Any]]) -> RenderableType:
    """A titled list of `name  value` lines."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column(overflow="fold")
    for name, value in pairs:
        grid.add_row(Text(name), _cell(value))
    return Group(Text(title, style="bold underline"), grid, Text(""))


# -- tenants, keys, quotas, usage ---------------------------------------------------------------


def tenants(data: dict[str, Any]) -> RenderableType:
    rows = [
        (
            t["name"],
            t.get("display_name"),
            t.get("keys"),
            when(t.get("created_at")),
            yes_no(t.get("bootstrap")),
        )
        for t in data["tenants"]
    ]
    columns = ("name", "display name", "live keys", "created", "bootstrap")
    return table("tenants", columns, rows, "no tenants")


def tenant(data: dict[str, Any]) -> RenderableType:
    """`GET /tenants/{name}`: the tenant, its limits, its usage and its keys."""
    info = data["tenant"]
    return Group(
        fields(
            f"tenant {info['name']}",
            [
                ("display name", info.get("display_name")),
                ("created", when(info.get("created_at"))),
                ("bootstrap", yes_no(info.get("bootstrap", False))),
            ],
        ),
        quotas(data["quotas"]),
        Text(""),
        usage({"usage": [data["usage"]]}),
        Text(""),
        keys({"keys": data["keys"]}),
    )


def key_rows(rows: Iterable[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [
        (
            k["key_id"],
            k["tenant"],
            f"{k['prefix']}...",
            k.get("label"),
            when(k.get("created_at")),
            when(k.get("revoked_at")) if k.get("revoked_at") else "live",
        )
        for k in rows
    ]


def keys(data: dict[str, Any]) -> RenderableType:
    """Keys by prefix and label: the API never returns a key after it is created."""
    return table(
        "keys",
        ("key_id", "tenant", "prefix", "label", "created", "revoked"),
        key_rows(data["keys"]),
        "no keys",
    )


def quotas(data: dict[str, Any]) -> RenderableType:
    """A tenant's limits in force: each an override of its own or the cluster's default."""
    limits, overrides = data["limits"], data["overrides"]
    names = [n for n in LIMIT_NAMES if n in limits] + [n for n in limits if n not in LIMIT_NAMES]
    rows = [
        (
            name,
            "unlimited" if limits[name] is None else limits[name],
            "override" if name in overrides else "default",
        )
        for name in names
    ]
    return table(f"quotas of {data['tenant']}", ("limit", "value", "source"), rows, "no limits")


USAGE_COLUMNS = (
    ("tokens_trained", "tokens trained"),
    ("tokens_forward", "tokens forward"),
    ("forward_backward_requests", "fwd/bwd requests"),
    ("optim_steps", "optim steps"),
    ("samples", "samples"),
    ("sampled_tokens", "sampled tokens"),
    ("active_adapters", "active adapters"),
    ("runs", "runs"),
)


def usage(data: dict[str, Any]) -> RenderableType:
    rows = [
        (
            u["tenant"],
            *(u.get(name) for name, _ in USAGE_COLUMNS),
            size(u.get("checkpoint_bytes")),
        )
        for u in data["usage"]
    ]
    columns = ("tenant", *(title for _, title in USAGE_COLUMNS), "checkpoints")
    return table("usage", columns, rows, "no usage")


# -- prices and usage per day and per run -------------------------------------------------------

PRICE_KINDS = (("train", "trained"), ("forward", "forward-only"), ("sample", "sampled"))


def prices(data: dict[str, Any]) -> RenderableType:
    """The price list: a currency and, per kind of token, a price per million."""
    return fields(
        f"prices ({data['currency']} per million tokens)",
        [(f"{title} tokens", _amount(data[kind])) for kind, title in PRICE_KINDS],
    )


def _amount(value: float) -> str:
    return f"{value:.6g}" if value < 0.01 else f"{value:,.2f}"


def tenant_usage(data: dict[str, Any]) -> RenderableType:
    """`GET /tenants/{name}/usage`: the tenant's days, then its runs, each with its cost."""
    currency = data["currency"]
    days = table(
        f"usage of {data['tenant']} per day (UTC)",
        ("day", "tokens trained", "tokens forward", "sampled tokens", f"cost ({currency})"),
        [
            (
                d["day"],
                d["tokens_trained"],
                d["tokens_forward"],
                d["sampled_tokens"],
                _amount(d["cost"]),
            )
            for d in data["days"]
        ],
        "no days",
    )
    runs = table(
        (
            f"runs (the {len(data['runs'])} most recently active; the others were not read)"
            if data.get("runs_truncated")
            else "runs"
        ),
        (
            "run_id",
            "base model",
            "tokens trained",
            "tokens forward",
            "optim steps",
            f"cost ({currency})",
        ),
        [
            (
                r["run_id"],
                r["base_model"],
                r["tokens_trained"],
                r["tokens_forward"],
                r["optim_steps"],
                _amount(r["cost"]),
            )
            for r in data["runs"]
        ],
        "no runs",
    )
    return Group(days, Text(""), runs)


# -- runs, checkpoints, sessions ----------------------------------------------------------------


def _run_state(run: dict[str, Any]) -> str:
    if run.get("corrupted"):
        return "corrupted"
    return "unloaded" if run.get("unloaded_at") is not None else "loaded"


def runs(data: dict[str, Any], title: str = "runs") -> RenderableType:
    rows = [
        (
            r["model_id"],
            r["tenant_id"],
            r["base_model"],
            (r.get("lora") or {}).get("rank"),
            _run_state(r),
            when(r.get("created_at")),
            ago(r.get("last_request_time")),
            r["session_id"],
        )
        for r in data["runs"]
    ]
    columns = ("run_id", "tenant", "base model", "rank", "state", "created", "last request")
    return table(title, (*columns, "session"), rows, "no runs")


def run(data: dict[str, Any]) -> RenderableType:
    """`GET /runs/{run_id}`: the run and its checkpoints."""
    info = data["run"]
    lora = info.get("lora") or {}
    trained = [part for part in ("unembed", "mlp", "attn") if lora.get(f"train_{part}")]
    metadata = info.get("user_metadata") or {}
    return Group(
        fields(
            f"run {info['model_id']}",
            [
                ("tenant", info["tenant_id"]),
                ("session", info["session_id"]),
                ("base model", info["base_model"]),
                ("rank", lora.get("rank")),
                ("trains", ", ".join(trained)),
                ("state", _run_state(info)),
                ("created", when(info.get("created_at"))),
                ("last request", when(info.get("last_request_time"))),
                ("unloaded", when(info.get("unloaded_at"))),
                ("metadata", ", ".join(f"{k}={v}" for k, v in metadata.items())),
            ],
        ),
        checkpoints({"checkpoints": data["checkpoints"]}),
    )


def run_metrics(data: dict[str, Any]) -> RenderableType:
    """A run's metric history: a row a request (with the tokens of a pass), a column a metric
    (the names of all rows)."""
    steps = data["steps"]
    names = sorted({name for step in steps for name in step["metrics"]})
    rows = [
        (
            step["step"],
            step["kind"],
            when(step["time"]),
            step.get("tokens") or "",
            *(_metric(step["metrics"].get(name)) for name in names),
        )
        for step in steps
    ]
    return table("metrics", ("step", "kind", "time", "tokens", *names), rows, "no metrics yet")


def _metric(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"


def checkpoints(data: dict[str, Any]) -> RenderableType:
    rows = [
        (
            c["path"],
            c.get("tenant_id"),
            c.get("kind"),
            size(c.get("size_bytes")),
            when(c.get("created_at")),
            yes_no(c.get("public")),
            when(c.get("expires_at")) if c.get("expires_at") is not None else "never",
        )
        for c in data["checkpoints"]
    ]
    columns = ("path", "tenant", "kind", "size", "created", "public", "expires")
    return table("checkpoints", columns, rows, "no checkpoints")


def checkpoint(info: dict[str, Any]) -> RenderableType:
    """One checkpoint record (the answer of publish, unpublish and ttl)."""
    expires = info.get("expires_at")
    return fields(
        f"checkpoint {info['path']}",
        [
            ("run", info.get("run_id")),
            ("tenant", info.get("tenant_id")),
            ("kind", info.get("kind")),
            ("size", size(info.get("size_bytes"))),
            ("created", when(info.get("created_at"))),
            ("public", yes_no(info.get("public"))),
            ("expires", "never" if expires is None else when(expires)),
        ],
    )


def _session_state(s: dict[str, Any]) -> str:
    if not s.get("finished"):
        return "active"
    return f"finished ({s['finish_reason']})" if s.get("finish_reason") else "finished"


def sessions(data: dict[str, Any]) -> RenderableType:
    rows = [
        (
            s["session_id"],
            s["tenant_id"],
            _session_state(s),
            when(s.get("created_at")),
            ago(s.get("last_heartbeat")),
            s.get("sdk_version"),
            ", ".join(s.get("tags") or []),
        )
        for s in data["sessions"]
    ]
    columns = ("session_id", "tenant", "state", "created", "last heartbeat", "sdk", "tags")
    return table("sessions", columns, rows, "no sessions")


def session(data: dict[str, Any]) -> RenderableType:
    """`GET /sessions/{session_id}`: the session and its runs."""
    info = data["session"]
    metadata = info.get("user_metadata") or {}
    return Group(
        fields(
            f"session {info['session_id']}",
            [
                ("tenant", info["tenant_id"]),
                ("state", _session_state(info)),
                ("created", when(info.get("created_at"))),
                ("last heartbeat", when(info.get("last_heartbeat"))),
                ("finished", when(info.get("finished_at"))),
                ("sdk", info.get("sdk_version")),
                ("tags", ", ".join(info.get("tags") or [])),
                ("metadata", ", ".join(f"{k}={v}" for k, v in metadata.items())),
            ],
        ),
        runs({"runs": data["runs"]}, title="runs of this session"),
    )


# -- workers and queues -------------------------------------------------------------------------


def workers(data: dict[str, Any]) -> RenderableType:
    rows = [
        (
            w["worker_id"],
            w["pool"],
            w["base_model"],
            w.get("role"),
            f"{w['slots_used']}/{w['slots_total']}",
            w.get("queue_depth"),
            ago(w.get("heartbeat_at")),
            "STALE" if w.get("stale") else "no",
        )
        for w in data["workers"]
    ]
    columns = ("worker", "pool", "base model", "role", "slots", "queue", "heartbeat", "stale")
    return table("workers", columns, rows, "no workers")


def queues(data: dict[str, Any]) -> RenderableType:
    """Each stream's backlog, each pool's pending jobs, and every consumer's depths."""
    streams = table(
        "streams",
        ("stream", "messages", "size", "consumers"),
        [(s["stream"], s["messages"], size(s["bytes"]), s["consumers"]) for s in data["streams"]],
        "no streams",
    )
    pools = table(
        "pools",
        ("pool", "pending"),
        [(p["pool"], p["backlog"]) for p in data["pools"]],
        "no pools",
    )
    consumers = table(
        "consumers",
        ("stream", "consumer", "pending", "ack pending", "redelivered"),
        [
            (
                c["stream"],
                c["consumer"],
                c["num_pending"],
                c["num_ack_pending"],
                c["num_redelivered"],
            )
            for c in data["consumers"]
        ],
        "no consumers",
    )
    return Group(streams, Text(""), pools, Text(""), consumers)

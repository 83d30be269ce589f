"""Pure views of a tenant's account: billing usage, stored checkpoints, audit log, session search.

Each function takes records the gateway already read (one tenant's) and the time, and builds the
SDK's response; `account_routes` does the reading and the parameter checks. What the fields mean
on this server (it has no projects, no display names, and prices no billing event):

- billing: `training` events count the tokens of forward and forward_backward passes,
  `sampling_sample` the tokens generated; prompt (prefill) tokens are not counted, so no
  `sampling_prefill` events. `checkpoint` events count the checkpoints saved in the hour that
  are still stored, `storage` events the GB-hours (10**9 bytes for an hour) held by checkpoints
  still stored. Costs and rates are never set (the operator's prices cost usage in
  `usage_views`); `user_id` and `project_id` are the tenant.
- a tenant is its own single project and its sessions' owner: both are the tenant's id.
- the audit log is derived from the records kept (sessions, training runs, sampling sessions,
  checkpoints, API keys): creations, session ends and key revocations. Deleted checkpoints and
  publications leave no trace in it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from protocol import account_api
from protocol.records import (
    CheckpointRecord,
    KeyRecord,
    RunRecord,
    SamplerRecord,
    SessionRecord,
    UsageHistory,
)
from twinkle_async.usage_history import HOUR_S, hour_of, hourly_usage

GIGABYTE = 10**9
MAX_AUDIT_ENTRIES = 1000
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def at_hour(hour: int) -> datetime:
    return _EPOCH + timedelta(hours=hour)


def micros(ts: float) -> int:
    """A Unix time in whole microseconds: the exact order key of a session search."""
    return round(ts * 1_000_000)


def from_micros(us: int) -> datetime:
    return _EPOCH + timedelta(microseconds=us)


def to_micros(when: datetime) -> int:
    return (when - _EPOCH) // timedelta(microseconds=1)


def is_live(ckpt: CheckpointRecord, now: float) -> bool:
    return ckpt.expires_at is None or ckpt.expires_at > now


# -- billing ------------------------------------------------------------------------------------


def _storage_gb_hours(
    ckpts: Iterable[CheckpointRecord], start_h: int, end_h: int, now: float
) -> dict[tuple[int, str], float]:
    """GB-hours held per (hour, base model) in `[start_h, end_h)`: whole hours through a
    difference array, the partial first and last hour of each checkpoint directly."""
    held: dict[tuple[int, str], float] = defaultdict(float)
    steps: dict[str, list[float]] = {}
    for ckpt in ckpts:
        begin = max(ckpt.created_at, start_h * HOUR_S)
        end = min(ckpt.expires_at or math.inf, now, end_h * HOUR_S)
        if end <= begin or ckpt.size_bytes <= 0:
            continue
        gb = ckpt.size_bytes / GIGABYTE
        first, last = hour_of(begin), hour_of(end)
        if first == last:
            held[first, ckpt.base_model] += (end - begin) / HOUR_S * gb
            continue
        held[first, ckpt.base_model] += ((first + 1) * HOUR_S - begin) / HOUR_S * gb
        step = steps.setdefault(ckpt.base_model, [0.0] * (end_h - start_h + 1))
        step[first + 1 - start_h] += gb
        step[last - start_h] -= gb
        if end > last * HOUR_S:
            held[last, ckpt.base_model] += (end - last * HOUR_S) / HOUR_S * gb
    for base_model, step in steps.items():
        level = 0.0
        for offset, change in enumerate(step[:-1]):
            level += change
            if level > 1e-15:
                held[start_h + offset, base_model] += level
    return held


def billing_events(
    tenant_id: str,
    histories: Iterable[UsageHistory],
    ckpts: list[CheckpointRecord],
    start_h: int,
    end_h: int,
    now: float,
) -> list[account_api.BillingUsageEvent]:
    """The tenant's hourly usage in `[start_h, end_h)`, by hour then by descending quantity."""
    trained: dict[tuple[int, str], int] = defaultdict(int)
    sampled: dict[tuple[int, str], int] = defaultdict(int)
    for history in histories:
        for usage in hourly_usage(history):
            if start_h <= usage.hour < end_h:
                key = (usage.hour, usage.base_model)
                trained[key] += usage.counts["tokens_trained"] + usage.counts["tokens_forward"]
                sampled[key] += usage.counts["sampled_tokens"]
    saved: dict[tuple[int, str], int] = defaultdict(int)
    for ckpt in ckpts:
        if start_h <= hour_of(ckpt.created_at) < end_h:
            saved[hour_of(ckpt.created_at), ckpt.base_model] += 1
    found: list[tuple[int, float, account_api.BillingUsageEvent]] = []

    def add(key: tuple[int, str], quantity: float, info: account_api.BillingEventInfo) -> None:
        hour, base_model = key
        event = account_api.BillingUsageEvent(
            bucket_start=at_hour(hour),
            bucket_end=at_hour(hour + 1),
            event_info=info,
            base_model=base_model or None,
            user_id=tenant_id,
            project_id=tenant_id,
        )
        found.append((hour, quantity, event))

    for key, tokens in trained.items():
        if tokens:
            add(key, tokens, account_api.TrainingBillingEvent(token_count=tokens))
    for key, tokens in sampled.items():
        if tokens:
            add(key, tokens, account_api.SamplingSampleBillingEvent(token_count=tokens))
    for key, count in saved.items():
        add(key, count, account_api.CheckpointBillingEvent(count=count))
    for key, gb_hours in _storage_gb_hours(ckpts, start_h, end_h, now).items():
        add(key, gb_hours, account_api.StorageBillingEvent(gigabyte_hours=gb_hours))
    found.sort(key=lambda item: (item[0], -item[1]))
    return [event for _, _, event in found]


# -- storage ------------------------------------------------------------------------------------


def storage_usage(
    tenant_id: str, ckpts: list[CheckpointRecord], now: float
) -> account_api.CurrentCheckpointStorageUsageResponse:
    """What the tenant stores now (checkpoints not yet expired); no rows when nothing."""
    live = [ckpt for ckpt in ckpts if is_live(ckpt, now)]
    size = sum(max(ckpt.size_bytes, 0) for ckpt in live)
    data = (
        [
            account_api.CurrentCheckpointStorageUsageItem(
                checkpoint_count=len(live),
                size_bytes=size,
                size_gigabytes=size / GIGABYTE,
                project_id=tenant_id,
                org_user_urn=tenant_id,
                user_name=tenant_id,
            )
        ]
        if live
        else []
    )
    return account_api.CurrentCheckpointStorageUsageResponse(data=data)


# -- audit log ----------------------------------------------------------------------------------

AUDIT_EVENT_TYPES = ("all", "checkpoints", "projects", "teams", "organizations")


def audit_entries(
    tenant_id: str,
    event_type: str,
    day_start: float,
    sessions: list[SessionRecord],
    runs: list[RunRecord],
    samplers: list[SamplerRecord],
    ckpts: list[CheckpointRecord],
    keys: list[KeyRecord],
) -> list[account_api.AuditLogEntry]:
    """The tenant's events of one UTC day (`[day_start, day_start + 1 day)`), oldest first, at
    most `MAX_AUDIT_ENTRIES`. Projects, teams and organizations do not exist here: none."""
    if event_type not in ("all", "checkpoints"):
        return []
    day_end = day_start + 24 * HOUR_S
    found: list[tuple[float, str, dict[str, Any], str | None, str | None]] = []
    actor = {"tenant": tenant_id}
    for ckpt in ckpts:
        details = {
            **actor,
            "tinker_path": ckpt.path,
            "checkpoint_type": ckpt.kind,
            "size_bytes": ckpt.size_bytes,
            "public": ckpt.public,
        }
        found.append((ckpt.created_at, "checkpoint_create", details, ckpt.run_id, ckpt.path))
    if event_type == "all":
        for session in sessions:
            found.append(
                (
                    session.created_at,
                    "session_create",
                    {**actor, "session_id": session.session_id},
                    None,
                    None,
                )
            )
            if session.finished and session.finished_at is not None:
                details = {
                    **actor,
                    "session_id": session.session_id,
                    "reason": session.finish_reason,
                }
                found.append((session.finished_at, "session_finish", details, None, None))
        for run in runs:
            details = {
                **actor,
                "session_id": run.session_id,
                "base_model": run.base_model,
                "lora_rank": run.lora.rank,
            }
            found.append((run.created_at, "training_run_create", details, run.model_id, None))
        for sampler in samplers:
            details = {
                **actor,
                "sampling_session_id": sampler.sampling_session_id,
                "session_id": sampler.session_id,
                "base_model": sampler.base_model,
                "model_path": sampler.model_path,
            }
            found.append((sampler.created_at, "sampling_session_create", details, None, None))
        for key in keys:
            details = {**actor, "key_id": key.key_id, "prefix": key.prefix, "label": key.label}
            found.append((key.created_at, "api_key_create", details, None, None))
            if key.revoked_at is not None:
                found.append((key.revoked_at, "api_key_revoke", details, None, None))
    in_day = sorted((item for item in found if day_start <= item[0] < day_end), key=lambda i: i[0])
    return [
        account_api.AuditLogEntry(
            timestamp=from_micros(micros(ts)),
            event=event,
            event_details={key: value for key, value in details.items() if value is not None},
            model_id=model_id,
            tinker_path=path,
        )
        for ts, event, details, model_id, path in in_day[:MAX_AUDIT_ENTRIES]
    ]


# -- session search -----------------------------------------------------------------------------


def _status(
    session: SessionRecord,
) -> account_api.ClientSessionFinished | account_api.SessionActive | None:
    if not session.finished:
        return account_api.SessionActive()
    if session.finish_reason in ("success", "errored", "interrupted"):
        return account_api.ClientSessionFinished(reason={"type": session.finish_reason})
    return None  # ended by the server (heartbeats stopped): neither finished nor running


def _status_matches(
    status: account_api.ClientSessionFinished | account_api.SessionActive | None,
    queries: list[account_api.SessionStatusQuery] | None,
) -> bool:
    if queries is None:
        return True
    for query in queries:
        if isinstance(query, account_api.ActiveSessionStatusQuery) and isinstance(
            status, account_api.SessionActive
        ):
            return True
        if isinstance(query, account_api.ClientFinishedSessionStatusQuery) and isinstance(
            status, account_api.ClientSessionFinished
        ):
            if query.reasons is None or status.reason["type"] in query.reasons:
                return True
    return False  # cancelled and failed sessions do not exist here


def search_sessions(
    tenant_id: str,
    query: account_api.SessionSearchRequest,
    sessions: list[SessionRecord],
    runs: list[RunRecord],
    ckpts: list[CheckpointRecord],
    now: float,
) -> account_api.SessionSearchResponse:
    """One page of the tenant's sessions matching `query`, newest first (keyset pagination on
    (created_at in microseconds, session_id))."""
    session_of_run = {run.model_id: run.session_id for run in runs}
    counts: dict[str, int] = defaultdict(int)
    stored: dict[str, int] = defaultdict(int)
    for ckpt in ckpts:
        session_id = session_of_run.get(ckpt.run_id)
        if session_id is not None and is_live(ckpt, now):
            counts[session_id] += 1
            stored[session_id] += max(ckpt.size_bytes, 0)
    after = (
        (to_micros(query.cursor.last_created_at), query.cursor.last_session_id)
        if query.cursor
        else None
    )
    ordered = sorted(
        sessions, key=lambda session: (micros(session.created_at), session.session_id), reverse=True
    )
    page: list[account_api.SessionSummary] = []
    more = False
    for session in ordered:
        order = (micros(session.created_at), session.session_id)
        if after is not None and order >= after:
            continue
        if query.project_ids is not None and tenant_id not in query.project_ids:
            continue
        named = query.session_id is not None or query.display_name is not None
        if named and session.session_id != query.session_id:
            continue  # no session has a display name here, so only the id can match
        if any(session.user_metadata.get(k) != v for k, v in query.user_metadata.items()):
            continue
        status = _status(session)
        if not _status_matches(status, query.statuses):
            continue
        if len(page) == query.limit:
            more = True
            break
        page.append(
            account_api.SessionSummary(
                session_id=session.session_id,
                created_at=from_micros(order[0]),
                owner=tenant_id,
                project_id=tenant_id,
                checkpoints_count=counts[session.session_id],
                status=status,
                user_metadata=session.user_metadata or None,
                checkpoint_storage_bytes=stored[session.session_id],
            )
        )
    cursor = (
        account_api.SessionSearchCursor(
            last_created_at=page[-1].created_at, last_session_id=page[-1].session_id
        )
        if more and page
        else None
    )
    return account_api.SessionSearchResponse(sessions=page, next_cursor=cursor)

"""The JetStream topology as data: the ops stream and the KV buckets, with their limits.

Gateway and workers both ensure it at start-up (whichever comes first creates it), each with
its own few lines of I/O around these declarations.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from protocol import stability, subjects
from protocol.errors import Unavailable

# One stream-info answer names at most this many subjects (nats-server's JSMaxSubjectDetails);
# the rest are fetched by offset.
MAX_SUBJECTS_PER_ANSWER = 100_000


@dataclass(frozen=True)
class BucketSpec:
    """A KV bucket: name, entry lifetime (None = forever) and history depth."""

    name: str
    ttl_s: float | None = None
    history: int = 1


def buckets(futures_ttl_s: float) -> tuple[BucketSpec, ...]:
    """Every KV bucket of DESIGN.md §4."""
    return (
        BucketSpec(subjects.BUCKET_FUTURES, ttl_s=futures_ttl_s),
        BucketSpec(subjects.BUCKET_SESSIONS),
        BucketSpec(subjects.BUCKET_RUNS),
        BucketSpec(subjects.BUCKET_CHECKPOINTS),
        BucketSpec(subjects.BUCKET_KEYS),
        BucketSpec(subjects.BUCKET_TENANTS),
        BucketSpec(subjects.BUCKET_QUOTAS),
        BucketSpec(subjects.BUCKET_USAGE),
        BucketSpec(subjects.BUCKET_LEASES, ttl_s=30.0),
        BucketSpec(subjects.BUCKET_WORKERS, ttl_s=30.0),
        BucketSpec(subjects.BUCKET_STABILITY, ttl_s=stability.RECORD_TTL_S),
    )


@dataclass(frozen=True)
class StreamSpec:
    """The ops log: limits retention, so a model's ops since its last snapshot stay replayable."""

    name: str = subjects.STREAM_OPS
    subjects: tuple[str, ...] = (f"{subjects.OPS_PREFIX}.>",)
    max_age_s: float = 7 * 24 * 3600.0
    max_bytes: int = 8 * 1024**3
    duplicate_window_s: float = 600.0
    max_msg_bytes: int = 8 * 1024 * 1024


@dataclass(frozen=True)
class SampleStreamSpec:
    """Sample jobs: work-queue retention (an answered sample is never replayed)."""

    name: str = subjects.STREAM_SAMPLE
    subjects: tuple[str, ...] = (f"{subjects.SAMPLE_PREFIX}.>",)
    max_age_s: float = 3600.0
    duplicate_window_s: float = 120.0
    max_msg_bytes: int = 8 * 1024 * 1024


async def kv_keys(
    request: Callable[[str, bytes], Awaitable[bytes]], bucket: str, prefix: str = ""
) -> list[str]:
    """The keys of KV `bucket` under `prefix.` (deleted ones included), sorted.

    Stream-info requests with a subject filter (no consumer is created, so a burst of listings
    leaves nothing behind on the server), paged by offset: one answer names at most
    `MAX_SUBJECTS_PER_ANSWER` subjects, and nats-py's `stream_info` asks for the first page
    only, which silently cut a listing past that many keys. `request(subject, body)` is the
    caller's NATS request, returning the answer's payload.
    """
    subject_prefix = f"$KV.{bucket}."
    pattern = f"{subject_prefix}{prefix}.>" if prefix else f"{subject_prefix}>"
    found: set[str] = set()
    offset = 0
    while True:
        body = json.dumps({"subjects_filter": pattern, "offset": offset}).encode()
        answer = json.loads(await request(f"$JS.API.STREAM.INFO.KV_{bucket}", body))
        if "error" in answer:
            raise Unavailable(f"listing {bucket}: {answer['error'].get('description', '')}")
        page = (answer.get("state") or {}).get("subjects") or {}
        found.update(page)
        offset += len(page)
        if not page or offset >= int(answer.get("total") or 0):
            return sorted(subject[len(subject_prefix) :] for subject in found)

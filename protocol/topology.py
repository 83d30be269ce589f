"""The JetStream topology as data: the ops stream and the KV buckets, with their limits.

Gateway and workers both ensure it at start-up (whichever comes first creates it), each with
its own few lines of I/O around these declarations.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol import stability, subjects


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

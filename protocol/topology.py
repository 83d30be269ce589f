"""The JetStream topology as data: the ops stream and the KV buckets, with their limits, and how
a process reaches the servers that hold them.

The gateway ensures the topology at start-up and workers wait for it, each with its own few
lines of I/O around these declarations.

NATS as a cluster: `--nats-url` is one URL or a comma-separated list of a cluster's nodes
(`nats_servers`); a client connects to any one that answers and learns the others from it.
Every stream and bucket has `replicas` copies (`check_replicas`: 1, or up to 5 on a cluster of
at least that many nodes; durable consumers follow their stream's count). A client pings its
server every `PING_INTERVAL_S` and drops a connection that leaves `MAX_OUTSTANDING_PINGS`
unanswered, so a host gone without a TCP reset is noticed in about 6 s, not nats-py's 4 minutes.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from protocol import stability, subjects
from protocol.errors import Unavailable

PING_INTERVAL_S = 2.0
MAX_OUTSTANDING_PINGS = 3
MAX_REPLICAS = 5  # JetStream's largest replica count
_SCHEMES = ("nats", "tls", "ws", "wss")

# One stream-info answer names at most this many subjects (nats-server's JSMaxSubjectDetails);
# the rest are fetched by offset.
MAX_SUBJECTS_PER_ANSWER = 100_000


def nats_servers(url: str) -> list[str]:
    """The servers of a `--nats-url`: one URL or a comma-separated list of a cluster's nodes.

    `host:port` means `nats://host:port`. Raises `ValueError` naming the first entry that is not
    a NATS URL.
    """
    servers = []
    for raw in url.split(","):
        entry = raw.strip()
        candidate = entry if "://" in entry else f"nats://{entry}"
        try:
            parts = urlsplit(candidate)
            port = parts.port
        except ValueError:
            parts, port = None, None
        if (
            not entry
            or parts is None
            or parts.scheme not in _SCHEMES
            or not parts.hostname
            or parts.path not in ("", "/")
            or (port is None and parts.netloc.endswith(":"))
        ):
            raise ValueError(
                f"NATS URL {entry!r} (of {url!r}) is not nats://HOST:PORT; several servers are"
                " separated by commas"
            )
        servers.append(candidate)
    return servers


def check_replicas(replicas: int) -> int:
    """`replicas` if it is a JetStream replica count (1 to 5), else `ValueError`."""
    if not 1 <= replicas <= MAX_REPLICAS:
        raise ValueError(
            f"NATS replicas must be 1 to {MAX_REPLICAS} (JetStream's range), got {replicas}"
        )
    return replicas


@dataclass(frozen=True)
class BucketSpec:
    """A KV bucket: name, entry lifetime (None = forever) and history depth."""

    name: str
    ttl_s: float | None = None
    history: int = 1


def buckets(futures_ttl_s: float) -> tuple[BucketSpec, ...]:
    """Every KV bucket (docs/architecture.md, "State")."""
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


@dataclass(frozen=True)
class MetricsStreamSpec:
    """Each run's metric history (`protocol.metric_history`): limits retention, at most
    `max_per_run` entries a run (its oldest dropped first), each at most `max_msg_bytes`."""

    name: str = subjects.STREAM_METRICS
    subjects: tuple[str, ...] = (f"{subjects.METRICS_PREFIX}.>",)
    max_per_run: int = 10_000
    max_bytes: int = 2 * 1024**3
    max_age_s: float = 90 * 24 * 3600.0
    duplicate_window_s: float = 600.0  # a replayed op's entry is written once
    max_msg_bytes: int = 8 * 1024


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

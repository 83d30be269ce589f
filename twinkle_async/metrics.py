"""The gateway's Prometheus series: requests, futures, long-polls and queue depth per pool.

Job: declare every gateway series once, on a `CollectorRegistry` owned by one app (so apps built
side by side in a test process never collide), and render it in the format a scraper asks for.
The HTTP side (the middleware that times requests, the `/metrics` route) is
`twinkle_async.gateway.metrics_routes`; `FutureStore` reports submitted and resolved futures and
waiting long-polls here. The names are listed in README.md ("Metrics").

Queue depth is read at scrape time, bounded by a timeout: one `CONSUMER.LIST` request per stream
gives every shard consumer `ops-<pool>-<shard>` and sample consumer `sample-<pool>` with its
`num_pending` (not yet delivered) and `num_ack_pending` (delivered, not yet acked); their sum per
pool is the work waiting for (or held by) that pool's workers. A scrape whose read fails or times
out keeps the previous values.

Invariants: label values come from closed or bounded sets — a route's canonical path (never the
raw path), a known HTTP method or `other`, a status code, a request type, a pool — never an id.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

from protocol import subjects

log = logging.getLogger(__name__)

# Long-polls hold up to ~30 s: buckets reach past that.
REQUEST_SECONDS_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_CONSUMER_PAGE = 256  # JetStream lists at most this many consumers per request

# the durable names `subjects.consumer_name` and `subjects.sample_consumer` build
_OPS_PREFIX = "ops-"
_SAMPLE_PREFIX = "sample-"


def queue_of_consumer(name: str) -> tuple[str, str] | None:
    """`(pool, "ops" | "sample")` of a worker consumer's durable name; None for any other."""
    if name.startswith(_OPS_PREFIX):
        pool, _, shard = name[len(_OPS_PREFIX) :].rpartition("-")
        if pool and shard.isdigit():
            return pool, "ops"
        return None
    if name.startswith(_SAMPLE_PREFIX) and len(name) > len(_SAMPLE_PREFIX):
        return name[len(_SAMPLE_PREFIX) :], "sample"
    return None


class GatewayMetrics:
    """Every gateway series, on one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "twinkle_gateway_requests",
            "HTTP requests answered, by route (canonical path), method and status.",
            ["route", "method", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "twinkle_gateway_request_seconds",
            "Time to answer an HTTP request, by route (canonical path), method and status.",
            ["route", "method", "status"],
            buckets=REQUEST_SECONDS_BUCKETS,
            registry=r,
        )
        self.futures_submitted = Counter(
            "twinkle_gateway_futures_submitted",
            "Futures this gateway recorded as pending, by request type.",
            ["request_type"],
            registry=r,
        )
        self.futures_resolved = Counter(
            "twinkle_gateway_futures_resolved",
            "Finished outcomes written to tw_futures (by any writer), by request type and state.",
            ["request_type", "state"],
            registry=r,
        )
        self.long_polls_waiting = Gauge(
            "twinkle_gateway_long_polls_waiting",
            "retrieve_future calls waiting for their outcome.",
            registry=r,
        )
        self.queue_depth = Gauge(
            "twinkle_gateway_queue_depth",
            "Jobs not yet acked by a pool's workers (JetStream num_pending + num_ack_pending).",
            ["pool", "queue"],
            registry=r,
        )

    # -- requests ------------------------------------------------------------------------------

    def observe_request(self, route: str, method: str, status: int, seconds: float) -> None:
        method = method if method in METHODS else "other"
        labels = (route, method, str(status))
        self.requests.labels(*labels).inc()
        self.request_seconds.labels(*labels).observe(seconds)

    # -- futures -------------------------------------------------------------------------------

    def future_submitted(self, request_type: str) -> None:
        self.futures_submitted.labels(request_type or "unknown").inc()

    def future_resolved(self, request_type: str, state: str) -> None:
        self.futures_resolved.labels(request_type or "unknown", state).inc()

    # -- queue depth ---------------------------------------------------------------------------

    async def refresh_queue_depth(self, js: Any, timeout_s: float) -> None:
        """Read every worker consumer's backlog from JetStream, within `timeout_s`."""
        try:
            depths = await asyncio.wait_for(_read_depths(js), timeout_s)
        except Exception as exc:  # the bus is away or slow: keep the last values
            log.warning("queue depth not refreshed: %s", type(exc).__name__)
            return
        self.queue_depth.clear()
        for (pool, queue), depth in sorted(depths.items()):
            self.queue_depth.labels(pool, queue).set(depth)

    # -- exposition ----------------------------------------------------------------------------

    def render(self, accept: str) -> tuple[bytes, str]:
        """The registry in the format `accept` asks for (Prometheus text by default)."""
        encode: Callable[[CollectorRegistry], bytes]
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type


async def _read_depths(js: Any) -> dict[tuple[str, str], int]:
    depths: dict[tuple[str, str], int] = {}
    for stream in (subjects.STREAM_OPS, subjects.STREAM_SAMPLE):
        offset = 0
        while True:
            page = await js.consumers_info(stream, offset=offset)
            for info in page:
                found = queue_of_consumer(str(info.name))
                if found is not None:
                    pending = int(info.num_pending or 0) + int(info.num_ack_pending or 0)
                    depths[found] = depths.get(found, 0) + pending
            if len(page) < _CONSUMER_PAGE:
                break
            offset += len(page)
    return depths

"""Prometheus series of a worker process, and the HTTP endpoint that serves them.

Job: declare every worker series once (`TrainerMetrics` for the shared pass, the fused step,
slots and ops; `SamplerMetrics` for sample requests), on a `CollectorRegistry` the process
creates in `main()` and passes down, and serve that registry on `/metrics` (`serve_metrics`).
The names are listed in README.md ("Metrics").

Invariants: a service given no registry gets a private one, so services built side by side in
one test process never collide; label values come from closed sets (op kinds, outcomes), never
from ids, so the number of series stays bounded; every observation is thread-safe (passes and
steps are observed on the engine thread, the rest on the event loop).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from protocol.sampling import SampleOutput

log = logging.getLogger(__name__)

# Seconds of one shared pass, one fused step or one sampling batch: a tiny CPU model takes
# milliseconds, a long GPU pass tens of seconds.
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536, 262144)
TENANT_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def outcome_label(state: str, category: str | None) -> str:
    """`done`, or `<category>_error` (`user_error`, `server_error`, `unknown_error`)."""
    if state != "error":
        return state
    return f"{category or 'unknown'}_error"


class TrainerMetrics:
    """The trainer's series: passes, fused steps, cycles, slots and ops."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.cycle_seconds = Histogram(
            "twinkle_worker_cycle_seconds",
            "Wall time of one scheduler cycle (shared pass, fused step, saves and loads).",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.pass_seconds = Histogram(
            "twinkle_worker_pass_seconds",
            "Engine time of one shared forward/backward pass.",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.pass_tokens = Histogram(
            "twinkle_worker_pass_tokens",
            "Input tokens of one shared pass.",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.pass_tenants = Histogram(
            "twinkle_worker_pass_tenants",
            "Distinct models (tenants' adapters) merged into one shared pass.",
            buckets=TENANT_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "twinkle_worker_tokens",
            "Input tokens run through shared passes (rate() gives tokens/s).",
            registry=r,
        )
        self.last_tokens_per_second = Gauge(
            "twinkle_worker_last_pass_tokens_per_second",
            "Input tokens per second of the latest shared pass.",
            registry=r,
        )
        self.optim_step_seconds = Histogram(
            "twinkle_worker_optim_step_seconds",
            "Engine time of one fused optimizer step.",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.slots_total = Gauge(
            "twinkle_worker_slots_total", "Adapter slots on the device.", registry=r
        )
        self.slots_used = Gauge(
            "twinkle_worker_slots_used", "Slots holding a tenant's adapter.", registry=r
        )
        self.slots_parked = Gauge(
            "twinkle_worker_slots_parked",
            "Adapters parked in host memory for want of a slot.",
            registry=r,
        )
        self.ops = Counter(
            "twinkle_worker_ops",
            "Ops whose outcome was written, by kind and outcome.",
            ["kind", "outcome"],
            registry=r,
        )

    def observe_pass(self, seconds: float, tokens: int, tenants: int) -> None:
        self.pass_seconds.observe(seconds)
        self.pass_tokens.observe(tokens)
        self.pass_tenants.observe(tenants)
        self.tokens.inc(tokens)
        if seconds > 0:
            self.last_tokens_per_second.set(tokens / seconds)

    def observe_optim_step(self, seconds: float) -> None:
        self.optim_step_seconds.observe(seconds)

    def observe_cycle(self, seconds: float) -> None:
        self.cycle_seconds.observe(seconds)

    def set_slots(self, *, used: int, parked: int, total: int) -> None:
        self.slots_used.set(used)
        self.slots_parked.set(parked)
        self.slots_total.set(total)

    def op_finished(self, kind: str, state: str, category: str | None) -> None:
        self.ops.labels(kind or "unknown", outcome_label(state, category)).inc()


class SamplerMetrics:
    """A sampler's series (the torch sampler in a trainer, or a sampler process)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "twinkle_sampler_requests",
            "Sample requests answered, by outcome.",
            ["outcome"],
            registry=r,
        )
        self.generated_tokens = Counter(
            "twinkle_sampler_generated_tokens",
            "Tokens generated across every returned sequence.",
            registry=r,
        )
        self.batch_seconds = Histogram(
            "twinkle_sampler_batch_seconds",
            "Sampling time of one batch of requests (one request with the continuous samplers).",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )

        self.cancelled = Counter(
            "twinkle_sampler_cancelled",
            "Sample requests their client cancelled: skipped at pickup or dropped while sampling.",
            ["stage"],
            registry=r,
        )
        self.cancelled_tokens = Counter(
            "twinkle_sampler_cancelled_tokens",
            "Tokens cancelled requests had generated when the sampler dropped them.",
            registry=r,
        )

    def request_cancelled(self, stage: str, generated_tokens: int) -> None:
        self.cancelled.labels(stage).inc()
        self.cancelled_tokens.inc(generated_tokens)

    def observe_batch(self, seconds: float, results: Sequence[object]) -> None:
        self.batch_seconds.observe(seconds)
        tokens = sum(
            len(sequence.tokens)
            for result in results
            if isinstance(result, SampleOutput)
            for sequence in result.sequences
        )
        self.generated_tokens.inc(tokens)

    def request_finished(self, state: str, category: str | None) -> None:
        self.requests.labels(outcome_label(state, category)).inc()


@dataclass
class MetricsServer:
    """A running `/metrics` endpoint (prometheus_client's HTTP server on its own thread)."""

    url: str
    server: WSGIServer
    thread: threading.Thread

    def close(self) -> None:
        """Stop serving and join the thread (blocks up to the server's 0.5 s poll)."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5.0)


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Serve `registry` on `http://host:port/metrics`; port 0 lets the OS pick a free one."""
    server, thread = start_http_server(port, addr=host, registry=registry)
    bound = int(server.server_port)
    shown = socket.gethostname() if host in ("", "0.0.0.0", "::") else host
    if ":" in shown:
        shown = f"[{shown}]"
    url = f"http://{shown}:{bound}/metrics"
    log.info("metrics on %s", url)
    return MetricsServer(url=url, server=server, thread=thread)

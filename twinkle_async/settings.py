"""Settings, read once in `main()` from flags and `TWINKLE_*` variables, then passed down.

Only this module reads the environment. Units are in the names.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from protocol import rules
from protocol.errors import UserError


def _env(name: str, default: str) -> str:
    return os.environ.get(f"TWINKLE_{name}", default)


@dataclass(frozen=True)
class BusSettings:
    """How to reach NATS and how big its messages and windows are."""

    nats_url: str = "nats://127.0.0.1:4222"  # or a comma-separated list of a cluster's nodes
    # copies of every stream and KV bucket (1, or up to 5 on a cluster with that many nodes);
    # an existing stream or bucket with fewer is scaled up at start-up
    nats_replicas: int = 1
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 10.0
    # a starting gateway waits this long for NATS, then exits (its supervisor restarts it)
    connect_wait_s: float = 60.0
    # a KV read or write or a job publish that fails because NATS is away is tried again for
    # this long, then answers 503 with x-should-retry (the SDK retries); well under the SDK's
    # 60 s request timeout
    retry_s: float = 10.0
    n_shards: int = 16
    # retention: a future (result or error) is kept this long after it was written
    futures_ttl_s: float = 24 * 3600.0
    # the ops log keeps a model's ops for replay until they are this old or the log this big
    ops_max_age_s: float = 7 * 24 * 3600.0
    ops_max_bytes: int = 8 * 1024**3
    duplicate_window_s: float = 600.0
    max_payload_bytes: int = 8 * 1024 * 1024


@dataclass(frozen=True)
class Limits:
    """A tenant's quota limits (the deployment's defaults, or in force); `None` = unlimited."""

    max_adapters: int | None = None
    max_rank: int | None = None
    max_tokens_per_request: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_samples: int | None = None
    max_checkpoint_bytes: int | None = None


def quota_defaults_from_env() -> Limits:
    """Default limits from `TWINKLE_QUOTA_<LIMIT>` (e.g. `TWINKLE_QUOTA_MAX_ADAPTERS=16`)."""
    values: dict[str, int | None] = {}
    for name in Limits.__dataclass_fields__:
        raw = os.environ.get(f"TWINKLE_QUOTA_{name.upper()}")
        values[name] = int(raw) if raw else None
    return Limits(**values)


@dataclass(frozen=True)
class GatewaySettings:
    """The HTTP side: listen address, keys, limits, long-poll window."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> tenant_id
    long_poll_s: float = 30.0
    max_request_bytes: int = 6 * 1024 * 1024  # a forward_backward chunk (protobuf)
    max_json_bytes: int = 2 * 1024 * 1024  # every JSON body (a prompt of ~250k token ids fits)
    fwdbwd_max_chunk_len: int = 1024
    fwdbwd_max_chunk_bytes: int = 4 * 1024 * 1024
    # tensor elements one forward_backward may declare (dense or sparse), checked before
    # anything is allocated; the job carries it, so the worker decodes under the same budget.
    # None: one element per byte of the chunk size announced to the SDK (4 Mi by default).
    max_request_elements: int | None = None

    @property
    def request_elements_budget(self) -> int:
        """The per-request element budget in force."""
        if self.max_request_elements is not None:
            return self.max_request_elements
        return self.fwdbwd_max_chunk_bytes

    base_models: tuple[str, ...] = ()
    bus: BusSettings = field(default_factory=BusSettings)
    # guards /admin/v1 (None: the admin API is off)
    admin_key: str | None = None
    quota_defaults: Limits = field(default_factory=Limits)
    # how long the rate-limit queue of one tenant may grow before requests are refused (429)
    max_rate_queue_s: float = 600.0
    # a tenant may burst this many seconds' worth of its tokens_per_minute before queueing
    rate_burst_s: float = 60.0
    # a session whose heartbeats stop for this long is finished and its adapters unloaded
    # (the SDK sends one every 10 s)
    session_timeout_s: float = 120.0
    # how often the gateway looks for expired sessions
    sweep_interval_s: float = 10.0
    # where checkpoint files live (`<data-dir>/checkpoints`, shared with the workers): the
    # gateway deletes, copies and serves them. None: a checkpoint's record can still be
    # deleted, its files stay, and copy and download answer that no store is configured.
    checkpoint_root: Path | None = None
    # `s3://BUCKET/PREFIX` where workers save checkpoints (endpoint and keys from `AWS_*`): the
    # gateway signs, streams, copies and deletes them there. Records without a store key keep
    # using `checkpoint_root`.
    artifact_store: str | None = None
    # the S3 endpoint clients reach, when it differs from `AWS_ENDPOINT_URL` (presigned URLs
    # are signed for a host)
    artifact_public_url: str | None = None
    # how often checkpoints past their TTL are deleted (record and files); None: never
    checkpoint_sweep_s: float | None = 60.0
    # HMAC key of signed download URLs. Random per process unless given: gateways behind one
    # address must share it, and a restart invalidates the URLs already handed out.
    download_secret: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    download_url_ttl_s: float = 900.0  # a signed URL's lifetime
    # the base of signed URLs as clients reach this gateway; None: the request's scheme and Host
    public_url: str | None = None
    # the Twinkle processor service (`workers.processor`) the processor routes forward to, and
    # the secret it checks; None: those routes answer 501
    processor_url: str | None = None
    processor_secret: str = field(default="", repr=False)


def bus_from_env(nats_url: str | None = None, nats_replicas: int | None = None) -> BusSettings:
    """Bus settings from `TWINKLE_NATS_URL`, `TWINKLE_NATS_REPLICAS` and friends, overridden
    by explicit values."""
    return BusSettings(
        nats_url=nats_url or _env("NATS_URL", "nats://127.0.0.1:4222"),
        nats_replicas=nats_replicas or int(_env("NATS_REPLICAS", "1")),
        n_shards=int(_env("SHARDS", "16")),
        futures_ttl_s=float(_env("FUTURES_TTL_S", str(24 * 3600))),
        ops_max_age_s=float(_env("OPS_MAX_AGE_S", str(7 * 24 * 3600))),
        ops_max_bytes=int(_env("OPS_MAX_BYTES", str(8 * 1024**3))),
    )


def load_api_keys(key_file: Path | None, api_key: str | None) -> dict[str, str]:
    """Keys from `--api-key` (tenant `default`), `TWINKLE_API_KEY`, and a key file.

    The key file holds one `tml-KEY TENANT` pair per line; `#` starts a comment.
    """
    keys: dict[str, str] = {}
    single = api_key or os.environ.get("TWINKLE_API_KEY")
    if single:
        keys[single] = "default"
    path = key_file or (Path(p) if (p := os.environ.get("TWINKLE_KEY_FILE")) else None)
    if path is not None:
        for raw in path.read_text().splitlines():
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            tenant = parts[1] if len(parts) > 1 else "default"
            try:  # a tenant's name becomes KV keys (its rate and in-flight entries): checked
                rules.check_tenant_name(f"{path}: tenant", tenant)
            except UserError as err:
                raise ValueError(str(err)) from None
            keys[parts[0]] = tenant
    for key in keys:
        if not key.startswith("tml-"):
            raise ValueError(
                f"API keys must start with 'tml-' (the tinker SDK refuses others): {key[:8]}..."
            )
    return keys

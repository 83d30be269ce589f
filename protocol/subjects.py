"""Subject, stream, bucket and key names, and the pure functions that build them.

Ops of one model always land in one shard: `shard = crc32(model_id) % n_shards`, computed by
whoever publishes. NATS subject tokens and KV keys may not hold `:` (which Tinker model ids do),
so ids are carried as `token(id)`, a reversible url-safe base64 form.
"""

from __future__ import annotations

import base64
import re
import zlib

STREAM_OPS = "TW_OPS"
STREAM_SAMPLE = "TW_SAMPLE"
STREAM_METRICS = "TW_METRICS"
OPS_PREFIX = "tw.v1.ops"
SAMPLE_PREFIX = "tw.v1.sample"
CANCEL_PREFIX = "tw.v1.cancel"
STREAM_PREFIX = "tw.v1.stream"
METRICS_PREFIX = "tw.v1.metrics"

BUCKET_FUTURES = "tw_futures"
BUCKET_SESSIONS = "tw_sessions"
BUCKET_RUNS = "tw_runs"
BUCKET_CHECKPOINTS = "tw_checkpoints"
BUCKET_KEYS = "tw_keys"
BUCKET_TENANTS = "tw_tenants"
BUCKET_QUOTAS = "tw_quotas"
BUCKET_USAGE = "tw_usage"
BUCKET_LEASES = "tw_leases"
BUCKET_WORKERS = "tw_workers"
BUCKET_STABILITY = "tw_stability"  # per sampled sequence, for stable_reinforce

# the operator's prices (`records.PriceList`) in `tw_quotas`, beside the tenants' limits: a
# dotted key, which no tenant's name can be
PRICES_KEY = "cluster.prices"

DEFAULT_SHARDS = 16

_SLUG_RE = re.compile(r"[^a-z0-9]+")


def token(value: str) -> str:
    """A reversible encoding of any id into `[A-Za-z0-9_-]`: a valid subject token and KV key."""
    return base64.urlsafe_b64encode(value.encode()).decode().rstrip("=")


def untoken(value: str) -> str:
    """Inverse of `token`."""
    return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)).decode()


def pool_of(base_model: str) -> str:
    """The pool name of a base model: a readable slug plus a crc so distinct ids never collide."""
    slug = _SLUG_RE.sub("-", base_model.lower()).strip("-")[-40:].strip("-") or "model"
    return f"{slug}-{zlib.crc32(base_model.encode()):08x}"


def shard_of(model_id: str, n_shards: int = DEFAULT_SHARDS) -> int:
    """The shard that carries every op of `model_id`."""
    return zlib.crc32(model_id.encode()) % n_shards


def ops_subject(pool: str, model_id: str, n_shards: int = DEFAULT_SHARDS) -> str:
    """`tw.v1.ops.<pool>.<shard>.<model_token>`: where a model's training ops are published."""
    return f"{OPS_PREFIX}.{pool}.{shard_of(model_id, n_shards)}.{token(model_id)}"


def shard_filter(pool: str, shard: int) -> str:
    """The filter subject of the durable consumer of one shard."""
    return f"{OPS_PREFIX}.{pool}.{shard}.>"


def consumer_name(pool: str, shard: int) -> str:
    """The durable pull consumer of one shard, `ops-<pool>-<shard>`."""
    return f"ops-{pool}-{shard}"


def metrics_subject(run_id: str) -> str:
    """`tw.v1.metrics.<run_token>`: a training run's metric history, one message a request."""
    return f"{METRICS_PREFIX}.{token(run_id)}"


def sample_subject(pool: str) -> str:
    """`tw.v1.sample.<pool>`: sample jobs, taken by any sampler of the pool."""
    return f"{SAMPLE_PREFIX}.{pool}"


def sample_cancel_subject(pool: str) -> str:
    """`tw.v1.cancel.<pool>`: core NATS, a cancelled sample's request id to every sampler of
    the pool (one still queued in the stream is skipped at pickup: its future is no longer
    pending)."""
    return f"{CANCEL_PREFIX}.{pool}"


def sample_stream_subject(request_id: str) -> str:
    """`tw.v1.stream.<request_token>`: core NATS, the text a streamed sample has so far
    (`protocol.text_sampling.TextProgress`), from its sampler to the gateway that waits."""
    return f"{STREAM_PREFIX}.{token(request_id)}"


def sample_consumer(pool: str) -> str:
    """The durable pull consumer every sampler of a pool shares."""
    return f"sample-{pool}"


def sampler_key(sampling_session_id: str) -> str:
    """KV key of a sampling session in `tw_sessions`."""
    return f"sampler.{token(sampling_session_id)}"


def open_session_key(session_id: str) -> str:
    """KV key (in `tw_sessions`) marking a session not finished yet: the expiry sweeper lists
    these instead of every session ever made."""
    return f"open.{token(session_id)}"


def clone_counter_key(sampling_session_id: str) -> str:
    """KV key (in `tw_sessions`) of the last clone id `join_sampling_session` handed out."""
    return f"clones.{token(sampling_session_id)}"


def seq_prefix(model_id: str) -> str:
    """The prefix of every `seq_key` of a model or sampling session (for a key listing)."""
    return f"seq.{token(model_id)}"


def msg_id(model_id: str, seq_id: int) -> str:
    """`Nats-Msg-Id` of a training op: JetStream drops a second publish of the same op."""
    return f"{model_id}/{seq_id}"


def future_key(request_id: str) -> str:
    """KV key of a future's outcome in `tw_futures`."""
    return f"res.{request_id}"


def seq_key(model_id: str, seq_id: int) -> str:
    """KV key mapping `(model_id, seq_id)` to the request id that first claimed it."""
    return f"{seq_prefix(model_id)}.{seq_id}"


def highest_seq_key(model_id: str) -> str:
    """KV key holding the highest `seq_id` the gateway has seen for a model."""
    return f"hiseq.{token(model_id)}"


def tenant_index_prefix(tenant_id: str) -> str:
    """The prefix (in `tw_runs`, `tw_sessions`) of a tenant's index of its records: one key per
    run or session it owns, so they are listed without reading every tenant's."""
    return f"tenant.{token(tenant_id)}"


def tenant_index_key(tenant_id: str, record_id: str) -> str:
    return f"{tenant_index_prefix(tenant_id)}.{token(record_id)}"


def snapshot_key(model_id: str) -> str:
    """KV key (in `tw_runs`) of a model's latest state snapshot record."""
    return f"snap.{token(model_id)}"


def lease_key(pool: str, shard: int) -> str:
    """KV key (in `tw_leases`) of one shard's lease."""
    return f"{pool}.{shard}"


def checkpoint_key(run_id: str, checkpoint_id: str) -> str:
    """KV key of a checkpoint record in `tw_checkpoints`: `<run_token>.<checkpoint_token>`."""
    return f"{token(run_id)}.{token(checkpoint_id)}"


def worker_key(pool: str, worker_id: str) -> str:
    """KV key of a worker's heartbeat record in `tw_workers`."""
    return f"{pool}.{worker_id}"

"""Worker settings, built once from flags and `TWINKLE_*` variables in `main()`."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from protocol import subjects


@dataclass(frozen=True)
class WorkerSettings:
    """What a trainer worker serves and how it batches."""

    base_model: str
    nats_url: str = "nats://127.0.0.1:4222"
    data_dir: Path = Path("data")
    n_shards: int = subjects.DEFAULT_SHARDS
    max_slots: int = 8
    max_rank: int = 32
    device: str = "cpu"
    threads: int | None = None
    token_budget: int = 16384
    gap_timeout_s: float = 120.0
    ack_wait_s: float = 120.0
    heartbeat_s: float = 5.0
    sampler: str = "torch"  # the in-process sampler: "torch", or "" for none
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}")

    @property
    def pool(self) -> str:
        return subjects.pool_of(self.base_model)

    @property
    def checkpoint_root(self) -> Path:
        return self.data_dir / "checkpoints"


def env(name: str, default: str) -> str:
    return os.environ.get(f"TWINKLE_{name}", default)

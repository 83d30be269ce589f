"""What the torch sampler needs of whoever assigns the bank's slots: snapshot slots by key.

A snapshot is a sampler checkpoint loaded, read-only, into a slot of the multi-slot model's bank
(`workers.engine.model`); the torch sampler (`workers.sampler.torch_sampler`) binds its rows to
that slot. Who decides which slot a snapshot takes, and what it evicts for it, is not the
sampler's business: the trainer's residency (`workers.trainer.residency.Residency`) implements
this protocol beside its tenants, and the worker's entry point (`workers.__main__`) hands it to
the sampler. The sampler never imports the trainer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class SnapshotSlots(Protocol):
    """Snapshot keys to slots of one bank; every call on the engine's thread."""

    def load_snapshot(self, key: str, directory: Path) -> None:
        """Load the sampler checkpoint in `directory` as snapshot `key` (a loaded key is only
        marked used); may evict the least recently used snapshot, never a training adapter's
        state (a tenant it displaces is parked, bit-exactly)."""
        ...

    def has_snapshot(self, key: str) -> bool:
        """Whether snapshot `key` is in a slot now."""
        ...

    def snapshot_slot(self, key: str) -> int:
        """The slot of snapshot `key`, marked as just used; `NotFound` if it is not loaded."""
        ...

    def snapshot_capacity(self) -> int:
        """How many snapshots fit at once."""
        ...

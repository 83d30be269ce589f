"""The live objects, each owned by one (tenant, session): at most `max_objects` of them per
owner, each dropped once idle for `ttl_s`. Used from the event loop only."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from workers.processor.checks import Refused

Owner = tuple[str, str]  # (tenant, session)


@dataclass(eq=False)
class Entry:
    """One object: twinkle's Dataset or DataLoader, and the lock its calls run under (a
    DataLoader shares its Dataset's: it reads the rows a Dataset call may be replacing)."""

    pid: str
    owner: Owner
    kind: str  # "Dataset" or "DataLoader"
    obj: Any
    lock: asyncio.Lock
    parent: Entry | None = None  # a DataLoader's Dataset
    iterator: Iterator[Any] | None = None  # a DataLoader's, from its last `__iter__`
    last_used: float = field(default_factory=time.monotonic)

    def touch(self) -> None:
        """Used now; a DataLoader's Dataset with it, so that it stays while the loader does."""
        now = time.monotonic()
        self.last_used = now
        if self.parent is not None:
            self.parent.last_used = now


class Registry:
    """pid -> object, and how many each owner holds (those still being made included)."""

    def __init__(self, max_objects: int) -> None:
        self.max_objects = max_objects
        self.entries: dict[str, Entry] = {}
        self.counts: dict[Owner, int] = {}

    def reserve(self, owner: Owner) -> None:
        """Count one more object for `owner` before it is made; 413 past the budget."""
        count = self.counts.get(owner, 0)
        if count >= self.max_objects:
            raise Refused(
                f"this session holds {count} processor objects, this server's limit; "
                "let some expire before creating more",
                413,
            )
        self.counts[owner] = count + 1

    def release(self, owner: Owner) -> None:
        """Undo a `reserve` whose object was not made, or forget a dropped one."""
        count = self.counts.get(owner, 0) - 1
        if count > 0:
            self.counts[owner] = count
        else:
            self.counts.pop(owner, None)

    def add(self, owner: Owner, kind: str, obj: Any, parent: Entry | None = None) -> Entry:
        """Record a reserved object under a new `pid:`."""
        pid = "pid:" + secrets.token_hex(16)
        lock = parent.lock if parent is not None else asyncio.Lock()
        entry = Entry(pid, owner, kind, obj, lock, parent)
        self.entries[pid] = entry
        return entry

    def get(self, owner: Owner, pid: Any, field_name: str = "processor_id") -> Entry:
        """The owner's object `pid`; another owner's is as unknown as a missing one (404)."""
        if not isinstance(pid, str) or not pid.startswith("pid:") or len(pid) > 100:
            raise Refused(f"{field_name}: expected a 'pid:...' id, got {pid!r:.60}")
        entry = self.entries.get(pid)
        if entry is None or entry.owner != owner:
            raise Refused(f"{field_name}: no processor object {pid!r:.60} in this session", 404)
        return entry

    def sweep(self, idle_s: float) -> list[Entry]:
        """Drop the objects idle longer than `idle_s` (none with a call running)."""
        cutoff = time.monotonic() - idle_s
        dropped = [e for e in self.entries.values() if e.last_used < cutoff and not e.lock.locked()]
        for entry in dropped:
            del self.entries[entry.pid]
            self.release(entry.owner)
        return dropped

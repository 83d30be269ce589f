"""What this worker ran for each tenant: counters, written to KV `tw_usage` now and then.

Pure accumulation plus one flush: each (tenant, worker) pair has its own key
(`u.<tenant>.<worker_id>`) holding cumulative totals, so no two processes ever write the same
counter and a lost flush is made good by the next. The admin API sums a tenant's keys.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from protocol import records, subjects
from protocol.records import UsageRecord


def usage_key(tenant_id: str, worker_id: str) -> str:
    return f"u.{tenant_id}.{worker_id}"


class UsageBook:
    """Cumulative per-tenant counters of one worker process; `dirty` since the last flush."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.totals: dict[str, UsageRecord] = {}
        self._dirty: set[str] = set()

    def add(self, tenant_id: str, **counts: int) -> None:
        """Add to a tenant's counters (field names of `UsageRecord`)."""
        if not tenant_id:
            return
        record = self.totals.get(tenant_id)
        if record is None:
            record = self.totals[tenant_id] = UsageRecord(
                tenant_id=tenant_id, worker_id=self.worker_id
            )
        for name, value in counts.items():
            setattr(record, name, getattr(record, name) + value)
        self._dirty.add(tenant_id)

    async def flush(self, put: Callable[[str, str, bytes], Awaitable[None]]) -> int:
        """Write every changed tenant's totals with `put(bucket, key, value)`; how many."""
        dirty, self._dirty = self._dirty, set()
        now = time.time()
        for tenant_id in sorted(dirty):
            record = self.totals[tenant_id]
            record.updated_at = now
            try:
                await put(
                    subjects.BUCKET_USAGE,
                    usage_key(tenant_id, self.worker_id),
                    records.encode(record),
                )
            except Exception:
                self._dirty.add(tenant_id)  # written next time
                raise
        return len(dirty)

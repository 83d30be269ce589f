"""The gateway's half of `stable_reinforce` provenance (step 2 in `protocol.stability`).

Job: for a `stable_reinforce` forward_backward, check each datum's spans, read the stability
records they name from KV `tw_stability` (concurrently, a bounded number at a time), and return
the encoded `SpanSlice`s the job carries to the worker. A record older than `RENEW_AFTER_S` is
written again, so sequences still in use do not expire.
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from protocol import stability, subjects
from protocol.stability import StabilityRecord
from twinkle_async.bus import Bus

_CONCURRENT_READS = 64


async def resolve(bus: Bus, body: bytes, tenant_id: str) -> bytes:
    """The job's encoded slices; a `UserError` for spans that do not resolve."""
    spans = stability.datum_spans(body)
    names = stability.referenced(spans)
    records: dict[str, StabilityRecord | None] = {}
    gate = asyncio.Semaphore(_CONCURRENT_READS)

    async def read(name: str) -> None:
        async with gate:
            raw = await bus.get(subjects.BUCKET_STABILITY, stability.sequence_key(name))
        records[name] = stability.decode_record(raw) if raw else None

    await asyncio.gather(*(read(name) for name in names))
    slices = stability.slices_for(spans, records, tenant_id)
    now = time.time()
    stale = [
        record
        for record in records.values()
        if record is not None and now - record.written_at > stability.RENEW_AFTER_S
    ]

    async def renew(record: StabilityRecord) -> None:
        async with gate:
            await bus.put(
                subjects.BUCKET_STABILITY,
                stability.sequence_key(record.sequence_id),
                stability.encode_record(msgspec.structs.replace(record, written_at=now)),
            )

    await asyncio.gather(*(renew(record) for record in stale))
    return stability.encode_slices(slices)

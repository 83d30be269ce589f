"""Spending a seq against a real nats-server: a genuine retry gets the first request id, a
different call reusing the seq is a 400 naming its owner, and the unload the gateway queues
for a finished session's model takes the next free seq when a client's call took the one it
reserved."""

from __future__ import annotations

import pytest

from protocol import subjects
from protocol.api import LoraConfig
from protocol.errors import UserError
from protocol.jobs import SeqClaim, decode_claim
from protocol.records import RunRecord
from twinkle_async.bus import Bus
from twinkle_async.futures import FutureStore
from twinkle_async.lifecycle import Lifecycle
from twinkle_async.nats_server import NatsServer
from twinkle_async.registry import Registry
from twinkle_async.seq_claims import SeqTaken, claim_seq
from twinkle_async.settings import BusSettings

RUN = RunRecord(
    model_id="sess-1:train:0",
    tenant_id="t",
    session_id="sess-1",
    base_model="base",
    lora=LoraConfig(),
    created_at=0.0,
    last_request_time=0.0,
)


async def test_a_retry_gets_the_first_id_and_another_call_is_refused(
    nats_server: NatsServer,
) -> None:
    bus = Bus(BusSettings(nats_url=nats_server.url))
    await bus.connect()
    try:
        futures = FutureStore(bus)
        first, mine = await claim_seq(futures, "m", 3, "optim_step", "abc", named="model 'm'")
        assert mine and first.request_type == "optim_step"
        again, mine = await claim_seq(futures, "m", 3, "optim_step", "abc", named="model 'm'")
        assert (again, mine) == (first, False)
        for request_type, digest in (("optim_step", "other"), ("forward_backward", "abc")):
            with pytest.raises(UserError) as refused:
                await claim_seq(futures, "m", 3, request_type, digest, named="model 'm'")
            assert refused.value.status == 400
            assert refused.value.message == (
                f"seq_id: 3 of model 'm' was already used by another optim_step call (request"
                f" {first.request_id}); each call takes the next seq_id"
            )
        # another owner's seq 3 is its own
        _, mine = await claim_seq(futures, "s", 3, "sample", "abc", named="sampling session 's'")
        assert mine
    finally:
        await bus.close()


async def test_the_unload_skips_a_seq_a_client_call_took(nats_server: NatsServer) -> None:
    bus = Bus(BusSettings(nats_url=nats_server.url))
    await bus.connect()
    try:
        futures = FutureStore(bus)
        lifecycle = Lifecycle(
            Registry(bus), futures, bus, session_timeout_s=60, sweep_interval_s=60
        )
        await futures.note_seq(RUN.model_id, 4)
        # A client's call claims seq 5 in the window after the unload reserved it (the client
        # saw 5 as already known), before the unload's own claim.
        client = SeqClaim(request_id="req-client-optim_step", request_type="optim_step", digest="d")
        assert await futures.claim(RUN.model_id, 5, client) == client
        request_id = await lifecycle.unload(RUN)
        assert request_id != client.request_id
        owner = await bus.get(subjects.BUCKET_FUTURES, subjects.seq_key(RUN.model_id, 6))
        assert owner is not None and decode_claim(owner).request_id == request_id
        with pytest.raises(SeqTaken):  # the client's call keeps seq 5
            await claim_seq(futures, RUN.model_id, 5, "unload_model", "server", named="model")
        pending = await futures.read(request_id)
        assert pending is not None and pending.request_type == "unload_model"
    finally:
        await bus.close()

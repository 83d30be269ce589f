"""A sampler killed in the middle of a sample, with real processes: `up` runs the trainer worker
that samples (the torch sampler) with a short `TWINKLE_ACK_WAIT_S`; it is SIGKILLed while an
SDK sample is being generated (its start counted on the pending future); `up` restarts it, the
job is handed out again, and the SDK's future resolves with the same seeded samples as an
uninterrupted request."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker
from tinker import types

from protocol import subjects
from protocol.jobs import decode_outcome
from tests.cluster_helpers import pids_of
from tests.conftest import Cluster, start_cluster, stop_cluster
from tests.sdk_helpers import kv_values

pytestmark = pytest.mark.e2e

ACK_WAIT_S = 4.0


@pytest.fixture(scope="module")
def quick_redelivery(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path
) -> Iterator[Cluster]:
    running = start_cluster(
        tmp_path_factory.mktemp("sample-crash") / "data",
        [tiny_model],
        env={"TWINKLE_ACK_WAIT_S": str(ACK_WAIT_S)},
    )
    try:
        yield running
    finally:
        stop_cluster(running)


async def _begun_samples(nats_url: str) -> list[int]:
    """The start counts of the sample futures still pending."""
    values = await kv_values(nats_url, subjects.BUCKET_FUTURES, prefix="res")
    outcomes = [decode_outcome(value) for value in values]
    return [
        outcome.attempts
        for outcome in outcomes
        if outcome.request_type == "sample" and outcome.state == "pending"
    ]


def test_a_sample_whose_sampler_is_killed_is_answered_by_its_restart(
    quick_redelivery: Cluster, tiny_model: Path
) -> None:
    cluster = quick_redelivery
    service = tinker.ServiceClient(base_url=cluster.base_url, api_key=cluster.api_key)
    try:
        sampler = service.create_sampling_client(base_model=str(tiny_model)).result()
        prompt = types.ModelInput.from_ints([1, 40, 41, 42, 43])
        params = types.SamplingParams(max_tokens=3000, seed=17, temperature=1.0)

        started = time.monotonic()
        reference = sampler.sample(prompt, num_samples=64, sampling_params=params).result(60)
        alone_s = time.monotonic() - started
        lengths = [len(seq.tokens) for seq in reference.sequences]
        assert alone_s > 1.0, ("too short to kill", lengths, alone_s)

        (worker,) = pids_of(cluster)["worker"]
        future = sampler.sample(prompt, num_samples=64, sampling_params=params)
        deadline = time.monotonic() + 30
        while 1 not in asyncio.run(_begun_samples(cluster.nats_url)):
            assert time.monotonic() < deadline, "the sample never began"
            assert not future.done(), f"answered before the kill ({alone_s:.1f} s alone)"
            time.sleep(0.02)
        os.kill(worker, signal.SIGKILL)
        killed_at = time.monotonic()

        result = future.result(timeout=120)
        assert [seq.tokens for seq in result.sequences] == [
            seq.tokens for seq in reference.sequences
        ]
        # handed out again after ack_wait, once the restarted worker serves the pool
        assert time.monotonic() - killed_at < 90
        (restarted,) = pids_of(cluster)["worker"]
        assert restarted != worker
    finally:
        service.close("success").result()

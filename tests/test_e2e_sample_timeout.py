"""A sample request that runs past the sampler's time limit, with real processes: `up` runs the
trainer worker that samples (the torch sampler) with `TWINKLE_SAMPLE_TIMEOUT_S` of a few seconds
and `TWINKLE_MAX_ATTEMPTS=1`. A short sample is answered; a long one stops the worker, which `up`
restarts, and its SDK future fails with an error that names the limit instead of staying pending
for ever (its sampler kept the job alive while it ran). The pool serves the next request."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker
from tinker import types

from tests.cluster_helpers import pids_of
from tests.conftest import Cluster, start_cluster, stop_cluster
from tests.wait_helpers import wait_until

pytestmark = pytest.mark.e2e

SAMPLE_TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def time_limited(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Cluster]:
    running = start_cluster(
        tmp_path_factory.mktemp("sample-timeout") / "data",
        [tiny_model],
        env={
            "TWINKLE_SAMPLE_TIMEOUT_S": str(SAMPLE_TIMEOUT_S),
            "TWINKLE_MAX_ATTEMPTS": "1",
            "TWINKLE_ACK_WAIT_S": "4",
        },
    )
    try:
        yield running
    finally:
        stop_cluster(running)


def test_a_sample_past_the_time_limit_fails_and_the_pool_goes_on(
    time_limited: Cluster, tiny_model: Path
) -> None:
    cluster = time_limited
    service = tinker.ServiceClient(base_url=cluster.base_url, api_key=cluster.api_key)
    try:
        sampler = service.create_sampling_client(base_model=str(tiny_model)).result()
        prompt = types.ModelInput.from_ints([1, 40, 41, 42, 43])
        short = types.SamplingParams(max_tokens=4, seed=3)
        assert len(sampler.sample(prompt, 1, short).result(60).sequences[0].tokens) == 4

        (worker,) = pids_of(cluster)["worker"]
        long = types.SamplingParams(max_tokens=3000, seed=17, temperature=1.0)
        started = time.monotonic()
        with pytest.raises(tinker.RequestFailedError) as failed:
            sampler.sample(prompt, num_samples=128, sampling_params=long).result(timeout=120)
        assert "--sample-timeout-s" in str(failed.value), failed.value
        assert time.monotonic() - started > SAMPLE_TIMEOUT_S

        wait_until(
            lambda: (
                len(pids_of(cluster)["worker"]) == 1 and worker not in pids_of(cluster)["worker"]
            ),
            30,
            "the worker's restart",
        )
        again = sampler.sample(prompt, 1, short).result(60)
        assert (
            again.sequences[0].tokens
            == sampler.sample(prompt, 1, short).result(60).sequences[0].tokens
        )
    finally:
        service.close("success").result()

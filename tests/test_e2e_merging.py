"""Shared passes through the official SDK and a real cluster: eight tenants with their own ranks
and optimizer settings train at once and each gets its solo numbers; a tenant flooding the
worker does not hold a light tenant's steps back."""

from __future__ import annotations

import concurrent.futures
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker
from tinker import types

from tests.conftest import OTHER_TENANT_KEY, Cluster, start_cluster, stop_cluster
from tests.sdk_helpers import n_targets, toy_batch

pytestmark = pytest.mark.e2e

# (rank, seed, learning rate, weight decay, gradient clip norm, datums)
TENANTS = [
    (2, 1, 1e-2, 0.0, 0.0, 2),
    (4, 2, 5e-3, 0.1, 0.0, 3),
    (8, 3, 2e-2, 0.0, 1.0, 4),
    (16, 4, 1e-3, 0.01, 0.5, 2),
    (4, 5, 3e-2, 0.0, 0.1, 5),
    (8, 6, 1e-2, 0.2, 0.0, 3),
    (16, 7, 7e-3, 0.0, 2.0, 2),
    (2, 8, 1.5e-2, 0.05, 0.3, 4),
]


def test_eight_tenants_with_their_own_settings_each_get_their_solo_run(
    service: tinker.ServiceClient, tiny_model: Path
) -> None:
    def run(rank: int, seed: int, lr: float, wd: float, clip: float, n: int) -> list[float]:
        client = service.create_lora_training_client(
            base_model=str(tiny_model), rank=rank, seed=seed
        ).result()
        batch = toy_batch(n=n, seed=100 + seed)
        adam = types.AdamParams(learning_rate=lr, weight_decay=wd, grad_clip_norm=clip)
        losses = []
        for _ in range(4):
            fwd = client.forward_backward(batch, "cross_entropy")
            opt = client.optim_step(adam)
            losses.append(fwd.result().metrics["loss:sum"] / n_targets(batch))
            opt.result()
        # the trained adapter itself, through the log-probs of a forward pass
        out = client.forward(batch, "cross_entropy").result()
        losses += [float(x) for o in out.loss_fn_outputs for x in o["logprobs"].data]
        return losses

    solo = [run(*tenant) for tenant in TENANTS]
    with concurrent.futures.ThreadPoolExecutor(len(TENANTS)) as pool:
        together = list(pool.map(lambda tenant: run(*tenant), TENANTS))
    # A shared pass multiplies other shapes than a solo one, so fp32 sums round in another order:
    # the bound is 1e-5 relative to the value (log-probs here reach about -9).
    for tenant, a, b in zip(TENANTS, solo, together, strict=True):
        worst = max(abs(x - y) / max(1.0, abs(x)) for x, y in zip(a, b, strict=True))
        assert worst <= 1e-5, (tenant, worst)


@pytest.fixture(scope="module")
def small_passes(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Cluster]:
    """A cluster whose passes hold at most 256 tokens: a flood fills many of them."""
    running = start_cluster(
        tmp_path_factory.mktemp("fair") / "data", [tiny_model], "--token-budget", "256"
    )
    try:
        yield running
    finally:
        stop_cluster(running)


FLOODER = """
import sys, time
from pathlib import Path
import tinker
from tests.sdk_helpers import toy_batch

base_url, api_key, model, signals, in_flight_n = sys.argv[1:6]
service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
flood = service.create_lora_training_client(base_model=model, rank=4, seed=2).result()
batch = toy_batch(n=2, length=128, seed=2)  # 2 x 128+ tokens: over the pass, one per cycle
lone = []
for _ in range(8):  # one call at a time: what a light step may wait for, the pass in progress
    started = time.perf_counter()
    flood.forward(batch, "cross_entropy").result()
    lone.append(time.perf_counter() - started)
Path(signals, "ready").touch()
while not Path(signals, "go").exists():
    time.sleep(0.01)
in_flight, sent = [], 0
while not Path(signals, "stop").exists():
    # an evaluation flood: forward calls never meet an optim_step barrier, so all of them are
    # ready at once and only the scheduler decides who goes first
    while len(in_flight) < int(in_flight_n):
        in_flight.append(flood.forward(batch, "cross_entropy"))
        sent += 1
    in_flight.pop(0).result()
for future in in_flight:
    future.result()
print(sent, sorted(lone)[len(lone) // 2], flush=True)
"""


def test_a_flooding_tenant_does_not_hold_a_light_one_back(
    small_passes: Cluster, tiny_model: Path, tmp_path: Path
) -> None:
    """The flooder runs in its own process (its client's threads do not share this one's
    interpreter) and keeps a backlog of large forward calls queued on the worker."""
    # The flooder's model is created first: first come, first served would run its backlog
    # before anything of the light tenant's.
    flooder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            FLOODER,
            small_passes.base_url,
            OTHER_TENANT_KEY,  # another tenant floods
            str(tiny_model),
            str(tmp_path),
            "2",  # a backlog that never drains, at the least CPU the flood can cost
        ],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).parent.parent,
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists():
            assert flooder.poll() is None and time.monotonic() < deadline, "flooder failed"
            time.sleep(0.05)
        service = tinker.ServiceClient(base_url=small_passes.base_url, api_key=small_passes.api_key)
        light = service.create_lora_training_client(base_model=str(tiny_model), rank=4, seed=1)
        light = light.result()
        light_batch = toy_batch(n=1, length=32, seed=1)

        def light_steps(count: int) -> list[float]:
            latencies = []
            for _ in range(count):
                started = time.perf_counter()
                fwd = light.forward_backward(light_batch, "cross_entropy")
                opt = light.optim_step(types.AdamParams(learning_rate=1e-3))
                fwd.result(timeout=60)
                opt.result(timeout=60)
                latencies.append(time.perf_counter() - started)
            return latencies

        light_steps(3)  # warm-up
        alone = statistics.median(light_steps(16))
        (tmp_path / "go").touch()
        time.sleep(2.0)  # the flood's backlog builds up
        assert flooder.poll() is None, "the flooder stopped early"
        crowded = statistics.median(light_steps(16))
    finally:
        (tmp_path / "stop").touch()
        out, _ = flooder.communicate(timeout=120)
    service.close("success").result()
    sent, flood_call = out.decode().split()[-2:]
    sent, flood_call = int(sent), float(flood_call)
    assert sent >= 2
    print(
        f"light step p50: alone {alone * 1e3:.1f} ms, beside the flood {crowded * 1e3:.1f} ms;"
        f" a lone flood call {flood_call * 1e3:.1f} ms"
    )
    # The target is 2x. A fair schedule makes a light step wait for the flood's pass in
    # progress at most, and lets its optim_step go before the flood's next pass: alone on this
    # 2-core machine the ratio is 1.3-1.6x. First come, first served makes it wait behind the
    # flood's backlog too: 50x and more. In a full CI run the flood's client, gateway and NATS
    # take CPU from the light step as well, a cost that does not shrink with the step (16 ms
    # alone measured 43 ms beside the flood there): the bound is the light step's own time plus
    # three lone flood calls (each a whole round trip, longer than the pass it holds).
    assert crowded <= alone + 3 * flood_call, (alone, crowded, flood_call, sent)

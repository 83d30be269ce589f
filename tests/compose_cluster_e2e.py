"""The compose `cluster` profile, run for real by `make compose-test` after the default shape:
three NATS nodes with replicas 3, an S3 server, two gateways and two workers with no volume
shared between workers. Two tenants train through the official SDK, one through each gateway's
published port, while one NATS container and then one worker container are SIGKILLed and
started again; neither client sees an error. A sampler checkpoint saved through one gateway
samples through the other, and a presigned download URL (the store's published port) fetches
the adapter from the host.

Called by `tests.compose_e2e.main` inside its private `dockerd`, with the images built.
"""

from __future__ import annotations

import math
import os
import secrets
import threading
import time
import urllib.request

import tinker
from tinker import types

from tests.compose_e2e import MODEL, compose, free_port, log, up, wait_healthy
from tests.sdk_helpers import toy_batch, train_steps

NODES = ["nats-1", "nats-2", "nats-3"]
SERVICES = [*NODES, "s3", "gateway-1", "gateway-2", "worker-1", "worker-2"]


def _cluster(*argv: str, timeout: float = 900, quiet: bool = False) -> str:
    return compose("--profile", "cluster", *argv, timeout=timeout, quiet=quiet)


def _train(
    base_url: str, api_key: str, seed: int
) -> tuple[tinker.ServiceClient, list[float], tinker.TrainingClient]:
    service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    client = service.create_lora_training_client(
        base_model=f"/models/{MODEL}", rank=8, seed=seed
    ).result()
    return service, [], client


def _restart(service: str) -> None:
    _cluster("kill", "-s", "SIGKILL", service, quiet=True)
    log(f"{service} SIGKILLed")
    time.sleep(2.0)
    _cluster("start", service, quiet=True)
    wait_healthy([service])


def run_cluster_profile(port: int) -> None:
    port_2, s3_port = free_port(), free_port()
    os.environ.update(
        TWINKLE_PORT=str(port),
        TWINKLE_PORT_2=str(port_2),
        TWINKLE_S3_PORT=str(s3_port),
        TWINKLE_DOWNLOAD_SECRET=secrets.token_hex(16),
    )
    api_key = os.environ["TWINKLE_API_KEY"]
    _cluster("down", "-v", "--remove-orphans", quiet=True)
    try:
        up("--profile", "cluster", "up", "-d", *SERVICES)
        wait_healthy(SERVICES)
        gateways = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port_2}"]
        tenants = [_train(url, api_key, seed) for seed, url in enumerate(gateways, start=1)]
        batch = toy_batch()
        stop = threading.Event()
        failures: list[BaseException] = []

        def keep_training(client: tinker.TrainingClient, losses: list[float]) -> None:
            try:
                while not stop.is_set():
                    losses.extend(train_steps(client, batch, 2))
                losses.extend(train_steps(client, batch, 2))
            except BaseException as err:  # reported by the main thread
                failures.append(err)

        threads = [
            threading.Thread(target=keep_training, args=(client, losses))
            for _, losses, client in tenants
        ]
        for thread in threads:
            thread.start()
        try:
            time.sleep(3.0)
            _restart("nats-1")
            time.sleep(3.0)
            _restart("worker-1")
            time.sleep(3.0)
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=900)
        assert not any(t.is_alive() for t in threads), "training did not finish"
        assert not failures, f"a client saw the restarts: {failures[0]!r}"
        for _, losses, _ in tenants:
            assert len(losses) >= 4 and all(math.isfinite(x) for x in losses), losses
        log(f"cluster: {[len(t[1]) for t in tenants]} steps through both kills, no client error")

        first = tenants[0][2]
        saved = first.save_weights_for_sampler("cluster").result().path
        other = tinker.ServiceClient(base_url=gateways[1], api_key=api_key)
        sampled = (
            other.create_sampling_client(model_path=saved)
            .result()
            .sample(
                types.ModelInput.from_ints(batch[0].model_input.to_ints()[:6]),
                num_samples=2,
                sampling_params=types.SamplingParams(max_tokens=8, seed=7),
            )
            .result()
        )
        assert len(sampled.sequences) == 2 and all(len(s.tokens) == 8 for s in sampled.sequences)
        export = first.save_weights_external("cluster-export").result().path
        urls = tinker.RestClient(base_url=gateways[1], api_key=api_key)
        signed = urls.get_external_weights_urls(export).result().urls
        url = signed["adapter_model.safetensors"]
        assert url.startswith(f"http://127.0.0.1:{s3_port}/"), url
        with urllib.request.urlopen(url, timeout=30) as response:
            size = len(response.read())
        assert size > 1000, size
        log(f"cluster: sampled through gateway-2, {size} adapter bytes fetched from S3")
        for service, _, _ in tenants:
            service.close("success").result()
    except BaseException:
        print(_cluster("logs", "--tail", "60", quiet=True)[-12000:], flush=True)
        raise
    finally:
        _cluster("down", "-v", "--remove-orphans", timeout=300, quiet=True)
    log("compose cluster profile passed")

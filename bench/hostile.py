"""What a hostile or careless client costs: the figures of the tenant-safety acceptance, printed.

Starts a local cluster (`twinkle-async up`) on a tiny model built offline, then measures, with
the official SDK and raw HTTP:

1. the next call's latency after each call the gateway refuses (bad name, negative learning
   rate, an option this server refuses): it must not wait for the refused call's seq;
2. a 379-byte `forward_backward` declaring six [1, 2**26] sparse tensors: answer time and the
   gateway's resident-memory growth over repeated tries;
3. a burst of run listings (15 runs, 300 calls, 20 at a time): statuses and the NATS consumer
   count before and after;
4. B's `optim_step` at learning_rate 1e38 fused with A's: A's result and B's error.

    .venv/bin/python bench/hostile.py
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import nats
import tinker
from roundtrip import start  # the sibling benchmark's cluster start-up
from tinker import types
from tinker.proto import tinker_public_pb2 as public_pb


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def gateway_pid(up_pid: int) -> int:
    """The gateway `up` runs as a child process."""
    for children in Path(f"/proc/{up_pid}/task").glob("*/children"):
        for pid in children.read_text().split():
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"twinkle_async" in argv and b"gateway" in argv:
                return int(pid)
    raise SystemExit("no gateway process found")


def sparse_bomb(model_id: str, seq_id: int) -> bytes:
    msg = public_pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="ppo")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = b"\x01\x00\x00\x00"
    for name in ("target_tokens", "logprobs", "advantages", "weights", "mask", "extra"):
        tensor = datum.loss_fn_inputs[name]
        tensor.dtype = public_pb.DTYPE_FLOAT32
        tensor.shape.extend([1, 2**26])
        tensor.sparse_csr.crow_indices = b"\x00" * 16
    return bytes(msg.SerializeToString())


def batch(n: int = 2) -> list[types.Datum]:
    tokens = list(range(3, 20))
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
        for _ in range(n)
    ]


def refused_calls(service: tinker.ServiceClient, model: Path) -> None:
    client = service.create_lora_training_client(base_model=str(model), rank=8, seed=0).result()
    data = batch()
    client.forward_backward(data, "cross_entropy").result()
    refusals = {
        "save_state('../x')": lambda: client.save_state("../x").result(),
        "optim_step(lr=-1)": lambda: client.optim_step(
            types.AdamParams(learning_rate=-1.0)
        ).result(),
        "save_weights_external(encrypted)": lambda: client.save_weights_external(
            "x", age_encryption_recipients=["age1qqqq"]
        ).result(),
    }
    for what, refuse in refusals.items():
        started = time.perf_counter()
        status = 200
        try:
            refuse()
        except tinker.APIStatusError as err:
            status = err.status_code
        refused_ms = (time.perf_counter() - started) * 1e3
        started = time.perf_counter()
        client.forward_backward(data, "cross_entropy").result()
        next_ms = (time.perf_counter() - started) * 1e3
        print(
            f"refused {what}: HTTP {status} in {refused_ms:.1f} ms;"
            f" the next forward_backward took {next_ms:.1f} ms"
        )


def sparse_bombs(info: dict[str, str], pid: int, model: Path) -> None:
    http = httpx.Client(base_url=info["base_url"], headers={"X-API-Key": info["api_key"]})
    service = tinker.ServiceClient(base_url=info["base_url"], api_key=info["api_key"])
    client = service.create_lora_training_client(base_model=str(model), rank=4).result()
    model_id = client.model_id
    body = sparse_bomb(model_id, 1)
    http.post("/api/v1/forward_backward", content=body)  # warm-up
    before = rss_mib(pid)
    times = []
    statuses = set()
    for seq in range(2, 102):
        body = sparse_bomb(model_id, seq)
        started = time.perf_counter()
        resp = http.post("/api/v1/forward_backward", content=body)
        times.append((time.perf_counter() - started) * 1e3)
        statuses.add(resp.status_code)
    grown = rss_mib(pid) - before
    times.sort()
    print(
        f"sparse bomb ({len(body)} bytes declaring 6 x [1, 2**26]), 100 tries: HTTP"
        f" {sorted(statuses)}, median {statistics.median(times):.1f} ms, max {times[-1]:.1f} ms;"
        f" gateway RSS grew {grown:+.1f} MiB"
    )
    http.close()
    service.close("success").result()


async def consumer_count(nats_url: str) -> int:
    nc = await nats.connect(nats_url)
    try:
        return sum(i.state.consumer_count for i in await nc.jetstream().streams_info())
    finally:
        await nc.close()


def listing_burst(info: dict[str, str], model: Path) -> None:
    service = tinker.ServiceClient(base_url=info["base_url"], api_key=info["api_key"])
    for _ in range(15):
        service.create_lora_training_client(base_model=str(model), rank=4).result()
    before = asyncio.run(consumer_count(info["nats_url"]))

    async def burst() -> list[int]:
        limit = asyncio.Semaphore(20)
        async with httpx.AsyncClient(
            base_url=info["base_url"], headers={"X-API-Key": info["api_key"]}, timeout=60.0
        ) as http:

            async def one() -> int:
                async with limit:
                    resp = await http.get("/api/v1/training_runs", params={"limit": 100})
                    return resp.status_code

            return list(await asyncio.gather(*(one() for _ in range(300))))

    started = time.perf_counter()
    statuses = asyncio.run(burst())
    elapsed = time.perf_counter() - started
    after = asyncio.run(consumer_count(info["nats_url"]))
    counts = {status: statuses.count(status) for status in sorted(set(statuses))}
    print(
        f"300 listings of >= 15 runs, 20 at a time: {counts} in {elapsed:.1f} s;"
        f" NATS consumers {before} before, {after} after"
    )
    service.close("success").result()


def poisoned_step(info: dict[str, str], model: Path) -> None:
    service = tinker.ServiceClient(base_url=info["base_url"], api_key=info["api_key"])
    a = service.create_lora_training_client(base_model=str(model), rank=8, seed=1).result()
    b = service.create_lora_training_client(base_model=str(model), rank=8, seed=2).result()
    data = batch()
    fa, fb = a.forward_backward(data, "cross_entropy"), b.forward_backward(data, "cross_entropy")
    oa = a.optim_step(types.AdamParams(learning_rate=1e-2))
    ob = b.optim_step(types.AdamParams(learning_rate=1e38))
    fa.result(), fb.result()
    oa.result()
    try:
        ob.result()
        outcome = "succeeded (unexpected)"
    except tinker.RequestFailedError as err:
        outcome = f"failed alone ({err.category}): {str(err)[:90]}"
    print(f"fused step with B at learning_rate 1e38: A's step succeeded; B's {outcome}")
    service.close("success").result()


def main() -> None:
    os.environ.update(HF_HUB_OFFLINE="1", OMP_WAIT_POLICY="PASSIVE", TINKER_TELEMETRY="0")
    tmp = Path(tempfile.mkdtemp(prefix="twinkle-bench-"))
    model = tmp / "tiny"
    subprocess.run(
        [sys.executable, "-m", "workers.tiny_model", str(model)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    proc, info = start(tmp, model)
    try:
        service = tinker.ServiceClient(base_url=info["base_url"], api_key=info["api_key"])
        refused_calls(service, model)
        service.close("success").result()
        sparse_bombs(info, gateway_pid(proc.pid), model)
        listing_burst(info, model)
        poisoned_step(info, model)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()

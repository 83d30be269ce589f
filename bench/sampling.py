"""Generated tokens per second of the torch and vLLM sampler backends, side by side.

For each backend, starts a local cluster (`twinkle-async up --sampler torch|vllm`) on a tiny
model built offline, creates 4 tenants' adapters (one LoRA snapshot each), and sends `sample`
requests spread over the 4 adapters through the official SDK, at 1, 8 and 32 concurrent, in two
patterns:
- burst: n requests at once, `--max-tokens` new tokens each (no early stop); best of `--rounds`;
- clients: n clients, each sending `--requests` requests one after another, each for a length
  drawn from [max_tokens / 4, max_tokens] (seeded), so requests arrive while others generate.
It prints generated tokens/s per pattern and concurrency level, and the 8 / 1 ratio.

    .venv/bin/python bench/sampling.py [--backends torch vllm] [--max-tokens 64] [--rounds 2]
        [--requests 8]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import tinker
from tinker import types

CONCURRENCY = (1, 8, 32)


def start(tmp: Path, model: Path, backend: str) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    ready = tmp / f"ready-{backend}.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "twinkle_async",
            "up",
            "--base-model",
            str(model),
            "--port",
            "0",
            "--data-dir",
            str(tmp / f"data-{backend}"),
            "--api-key",
            "tml-bench",
            "--ready-file",
            str(ready),
            "--sampler",
            backend,
            "--max-rank",
            "8",
            "--log-level",
            "WARNING",
        ],
    )
    deadline = time.monotonic() + 600
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"cluster with the {backend} sampler failed to start")
        time.sleep(0.1)
    return proc, json.loads(ready.read_text())


def measure(
    info: dict[str, str], model: Path, max_tokens: int, rounds: int, requests: int
) -> dict[str, dict[int, float]]:
    service = tinker.ServiceClient(base_url=info["base_url"], api_key=info["api_key"])
    samplers = []
    for tenant in range(4):
        client = service.create_lora_training_client(
            base_model=str(model), rank=8, seed=tenant, train_unembed=False
        ).result()
        samplers.append(client.save_weights_and_get_sampling_client().result())
    prompt = types.ModelInput.from_ints(list(range(10, 26)))

    def params(tokens: int) -> types.SamplingParams:
        return types.SamplingParams(max_tokens=tokens, temperature=1.0, stop=[])

    for sampler in samplers:  # warm up: adapters loaded, caches built
        sampler.sample(prompt, 1, params(max_tokens)).result()

    def burst(n: int) -> float:
        best = 0.0
        for _ in range(rounds):
            started = time.perf_counter()
            futures = [samplers[i % 4].sample(prompt, 1, params(max_tokens)) for i in range(n)]
            tokens = sum(len(f.result().sequences[0].tokens) for f in futures)
            best = max(best, tokens / (time.perf_counter() - started))
        return best

    def clients(n: int) -> float:
        lengths = np.random.default_rng(n).integers(
            max(1, max_tokens // 4), max_tokens + 1, (n, requests)
        )

        def client(number: int) -> int:
            sampler = samplers[number % 4]
            return sum(
                len(sampler.sample(prompt, 1, params(int(t))).result().sequences[0].tokens)
                for t in lengths[number]
            )

        started = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            tokens = sum(pool.map(client, range(n)))
        return tokens / (time.perf_counter() - started)

    rates = {
        "burst": {n: burst(n) for n in CONCURRENCY},
        "clients": {n: clients(n) for n in CONCURRENCY},
    }
    service.close("success").result()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", nargs="+", default=["torch", "vllm"])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=8, help="per client, clients pattern")
    args = parser.parse_args()
    os.environ.update(
        HF_HUB_OFFLINE="1",
        OMP_WAIT_POLICY="PASSIVE",
        TINKER_TELEMETRY="0",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        VLLM_CPU_KVCACHE_SPACE="1",
    )
    tmp = Path(tempfile.mkdtemp(prefix="twinkle-bench-"))
    model = tmp / "tiny"
    subprocess.run(
        [sys.executable, "-m", "workers.tiny_model", str(model)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    results = {}
    for backend in args.backends:
        proc, info = start(tmp, model, backend)
        try:
            results[backend] = measure(info, model, args.max_tokens, args.rounds, args.requests)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
    print(
        f"\ngenerated tokens/s, tiny model (hidden 64, 2 layers), up to {args.max_tokens} new "
        "tokens per request, requests spread over 4 adapters:"
    )
    print("backend  pattern  " + "  ".join(f"{n:>4} concurrent" for n in CONCURRENCY) + "    8 / 1")
    for backend, patterns in results.items():
        for pattern, rates in patterns.items():
            print(
                f"{backend:<8} {pattern:<8} "
                + "  ".join(f"{rates[n]:15.0f}" for n in CONCURRENCY)
                + f"  {rates[8] / rates[1]:6.1f}x"
            )


if __name__ == "__main__":
    main()

"""Generated tokens per second of the torch and vLLM sampler backends, side by side.

For each backend, starts a local cluster (`twinkle-async up --sampler torch|vllm`) on a tiny
model built offline, creates 4 tenants' adapters (one LoRA snapshot each), then submits 1, 8
and 32 concurrent `sample` requests spread over the 4 adapters (64 new tokens each, no early
stop) through the official SDK and prints generated tokens/s per concurrency level.

    .venv/bin/python bench/sampling.py [--backends torch vllm] [--max-tokens 64] [--rounds 2]
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
from pathlib import Path

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


def measure(info: dict[str, str], model: Path, max_tokens: int, rounds: int) -> dict[int, float]:
    service = tinker.ServiceClient(base_url=info["base_url"], api_key=info["api_key"])
    samplers = []
    for tenant in range(4):
        client = service.create_lora_training_client(
            base_model=str(model), rank=8, seed=tenant, train_unembed=False
        ).result()
        samplers.append(client.save_weights_and_get_sampling_client().result())
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=[])
    prompt = types.ModelInput.from_ints(list(range(10, 26)))
    for sampler in samplers:  # warm up: adapters loaded, caches built
        sampler.sample(prompt, 1, params).result()
    rates = {}
    for n in CONCURRENCY:
        best = 0.0
        for _ in range(rounds):
            started = time.perf_counter()
            futures = [samplers[i % 4].sample(prompt, 1, params) for i in range(n)]
            tokens = sum(len(f.result().sequences[0].tokens) for f in futures)
            best = max(best, tokens / (time.perf_counter() - started))
        rates[n] = best
    service.close("success").result()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", nargs="+", default=["torch", "vllm"])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
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
            results[backend] = measure(info, model, args.max_tokens, args.rounds)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
    print(
        f"\ngenerated tokens/s, tiny model (hidden 64, 2 layers), {args.max_tokens} new tokens per request, "
        f"requests spread over 4 adapters:"
    )
    print("backend  " + "  ".join(f"{n:>4} concurrent" for n in CONCURRENCY))
    for backend, rates in results.items():
        print(f"{backend:<8} " + "  ".join(f"{rates[n]:15.0f}" for n in CONCURRENCY))


if __name__ == "__main__":
    main()

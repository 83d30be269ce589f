"""Generated tokens per second of the torch sampler as the trainer's service drives it, in-process:
`TorchBackend` on a one-thread engine executor, with 1 and 8 concurrent clients.

Builds the tiny model offline, loads 4 LoRA snapshots, then runs n clients (asyncio tasks), each
sending `--requests` requests one after another over the 4 snapshots, each for a length drawn
from [max_tokens / 4, max_tokens] (seeded; no early stop), so requests arrive while others
generate. Prints generated tokens/s at 1 and 8 concurrent and their ratio. No HTTP, NATS or SDK:
the sampler alone, which `bench/sampling.py` measures behind a whole local cluster.

    OMP_NUM_THREADS=1 .venv/bin/python bench/sampling_torch.py [--max-tokens 64] [--requests 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# This checkout's code, not whichever checkout the environment has installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from protocol.api import LoraConfig  # noqa: E402
from protocol.jobs import SampleJob  # noqa: E402
from protocol.sampling import SampleOutput, SampleSpec  # noqa: E402
from workers.engine.model import MultiSlotModel  # noqa: E402
from workers.sampler.backends import Prepared, TorchBackend  # noqa: E402
from workers.sampler.torch_sampler import TorchSampler  # noqa: E402
from workers.tiny_model import build_tiny_model  # noqa: E402
from workers.trainer.residency import Residency  # noqa: E402

ADAPTERS = 4


def snapshots(residency: Residency, root: Path) -> list[tuple[str, Path]]:
    keys = []
    for n in range(ADAPTERS):
        residency.create(f"tenant{n}", LoraConfig(rank=8, seed=n))
        residency.save(f"tenant{n}", root / f"s{n}", kind="sampler_weights", meta={})
        keys.append((f"s{n}@1", root / f"s{n}"))
    return keys


async def rate(backend: TorchBackend, keys: list[tuple[str, Path]], n: int, args: Any) -> float:
    rng = np.random.default_rng(n)
    low = max(1, args.max_tokens // 4)
    lengths = rng.integers(low, args.max_tokens + 1, (n, args.requests))
    prompt = tuple(range(10, 26))

    async def client(number: int) -> int:
        tokens = 0
        for i, length in enumerate(lengths[number]):
            key, directory = keys[(number + i) % ADAPTERS]
            spec = SampleSpec(prompt, max_tokens=int(length), seed=i, stop_at_eos=False)
            job = SampleJob(f"c{number}-{i}", "t", "s", "m")
            [output] = await backend.sample_many(
                [Prepared(job, cast(Any, None), spec, directory, key)]
            )
            assert isinstance(output, SampleOutput)
            tokens += len(output.sequences[0].tokens)
        return tokens

    started = time.perf_counter()
    tokens = sum(await asyncio.gather(*(client(c) for c in range(n))))
    return tokens / (time.perf_counter() - started)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=16, help="per client")
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="twinkle-bench-"))
    model = MultiSlotModel(str(build_tiny_model(root / "tiny")), max_slots=8, max_rank=8)
    residency = Residency(model)  # its tenants' slots, and the snapshots' (as in a worker)
    keys = snapshots(residency, root)
    with ThreadPoolExecutor(1, thread_name_prefix="engine") as executor:
        backend = TorchBackend(TorchSampler(model, residency), executor)
        await rate(backend, keys, ADAPTERS, argparse.Namespace(max_tokens=8, requests=1))  # warm
        rates = {n: await rate(backend, keys, n, args) for n in (1, 8)}
    print(
        f"torch sampler in-process, tiny model (hidden 64, 2 layers), {args.requests} requests "
        f"per client of {max(1, args.max_tokens // 4)}-{args.max_tokens} new tokens, "
        f"{ADAPTERS} snapshots:"
    )
    print(f"  1 concurrent: {rates[1]:7.0f} tokens/s")
    print(f"  8 concurrent: {rates[8]:7.0f} tokens/s")
    print(f"  8 / 1:        {rates[8] / rates[1]:7.1f}x")


if __name__ == "__main__":
    asyncio.run(main())

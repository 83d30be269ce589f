"""Crash recovery: how long a tenant waits after its worker is killed, and what snapshots cost.

1. Takeover time. Starts a local cluster (`twinkle-async up`, one trainer worker) on a tiny
   model, starts a second worker on the same NATS, trains a tenant whose model the second worker
   holds, SIGKILLs that worker mid-run, and times from the kill to the tenant's next completed
   step (lease expiry + snapshot restore + replay). `--lease-s` is the lease time of both
   workers (the default is the workers' default).
2. Snapshot cost per step, in process: after one forward_backward + optim_step of a rank-16
   adapter, the time to capture the slot and write the snapshot files, and their size, for the
   tiny model and for a ~100M-parameter random Qwen3.

    .venv/bin/python bench/recovery.py [--lease-s 10] [--no-big]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import tinker
from roundtrip import start  # the sibling benchmark's cluster start-up
from tinker import types

from protocol import subjects


def takeover(tmp: Path, model: Path, lease_s: float) -> None:
    env = {"TWINKLE_LEASE_S": str(lease_s)}
    os.environ.update(env)  # the cluster's worker and the second one read it
    proc, info = start(tmp, model)
    second = subprocess.Popen(
        [
            sys.executable, "-m", "workers", "--base-model", str(model),
            "--nats-url", info["nats_url"], "--data-dir", str(tmp / "data"),
            "--threads", "1", "--log-level", "WARNING",
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        time.sleep(lease_s + 8)  # the second worker claims half the shards
        service = tinker.ServiceClient(base_url=info["base_url"], api_key=info["api_key"])
        tokens = list(range(3, 40))
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
        # a tenant on one of the second worker's shards (the upper half after the hand-over)
        while True:
            client = service.create_lora_training_client(base_model=str(model), rank=8).result()
            if subjects.shard_of(client.model_id) >= subjects.DEFAULT_SHARDS // 2:
                break
        done: list[float] = []
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                client.forward_backward([datum] * 4, "cross_entropy").result()
                client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
                done.append(time.monotonic())

        thread = threading.Thread(target=loop)
        thread.start()
        while len(done) < 8:
            time.sleep(0.05)
        steps = np.diff(done[-6:])
        os.kill(second.pid, signal.SIGKILL)
        killed = time.monotonic()
        while not done or done[-1] < killed:
            time.sleep(0.01)
        waited = done[-1] - killed
        stop.set()
        thread.join()
        print(
            f"takeover: the tenant's next step completed {waited:.1f} s after its worker was"
            f" killed (lease {lease_s:.0f} s; a step takes {statistics.median(steps) * 1e3:.0f} ms)"
        )
        service.close("success").result()
    finally:
        if second.poll() is None:
            second.kill()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


def snapshot_cost(model: Path, label: str, tmp: Path) -> None:
    import torch

    from protocol.api import AdamParams, LoraConfig
    from protocol.tensors import DatumArrays, FwdBwdRequest
    from workers.engine.model import MultiSlotModel
    from workers.trainer.operations import run_passes, run_steps
    from workers.trainer.residency import Residency
    from workers.trainer.snapshots import write_state

    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    engine = MultiSlotModel(str(model), max_slots=2, max_rank=16)
    residency = Residency(engine)
    residency.create("m", LoraConfig(rank=16, seed=0))
    tokens = np.arange(3, 131, dtype=np.int32) % engine.vocab_size
    datum = DatumArrays(
        tokens=tokens,
        inputs={
            "target_tokens": np.roll(tokens, -1).astype(np.int64),
            "weights": np.ones(len(tokens), dtype=np.float32),
        },
    )
    request = FwdBwdRequest("m", 1, "cross_entropy", False, {}, [datum])
    capture_ms, write_ms, sizes = [], [], []
    for seq in range(5):
        run_passes(engine, residency, [("m", engine.validate(request))])
        run_steps(engine, residency, [("m", AdamParams(learning_rate=1e-3))])
        started = time.perf_counter()
        state = residency.capture("m")
        captured = time.perf_counter()
        written = write_state(tmp / label, seq, state, {"seq_id": seq})
        finished = time.perf_counter()
        capture_ms.append((captured - started) * 1e3)
        write_ms.append((finished - captured) * 1e3)
        sizes.append(written.stat().st_size + written.with_suffix(".safetensors").stat().st_size)
    params = sum(p.numel() for p in engine.model.parameters())
    print(
        f"snapshot ({label}, {params / 1e6:.1f}M parameters, rank-16 adapter on every linear):"
        f" {statistics.median(capture_ms) + statistics.median(write_ms):.1f} ms per snapshot"
        f" (capture {statistics.median(capture_ms):.1f} ms, write"
        f" {statistics.median(write_ms):.1f} ms), {sizes[-1] / 2**20:.1f} MiB"
    )


def random_qwen3_100m(directory: Path) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lease-s", type=float, default=10.0)
    parser.add_argument("--no-big", action="store_true", help="skip the ~100M-parameter model")
    args = parser.parse_args()
    os.environ.update(
        HF_HUB_OFFLINE="1",
        OMP_WAIT_POLICY="PASSIVE",
        TINKER_TELEMETRY="0",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
    )
    tmp = Path(tempfile.mkdtemp(prefix="twinkle-bench-"))
    model = tmp / "tiny"
    subprocess.run(
        [sys.executable, "-m", "workers.tiny_model", str(model)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    takeover(tmp, model, args.lease_s)
    snapshot_cost(model, "tiny Qwen3", tmp / "snapshots")
    if not args.no_big:
        snapshot_cost(random_qwen3_100m(tmp / "qwen3-100m"), "random Qwen3", tmp / "snapshots")


if __name__ == "__main__":
    main()

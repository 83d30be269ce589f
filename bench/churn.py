"""Sessions that come and go: the trainer worker's memory after one session and after many.

Starts a local cluster (`twinkle-async up`) on a tiny model built offline; each session creates
a LoRA training client, runs one forward_backward and one optim_step, and closes, which unloads
its adapter (its state saved as `weights/session-end`). Prints the worker's resident memory
after the first session and after the last, once every adapter has left its slot.

    .venv/bin/python bench/churn.py [--sessions 50]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import tinker
from roundtrip import start  # the sibling benchmark's cluster start-up
from tinker import types


def worker_pid(up_pid: int) -> int:
    for children in Path(f"/proc/{up_pid}/task").glob("*/children"):
        for pid in children.read_text().split():
            if b"workers" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                return int(pid)
    raise SystemExit("no worker process found")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def wait_unloaded(admin: httpx.Client, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(w["slots_used"] for w in admin.get("/admin/v1/workers").json()["workers"]):
        if time.monotonic() > deadline:
            raise SystemExit("adapters did not leave the worker")
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", type=int, default=50)
    args = parser.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", OMP_WAIT_POLICY="PASSIVE", TINKER_TELEMETRY="0")
    tmp = Path(tempfile.mkdtemp(prefix="twinkle-bench-"))
    model = tmp / "tiny"
    subprocess.run(
        [sys.executable, "-m", "workers.tiny_model", str(model)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    proc, info = start(tmp, model)
    admin = httpx.Client(base_url=info["base_url"], headers={"X-Admin-Key": info["admin_key"]})
    try:
        pid = worker_pid(proc.pid)
        tokens = list(range(3, 40))
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
        first = 0.0
        started = time.perf_counter()
        for index in range(args.sessions):
            service = tinker.ServiceClient(base_url=info["base_url"], api_key=info["api_key"])
            client = service.create_lora_training_client(base_model=str(model), rank=8).result()
            client.forward_backward([datum] * 4, "cross_entropy").result()
            client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            service.close("success").result()
            if index == 0:
                wait_unloaded(admin)
                first = rss_mib(pid)
        wait_unloaded(admin)
        last = rss_mib(pid)
        elapsed = time.perf_counter() - started
        print(
            f"{args.sessions} sessions in {elapsed:.0f} s: worker RSS {first:.0f} MiB after the"
            f" first, {last:.0f} MiB after the last ({(last / first - 1) * 100:+.1f} %)"
        )
    finally:
        admin.close()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()

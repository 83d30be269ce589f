"""`twinkle-async up` while it is still starting: a worker that has reported in (it serves) and
then dies is restarted like any crash, even while another worker has not reported in yet; the
gateway stays up and the cluster then serves the official SDK.

`up --workers 2` on the tiny model, over a nats-server the test owns (so it can read the
heartbeats before `up` writes its ready file). Trainer 1's start is held with SIGSTOP before it
reports in, trainer 0 reports in and is SIGKILLed, then trainer 1 is let go. About 30-60 s on
2 cores: three worker starts (trainer 0 twice) and one training step.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from protocol import records, subjects
from protocol.records import WorkerRecord
from twinkle_async.bus import Bus
from twinkle_async.nats_server import NatsServer
from twinkle_async.settings import bus_from_env

pytestmark = pytest.mark.e2e

API_KEY = "tml-start-test-key-0123456789"


# -- processes, as /proc shows them ----------------------------------------------------------


def _state(pid: int) -> str:
    """The process's state letter (R, S, T, Z...); "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return ""


def _children(parent: int) -> dict[int, list[str]]:
    """Live child processes of `parent`: pid -> argv."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            argv = (entry / "cmdline").read_bytes().decode().split("\0")
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == parent and fields[0] != "Z":
            found[int(entry.name)] = argv
    return found


def _trainers(up: subprocess.Popen[bytes]) -> dict[str, int]:
    """`up`'s trainer workers: the worker id `up` gave each -> its pid."""
    return {
        argv[argv.index("--worker-id") + 1]: pid
        for pid, argv in _children(up.pid).items()
        if "--worker-id" in argv
    }


def _gateway(up: subprocess.Popen[bytes]) -> int:
    (pid,) = (pid for pid, argv in _children(up.pid).items() if "gateway" in argv)
    return pid


def _until(
    condition: Callable[[], bool],
    up: subprocess.Popen[bytes],
    log: Path,
    what: str,
    timeout_s: float = 120.0,
) -> None:
    """Until `condition`; fails at once (with the log's tail) if `up` exits."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert up.poll() is None, f"up exited before {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"not {what} within {timeout_s} s"
        time.sleep(0.1)


def _heartbeats(nats_url: str) -> dict[str, float]:
    """worker id -> its latest heartbeat time, from `tw_workers`."""

    async def read() -> list[bytes]:
        bus = Bus(bus_from_env(nats_url))
        await bus.connect()
        try:
            return await bus.values(subjects.BUCKET_WORKERS)
        finally:
            await bus.close()

    beats = {}
    for value in asyncio.run(read()):
        record = records.decode(value, WorkerRecord)
        beats[record.worker_id] = record.heartbeat_at
    return beats


def _one_step(base_url: str, base_model: str) -> float:
    """A LoRA model, one forward_backward and optim_step on a short pattern; its loss."""
    service = tinker.ServiceClient(base_url=base_url, api_key=API_KEY)
    try:
        client = service.create_lora_training_client(base_model=base_model, rank=4).result()
        tokens = [5, 9, 17, 33] * 3
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
        fwd = client.forward_backward([datum], "cross_entropy")
        opt = client.optim_step(types.AdamParams(learning_rate=1e-2))
        loss = float(fwd.result().metrics["loss:sum"])
        opt.result()
        return loss
    finally:
        service.close("success").result()


def test_a_served_worker_killed_while_another_starts_is_restarted(
    tmp_path: Path, tiny_model: Path, nats_server: NatsServer
) -> None:
    ready = tmp_path / "ready.json"
    log = tmp_path / "up.log"
    started_at = time.time()
    with open(log, "wb") as out:
        up = subprocess.Popen(
            [
                *(sys.executable, "-m", "twinkle_async", "up", "--workers", "2"),
                *("--nats-url", nats_server.url, "--base-model", str(tiny_model)),
                *("--port", "0", "--data-dir", str(tmp_path / "data"), "--api-key", API_KEY),
                *("--ready-file", str(ready), "--threads", "1", "--token-budget", "2048"),
                *("--max-rank", "8", "--max-slots", "4", "--log-level", "INFO"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    held: int | None = None

    def reported(worker_id: str, since: float) -> bool:
        return _heartbeats(nats_server.url).get(worker_id, 0.0) >= since

    try:
        # 1. hold trainer 1 before it reports in (it still imports torch: seconds)
        _until(lambda: len(_trainers(up)) == 2, up, log, "both trainers started")
        (id_0, first), (id_1, held) = sorted(_trainers(up).items())
        os.kill(held, signal.SIGSTOP)
        _until(lambda: _state(held) == "T", up, log, "trainer 1 stopped")
        assert id_1 not in _heartbeats(nats_server.url), "trainer 1 reported in before it was held"

        # 2. trainer 0 reports in, serves; it is killed while trainer 1 is still starting
        _until(lambda: reported(id_0, started_at), up, log, "trainer 0 reported in")
        gateway = _gateway(up)
        killed_at = time.time()
        os.kill(first, signal.SIGKILL)

        # 3. restarted (the same worker id, a new pid, a fresh heartbeat), nothing else stopped
        _until(lambda: reported(id_0, killed_at), up, log, "trainer 0 reported in again")
        assert _trainers(up)[id_0] != first and _state(first) == ""
        assert _gateway(up) == gateway
        assert id_1 not in _heartbeats(nats_server.url) and not ready.exists()  # still starting

        # 4. trainer 1 goes on; the cluster is up, with the same gateway, and trains
        os.kill(held, signal.SIGCONT)
        held = None
        _until(ready.exists, up, log, "the cluster ready")
        assert _gateway(up) == gateway
        base_url = json.loads(ready.read_text())["base_url"]
        loss = _one_step(base_url, str(tiny_model))
        assert np.isfinite(loss) and loss > 0
        assert "did not start" not in log.read_text()
    finally:
        if held is not None and _state(held):
            os.kill(held, signal.SIGCONT)
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=30)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()

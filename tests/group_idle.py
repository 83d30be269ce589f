"""`python -m tests.group_idle MODEL [--no-keepalive]`: a worker group of 2 ranks whose
collectives time out after 3 s sits idle for 8 s, then creates an adapter; prints "created".
Without rank 0's keepalives rank 1 times out while it waits, and the group stops as one (rank 0
exits 70 before anything is created).

`python -m tests.group_idle MODEL --calibrate DIR`: the group measures its pass size, every rank
in step, and prints it; a second start finds it in DIR and prints "cached" instead."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from protocol.api import LoraConfig
from protocol.jobs import CreateModelJob
from workers.group.launch import start_group
from workers.settings import WorkerSettings
from workers.trainer.calibration import cached


def main() -> None:
    model = Path(sys.argv[1])
    settings = WorkerSettings(
        base_model=str(model), devices=2, group_timeout_s=3.0, max_slots=2, max_rank=8
    )
    group = start_group(settings)
    if "--calibrate" in sys.argv:
        directory = Path(sys.argv[sys.argv.index("--calibrate") + 1])
        if cached(group.ops.model, directory, threads=1) is not None:
            print("cached", flush=True)
        found = group.ops.calibrate(group.ops.model, directory, 1)
        print(f"pass_tokens {found.pass_tokens}", flush=True)
        group.stop()
        return
    if "--no-keepalive" in sys.argv:
        group.ops.keepalive_s = 1e9
    time.sleep(8.0)
    create = CreateModelJob(
        request_id="r", model_id="m", tenant_id="t", seq_id=0, lora=LoraConfig(rank=4, seed=1)
    )
    [(outcome, _)] = group.ops.other([create])
    assert outcome.state == "done", outcome
    print("created", flush=True)
    group.stop()


if __name__ == "__main__":
    main()

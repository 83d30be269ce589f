"""The way of one forward_backward through the worker's code: the files it runs in, and how
often it validates, looks its loss up and splits its sub-calls.

`python bench/request_path.py [--tree DIR]` builds a tiny random Qwen3, creates two tenants and
hands the trainer's operations one cycle of two `ForwardBackwardJob`s (protobuf bodies, as the
gateway publishes them), from decoding the bodies to the encoded outcomes: the engine-thread
part of a request (`workers.trainer.operations.EngineOps.shared_pass`). The second, traced call
(the first warms up) prints every file of the tree whose code ran, and the count of calls of
the functions that check a request, find its loss and split a call into transactions.

`--tree` measures another checkout of the project the same way (e.g. an older commit made with
`git worktree add /tmp/before <commit>`), for a before-and-after figure.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

WATCHED = ("validate", "get_loss", "resolve_config", "sub_calls", "check_inputs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args()
    tree = args.tree.resolve()
    sys.path.insert(0, str(tree))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import numpy as np
    import torch

    from protocol.api import LoraConfig
    from protocol.jobs import ForwardBackwardJob
    from protocol.tensors import DatumArrays, FwdBwdRequest, encode_forward_backward
    from workers.metrics import TrainerMetrics
    from workers.settings import WorkerSettings
    from workers.tiny_model import build_tiny_model
    from workers.trainer.operations import EngineOps

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="request-path-"))
    model_dir = build_tiny_model(work / "model", "qwen3")
    settings = WorkerSettings(base_model=str(model_dir), data_dir=work / "data")
    ops: Any
    try:  # this layout: the model and the residency
        from workers.engine.model import MultiSlotModel
        from workers.trainer.residency import Residency

        model = MultiSlotModel(str(model_dir), max_slots=4, max_rank=8)
        residency = Residency(model)
        ops = EngineOps(model, residency, settings, TrainerMetrics())
        create = residency.create
    except ImportError:  # the layout before it: one engine object
        # an older checkout's module, named so today's import check does not look for it
        engine_class: Any = importlib.import_module("workers.trainer.engine").Engine
        engine = engine_class(str(model_dir), max_slots=4, max_rank=8)
        ops = EngineOps(engine, settings, TrainerMetrics())  # type: ignore[arg-type, call-arg]
        create = engine.create
    rng = np.random.default_rng(0)
    jobs = []
    for index, model_id in enumerate(("tenant-a", "tenant-b")):
        create(model_id, LoraConfig(rank=8, seed=index))
        tokens = rng.integers(0, 200, 33)
        datum = DatumArrays(
            tokens[:-1].astype(np.int32),
            {"target_tokens": tokens[1:].astype(np.int64), "weights": np.ones(32, np.float32)},
        )
        request = FwdBwdRequest(model_id, 1, "cross_entropy", False, {}, [datum])
        body = encode_forward_backward(request)
        jobs.append(
            ForwardBackwardJob(
                request_id=f"req-{index}",
                model_id=model_id,
                tenant_id="t",
                seq_id=1,
                body=body,
                n_tokens=32,
            )
        )
    ops.shared_pass(jobs)  # warm-up
    files: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    root = str(tree) + os.sep

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        filename = frame.f_code.co_filename
        if filename.startswith(root):
            files[filename[len(root) :]] += 1
            if frame.f_code.co_name in WATCHED:
                calls[frame.f_code.co_name] += 1

    sys.setprofile(profile)
    try:
        results = ops.shared_pass(jobs)
    finally:
        sys.setprofile(None)
    assert all(outcome.state == "done" for outcome, _ in results), results
    ours = sorted(name for name in files if name.startswith(("protocol/", "workers/")))
    print(f"tree: {tree}")
    print(f"files a cycle of 2 forward_backward jobs runs in: {len(ours)}")
    for name in ours:
        print(f"  {name} ({files[name]} calls)")
    print("per cycle of 2 jobs: " + ", ".join(f"{name} {calls[name]}" for name in WATCHED))


if __name__ == "__main__":
    main()

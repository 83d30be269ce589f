"""Small helpers the end-to-end tests share: the SDK's client of a test cluster, toy data,
training loops with the real SDK, and the trainer's own logprobs of a prompt."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import tinker
from tinker import types

from twinkle_async.bus import Bus
from twinkle_async.settings import bus_from_env

if TYPE_CHECKING:
    from tests.conftest import Cluster

PROMPT = [7, 19, 23, 42, 101, 7, 19, 250]  # a prompt of the tiny models' vocabulary


@contextmanager
def sdk_service(cluster: Cluster) -> Iterator[tinker.ServiceClient]:
    """The official SDK's client of `cluster` with its test key; closed as a run that
    succeeded. The `service` fixture of `tests/conftest.py` is this over the session's cluster."""
    client = tinker.ServiceClient(base_url=cluster.base_url, api_key=cluster.api_key)
    try:
        yield client
    finally:
        client.close("success").result()


def toy_batch(n: int = 4, length: int = 12, vocab: int = 200, seed: int = 0) -> list[types.Datum]:
    """Fixed next-token data: each datum is a short repeating pattern, easy to memorise."""
    rng = np.random.default_rng(seed)
    batch = []
    for i in range(n):
        pattern = rng.integers(3, vocab, size=4)
        seq = np.resize(pattern, length + 1 + i).astype(np.int64)
        batch.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
                loss_fn_inputs={
                    "target_tokens": seq[1:].tolist(),
                    "weights": [1.0] * (len(seq) - 1),
                },
            )
        )
    return batch


def trainer_logprobs(client: tinker.TrainingClient, prompt: list[int]) -> np.ndarray:
    """The trainer's logprobs of `prompt[1:]` after `prompt[:-1]` (a `forward`, no training)."""
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(prompt[:-1]),
        loss_fn_inputs={"target_tokens": prompt[1:], "weights": [0.0] * (len(prompt) - 1)},
    )
    out = client.forward([datum], "cross_entropy").result()
    return np.asarray(out.loss_fn_outputs[0]["logprobs"].data, dtype=np.float64)


def n_targets(batch: list[types.Datum]) -> int:
    return sum(len(d.loss_fn_inputs["target_tokens"].data) for d in batch)


def train_steps(
    client: tinker.TrainingClient, batch: list[types.Datum], steps: int, lr: float = 1e-2
) -> list[float]:
    """Pipelined rounds as the cookbook runs them: step i+1 is submitted before step i's
    results are read. Returns the loss per target token of each step."""
    n = n_targets(batch)
    pending = []
    losses = []
    for _ in range(steps):
        fwd = client.forward_backward(batch, "cross_entropy")
        opt = client.optim_step(types.AdamParams(learning_rate=lr))
        pending.append((fwd, opt))
        if len(pending) > 1:
            f, o = pending.pop(0)
            losses.append(f.result().metrics["loss:sum"] / n)
            o.result()
    for f, o in pending:
        losses.append(f.result().metrics["loss:sum"] / n)
        o.result()
    return losses


async def kv_values(nats_url: str, bucket: str, prefix: str = "") -> list[bytes]:
    """The current values of a KV bucket's keys under `prefix.`, read as the services read them
    (one stream-info listing, then direct gets). nats-py's `KeyValue.keys()` is not used: its
    watcher can report "no keys" when the first entries are still on the wire."""
    bus = Bus(bus_from_env(nats_url))
    await bus.connect()
    try:
        return await bus.values(bucket, prefix)
    finally:
        await bus.close()


def train_pipelined(
    client: tinker.TrainingClient,
    seed: int,
    steps: int,
    name: str,
    progress: dict[int, int] | None = None,
    pause_s: float = 0.25,
) -> str:
    """Steps on the tenant's own data (`toy_batch(n=3, seed=seed)`), each submitted before the
    last one's results are read (as the cookbook pipelines), paced so a run lasts a few
    seconds; then `save_state(name)`, whose path it returns. `progress[seed]` counts the steps
    whose results came back."""
    batch = toy_batch(n=3, seed=seed)
    previous = None
    for step in range(steps):
        current = (
            client.forward_backward(batch, "cross_entropy"),
            client.optim_step(types.AdamParams(learning_rate=2e-2)),
        )
        if previous is not None:
            previous[0].result()
            previous[1].result()
            if progress is not None:
                progress[seed] = step
        previous = current
        time.sleep(pause_s)
    assert previous is not None
    previous[0].result()
    previous[1].result()
    return str(client.save_state(name).result().path)

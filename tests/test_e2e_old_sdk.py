"""An older tinker SDK, unmodified, against the session's cluster: tinker 0.16.1 (what
twinkle-kit's `[client]` extra pins) sends `forward_backward` and `forward` as JSON, the latter on
`/api/v1/forward`. Its training loop, a forward pass, a saved state and a sampler checkpoint
work, with the same numbers as SDK 0.38's loop on the same data and seed. The SDK runs in its
own virtualenv (`make install` builds `.venv-sdk/tinker-<version>`), in a process of its own
(`tests/old_sdk_client.py`)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from tests.conftest import Cluster
from tests.old_sdk_client import batch  # the same data the older SDK trains on

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = ("0.16.1", "0.24.1", "0.25.0")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("version", VERSIONS)
def test_an_older_sdk_trains_samples_and_saves_as_the_current_one(
    version: str, cluster: Cluster, tiny_model: Path
) -> None:
    python = ROOT / ".venv-sdk" / f"tinker-{version}" / "bin" / "python"
    assert python.exists(), f"{python} is missing: `make install` builds it"
    ran = subprocess.run(
        [
            str(python),
            str(ROOT / "tests" / "old_sdk_client.py"),
            cluster.base_url,
            cluster.api_key,
            str(tiny_model),
        ],
        capture_output=True,
        text=True,
        timeout=500,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert ran.returncode == 0, ran.stderr[-4000:]
    old = json.loads(ran.stdout.strip().splitlines()[-1])
    assert old["version"] == version
    assert old["saved"].startswith("tinker://") and old["saved"].endswith("/weights/old-sdk")
    assert [len(tokens) for tokens in old["sampled"]] == [4, 4]

    # the same loop with SDK 0.38
    service = tinker.ServiceClient(base_url=cluster.base_url, api_key=cluster.api_key)
    try:
        client = service.create_lora_training_client(
            base_model=str(tiny_model), rank=4, seed=11
        ).result()
        data, losses = batch(), []
        for _ in range(3):
            out = client.forward_backward(data, "cross_entropy").result()
            losses.append(out.metrics["loss:sum"])
            step = client.optim_step(types.AdamParams(learning_rate=2e-2)).result()
            # without clipping too: the gradient's norm before any clip, and the rate used
            assert step.metrics is not None and step.metrics["learning_rate:mean"] == 2e-2
            assert step.metrics["unclipped_grad_l2:mean"] > 0
        forward = client.forward(data, "cross_entropy").result()
    finally:
        service.close("success").result()
    assert losses[-1] < losses[0]  # it learns
    np.testing.assert_allclose(old["losses"], losses, rtol=1e-5)
    assert old["forward_loss"] == pytest.approx(forward.metrics["loss:sum"], rel=1e-5)
    for got, want in zip(old["forward_logprobs"], forward.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(got, want["logprobs"].tolist(), atol=1e-5)

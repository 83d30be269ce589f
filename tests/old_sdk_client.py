"""A training loop as an older tinker SDK runs it (0.16.1: JSON bodies, `/api/v1/forward`),
unmodified, run by that SDK's own interpreter: `<venv>/bin/python tests/old_sdk_client.py
BASE_URL API_KEY BASE_MODEL`. Prints one JSON line of what it observed. Imports nothing of
this repository (the SDK's venv has none of it)."""

from __future__ import annotations

import json
import sys

import numpy as np
import tinker
from tinker import types


def batch() -> list[types.Datum]:
    rng = np.random.default_rng(0)
    data = []
    for i in range(3):
        pattern = rng.integers(3, 200, size=4)
        seq = np.resize(pattern, 13 + i).astype(np.int64)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
                loss_fn_inputs={
                    "target_tokens": seq[1:].tolist(),
                    "weights": [1.0] * (len(seq) - 1),
                },
            )
        )
    return data


def main() -> None:
    base_url, api_key, base_model = sys.argv[1:4]
    service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    client = service.create_lora_training_client(base_model=base_model, rank=4, seed=11)
    data = batch()
    losses = []
    for _ in range(3):
        out = client.forward_backward(data, "cross_entropy").result()
        losses.append(float(out.metrics["loss:sum"]))
        client.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    forward = client.forward(data, "cross_entropy").result()
    saved = client.save_state("old-sdk").result().path
    sampler = client.save_weights_and_get_sampling_client("old-sdk-sampler")
    prompt = types.ModelInput.from_ints(data[0].model_input.to_ints()[:5])
    sampled = sampler.sample(
        prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=4, seed=3)
    ).result()
    print(
        json.dumps(
            {
                "version": tinker.__version__,
                "losses": losses,
                "forward_loss": float(forward.metrics["loss:sum"]),
                "forward_logprobs": [
                    list(map(float, o["logprobs"].tolist())) for o in forward.loss_fn_outputs
                ],
                "saved": str(saved),
                "sampled": [list(s.tokens) for s in sampled.sequences],
            }
        )
    )


if __name__ == "__main__":
    main()

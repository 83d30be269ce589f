"""Reinforcement learning with LoRA through the official tinker SDK, unmodified.

Each iteration snapshots the adapter (`save_weights_and_get_sampling_client`), samples a group
of completions per prompt, scores them (the reward is the share of completion tokens drawn from
a target set of token ids), centres the advantages on each group's mean reward (per token: each
token is credited with its own part of the reward), and trains on the samples with the
`importance_sampling` loss using the sampler's own logprobs. The mean reward rises.

    python examples/rl.py --base-url http://127.0.0.1:8000 --api-key tml-... --base-model MODEL
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import tinker
from tinker import types

PROMPTS = [[5, 17, 29], [41, 53, 67, 79], [83, 97], [101, 113, 127, 131, 137]]


def reward(tokens: list[int], target_below: int) -> float:
    """The share of tokens whose id is below `target_below` (a fixed target set)."""
    return float(np.mean([t < target_below for t in tokens])) if tokens else 0.0


def run(
    base_url: str | None,
    api_key: str | None,
    base_model: str,
    iterations: int = 20,
    group_size: int = 8,
    max_tokens: int = 8,
    lr: float = 2e-2,
    target_below: int = 64,
    seed: int = 0,
) -> list[float]:
    """Train; return the mean reward of each iteration's samples."""
    service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    client = service.create_lora_training_client(
        base_model=base_model, rank=8, seed=seed, train_unembed=False
    ).result()
    history = []
    for iteration in range(iterations):
        sampler = client.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(
            max_tokens=max_tokens, temperature=1.0, seed=seed * 1000 + iteration, stop=[]
        )
        futures = [
            sampler.sample(
                types.ModelInput.from_ints(prompt), num_samples=group_size, sampling_params=params
            )
            for prompt in PROMPTS
        ]
        data = []
        rewards = []
        for prompt, future in zip(PROMPTS, futures, strict=True):
            sequences = future.result().sequences
            scores = [reward(seq.tokens, target_below) for seq in sequences]
            rewards += scores
            baseline = float(np.mean(scores))
            for seq in sequences:
                if not seq.tokens:
                    continue
                # credit each sampled token with its own contribution to the reward, centred on
                # the group's mean: target tokens are pushed up, the others down
                advantages = [float(t < target_below) - baseline for t in seq.tokens]
                full = prompt + seq.tokens
                n_prompt = len(prompt) - 1
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={
                            "target_tokens": full[1:],
                            "logprobs": [0.0] * n_prompt + list(seq.logprobs or []),
                            "advantages": [0.0] * n_prompt + advantages,
                        },
                    )
                )
        history.append(float(np.mean(rewards)))
        print(
            f"iteration {iteration:2d}  mean reward {history[-1]:.3f}  ({len(data)} datums)",
            flush=True,
        )
        if data:
            step = client.forward_backward(data, "importance_sampling")
            client.optim_step(types.AdamParams(learning_rate=lr)).result()
            step.result()
    service.close("success").result()
    return history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=os.environ.get("TINKER_BASE_URL"))
    parser.add_argument("--api-key", default=os.environ.get("TINKER_API_KEY"))
    parser.add_argument("--base-model", required=True)
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    history = run(args.base_url, args.api_key, args.base_model, args.iterations)
    first, last = np.mean(history[:5]), np.mean(history[-5:])
    print(f"mean reward: first 5 iterations {first:.3f}, last 5 iterations {last:.3f}")


if __name__ == "__main__":
    main()

"""Supervised fine-tuning of a LoRA adapter with the official tinker SDK, unmodified.

Trains on a fixed toy dataset, printing the loss per token as it falls; saves the state; resumes
from it (weights and optimizer) in a new training client; lists the run and its checkpoints.

    python examples/sft.py --base-url http://127.0.0.1:8000 --api-key tml-... --base-model MODEL
"""

from __future__ import annotations

import argparse
import os
import time

import tinker
from tinker import types

LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "A journey of a thousand miles begins with a single step.",
    "To be or not to be, that is the question.",
    "All that glitters is not gold.",
]


def make_batch(tokenizer: object) -> list[types.Datum]:
    """Next-token data: model_input = tokens[:-1], target_tokens = tokens[1:], all weighted."""
    batch = []
    for line in LINES:
        ids = tokenizer.encode(line)  # type: ignore[attr-defined]
        batch.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
            )
        )
    return batch


def train(
    client: tinker.TrainingClient, batch: list[types.Datum], steps: int, lr: float, label: str
) -> list[float]:
    """`steps` pipelined forward_backward + optim_step rounds; returns the loss per token."""
    n_tokens = sum(len(d.loss_fn_inputs["target_tokens"].data) for d in batch)
    losses = []
    for step in range(steps):
        started = time.perf_counter()
        fwd = client.forward_backward(batch, "cross_entropy")
        opt = client.optim_step(types.AdamParams(learning_rate=lr))
        loss = fwd.result().metrics["loss:sum"] / n_tokens
        opt.result()
        losses.append(loss)
        print(
            f"{label} step {step:3d}  loss/token {loss:.4f}  ({(time.perf_counter() - started) * 1e3:.0f} ms)",
            flush=True,
        )
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=os.environ.get("TINKER_BASE_URL"))
    parser.add_argument("--api-key", default=os.environ.get("TINKER_API_KEY"))
    parser.add_argument("--base-model", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=5e-3)
    args = parser.parse_args()

    service = tinker.ServiceClient(base_url=args.base_url, api_key=args.api_key)
    client = service.create_lora_training_client(
        base_model=args.base_model, rank=8, seed=0
    ).result()
    batch = make_batch(client.get_tokenizer())

    losses = train(client, batch, args.steps, args.lr, "train")
    print(
        f"loss fell from {losses[0]:.4f} to {losses[-1]:.4f} ({losses[-1] / losses[0]:.0%} of the first)"
    )

    path = client.save_state(f"demo-step-{args.steps}").result().path
    print(f"saved state: {path}")
    after = train(client, batch, 3, args.lr, "continue")

    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    again = train(resumed, batch, 3, args.lr, "resumed")
    gap = max(abs(a - b) for a, b in zip(after, again, strict=True))
    print(f"resumed run repeats the original's next 3 losses (max difference {gap:.2e})")

    rest = tinker.RestClient(base_url=args.base_url, api_key=args.api_key)
    for run in rest.list_training_runs().result().training_runs:
        print(f"run {run.training_run_id}  base {run.base_model}  rank {run.lora_rank}")
        for ckpt in rest.list_checkpoints(run.training_run_id).result().checkpoints:
            print(f"    checkpoint {ckpt.tinker_path}  {ckpt.size_bytes} bytes")
    service.close("success").result()


if __name__ == "__main__":
    main()

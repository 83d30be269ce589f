"""One training scenario, run by every rank of a worker group or by one engine alone.

`python -m tests.group_harness --rank R --world N --port P --model DIR --out FILE` joins a gloo
group of N ranks on loopback, builds the engine (its share of the experts) and runs `scenario`;
rank 0 writes what it observed to FILE (safetensors). `tests/test_group_engine.py` compares that
with the same scenario on one device: tenants of different ranks sharing passes (one of them
MLP-only, one failing alone on a non-finite loss), fused optimizer steps with and without
clipping, a checkpoint saved then loaded into a new tenant, a state captured then adopted,
every adapter saved at the end, and the torch sampler drawing seeded tokens from the base model
and from a sampler checkpoint.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import safetensors.torch
import torch

from protocol.api import AdamParams, LoraConfig
from protocol.errors import TwinkleError
from protocol.sampling import SampleSpec
from protocol.tensors import DatumArrays, FwdBwdRequest
from tests.engine_helpers import Trainer
from workers.engine.collective import Collective
from workers.group.runtime import GroupSpec, join, leave

# Adam divides by the gradient's own scale: a gradient entry near 0, whose rounding differs
# between a sum over ranks and one over a device, moves its weight by up to LR whatever its size.
# With EPS above such entries the step is linear in them, and their rounding stays rounding.
LR, EPS = 0.01, 1e-3
TENANTS = (
    ("t0", 4, {}),
    ("t1", 8, {}),
    ("t2", 8, {"train_attn": False, "train_unembed": False}),
    ("t3", 16, {}),
)


def _request(
    model_id: str, lengths: list[int], rng: np.random.Generator, vocab: int
) -> FwdBwdRequest:
    datums = []
    for length in lengths:
        targets = rng.integers(0, vocab, length).astype(np.int64)
        weights = (rng.normal(size=length) / length).astype(np.float32)
        tokens = rng.integers(0, vocab, length).astype(np.int32)
        datums.append(DatumArrays(tokens, {"target_tokens": targets, "weights": weights}))
    return FwdBwdRequest(model_id, 1, "cross_entropy", False, {}, datums)


def _record(out: dict[str, torch.Tensor], key: str, result: object) -> None:
    if isinstance(result, TwinkleError):
        out[f"{key}.error"] = torch.ones(1)
        return
    for i, datum in enumerate(result.loss_fn_outputs):  # type: ignore[attr-defined]
        out[f"{key}.{i}.logprobs"] = torch.from_numpy(np.array(datum["logprobs"]))
    out[f"{key}.loss"] = torch.tensor([result.metrics["loss:sum"]])  # type: ignore[attr-defined]


def scenario(
    engine: Trainer, workdir: Path, foreign: Path | None = None
) -> dict[str, torch.Tensor]:
    """The same calls on every rank; what rank 0 saw, by name. `foreign`: a checkpoint saved
    by another group size, loaded at the end (else this run's own)."""
    out: dict[str, torch.Tensor] = {
        # what this rank holds: a slot's row length and each experts block's experts
        "meta.row": torch.tensor([engine.bank.weights.shape[1]]),
        "meta.experts": torch.tensor(
            [layer.shape.num_experts for layer in engine.bank.expert_layers.values()] or [0]
        ),
        "meta.base": torch.tensor(
            [sum(p.numel() for n, p in engine.model.named_parameters() if "lora_" not in n)]
        ),
    }
    vocab = engine.vocab_size
    rng = np.random.default_rng(0)
    for index, (model_id, rank, flags) in enumerate(TENANTS):
        engine.create(model_id, LoraConfig(rank=rank, seed=index, **flags))
    for round_ in range(2):
        batch = [
            (model_id, _request(model_id, [5 + i, 3 + round_], rng, vocab))
            for i, (model_id, _, _) in enumerate(TENANTS)
        ]
        for (model_id, _), result in zip(batch, engine.forward_backward(batch), strict=True):
            _record(out, f"r{round_}.{model_id}", result)
        steps = [
            (model_id, AdamParams(learning_rate=LR, eps=EPS, grad_clip_norm=0.5 if i % 2 else 0.0))
            for i, (model_id, _, _) in enumerate(TENANTS)
        ]
        for (model_id, _), metrics in zip(steps, engine.optim_step(steps), strict=True):
            assert isinstance(metrics, dict), metrics
            for name, value in metrics.items():
                out[f"r{round_}.{model_id}.{name}"] = torch.tensor([value])
    # a non-finite loss fails its tenant alone, and leaves its slot as it was
    bad = _request("t1", [6], rng, vocab)
    bad.datums[0].inputs["weights"][:] = 1e38  # a loss float32 cannot hold
    mixed = [("t0", _request("t0", [4], rng, vocab)), ("t1", bad)]
    for (model_id, _), result in zip(mixed, engine.forward_backward(mixed), strict=True):
        _record(out, f"bad.{model_id}", result)
    engine.optim_step([("t0", AdamParams(learning_rate=LR, eps=EPS))])
    # checkpoints and states move through the one-device layout
    engine.save("t3", workdir / "t3", kind="weights", meta={})
    _barrier(engine)  # rank 0 wrote the files every rank reads next
    state = engine.capture("t2")
    if engine.collective.rank == 0:
        for name, row in state.rows.items():
            out[f"state.t2.{name}"] = row.values.clone()
    engine.load("t9", workdir / "t3", with_optimizer=True)
    engine.adopt("t8", state)
    probe = _request("t3", [7], rng, vocab)
    for model_id in ("t3", "t9", "t2", "t8"):
        [result] = engine.forward_backward([(model_id, probe)])
        _record(out, f"probe.{model_id}", result)
    engine.optim_step(
        [(model_id, AdamParams(learning_rate=LR, eps=EPS)) for model_id in ("t9", "t8")]
    )
    for model_id in ("t0", "t1", "t2", "t3", "t8", "t9"):
        engine.save(model_id, workdir / f"final-{model_id}", kind="weights", meta={})
        if engine.collective.rank == 0:
            files = safetensors.torch.load_file(
                workdir / f"final-{model_id}" / "adapter_model.safetensors"
            )
            for key, tensor in files.items():
                out[f"final.{model_id}.{key}"] = tensor
    # the torch sampler, seeded, from the base model and from a sampler checkpoint
    engine.save("t3", workdir / "sampler-t3", kind="sampler_weights", meta={})
    _barrier(engine)
    sampler = engine.sampler()
    sampler.load_adapter("snap", workdir / "sampler-t3")
    prompt = tuple(int(t) for t in rng.integers(0, vocab, 5))
    specs = [
        (SampleSpec(prompt=prompt, num_samples=2, max_tokens=6, seed=5), None),
        (SampleSpec(prompt=prompt, num_samples=2, max_tokens=6, seed=6), "snap"),
    ]
    for index, output in enumerate(sampler.sample(specs)):
        for n, sequence in enumerate(output.sequences):
            out[f"sample.{index}.{n}.tokens"] = torch.tensor(sequence.tokens, dtype=torch.float64)
            out[f"sample.{index}.{n}.logprobs"] = torch.tensor(sequence.logprobs)
    # a checkpoint written with another number of ranks loads and trains on
    out.update(cross_check(engine, foreign or workdir / "final-t3"))
    return out


def long_scenario(engine: Trainer, workdir: Path) -> dict[str, torch.Tensor]:
    """Datums longer than the pass token budget, each a pass of its own (split by position
    over the ranks with `--context`): two tenants trained, one forward-only call, two steps,
    the adapters saved."""
    out: dict[str, torch.Tensor] = {}
    vocab = engine.vocab_size
    rng = np.random.default_rng(3)
    engine.core.pass_tokens = 64
    for index, (model_id, rank) in enumerate((("l0", 8), ("l1", 4))):
        engine.create(model_id, LoraConfig(rank=rank, seed=index))
    for round_ in range(2):
        batch = [
            ("l0", _request("l0", [301, 40], rng, vocab)),
            ("l1", _request("l1", [129 + round_], rng, vocab)),
        ]
        for (model_id, _), result in zip(batch, engine.forward_backward(batch), strict=True):
            _record(out, f"long{round_}.{model_id}", result)
        steps = [
            (m, AdamParams(learning_rate=LR, eps=EPS, grad_clip_norm=1.0)) for m in ("l0", "l1")
        ]
        for (model_id, _), metrics in zip(steps, engine.optim_step(steps), strict=True):
            assert isinstance(metrics, dict), metrics
            out[f"long{round_}.{model_id}.norm"] = torch.tensor([metrics["unclipped_grad_l2:mean"]])
    probe = _request("l1", [200], rng, vocab)
    probe = FwdBwdRequest("l1", 1, "cross_entropy", True, {}, probe.datums)
    [result] = engine.forward_backward([("l1", probe)])
    _record(out, "long.forward", result)
    for model_id in ("l0", "l1"):
        engine.save(model_id, workdir / f"long-{model_id}", kind="weights", meta={})
        if engine.collective.rank == 0:
            files = safetensors.torch.load_file(
                workdir / f"long-{model_id}" / "adapter_model.safetensors"
            )
            for key, tensor in files.items():
                out[f"long.{model_id}.{key}"] = tensor
    out["meta.splits"] = torch.tensor([engine.core.passes.context.splits_run])
    return out


def cross_check(engine: Trainer, checkpoint: Path) -> dict[str, torch.Tensor]:
    """Load `checkpoint` (with its optimizer) as a new tenant, then one pass and one step."""
    out: dict[str, torch.Tensor] = {}
    rng = np.random.default_rng(99)
    engine.load("tx", checkpoint, with_optimizer=True)
    [result] = engine.forward_backward([("tx", _request("tx", [6], rng, engine.vocab_size))])
    _record(out, "cross.tx", result)
    [metrics] = engine.optim_step(
        [("tx", AdamParams(learning_rate=LR, eps=EPS, grad_clip_norm=1.0))]
    )
    assert isinstance(metrics, dict), metrics
    out["cross.tx.norm"] = torch.tensor([metrics["unclipped_grad_l2:mean"]])
    return out


def _barrier(engine: Trainer) -> None:
    if engine.collective.parallel:
        torch.distributed.barrier()


def run_alone(model: Path, workdir: Path, *, long: bool = False) -> dict[str, torch.Tensor]:
    """The scenario (`long`: `long_scenario`) on one device (the reference)."""
    engine = Trainer(str(model), max_slots=4, max_rank=16, collective=Collective())
    return long_scenario(engine, workdir) if long else scenario(engine, workdir)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--turns", type=Path)
    parser.add_argument("--foreign", type=Path)
    # every training pass recomputes its layers in the backward (`workers.engine.recompute`)
    parser.add_argument("--recompute", action="store_true")
    # every pass split by position over the ranks (`workers.engine.context_parallel`)
    parser.add_argument("--context", action="store_true")
    parser.add_argument("--long", action="store_true")  # `long_scenario` instead
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    spec = GroupSpec(rank=args.rank, world=args.world, port=args.port, timeout_s=300)
    collective = join(spec, torch.device("cpu"))
    if args.turns is not None:  # when each rank's turn began and ended, appended to a file
        try:

            def turn() -> None:
                began = time.time()
                time.sleep(0.3)
                with args.turns.open("a") as out:
                    out.write(f"{args.rank} {began} {time.time()}\n")

            collective.in_turns(turn)
        finally:
            leave()
        return
    try:
        engine = Trainer(str(args.model), max_slots=4, max_rank=16, collective=collective)
        if args.recompute:
            engine.core.passes.recompute_tokens = 0
        context = engine.core.passes.context
        if args.context:
            assert context.supported, context.refused
            context.tokens = 0
        elif args.long:  # the default: a datum over the pass budget (tiny: from 100 tokens)
            context.floor = 100
        if args.long:
            out = long_scenario(engine, args.workdir)
        else:
            out = scenario(engine, args.workdir, args.foreign)
        if args.rank == 0:
            safetensors.torch.save_file({k: v.contiguous() for k, v in out.items()}, str(args.out))
    finally:
        leave()


if __name__ == "__main__":
    main()

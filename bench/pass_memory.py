"""Peak memory of one training pass, whole logits against logits in chunks (CPU RSS).

One pass of `--tokens` tokens (rows of 512) at vocabulary `--vocab` on a random Qwen3 (hidden
256, 2 layers, rank-16 adapters on every layer group, fp32). Each mode runs in a fresh process;
the peak resident set (VmHWM, reset just before the measured call) minus the resident set
before it is the call's extra memory. Two figures per mode:
- loss: the log-prob, loss and backward part alone, from given hidden states (`target_logprobs`
  on [tokens, hidden], then backward), i.e. what the full-logits path materialises;
- pass: a whole shared pass of those tokens (`workers.trainer.operations.run_passes`), decoder
  included.
"whole" computes the logits of all tokens at once (the former path); "chunked" uses the
model's default chunk (2**21 logits on a CPU). The full fp32 logits of the pass are printed
for scale.

    OMP_NUM_THREADS=1 .venv/bin/python bench/pass_memory.py [--tokens 8192] [--vocab 32000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

MiB = 2**20


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def child(mode: str, tokens: int, vocab: int, model_dir: str) -> None:
    import numpy as np
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from engine_merge import Trainer, request

    from protocol.api import LoraConfig
    from workers.engine.lora import Segment
    from workers.engine.passes import target_logprobs, tune_malloc

    tune_malloc()  # as the worker does: see its docstring
    torch.set_num_threads(1)
    chunk = {"logits_chunk_elements": tokens * vocab} if mode == "whole" else {}
    engine = Trainer.build(model_dir, max_slots=1, max_rank=16, pass_tokens=tokens, **chunk)
    engine.residency.create("t", LoraConfig(rank=16, seed=0))
    slot = engine.residency.slot("t")
    batch = [("t", request("t", tokens // 512, 512, vocab, 0))]
    engine.forward_backward([("t", request("t", 1, 64, vocab, 1))])  # allocator warm-up
    engine.model.bank.grads.zero_()
    figures: dict[str, int] = {}

    hidden = torch.randn(tokens, 256, requires_grad=True)
    targets = torch.from_numpy(np.random.default_rng(0).integers(0, vocab, (tokens, 1)))
    chunk_tokens = tokens if mode == "whole" else engine.model.passes.chunk_tokens
    before = _status("VmRSS")
    _reset_peak()
    logprobs = target_logprobs(
        hidden,
        targets,
        engine.model.passes.head,
        [Segment(slot, 0, tokens)],
        chunk_tokens,
        recompute=mode != "whole",
    )
    logprobs.sum().backward()  # type: ignore[no-untyped-call]
    figures["loss"] = _status("VmHWM") - before
    del logprobs, hidden
    engine.model.bank.grads.zero_()

    before = _status("VmRSS")
    _reset_peak()
    engine.forward_backward(batch)
    figures["pass"] = _status("VmHWM") - before
    print(json.dumps(figures))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--child", nargs=2, metavar=("MODE", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.tokens, args.vocab, args.child[1])
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from engine_merge import build_model

    full = args.tokens * args.vocab * 4
    print(f"{args.tokens} tokens, vocab {args.vocab}: full fp32 logits {full / MiB:.0f} MiB")
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp), args.vocab, 256, 2)
        results = {}
        for mode in ("whole", "chunked"):
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--tokens",
                    str(args.tokens),
                    "--vocab",
                    str(args.vocab),
                    "--child",
                    mode,
                    str(model),
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{'mode':>8} {'loss extra MiB':>15} {'÷ full logits':>14} {'pass extra MiB':>15}")
    for mode, figures in results.items():
        print(
            f"{mode:>8} {figures['loss'] / MiB:>15.0f} {figures['loss'] / full:>13.0%}"
            f" {figures['pass'] / MiB:>15.0f}"
        )


if __name__ == "__main__":
    main()

"""The output layer and loss of one long row: the logits never exist for the whole row.

`workers.engine.passes.target_logprobs` computes the target log-probabilities of T token rows
`chunk_tokens` rows at a time and, in a training pass, recomputes each chunk's logits in the
backward. This runs it on T hidden states (hidden 256, vocabulary 16384, fp32, one LoRA slot on
the output layer) with the engine's CPU chunk (8 MiB of logits), forward and backward, and
prints the peak resident set's growth beside what the whole row's logits alone would take.
At 256 Ki tokens those are 16 GiB, more than the development VM can hold.

    OMP_NUM_THREADS=2 .venv/bin/python bench/long_logits.py [--tokens 262144]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

MiB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=262144)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=16384)
    args = parser.parse_args()

    import torch
    from torch import nn

    sys.path.insert(0, str(Path(__file__).parent))
    from long_context import _status

    from workers.engine.lora import Segment
    from workers.engine.passes import target_logprobs, tune_malloc

    tune_malloc()
    torch.manual_seed(0)
    head = nn.Linear(args.hidden, args.vocab, bias=False).requires_grad_(False)
    hidden = torch.randn(args.tokens, args.hidden, requires_grad=True)
    targets = torch.randint(0, args.vocab, (args.tokens, 1))
    chunk = 2**21 // args.vocab  # the engine's CPU chunk: 8 MiB of fp32 logits
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    started = time.perf_counter()
    logprobs = target_logprobs(
        hidden, targets, head, [Segment(0, 0, args.tokens)], chunk, recompute=True
    )
    logprobs.sum().backward()  # type: ignore[no-untyped-call]
    seconds = time.perf_counter() - started
    growth = _status("VmHWM") - before
    whole = args.tokens * args.vocab * 4
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()
    print(
        f"{args.tokens} tokens, hidden {args.hidden}, vocabulary {args.vocab}, chunks of {chunk}"
        f" tokens: peak growth {growth / MiB:.0f} MiB (the whole row's fp32 logits alone:"
        f" {whole / MiB:.0f} MiB; the hidden states and their gradient:"
        f" {2 * hidden.numel() * 4 / MiB:.0f} MiB), forward + backward {seconds:.1f} s"
    )


if __name__ == "__main__":
    main()

"""The pass size of this device, found by measurement: where training tokens/s stops improving.

Job: time training passes as a merged pass runs them, at growing sizes (256, 512, … tokens):
several scratch adapters (up to `_TENANTS`, each on every layer group, the experts of a MoE model
included), their datums in rows of 128 tokens packed tenant by tenant, forward, loss and
backward; the median of `repeats` timings per size. It chooses the smallest size whose tokens/s
is within `tolerance` of the best seen, stopping once two larger passes in a row are no faster
(one slower measurement on a busy machine does not end it), a pass takes longer than
`max_pass_s`, or the device runs out of memory. Bigger passes past that point only add latency
(and, on a CPU, lose throughput to cache misses); smaller ones leave the device idle between
kernels.

The result is cached per model, device and thread count under the data directory, so a worker
measures once; `--token-budget` (TWINKLE_TOKEN_BUDGET) skips all of this.

Invariants: runs on the engine's thread before the worker serves, on a slot it frees again;
changes no tenant's state (it runs before any exists, and refuses to run once one does).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from protocol.api import LoraConfig
from protocol.tensors import DatumArrays, FwdBwdRequest
from workers.trainer.engine import Engine

log = logging.getLogger(__name__)

SCRATCH = "calibration"
_ROW_TOKENS = 128  # a typical datum of a merged pass (4 x 128 tokens is bench/engine_merge's)
_TENANTS = 4


@dataclass(frozen=True)
class Calibration:
    """The chosen pass size and the measured curve: (tokens, tokens per second) by size."""

    pass_tokens: int
    curve: tuple[tuple[int, float], ...]


def measure(
    engine: Engine,
    *,
    smallest: int = 256,
    largest: int = 32768,
    tolerance: float = 0.05,
    max_pass_s: float = 1.0,
    repeats: int = 3,
) -> Calibration:
    """Time merged passes of doubling size on scratch slots; see the module docstring."""
    if engine.slots_used():
        raise RuntimeError("calibration runs before any tenant is loaded")
    rng = np.random.default_rng(0)
    placeholder = None if engine.vision is None else engine.vision.image_token_id
    tenants = [f"{SCRATCH}-{i}" for i in range(min(_TENANTS, engine.max_slots))]
    for index, model_id in enumerate(tenants):
        engine.create(model_id, LoraConfig(rank=min(16, engine.max_rank), seed=index))
    saved = engine.pass_tokens
    curve: list[tuple[int, float]] = []
    try:
        size = smallest
        while size <= largest:
            row = min(_ROW_TOKENS, size, engine.max_context)
            rows = max(1, size // row)
            batch = [
                (model_id, _request(rng, model_id, share, row, engine.vocab_size, placeholder))
                for model_id, share in zip(tenants, _shares(rows, len(tenants)), strict=True)
                if share
            ]
            engine.pass_tokens = size
            try:
                engine.forward_backward(batch)  # warm-up
                timings = []
                for _ in range(repeats):
                    started = time.perf_counter()
                    engine.forward_backward(batch)
                    timings.append(time.perf_counter() - started)
                seconds = sorted(timings)[len(timings) // 2]
            except torch.OutOfMemoryError:
                log.info("calibration: a pass of %d tokens does not fit", size)
                break
            finally:
                engine.bank.grads.zero_()
            curve.append((size, size / seconds))
            best = max(rate for _, rate in curve)
            if seconds > max_pass_s or all(rate < best for _, rate in curve[-2:]):
                break
            size *= 2
    finally:
        engine.pass_tokens = saved
        for model_id in tenants:
            engine.release(model_id)
    best = max(rate for _, rate in curve)
    chosen = min(size for size, rate in curve if rate >= (1 - tolerance) * best)
    return Calibration(chosen, tuple(curve))


def cached_or_measured(engine: Engine, directory: Path, threads: int) -> Calibration:
    """This model and device's calibration from `directory`, measured and stored if absent."""
    # v3: past one slower size, and with the CPU allocator settings of `tune_malloc`
    # (v2: stopped at the first slower size; v1 timed one tenant in 256-token rows)
    key = f"v3|{engine.base_model}|{engine.device}|{engine.dtype}|{threads}"
    path = directory / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    try:
        data = json.loads(path.read_text())
        return Calibration(int(data["pass_tokens"]), tuple(map(tuple, data["curve"])))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    found = measure(engine)
    directory.mkdir(parents=True, exist_ok=True)
    record = {"key": key, "pass_tokens": found.pass_tokens, "curve": found.curve}
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(record))
    temporary.replace(path)
    log.info(
        "calibrated %s: passes of %d tokens (%s)",
        engine.base_model,
        found.pass_tokens,
        ", ".join(f"{size}: {rate:.0f} tok/s" for size, rate in found.curve),
    )
    return found


def _shares(rows: int, tenants: int) -> list[int]:
    """`rows` dealt to `tenants` as evenly as possible."""
    return [rows // tenants + (index < rows % tenants) for index in range(tenants)]


def _request(
    rng: np.random.Generator,
    model_id: str,
    rows: int,
    length: int,
    vocab: int,
    placeholder: int | None = None,
) -> FwdBwdRequest:
    """Random text; a VL model's image placeholder id (which only an image may hold) is not
    drawn."""
    datums = []
    for _ in range(max(1, rows)):
        tokens = rng.integers(0, vocab, size=length + 1)
        if placeholder is not None:
            tokens[tokens == placeholder] = (placeholder + 1) % vocab
        datums.append(
            DatumArrays(
                tokens=tokens[:-1].astype(np.int32),
                inputs={"target_tokens": tokens[1:].astype(np.int64)},
            )
        )
    return FwdBwdRequest(model_id, 0, "cross_entropy", False, {}, datums)

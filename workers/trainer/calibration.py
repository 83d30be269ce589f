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

It runs on the multi-slot model alone (`workers.engine.model`), on scratch slots it clears
again. On a worker group every rank runs it in step (`workers.group.mirror`): each timing is
the slowest rank's, so every rank makes the same choices and runs the same passes.

Invariants: runs on the engine's thread before the worker serves, before any slot is assigned;
leaves every slot it used zeroed, as it found it.
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

from protocol.tensors import DatumArrays, FwdBwdRequest
from workers.engine.model import MultiSlotModel

log = logging.getLogger(__name__)

_ROW_TOKENS = 128  # a typical datum of a merged pass (4 x 128 tokens is bench/engine_merge's)
_TENANTS = 4


@dataclass(frozen=True)
class Calibration:
    """The chosen pass size and the measured curve: (tokens, tokens per second) by size."""

    pass_tokens: int
    curve: tuple[tuple[int, float], ...]


def measure(
    model: MultiSlotModel,
    *,
    smallest: int = 256,
    largest: int = 32768,
    tolerance: float = 0.05,
    max_pass_s: float = 1.0,
    repeats: int = 3,
) -> Calibration:
    """Time merged passes of doubling size on scratch slots; see the module docstring."""
    rng = np.random.default_rng(0)
    placeholder = None if model.vision is None else model.vision.image_token_id
    slots = list(range(min(_TENANTS, model.max_slots)))
    rank = min(16, model.max_rank)
    for slot in slots:
        generator = torch.Generator().manual_seed(slot)
        groups = model.bank.groups_present()
        model.bank.init_slot(slot, rank=rank, groups=groups, lora_alpha=32.0, generator=generator)
    saved = model.pass_tokens
    curve: list[tuple[int, float]] = []
    try:
        size = smallest
        while size <= largest:
            row = min(_ROW_TOKENS, size, model.max_context)
            rows = max(1, size // row)
            shared = [
                (slot, model.validate(_request(rng, share, row, model.vocab_size, placeholder)))
                for slot, share in zip(slots, _shares(rows, len(slots)), strict=True)
                if share
            ]
            items = [checked for _, checked in shared]
            item_slots = [slot for slot, _ in shared]
            model.pass_tokens = size
            try:
                model.forward_backward(items, item_slots)  # warm-up
                timings = []
                for _ in range(repeats):
                    started = time.perf_counter()
                    model.forward_backward(items, item_slots)
                    timings.append(time.perf_counter() - started)
                seconds = _slowest(model, sorted(timings)[len(timings) // 2])
            except torch.OutOfMemoryError:
                log.info("calibration: a pass of %d tokens does not fit", size)
                break
            finally:
                model.bank.grads.zero_()
            curve.append((size, size / seconds))
            best = max(rate for _, rate in curve)
            if seconds > max_pass_s or all(rate < best for _, rate in curve[-2:]):
                break
            size *= 2
    finally:
        model.pass_tokens = saved
        for slot in slots:
            model.bank.clear_slot(slot)
            model.optimizer.reset_slot(slot)
    best = max(rate for _, rate in curve)
    chosen = min(size for size, rate in curve if rate >= (1 - tolerance) * best)
    return Calibration(chosen, tuple(curve))


def _slowest(model: MultiSlotModel, seconds: float) -> float:
    """The slowest rank's timing (in microseconds, agreed): every rank then chooses alike."""
    return model.collective.agree_max([max(1, round(seconds * 1e6))])[0] / 1e6


def cached_or_measured(model: MultiSlotModel, directory: Path, threads: int) -> Calibration:
    """This model and device's calibration from `directory`, measured and stored if absent."""
    found = cached(model, directory, threads)
    if found is None:
        found = measure(model)
        store_calibration(model, directory, threads, found)
    return found


def _path(model: MultiSlotModel, directory: Path, threads: int) -> tuple[str, Path]:
    # v3: past one slower size, and with the CPU allocator settings of `tune_malloc`
    # (v2: stopped at the first slower size; v1 timed one tenant in 256-token rows)
    key = f"v3|{model.base_model}|{model.device}|{model.dtype}|{threads}"
    return key, directory / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def cached(model: MultiSlotModel, directory: Path, threads: int) -> Calibration | None:
    """The stored calibration of this model, device and thread count; None if there is none."""
    _, path = _path(model, directory, threads)
    try:
        data = json.loads(path.read_text())
        return Calibration(int(data["pass_tokens"]), tuple(map(tuple, data["curve"])))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store_calibration(
    model: MultiSlotModel, directory: Path, threads: int, found: Calibration
) -> None:
    """Keep a measured calibration for the next start (written whole, then renamed)."""
    key, path = _path(model, directory, threads)
    directory.mkdir(parents=True, exist_ok=True)
    record = {"key": key, "pass_tokens": found.pass_tokens, "curve": found.curve}
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(record))
    temporary.replace(path)
    log.info(
        "calibrated %s: passes of %d tokens (%s)",
        model.base_model,
        found.pass_tokens,
        ", ".join(f"{size}: {rate:.0f} tok/s" for size, rate in found.curve),
    )


def _shares(rows: int, tenants: int) -> list[int]:
    """`rows` dealt to `tenants` as evenly as possible."""
    return [rows // tenants + (index < rows % tenants) for index in range(tenants)]


def _request(
    rng: np.random.Generator,
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
    return FwdBwdRequest("", 0, "cross_entropy", False, {}, datums)

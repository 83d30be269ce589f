"""Sampling inside the trainer: generation on the engine's own multi-slot model (DESIGN.md §5),
so a tenant samples its snapshot weights without exporting them to another process.

Job: run a batch of `SampleSpec`s, each from the base model or from a snapshot adapter, as one
generation with a KV cache, and answer each with a `SampleOutput`.

Step 1 (`load_adapter`): a sampler checkpoint becomes an inference-only snapshot slot of the
        engine's bank (`Engine.load_snapshot`), cached by key.
Step 2 (prefill): one row per request, left-padded, rows grouped by slot so each slot is one
        routing segment; position ids count real tokens only. The logits give the prompt
        logprobs and each request's first-token distribution.
Step 3 (expand): the cache's rows are repeated to one row per sample.
Step 4 (decode): each row draws its token, records the token's raw logprob and checks its stops;
        finished rows leave the cache and the rest take one step together.

Invariants:
- Logprobs are raw: log_softmax of the model's logits, before temperature, top-k and top-p,
  exactly what the trainer's forward computes for the same tokens.
- A row's tokens depend only on its request, its adapter and (seed, sample index): its noise
  comes from its own generator, and other rows and padding change its logits only by rounding.
- Snapshots are immutable: training writes tenant slots only.
- Synchronous and single-threaded, on the engine's thread; no gradients are recorded.

Qwen3.5's linear-attention layers batch the same way: they zero the hidden states of padded
positions, and with bias-free projections and convolution a left pad leaves their state at zero.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from transformers import AutoTokenizer, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from protocol.errors import NotFound
from protocol.sampling import SampledSequence, SampleOutput, SampleSpec
from workers.engine import Engine
from workers.lora import BASE_SLOT, Segment

# A stop string of n characters spans at most 4n tokens (a character has at most four bytes, a
# token at least one); the margin is slack. Only this tail of a row is detokenized each step.
_BYTES_PER_CHAR = 4
_STOP_WINDOW_MARGIN = 8


@dataclass
class _Row:
    """One sample in generation."""

    request: int  # index into the batch's requests
    slot: int
    spec: SampleSpec
    generator: torch.Generator | None  # None for greedy rows
    stop_ids: frozenset[int]
    stop_window: int  # tokens detokenized for the stop-string check
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: Literal["stop", "length"] | None = None


class TorchSampler:
    """Batched sampling from the base model and snapshot adapters of one `Engine`."""

    def __init__(self, engine: Engine, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(engine.base_model)
        self.eos_token_ids = _eos_token_ids(engine.model, self.tokenizer)
        # Where each key was loaded from, so an evicted snapshot can come back for a batch.
        self._directories: dict[str, Path] = {}

    def load_adapter(self, key: str, directory: Path) -> None:
        """Load a sampler checkpoint as snapshot `key`; a loaded key is kept as it is.

        May evict the least recently used snapshot; never a tenant's adapter.
        """
        self.engine.load_snapshot(key, directory)
        self._directories[key] = directory

    def has_adapter(self, key: str) -> bool:
        """Whether snapshot `key` is in a slot now."""
        return self.engine.has_snapshot(key)

    def sample(self, requests: list[tuple[SampleSpec, str | None]]) -> list[SampleOutput]:
        """One output per (spec, adapter key or None for the base model), in request order.

        All requests run as one generation, unless they name more snapshots than fit in the
        slots no tenant holds: then one generation per group of snapshots that fit, reloading
        evicted snapshots from where they were loaded.
        """
        outputs: list[SampleOutput | None] = [None] * len(requests)
        for wave in self._waves(requests):
            if not wave:
                continue
            slots = self._slots([key for _, key in (requests[i] for i in wave)])
            specs = [requests[i][0] for i in wave]
            with torch.no_grad():
                results = self._generate(specs, slots)
            for index, output in zip(wave, results, strict=True):
                outputs[index] = output
        return [output for output in outputs if output is not None]

    # -- slots -----------------------------------------------------------------------------

    def _waves(self, requests: list[tuple[SampleSpec, str | None]]) -> list[list[int]]:
        """Request indices per generation: each names at most as many snapshots as fit."""
        capacity = max(1, self.engine.snapshot_capacity())
        keys = list(dict.fromkeys(key for _, key in requests if key is not None))
        chunks = [keys[i : i + capacity] for i in range(0, len(keys), capacity)] or [[]]
        wave_of = {key: number for number, chunk in enumerate(chunks) for key in chunk}
        waves: list[list[int]] = [[] for _ in chunks]
        for index, (_, key) in enumerate(requests):
            waves[0 if key is None else wave_of[key]].append(index)
        return waves

    def _slots(self, keys: list[str | None]) -> list[int]:
        """Each request's slot; snapshots of this wave are marked used before any is reloaded,
        so a reload evicts only snapshots outside the wave."""
        wanted = [key for key in dict.fromkeys(keys) if key is not None]
        missing = []
        for key in wanted:
            if self.engine.has_snapshot(key):
                self.engine.snapshot_slot(key)
            else:
                missing.append(key)
        for key in missing:
            directory = self._directories.get(key)
            if directory is None:
                raise NotFound(f"sampler adapter {key!r} was never loaded on this worker")
            self.engine.load_snapshot(key, directory)
        slot_of = {key: self.engine.snapshot_slot(key) for key in wanted}
        return [BASE_SLOT if key is None else slot_of[key] for key in keys]

    # -- generation ------------------------------------------------------------------------

    def _generate(self, specs: list[SampleSpec], slots: list[int]) -> list[SampleOutput]:
        """Steps 2-4 for requests that all have their slots: one prefill, one decode loop."""
        device = self.engine.device
        # Prefill rows grouped by slot (stable), so each slot's rows form one segment.
        first_seen = {slot: rank for rank, slot in enumerate(dict.fromkeys(slots))}
        order = sorted(range(len(specs)), key=lambda index: first_seen[slots[index]])
        want_prompt = any(spec.prompt_logprobs or spec.topk_prompt_logprobs for spec in specs)
        cache = DynamicCache(config=self.engine.model.config)
        logits, attention_mask = self._prefill(
            [specs[i].prompt for i in order], [slots[i] for i in order], cache, want_prompt
        )

        outputs = [SampleOutput(sequences=[]) for _ in specs]
        rows: list[_Row] = []
        source: list[int] = []  # the prefill row each sample row continues
        width = logits.shape[1]
        for prefill_row, index in enumerate(order):
            spec = specs[index]
            if want_prompt:
                prompt_logits = logits[prefill_row, width - len(spec.prompt) :]
                _fill_prompt_logprobs(outputs[index], spec, prompt_logits)
            for sample_index in range(spec.num_samples):
                rows.append(self._row(index, slots[index], spec, sample_index))
                source.append(prefill_row)
        expand = torch.tensor(source, device=device)
        # `reorder_cache` is annotated LongTensor; any int64 index tensor is what it takes.
        cache.reorder_cache(expand)  # type: ignore[arg-type]
        attention_mask = attention_mask[expand]
        next_logits = logits[:, -1][expand]
        del logits

        active = rows
        while True:
            tokens = self._choose(next_logits, active)
            keep = [i for i, row in enumerate(active) if row.stop_reason is None]
            if not keep:
                break
            if len(keep) < len(active):
                kept = torch.tensor(keep, device=device)
                cache.reorder_cache(kept)  # type: ignore[arg-type]
                attention_mask = attention_mask[kept]
                active = [active[i] for i in keep]
                tokens = [tokens[i] for i in keep]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(active), 1)], 1)
            with self._routed([row.slot for row in active]):
                next_logits = self.engine.model(
                    input_ids=torch.tensor(tokens, device=device)[:, None],
                    attention_mask=attention_mask,
                    position_ids=attention_mask.sum(-1, keepdim=True) - 1,
                    past_key_values=cache,
                    use_cache=True,
                ).logits[:, -1]

        for row in rows:
            assert row.stop_reason is not None
            outputs[row.request].sequences.append(
                SampledSequence(row.tokens, row.logprobs, row.stop_reason)
            )
        return outputs

    def _prefill(
        self,
        prompts: list[tuple[int, ...]],
        slots: list[int],
        cache: DynamicCache,
        every_position: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the left-padded prompts into `cache`: (logits, attention mask).

        Logits are [rows, width, vocab] with `every_position`, else the last position's only.
        """
        width = max(len(prompt) for prompt in prompts)
        input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
        attention_mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        device = self.engine.device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        with self._routed(slots):
            logits = self.engine.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=0 if every_position else 1,
            ).logits
        return logits, attention_mask

    def _routed(self, slots: Sequence[int]) -> contextlib.AbstractContextManager[None]:
        """Bind the rows' slots for one forward; base-only passes need no routing."""
        if all(slot == BASE_SLOT for slot in slots):
            return contextlib.nullcontext()
        return self.engine.routing.bind(_segments(slots))

    def _row(self, request: int, slot: int, spec: SampleSpec, sample_index: int) -> _Row:
        generator = None
        if spec.temperature > 0:
            generator = torch.Generator(device=self.engine.device)
            if spec.seed is None:
                generator.seed()
            else:
                generator.manual_seed(_row_seed(spec.seed, sample_index))
        stop_ids = frozenset(spec.stop_token_ids)
        if spec.stop_at_eos:
            stop_ids |= self.eos_token_ids
        longest = max((len(stop) for stop in spec.stop_strings), default=0)
        window = _BYTES_PER_CHAR * longest + _STOP_WINDOW_MARGIN
        return _Row(request, slot, spec, generator, stop_ids, window)

    def _choose(self, logits: torch.Tensor, rows: list[_Row]) -> list[int]:
        """Draw each row's next token from `logits` [rows, vocab]; record it and its stops."""
        logits = logits.float()
        chosen = logits.argmax(dim=-1)
        drawn = [i for i, row in enumerate(rows) if row.generator is not None]
        if drawn:
            index = torch.tensor(drawn, device=logits.device)
            specs = [rows[i].spec for i in drawn]
            scaled = logits[index] / logits.new_tensor([s.temperature for s in specs])[:, None]
            if any(s.top_k > 0 or s.top_p < 1.0 for s in specs):
                vocab = scaled.shape[-1]
                top_k = [s.top_k if s.top_k > 0 else vocab for s in specs]
                top_p = [s.top_p if s.top_p < 1.0 else float("inf") for s in specs]
                scaled = _keep_top_k_top_p(
                    scaled, logits.new_tensor(top_k).long(), logits.new_tensor(top_p)
                )
            probs = torch.softmax(scaled, dim=-1)
            # The exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. is a draw from p.
            noise = torch.empty_like(probs)
            for j, i in enumerate(drawn):
                noise[j].exponential_(generator=rows[i].generator)
            noise.clamp_(min=torch.finfo(noise.dtype).tiny)
            chosen[index] = (probs / noise).argmax(dim=-1)
        raw = torch.log_softmax(logits, dim=-1).gather(-1, chosen[:, None])[:, 0]
        tokens: list[int] = chosen.tolist()
        for row, token, logprob in zip(rows, tokens, raw.tolist(), strict=True):
            row.tokens.append(token)
            row.logprobs.append(logprob)
            if token in row.stop_ids or self._completes_stop_string(row):
                row.stop_reason = "stop"
            elif len(row.tokens) >= row.spec.max_tokens:
                row.stop_reason = "length"
        return tokens

    def _completes_stop_string(self, row: _Row) -> bool:
        """Whether the newest token completed a stop string in the generated text.

        Earlier tokens were checked at their own step, so any stop string now in the text's tail
        is a new one; the tail covers every token a stop string can span.
        """
        if not row.spec.stop_strings:
            return False
        text = self.tokenizer.decode(
            row.tokens[-row.stop_window :],
            skip_special_tokens=True,
            clean_up_tokenization_spaces=False,
        )
        return any(stop in text for stop in row.spec.stop_strings)


def _fill_prompt_logprobs(output: SampleOutput, spec: SampleSpec, logits: torch.Tensor) -> None:
    """Prompt logprobs from the prefill logits of one prompt ([len(prompt), vocab])."""
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)  # position i predicts prompt[i+1]
    if spec.prompt_logprobs:
        targets = torch.tensor(spec.prompt[1:], device=logits.device, dtype=torch.long)
        values = logprobs.gather(-1, targets[:, None])[:, 0].tolist()
        output.prompt_logprobs = [None, *values]
    if spec.topk_prompt_logprobs > 0:
        k = min(spec.topk_prompt_logprobs, logprobs.shape[-1])
        top = logprobs.topk(k, dim=-1)
        pairs = zip(top.indices.tolist(), top.values.tolist(), strict=True)
        output.topk_prompt_logprobs = [[]] + [
            list(zip(ids, values, strict=True)) for ids, values in pairs
        ]


def _keep_top_k_top_p(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """`scaled` logits with every token outside each row's top-k, then top-p nucleus, at -inf.

    The nucleus is the smallest prefix of the sorted distribution whose mass reaches top_p; the
    most likely token is always kept.
    """
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[-1], device=scaled.device)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return scaled.scatter(-1, order, sorted_logits)


def _segments(slots: Sequence[int]) -> list[Segment]:
    """Runs of equal slots as routing segments."""
    segments: list[Segment] = []
    start = 0
    for index in range(1, len(slots) + 1):
        if index == len(slots) or slots[index] != slots[start]:
            segments.append(Segment(slots[start], start, index))
            start = index
    return segments


def _row_seed(seed: int, sample_index: int) -> int:
    """A 64-bit generator seed for sample `sample_index` of a request seeded with `seed`."""
    sequence = np.random.SeedSequence([seed % 2**64, sample_index])
    return int(sequence.generate_state(1, np.uint64)[0])


def _eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """End-of-sequence ids from the generation config, the model config and the tokenizer."""
    sources = (
        getattr(model, "generation_config", None),
        model.config.get_text_config(),
        tokenizer,
    )
    ids: set[int] = set()
    for source in sources:
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return frozenset(ids)

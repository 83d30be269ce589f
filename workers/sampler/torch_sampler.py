"""Sampling on the trainer's own multi-slot model (`workers.engine.model`), so a tenant samples
its snapshot weights without exporting them to another process.

Job: generate for `SampleSpec`s, each from the base model or from a snapshot adapter, with
continuous batching: requests are `submit`ted at any time and join the running generation at
its next step, and each is answered as soon as its last sample finishes. `step` does one step:

Step 1 (admit): waiting requests join in arrival order while their snapshots fit in the slots no
        tenant holds (`SnapshotSlots.snapshot_capacity`) together with the running rows'; a request
        whose snapshot does not fit waits, and so does every later one that needs a new
        snapshot (base-model requests pass), so none waits forever. A sampler checkpoint becomes
        an inference-only snapshot slot of the model's bank, by key, through whoever assigns
        the slots (`workers.sampler.snapshots.SnapshotSlots`: the trainer's residency).
Step 2 (prefill): one row per admitted request, left-padded, rows grouped by slot so each slot
        is one routing segment; position ids count real tokens only. The decoder's last
        hidden states go through the output layer at each row's last position (each request's
        first-token distribution) and, one request at a time, at every prompt position of a
        request that asks for prompt outputs (prompt logprobs, top-k, target ids,
        alternative-token draws, the last n only when asked): full-vocabulary logits exist
        only for the prompts that need them, one prompt at once. A request whose prompt
        outputs fail is answered with the error; the others go on. The cache's rows are
        repeated to one row per sample, and the batch merges into the running one
        (`workers.sampler.batch.RunningBatch.merge`: the narrower side is left-padded further).
Step 3 (draw): each row draws its token, records the token's raw logprob and checks its stops.
Step 4 (retire): finished rows leave the batch; a request whose samples have all finished is
        returned by `step`.
Step 5 (decode): the remaining rows take one step together. Their snapshots are looked up again
        first, since a training call between two steps may have taken a snapshot's slot (it is
        reloaded); if they no longer all fit, the rows step in groups that do.

`sample` runs requests to completion with these steps (tests, tools). The trainer's service calls
`submit` and `step` on the engine's thread, one step per executor call, so training calls run
between two steps (`workers.sampler.backends.TorchBackend`).

Invariants:
- Logprobs are raw: log_softmax of the model's logits, before temperature, top-k and top-p,
  exactly what the trainer's forward computes for the same tokens (the same decoder and
  output layer, `MultiSlotModel.decoder` and `.head`). A temperature below
  `protocol.sampling.GREEDY_TEMPERATURE` is greedy.
- A row's tokens depend only on its request, its adapter and (seed, sample index): its noise
  comes from its own generator, and other rows, padding and the step at which it joined change
  its logits only by rounding.
- Snapshots are immutable: training writes tenant slots only.
- Synchronous and single-threaded, on the engine's thread; no gradients are recorded.

Qwen3.5's linear-attention layers batch the same way: they zero the hidden states of padded
positions, and with bias-free projections and convolution a left pad leaves their state at zero;
their state has no sequence axis, so joining a running batch concatenates it row-wise. A model
whose cache holds other layer kinds (sliding windows) does not merge: its requests join only an
empty batch, i.e. everything waiting runs as one generation, as before continuous batching.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn
from transformers import AutoTokenizer, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from protocol.errors import NotFound, ServerError, TwinkleError, UserError
from protocol.sampling import SampleOutput, SampleSpec
from workers.engine import memory
from workers.engine.lora import BASE_SLOT, Segment
from workers.engine.model import MultiSlotModel
from workers.engine.passes import head_logits
from workers.sampler.batch import (
    Request,
    Row,
    RunningBatch,
    fill_prompt_outputs,
    mergeable,
    pads_prompts,
)
from workers.sampler.snapshots import SnapshotSlots

# A stop string of n characters spans at most 4n tokens (a character has at most four bytes, a
# token at least one); the margin is slack. Only this tail of a row is detokenized each step.
_BYTES_PER_CHAR = 4
_STOP_WINDOW_MARGIN = 8

# The most positions (rows x columns) one prefill chunk runs: a longer batch of text prompts
# is prefilled in chunks of columns (`TorchSampler._prefill`); the memory plan counts one.
PREFILL_TOKENS = memory.PREFILL_TOKENS

_PROMPT_OUTPUTS_FAILED = "the sampler failed on this request's prompt outputs; see its log"

log = logging.getLogger(__name__)

Finished = tuple[int, SampleOutput | TwinkleError]  # (ticket, answer)


class TorchSampler:
    """Continuously batched sampling from the base model and snapshot adapters of one model."""

    def __init__(
        self,
        model: MultiSlotModel,
        snapshots: SnapshotSlots,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        self.model = model
        self.snapshots = snapshots
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(model.base_model)
        self.eos_token_ids = _eos_token_ids(model.model, self.tokenizer)
        # Where each key was loaded from, so an evicted snapshot can come back.
        self._directories: dict[str, Path] = {}
        # prompts of different lengths padded into one batch (else: one length a batch)
        self._pads = pads_prompts(model.model)
        self._merges = mergeable(model.model.config) and self._pads
        self._waiting: deque[Request] = deque()
        self._running: RunningBatch | None = None
        self._tickets = 0

    def load_adapter(self, key: str, directory: Path) -> None:
        """Load a sampler checkpoint as snapshot `key`; a loaded key is kept as it is.

        May evict the least recently used snapshot; never a tenant's adapter.
        """
        self.snapshots.load_snapshot(key, directory)
        self._directories[key] = directory

    def has_adapter(self, key: str) -> bool:
        """Whether snapshot `key` is in a slot now."""
        return self.snapshots.has_snapshot(key)

    # -- continuous batching -----------------------------------------------------------------

    def submit(self, spec: SampleSpec, key: str | None, directory: Path | None = None) -> int:
        """Queue a request (from snapshot `key`, loaded from `directory` when it joins, or the
        base model for None); its ticket, which `step` returns with its answer."""
        if key is not None and directory is not None:
            self._directories[key] = directory
        self._tickets += 1
        self._waiting.append(Request(self._tickets, spec, key))
        return self._tickets

    @property
    def busy(self) -> bool:
        """Whether requests are waiting or generating."""
        return bool(self._waiting) or self._running is not None

    def step(self) -> list[Finished]:
        """Steps 1-5 once: the requests that finished, with their outputs or errors."""
        finished: list[Finished] = []
        with torch.no_grad():
            joining = self._admit(finished)
            batch = self._prefill_batch(joining, finished) if joining else None
            if batch is not None:
                if self._running is None:
                    self._running = batch
                else:
                    self._running.merge(batch)
            if self._running is not None:
                finished += self._advance(self._running)
        return finished

    def drawn(self, ticket: int) -> dict[int, list[int]]:
        """The tokens each sequence of request `ticket` has drawn so far, by sample index
        (finished sequences included); empty while it waits or once answered."""
        found: dict[int, list[int]] = {}
        batch = self._running
        for row in batch.rows if batch is not None else []:
            if row.request.ticket == ticket:
                if not found:
                    found = {i: list(seq.tokens) for i, seq in row.request.sequences.items()}
                found[row.sample_index] = list(row.tokens)
        return found

    def cancel(self, ticket: int) -> int | None:
        """Drop request `ticket`, waiting or generating (its client cancelled it): the tokens
        its rows still in generation had drawn, None if the sampler no longer holds it."""
        for request in self._waiting:
            if request.ticket == ticket:
                self._waiting.remove(request)
                return 0
        batch = self._running
        if batch is None:
            return None
        keep = [i for i, row in enumerate(batch.rows) if row.request.ticket != ticket]
        if len(keep) == len(batch.rows):
            return None
        tokens = sum(len(row.tokens) for row in batch.rows if row.request.ticket == ticket)
        if keep:
            batch.keep(keep)
        else:
            self._running = None
        return tokens

    def abort(self) -> None:
        """Drop every waiting and generating request: after a failed step, whose requests may
        be half-way through it, nothing in the sampler is answered."""
        self._waiting.clear()
        self._running = None

    def sample(self, requests: list[tuple[SampleSpec, str | None]]) -> list[SampleOutput]:
        """One output per (spec, adapter key or None for the base model), in request order,
        stepping until they (and anything submitted before) are done; raises the first error."""
        tickets = [self.submit(spec, key) for spec, key in requests]
        answers: dict[int, SampleOutput | TwinkleError] = {}
        while self.busy:
            answers.update(self.step())
        outputs = []
        for ticket in tickets:
            answer = answers[ticket]
            if isinstance(answer, TwinkleError):
                raise answer
            outputs.append(answer)
        return outputs

    # -- step 1: admission and slots -----------------------------------------------------------

    def _admit(self, finished: list[Finished]) -> list[Request]:
        """Waiting requests that join now, their snapshots loaded; failed loads are answered."""
        if self._running is not None and not self._merges:
            return []
        capacity = max(1, self.snapshots.snapshot_capacity())
        running = [] if self._running is None else [row.key for row in self._running.rows]
        in_use = {key for key in running if key is not None}
        joining: list[Request] = []
        blocked = False
        length = None if self._pads else len(self._waiting[0].spec.prompt) if self._waiting else 0
        for request in list(self._waiting):
            key = request.key
            if length is not None and len(request.spec.prompt) != length:
                continue  # waits for a batch of its own length, in arrival order
            if key is None or (not blocked and (key in in_use or len(in_use) < capacity)):
                joining.append(request)
                self._waiting.remove(request)
                if key is not None:
                    in_use.add(key)
            else:
                blocked = True
        # Running snapshots are marked used first, so a load evicts only snapshots outside them.
        resolved = self._resolve([*running, *(request.key for request in joining)])
        admitted = []
        for request in joining:
            slot = resolved[request.key]
            if isinstance(slot, TwinkleError):
                finished.append((request.ticket, slot))
            else:
                admitted.append(request)
        return admitted

    def _resolve(self, keys: Sequence[str | None]) -> dict[str | None, int | TwinkleError]:
        """Each key's slot, loading missing snapshots from where they were loaded before (or
        the error that stopped it); loaded ones are marked used before any load."""
        wanted = [key for key in dict.fromkeys(keys) if key is not None]
        for key in wanted:
            if self.snapshots.has_snapshot(key):
                self.snapshots.snapshot_slot(key)
        slots: dict[str | None, int | TwinkleError] = {None: BASE_SLOT}
        for key in wanted:
            try:
                if not self.snapshots.has_snapshot(key):
                    directory = self._directories.get(key)
                    if directory is None:
                        raise NotFound(f"sampler adapter {key!r} was never loaded on this worker")
                    self.snapshots.load_snapshot(key, directory)
                slots[key] = self.snapshots.snapshot_slot(key)
            except TwinkleError as err:
                slots[key] = err
        return slots

    def _slots(self, rows: Sequence[Row]) -> list[int]:
        """Each row's slot now (reloading evicted snapshots); the rows' keys must all fit."""
        resolved = self._resolve([row.key for row in rows])
        for row in rows:
            slot = resolved[row.key]
            if isinstance(slot, TwinkleError):
                raise slot
            row.slot = slot
        return [row.slot for row in rows]

    # -- step 2: prefill -----------------------------------------------------------------------

    def _prefill_batch(
        self, requests: list[Request], finished: list[Finished]
    ) -> RunningBatch | None:
        """The admitted requests prefilled, one row per sample, with their prompt outputs
        filled; a request whose images do not decode or whose prompt outputs fail is answered
        with an error in `finished` and leaves (None when no request is left)."""
        device = self.model.device
        pixels: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for request in list(requests):
            if request.spec.images:
                try:
                    pixels[request.ticket] = self._pixels(request.spec)
                except UserError as err:  # this request's own images: the others carry on
                    finished.append((request.ticket, err))
                    requests.remove(request)
        if not requests:
            return None
        first_seen = {key: rank for rank, key in enumerate(dict.fromkeys(r.key for r in requests))}
        requests = sorted(requests, key=lambda request: first_seen[request.key])
        rows = [[self._row(r, index) for index in range(r.spec.num_samples)] for r in requests]
        self._slots([row for request_rows in rows for row in request_rows])
        slots = [request_rows[0].slot for request_rows in rows]  # one per request, in order
        cache = DynamicCache(config=self.model.model.config)
        last, prompt_hidden, attention_mask, deltas = self._prefill(
            [r.spec for r in requests], slots, cache, [pixels.get(r.ticket) for r in requests]
        )
        for request_rows, delta in zip(rows, deltas, strict=True):
            for row in request_rows:
                row.rope_delta = delta
        next_logits = self._head(last, _segments(slots))
        kept: list[Row] = []
        source: list[int] = []  # the prefill row each kept sample row continues
        for prefill_row, request in enumerate(requests):
            spec = request.spec
            if spec.needs_prompt_rows:
                try:
                    # The full-vocabulary rows of this one prompt, so a batch holds at most
                    # len(prompt) x vocabulary logits at once, whatever else it prefills.
                    length = len(spec.prompt)
                    prompt_logits = self._head(
                        prompt_hidden[prefill_row], [Segment(slots[prefill_row], 0, length)]
                    )
                    fill_prompt_outputs(request.output, spec, prompt_logits)
                    del prompt_logits
                except Exception:  # this request's own outputs: the others carry on
                    log.exception("sample ticket %d: its prompt outputs failed", request.ticket)
                    finished.append((request.ticket, ServerError(_PROMPT_OUTPUTS_FAILED)))
                    continue
            kept += rows[prefill_row]
            source += [prefill_row] * spec.num_samples
        if not kept:
            return None
        expand = torch.tensor(source, device=device)
        # `reorder_cache` is annotated LongTensor; any int64 index tensor is what it takes.
        cache.reorder_cache(expand)  # type: ignore[arg-type]
        _reorder_layer_state(cache, expand, len(requests))
        return RunningBatch(kept, cache, attention_mask[expand], next_logits[expand])

    def _pixels(self, spec: SampleSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """A prompt's images decoded: the processor's pixel values and patch grids (a
        `UserError` for one that does not decode to what its header declared)."""
        vision = self.model.vision
        if vision is None:  # `sample_spec` refuses images for a text model
            raise UserError(f"{self.model.base_model} is a text model and takes no images")
        return vision.pixels(spec.images)

    def _prefill(
        self,
        specs: list[SampleSpec],
        slots: list[int],
        cache: DynamicCache,
        pixels: list[tuple[torch.Tensor, torch.Tensor] | None],
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor], torch.Tensor, list[int]]:
        """Run the left-padded prompts through the decoder into `cache`: (the last position's
        hidden states [rows, hidden], each prompt's own hidden states [length, hidden] for the
        rows whose requests ask for prompt outputs, attention mask [rows, width], each row's
        RoPE delta); `_head` makes logits of the positions that need them. Prompts with images
        are embedded with their image features and take multimodal positions (`_with_images`).

        A batch of text prompts whose cache continues (`mergeable`) runs in chunks of at most
        `PREFILL_TOKENS` positions (over its rows): what a chunk's layers work with is freed
        before the next, so a long prompt holds its KV cache and one chunk's activations, not
        the whole prompt's."""
        prompts = [spec.prompt for spec in specs]
        width = max(len(prompt) for prompt in prompts)
        input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
        attention_mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        device = self.model.device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        inputs: dict[str, Any] = {"input_ids": input_ids}
        deltas = [0] * len(specs)
        if any(spec.images for spec in specs):
            inputs, position_ids, deltas = self._with_images(specs, pixels, input_ids, position_ids)
        rows = len(prompts)
        keep = [row for row, spec in enumerate(specs) if spec.needs_prompt_rows]
        step = width
        if self._merges and "input_ids" in inputs:
            step = max(1, PREFILL_TOKENS // rows)
        kept: list[torch.Tensor] = []  # the kept rows' hidden states, chunk by chunk
        hidden = torch.empty(0)
        for start in range(0, width, step):
            stop = min(width, start + step)
            chunk = inputs if step == width else {"input_ids": input_ids[:, start:stop]}
            with self._routed(slots):
                hidden = self.model.decoder(
                    **chunk,
                    attention_mask=attention_mask[:, :stop],
                    position_ids=position_ids[..., start:stop],
                    past_key_values=cache,
                    use_cache=True,
                ).last_hidden_state
            if keep:
                kept.append(hidden[keep])
        prompts_hidden = torch.cat(kept, dim=1) if keep else hidden[:0]
        prompt_hidden = {
            row: prompts_hidden[i, width - len(prompts[row]) :] for i, row in enumerate(keep)
        }
        return hidden[:, -1], prompt_hidden, attention_mask, deltas

    def _with_images(
        self,
        specs: list[SampleSpec],
        pixels: list[tuple[torch.Tensor, torch.Tensor] | None],
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
    ) -> tuple[dict[str, Any], torch.Tensor, list[int]]:
        """The decoder's inputs for left-padded rows some of whose prompts hold images: the
        embeddings with each image's features at its placeholders, position ids
        `[4, rows, width]` (the text positions, then the multimodal ones), and each row's RoPE
        delta. `pixels`: each prompt's decoded images (`_pixels`), None for a text prompt."""
        vision = self.model.vision
        assert vision is not None  # `_pixels` decoded the images
        decoded = [p for p in pixels if p is not None]  # the rows' order
        pixel_values = torch.cat([values for values, _ in decoded])
        grids = torch.cat([grid for _, grid in decoded])
        device = self.model.device
        embedding = cast(nn.Module, self.model.decoder.get_input_embeddings())  # type: ignore[operator]
        inputs = vision.decoder_inputs(embedding, input_ids, pixel_values, grids)
        rows, width = input_ids.shape
        positions = position_ids.unsqueeze(0).repeat(4, 1, 1)
        deltas = [0] * rows
        grid_list = grids.tolist()
        for row, spec in enumerate(specs):
            if not spec.images:
                continue
            length, n = len(spec.prompt), len(spec.images)
            ids = input_ids[row, width - length :].cpu()
            mrope = vision.positions(ids, grid_list[:n])
            positions[1:, row, width - length :] = mrope.to(device)
            deltas[row] = int(mrope.max()) + 1 - length
            grid_list = grid_list[n:]
        return inputs, positions, deltas

    def _head(self, hidden: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
        """The output layer on token rows `hidden` [T, hidden]: logits [T, vocab], each segment
        of rows with its slot's LoRA term (an adapter may train the output layer)."""
        return head_logits(self.model.head, hidden, segments, self.model.passes.output)

    # -- steps 3-5: draw, retire, decode -------------------------------------------------------

    def _advance(self, batch: RunningBatch) -> list[Finished]:
        """Draw every row's token, answer the requests that finished, decode the rest."""
        batch.draw(self.tokenizer)
        finished: list[Finished] = []
        keep = []
        for index, row in enumerate(batch.rows):
            if row.stop_reason is None:
                keep.append(index)
            elif row.request.finish(row):
                finished.append((row.request.ticket, row.request.output))
        if not keep:
            self._running = None
            return finished
        batch.keep(keep)
        capacity = max(1, self.snapshots.snapshot_capacity())
        keys = [key for key in dict.fromkeys(row.key for row in batch.rows) if key is not None]
        if len(keys) <= capacity:
            self._decode(batch)
            return finished
        # A training call took slots since the rows joined: step them in groups that fit.
        wave_of = {key: n // capacity for n, key in enumerate(keys)}
        groups: list[list[int]] = [[] for _ in range(-(-len(keys) // capacity))]
        for index, row in enumerate(batch.rows):
            groups[0 if row.key is None else wave_of[row.key]].append(index)
        parts = batch.split(groups)
        for part in parts:
            self._decode(part)
        self._running = RunningBatch.joined(parts)
        return finished

    def _decode(self, batch: RunningBatch) -> None:
        """One forward of every row's newest token; refreshes `batch.next_logits`."""
        slots = self._slots(batch.rows)
        mask = batch.attention_mask
        batch.attention_mask = torch.cat([mask, mask.new_ones(len(batch.rows), 1)], 1)
        tokens = [row.tokens[-1] for row in batch.rows]
        position_ids = batch.attention_mask.sum(-1, keepdim=True) - 1
        if any(row.rope_delta for row in batch.rows):  # rows whose prompts held images
            delta = torch.tensor([row.rope_delta for row in batch.rows], device=mask.device)
            position_ids = torch.stack([position_ids, *[position_ids + delta[:, None]] * 3])
        with self._routed(slots):
            batch.next_logits = self.model.model(
                input_ids=torch.tensor(tokens, device=self.model.device)[:, None],
                attention_mask=batch.attention_mask,
                position_ids=position_ids,
                past_key_values=batch.cache,
                use_cache=True,
            ).logits[:, -1]

    def _routed(self, slots: Sequence[int]) -> contextlib.AbstractContextManager[None]:
        """Bind the rows' slots for one forward; base-only passes need no routing."""
        if all(slot == BASE_SLOT for slot in slots):
            return contextlib.nullcontext()
        return self.model.bind(_segments(slots))

    def _row(self, request: Request, sample_index: int) -> Row:
        spec = request.spec
        generator = None
        if not spec.greedy:
            generator = torch.Generator(device=self.model.device)
            if spec.seed is None:
                generator.seed()
            else:
                generator.manual_seed(_row_seed(spec.seed, sample_index))
        stop_ids = frozenset(spec.stop_token_ids)
        if spec.stop_at_eos:
            stop_ids |= self.eos_token_ids
        longest = max((len(stop) for stop in spec.stop_strings), default=0)
        window = _BYTES_PER_CHAR * longest + _STOP_WINDOW_MARGIN
        return Row(request, sample_index, BASE_SLOT, generator, stop_ids, window)


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


def _reorder_layer_state(cache: DynamicCache, index: torch.Tensor, batch: int) -> None:
    """Reorder what a cache layer keeps besides its keys and values, row by row as
    `reorder_cache` did those: DeepSeek-V4's compressors keep their pending window, their
    compressed entries and their overlap state in dicts of `[batch, …]` tensors, which
    `reorder_cache` leaves at the prefill's batch (one row a prompt, not a sample)."""
    for layer in cache.layers:
        for name, value in vars(layer).items():
            if name in ("keys", "values"):
                continue
            if isinstance(value, dict):
                for key, tensor in value.items():
                    if (
                        isinstance(tensor, torch.Tensor)
                        and tensor.dim()
                        and tensor.shape[0] == batch
                    ):
                        value[key] = tensor.index_select(0, index.to(tensor.device))

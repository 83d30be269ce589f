"""The torch sampler's running batch: the rows in generation, their KV cache, their attention mask
and the logits each row draws its next token from (continuous batching, `workers.sampler.torch_sampler`).

Job: the cache surgery that lets requests join and leave a generation between decode steps, and
the per-row token draw.
- `merge`: a freshly prefilled batch joins the running one. Both are left-padded; the narrower
  one is padded further on the left (zero keys and values, mask 0) to the common width, the rows
  are concatenated and then regrouped so each adapter's rows stay contiguous (one routing
  segment per adapter).
- `keep`: finished rows leave; leading columns that are padding in every remaining row go too.
- `split` / `joined`: rows in groups, each with its own copy of their cache rows, and back; for a
  decode step whose snapshots do not all fit in the engine's slots at once.
- `fill_prompt_outputs`: what a request asks of its prompt, from its prefill logits.
- `draw`: each row draws its next token with its own generator (the exponential race over its
  temperature-scaled, top-k/top-p-filtered distribution; greedy rows, those of a temperature
  below `protocol.sampling.GREEDY_TEMPERATURE`, have none and take the most likely token),
  records its raw logprob (and the raw top-k when asked) and checks its stops. A row's noise
  comes only from its generator, seeded from (seed, sample index), so its tokens do not depend
  on which rows share its steps.

Invariants:
- Every row's last real token is in the last column (left padding), so one decode step appends
  one column to every row, and a row's position id is its count of real tokens minus one.
- Padding is masked out of attention exactly (weight 0), and a linear-attention layer's state is
  per row with no sequence axis, so merging, dropping and trimming change a row's logits only by
  the rounding of a differently shaped batch.
- Only cache layers whose every field is understood here are merged: full attention
  (`DynamicLayer`), linear attention (`LinearAttentionLayer`: Qwen3.5's gated DeltaNet) and the
  two in one layer. `mergeable` says whether a model's cache is made only of those; sliding
  windows and other layouts are not (the sampler then lets requests join only an empty batch).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PretrainedConfig, PreTrainedTokenizerBase
from transformers.cache_utils import (
    DynamicLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionLayer,
)

from protocol.sampling import SampledSequence, SampleOutput, SampleSpec, TopK, keep_last_n

_MERGEABLE_LAYERS = (DynamicLayer, LinearAttentionLayer, LinearAttentionAndFullAttentionLayer)


@dataclass
class Request:
    """One sample request in the sampler: waiting, then generating, then answered."""

    ticket: int
    spec: SampleSpec
    key: str | None  # snapshot key, None for the base model
    output: SampleOutput = field(default_factory=lambda: SampleOutput(sequences=[]))
    sequences: dict[int, SampledSequence] = field(default_factory=dict)  # by sample index

    def finish(self, row: Row) -> bool:
        """Record a finished row; whether it was the request's last."""
        assert row.stop_reason is not None
        self.sequences[row.sample_index] = SampledSequence(
            row.tokens,
            row.logprobs,
            row.stop_reason,
            row.topk_logprobs if self.spec.topk_sample_logprobs > 0 else None,
        )
        if len(self.sequences) < self.spec.num_samples:
            return False
        self.output.sequences = [self.sequences[i] for i in range(self.spec.num_samples)]
        return True


@dataclass
class Row:
    """One sample in generation."""

    request: Request
    sample_index: int
    slot: int  # the slot its snapshot had at the last forward; re-resolved every step
    generator: torch.Generator | None  # None for greedy rows
    stop_ids: frozenset[int]
    stop_window: int  # tokens detokenized for the stop-string check
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk_logprobs: list[TopK] = field(default_factory=list)  # when the spec asks for them
    stop_reason: Literal["stop", "length"] | None = None
    # a prompt with images: its multimodal RoPE position after the prompt, less its length
    # (each generated token's three positions are its text position plus this)
    rope_delta: int = 0

    @property
    def spec(self) -> SampleSpec:
        return self.request.spec

    @property
    def key(self) -> str | None:
        return self.request.key


@dataclass
class RunningBatch:
    """Rows in generation, all with their next-token logits ready; see the module docstring."""

    rows: list[Row]
    cache: DynamicCache
    attention_mask: torch.Tensor  # [rows, width], 1 where a column holds a real token
    next_logits: torch.Tensor  # [rows, vocab]

    @property
    def width(self) -> int:
        return int(self.attention_mask.shape[1])

    def merge(self, other: RunningBatch) -> None:
        """Take `other`'s rows (and its cache) into this batch; `other` is used up."""
        width = max(self.width, other.width)
        mine, theirs = width - self.width, width - other.width
        for layer, joining in zip(self.cache.layers, other.cache.layers, strict=True):
            _concat_layer(layer, joining, mine, theirs)
        self.attention_mask = torch.cat(
            [F.pad(self.attention_mask, (mine, 0)), F.pad(other.attention_mask, (theirs, 0))]
        )
        self.next_logits = torch.cat([self.next_logits, other.next_logits])
        self.rows = self.rows + other.rows
        self._regroup()

    def keep(self, index: Sequence[int]) -> None:
        """Keep only rows `index` (in that order), then drop the columns no row needs."""
        if list(index) != list(range(len(self.rows))):
            self._select(index)
        real = self.attention_mask.any(dim=0).nonzero()
        first = int(real[0, 0]) if real.numel() else 0
        if first > 0:
            for layer in self.cache.layers:
                if isinstance(layer, DynamicLayer) and layer.is_initialized:
                    assert layer.keys is not None and layer.values is not None
                    layer.keys = layer.keys[..., first:, :]
                    layer.values = layer.values[..., first:, :]
            self.attention_mask = self.attention_mask[:, first:]

    def split(self, groups: Sequence[Sequence[int]]) -> list[RunningBatch]:
        """The rows in `groups`, each group a batch with its own copy of its cache rows."""
        parts = []
        for group in groups:
            index = torch.tensor(group, device=self.next_logits.device)
            cache = copy.deepcopy(self.cache)
            # `reorder_cache` is annotated LongTensor; any int64 index tensor is what it takes.
            cache.reorder_cache(index)  # type: ignore[arg-type]
            parts.append(
                RunningBatch(
                    [self.rows[i] for i in group],
                    cache,
                    self.attention_mask[index],
                    self.next_logits[index],
                )
            )
        return parts

    @staticmethod
    def joined(parts: list[RunningBatch]) -> RunningBatch:
        """One batch of `parts`' rows in order; the parts are used up."""
        batch = parts[0]
        for part in parts[1:]:
            batch.merge(part)
        return batch

    def draw(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """Every row draws its next token from `next_logits`; records it, its raw logprob and
        whether it stops the row (`tokenizer` detokenizes for stop strings)."""
        rows = self.rows
        logits = self.next_logits.float()
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
            raced = (probs / noise).argmax(dim=-1)
            # A row whose logits are not finite (a diverged adapter) has no distribution to
            # draw from (NaN wins every argmax); it takes its most likely token instead.
            chosen[index] = torch.where(_finite_rows(probs), raced, chosen[index])
        all_raw = torch.log_softmax(logits, dim=-1)
        raw = all_raw.gather(-1, chosen[:, None])[:, 0]
        width = min(max(row.spec.topk_sample_logprobs for row in rows), all_raw.shape[-1])
        top = all_raw.topk(width, dim=-1) if width > 0 else None
        tokens: list[int] = chosen.tolist()
        for i, (row, token, logprob) in enumerate(zip(rows, tokens, raw.tolist(), strict=True)):
            row.tokens.append(token)
            row.logprobs.append(logprob)
            k = min(row.spec.topk_sample_logprobs, width)
            if top is not None and k > 0:
                ids, values = top.indices[i, :k].tolist(), top.values[i, :k].tolist()
                row.topk_logprobs.append(list(zip(ids, values, strict=True)))
            if token in row.stop_ids or _completes_stop_string(row, tokenizer):
                row.stop_reason = "stop"
            elif len(row.tokens) >= row.spec.max_tokens:
                row.stop_reason = "length"

    def _regroup(self) -> None:
        """Rows of one adapter next to each other, in order of first appearance (stable)."""
        rank = {key: n for n, key in enumerate(dict.fromkeys(row.key for row in self.rows))}
        order = sorted(range(len(self.rows)), key=lambda i: rank[self.rows[i].key])
        if order != list(range(len(self.rows))):
            self._select(order)

    def _select(self, index: Sequence[int]) -> None:
        selected = torch.tensor(index, device=self.next_logits.device)
        self.cache.reorder_cache(selected)  # type: ignore[arg-type]
        self.attention_mask = self.attention_mask[selected]
        self.next_logits = self.next_logits[selected]
        self.rows = [self.rows[i] for i in index]


def mergeable(config: PretrainedConfig) -> bool:
    """Whether a model's cache is made only of layers `RunningBatch.merge` knows."""
    return all(type(layer) in _MERGEABLE_LAYERS for layer in DynamicCache(config=config).layers)


def pads_prompts(model: nn.Module) -> bool:
    """Whether prompts of different lengths may share a left-padded prefill (and a running
    batch). Not for a model with a layer that reads the padding as tokens: DeepSeek-V4's KV
    compressors and GLM-5's DSA indexer (which size their own masks), or a convolution over the
    sequence outside a recurrent mixer (Inkling's short convolutions); such a model's requests
    are prefilled and generated with others of the same prompt length only."""
    for name, module in model.named_modules():
        if any(part.startswith(("visual", "vision")) for part in name.split(".")):
            continue
        if name.endswith((".compressor", ".indexer")):
            return False
        if isinstance(module, nn.Conv1d):
            parent = model.get_submodule(name.rpartition(".")[0])
            if not isinstance(getattr(parent, "A_log", None), torch.Tensor):
                return False
    return True


def fill_prompt_outputs(output: SampleOutput, spec: SampleSpec, logits: torch.Tensor) -> None:
    """Prompt logprobs, target-id logprobs and alternative-token draws from the prefill logits
    of one prompt ([len(prompt), vocab]); all raw, as the trainer's forward computes them."""
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
    keep_last_n(spec, output)
    if spec.target_prompt_logprobs is not None:
        rows, ids = spec.target_prompt_logprobs.cells()
        index = torch.tensor(ids, device=logits.device, dtype=torch.long)
        picked = logprobs[torch.tensor(rows, device=logits.device), index.clamp(min=0)]
        output.target_prompt_logprobs = picked.masked_fill(index < 0, 0.0).tolist()
    if spec.prompt_alt_tokens_k > 0:
        k = spec.prompt_alt_tokens_k
        # The most likely token by the raw logits, as `draw` takes it (defined even where the
        # logits are not finite and the logprobs are NaN).
        greedy = logits[:-1].float().argmax(dim=-1, keepdim=True)
        if not spec.greedy and logprobs.shape[0] > 0:
            generator = torch.Generator(device=logits.device)
            if spec.seed is None:
                generator.seed()
            else:
                generator.manual_seed(_alt_seed(spec.seed))
            probs = torch.softmax(logits[:-1].float() / spec.temperature, dim=-1)
            # `multinomial` raises on a row that is not a distribution (non-finite logits of a
            # diverged adapter); such a row puts all its mass on its most likely token.
            finite = _finite_rows(probs)
            if not bool(finite.all()):
                one_hot = torch.zeros_like(probs).scatter_(-1, greedy, 1.0)
                probs = torch.where(finite[:, None], probs, one_hot)
            draws = torch.multinomial(probs, k, replacement=True, generator=generator)
        else:  # greedy: every draw is the most likely token
            draws = greedy.expand(-1, k)
        output.prompt_alt_tokens = draws.tolist()
        output.prompt_alt_logprobs = logprobs.gather(-1, draws).tolist()


def _finite_rows(probs: torch.Tensor) -> torch.Tensor:
    """Whether each row of `probs` is a distribution: finite, with some mass."""
    return torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)


def _alt_seed(seed: int) -> int:
    """The generator seed of a seeded request's alternative-token draws: a stream apart from
    every sample's (`_row_seed`)."""
    sequence = np.random.SeedSequence([seed % 2**64, 2**32])
    return int(sequence.generate_state(1, np.uint64)[0])


def _completes_stop_string(row: Row, tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the newest token completed a stop string in the generated text.

    Earlier tokens were checked at their own step, so any stop string now in the text's tail
    is a new one; the tail covers every token a stop string can span.
    """
    if not row.spec.stop_strings:
        return False
    text = tokenizer.decode(
        row.tokens[-row.stop_window :],
        skip_special_tokens=True,
        clean_up_tokenization_spaces=False,
    )
    return any(stop in text for stop in row.spec.stop_strings)


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


def _concat_layer(layer: object, joining: object, pad: int, pad_joining: int) -> None:
    """Append `joining`'s rows to `layer`'s, each padded on the left by its own count."""
    if isinstance(layer, DynamicLayer) and layer.is_initialized:
        assert isinstance(joining, DynamicLayer) and joining.is_initialized
        assert layer.keys is not None and layer.values is not None
        assert joining.keys is not None and joining.values is not None
        layer.keys = torch.cat(
            [F.pad(layer.keys, (0, 0, pad, 0)), F.pad(joining.keys, (0, 0, pad_joining, 0))]
        )
        layer.values = torch.cat(
            [F.pad(layer.values, (0, 0, pad, 0)), F.pad(joining.values, (0, 0, pad_joining, 0))]
        )
    if isinstance(layer, LinearAttentionLayer):
        assert isinstance(joining, LinearAttentionLayer)
        for state in range(layer.number_of_states):
            if layer.is_conv_states_initialized[state]:
                layer.conv_states[state] = _cat(layer.conv_states, joining.conv_states, state)
            if layer.is_recurrent_states_initialized[state]:
                layer.recurrent_states[state] = _cat(
                    layer.recurrent_states, joining.recurrent_states, state
                )


def _cat(
    states: dict[int, torch.Tensor | None], joining: dict[int, torch.Tensor | None], index: int
) -> torch.Tensor:
    mine, theirs = states[index], joining[index]
    assert mine is not None and theirs is not None
    return torch.cat([mine, theirs])

"""The forward/backward passes of one engine call: rows in, per-datum log-probs and losses out.

Job: run a validated call's items (one tenant's slot each) as passes of at most `pass_tokens`
token positions (`workers.engine.packing.layout`), and in each pass:
Step 1: build the rows: each datum's tokens at its piece's place; packed rows restart position
        ids per sequence (the model then masks block-diagonally), padded rows carry an attention
        mask instead. Each slot's rows are one routing segment.
Step 2: run the decoder (every layer but the output one) with the segments bound.
Step 3: pick each datum's hidden states out of the rows, then compute the log-probability of
        every target token in chunks of `chunk_tokens` tokens: output layer (its LoRA term per
        slot included), logsumexp and gather per chunk, recomputed chunk by chunk in the
        backward. A pass never holds [tokens, vocab] logits, only [chunk, vocab].
Step 4: each datum's elementwise loss (`workers.engine.losses`), or for loss_fn "custom" the
        request's own graph run on the datum (`workers.engine.custom_loss`; a graph that fails fails
        its request alone and none of its datums adds gradient); one backward per pass of the
        sum of the finite losses of training datums, so gradients of every pass add up in the
        slots.

What the engine's transaction needs back: per item its outputs (or the non-finite error of a
training item) and which items put gradient into their slot (`PassResults.contributed`).

Invariants: a forward_only item contributes no gradient; a datum whose loss is not finite is
left out of the backward; a datum's numbers do not depend on which pass, row or position it ran
in beyond float rounding (≤ 1e-5 in fp32 against one pass per datum).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from protocol.errors import TwinkleError, UserError
from protocol.tensors import TARGET_TOKENS, FwdBwdOutput, FwdBwdRequest
from workers.engine.collective import Collective
from workers.engine.context_parallel import (
    ContextParallel,
    gather_columns,
    split_pass,
    splitting,
)
from workers.engine.custom_loss import (
    BUDGET_FACTOR,
    CustomLossError,
    ElementBudget,
    LossProgram,
    metric_values,
)
from workers.engine.custom_loss import failed as custom_failed
from workers.engine.lora import MultiSlotLoraLinear, Segment, SlotRouting
from workers.engine.losses import LossFn, Settings
from workers.engine.packing import PassLayout, Piece, layout
from workers.engine.recompute import LayerRecompute
from workers.engine.vision import VisionTower

log = logging.getLogger(__name__)

CUSTOM = "custom"
CUSTOM_OUTPUT_TYPE = "CustomLossReturn"
# the shortest pass that recomputes its layers in the backward, when it is over the pass token
# budget (`PassRunner.recomputes`; measured in docs/long-context.md, `bench/long_context.py`)
RECOMPUTE_FLOOR = 4096


@dataclass
class _Custom:
    """A `custom` item's state across its passes: its program, budget, metrics and failure."""

    program: LossProgram
    budget: ElementBudget
    metrics: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    error: TwinkleError | None = None


ItemLoss = tuple[LossFn, Settings] | _Custom


@dataclass(frozen=True)
class Checked:
    """A request that passed `MultiSlotModel.validate`, with its loss looked up there (None: a
    custom loss, whose program the request carries and each run builds afresh)."""

    request: FwdBwdRequest
    loss: tuple[LossFn, Settings] | None


def _item_loss(item: Checked) -> ItemLoss:
    if item.loss is not None:
        return item.loss
    req = item.request
    assert req.custom_loss is not None  # checked by `MultiSlotModel.validate`
    budget = ElementBudget(req.max_elements * BUDGET_FACTOR)
    return _Custom(LossProgram(req.custom_loss), budget)


@dataclass
class PassResults:
    """One call's results by item, and the items that added gradient to their slot."""

    results: list[FwdBwdOutput | TwinkleError]
    contributed: set[int] = field(default_factory=set)


def carries_state(model: nn.Module) -> bool:
    """Whether any layer of `model` mixes tokens along the row other than through the attention
    mask, so that datums sharing a row would leak into each other:
    - recurrent mixers, Gated DeltaNet (Qwen3.5's `linear_attn`) and Mamba2 (Nemotron-H's
      `mixer`), recognised by the decay `A_log` they learn;
    - convolutions over the sequence (`nn.Conv1d`: Inkling's short convolutions);
    - DeepSeek-V4's KV compressors, which pool consecutive tokens into one entry.
    transformers' torch paths of all of them ignore sequence boundaries inside a row. Vision
    towers are not the row's."""
    for name, module in model.named_modules():
        if any(part.startswith(("visual", "vision")) for part in name.split(".")):
            continue
        if name.endswith("linear_attn") or isinstance(getattr(module, "A_log", None), torch.Tensor):
            return True
        if isinstance(module, nn.Conv1d) or name.endswith(".compressor"):
            return True
    return False


class PassRunner:
    """Runs calls on one model with an adapter bank bound through `routing`."""

    def __init__(
        self,
        model: nn.Module,
        routing: SlotRouting,
        device: torch.device,
        *,
        pass_tokens: int,
        chunk_tokens: int,
        vision: VisionTower | None = None,
        recompute_tokens: int | None = None,
        collective: Collective | None = None,
        sum_over_ranks: Callable[[list[int], Callable[[], None]], None] | None = None,
    ) -> None:
        get_decoder = getattr(model, "get_decoder", None)
        decoder = get_decoder() if get_decoder is not None else model.model
        self.decoder = cast(nn.Module, decoder)
        self.head: nn.Module = model.get_output_embeddings()  # type: ignore[operator]
        self.output = output_of(model)
        self.routing = routing
        self.device = device
        self.pass_tokens = pass_tokens
        self.chunk_tokens = chunk_tokens
        self.vision = vision  # a vision-language model's tower: rows with images
        # Recurrent mixers carry a state along the row on the torch path, so sequences sharing
        # a row would leak into each other: pad those instead (`carries_state`).
        self.packs = not carries_state(model)
        # Which training passes keep only each decoder layer's input and recompute the rest in
        # their backward (`recompute.py`, `recomputes`).
        self.recompute = LayerRecompute.install(self.decoder, routing)
        self.recompute_tokens = recompute_tokens
        # Which passes a worker group splits by position (`context_parallel.py`), and how
        # the ranks' shares of a split pass's gradients are summed (`LoraBank.sum_over_ranks`).
        self.context = ContextParallel(model, collective or Collective())
        self.sum_over_ranks = sum_over_ranks

    def run(self, items: Sequence[Checked], slots: Sequence[int]) -> PassResults:
        """Every item (validated, its loss looked up; `slots[i]` holds item i's adapter)."""
        batch = [item.request for item in items]
        n_items = len(batch)
        outputs: list[list[dict[str, np.ndarray]]] = [[{} for _ in req.datums] for req in batch]
        losses: list[list[torch.Tensor]] = [[torch.zeros(()) for _ in req.datums] for req in batch]
        contributed: set[int] = set()
        passes = layout(
            [
                (slot, [int(d.tokens.shape[0]) for d in req.datums])
                for req, slot in zip(batch, slots, strict=True)
            ],
            self.pass_tokens,
            pack=self.packs,
        )
        losses_of = [_item_loss(item) for item in items]
        for one_pass in passes:
            self._run_one(batch, losses_of, one_pass, outputs, losses, contributed)
        results: list[FwdBwdOutput | TwinkleError] = []
        for index in range(n_items):
            req = batch[index]
            item_loss = losses_of[index]
            if isinstance(item_loss, _Custom) and item_loss.error is not None:
                results.append(item_loss.error)
                continue
            total = float(torch.stack(losses[index]).sum())
            if not req.forward_only and not math.isfinite(total):
                results.append(not_finite("loss", f"loss:sum = {total}"))
                continue
            if isinstance(item_loss, _Custom):
                sums = {
                    key: float(torch.stack(values).sum())
                    for key, values in item_loss.metrics.items()
                }
                metrics = {**metric_values(sums, len(req.datums)), "loss:sum": total}
                results.append(FwdBwdOutput(outputs[index], metrics, CUSTOM_OUTPUT_TYPE))
                continue
            output_type = item_loss[0].output_type
            results.append(FwdBwdOutput(outputs[index], {"loss:sum": total}, output_type))
        return PassResults(results, contributed)

    def recomputes(self, tokens: int) -> bool:
        """Whether a training pass of `tokens` positions (rows × width) recomputes its layers:
        `recompute_tokens` or more where that is set; else a pass over the token budget (a
        datum longer than it, in a pass of its own) of at least `RECOMPUTE_FLOOR`. A pass within
        the budget keeps its activations: the budget is what a pass may hold, and keeping costs
        no recomputation (about 1.1 to 1.2 times the step's time, docs/long-context.md)."""
        if self.recompute_tokens is not None:
            return tokens >= self.recompute_tokens
        return tokens > self.pass_tokens and tokens >= RECOMPUTE_FLOOR

    def _run_one(
        self,
        batch: Sequence[FwdBwdRequest],
        losses_of: Sequence[ItemLoss],
        one_pass: PassLayout,
        outputs: list[list[dict[str, np.ndarray]]],
        losses: list[list[torch.Tensor]],
        contributed: set[int],
    ) -> None:
        pieces = one_pass.pieces()
        training = any(not batch[piece.item].forward_only for piece in pieces)
        images = self.vision is not None and any(
            batch[p.item].datums[p.datum].images for p in pieces
        )
        tokens = len(one_pass.rows) * one_pass.width
        split = not images and self.context.splits(tokens, one_pass.width, self.pass_tokens)
        if self.recompute is not None:
            self.recompute.on = training and self.recomputes(tokens)
        with torch.set_grad_enabled(training):
            if split:
                logprobs = self._split_logprobs(batch, one_pass, pieces, training)
            else:
                logprobs = self._logprobs(batch, one_pass, pieces, training, images)
            datum_losses: list[torch.Tensor] = []
            start = 0
            for piece in pieces:
                req = batch[piece.item]
                datum = req.datums[piece.datum]
                target = datum.inputs[TARGET_TOKENS]
                stop = start + piece.length
                rows = logprobs[start:stop]
                datum_lp = rows[:, 0] if target.ndim == 1 else rows[:, : target.shape[1]]
                start = stop
                item_loss = losses_of[piece.item]
                inputs = {name: self._tensor(array) for name, array in datum.inputs.items()}
                if isinstance(item_loss, _Custom):
                    datum_losses.append(_custom_datum(item_loss, piece.datum, datum_lp, inputs))
                    outputs[piece.item][piece.datum] = {"logprobs": _to_numpy(datum_lp)}
                    continue
                loss_fn, settings = item_loss
                elementwise = loss_fn.elementwise(datum_lp, inputs, settings)
                datum_losses.append(elementwise.sum())
                outputs[piece.item][piece.datum] = {
                    "logprobs": _to_numpy(datum_lp),
                    "elementwise_loss": _to_numpy(elementwise),
                }
            values = torch.stack([loss.detach() for loss in datum_losses]).cpu()
            finite = torch.isfinite(values).tolist()
            backward: list[torch.Tensor] = []
            for piece, loss, value, ok in zip(pieces, datum_losses, values, finite, strict=True):
                losses[piece.item][piece.datum] = value
                item_loss = losses_of[piece.item]
                if isinstance(item_loss, _Custom) and item_loss.error is not None:
                    continue  # failed on some datum: none of its datums adds gradient
                if ok and not batch[piece.item].forward_only:
                    backward.append(loss)
                    contributed.add(piece.item)
        if backward:
            total = torch.stack(backward).sum()
            if total.requires_grad:

                def run_backward() -> None:
                    # Each `.grad` is a strided view of the bank's flat gradient buffer by
                    # design; autograd adds into it in place, so the layout advice does not apply.
                    with torch.autograd.enforce_grad_layout_policy(False):
                        total.backward()  # type: ignore[no-untyped-call]

                if split and self.sum_over_ranks is not None:
                    trained = {
                        slot
                        for slot, start, stop in one_pass.segments
                        for piece in pieces
                        if start <= piece.row < stop and not batch[piece.item].forward_only
                    }
                    self.sum_over_ranks(sorted(trained), run_backward)
                else:
                    run_backward()

    def _logprobs(
        self,
        batch: Sequence[FwdBwdRequest],
        one_pass: PassLayout,
        pieces: list[Piece],
        training: bool,
        images: bool,
    ) -> torch.Tensor:
        """Every piece's target log-probabilities `[tokens, K]`, in `pieces`' order: the
        whole pass on this device."""
        input_ids, position_ids, attention_mask = self._rows(batch, one_pass, one_pass.width)
        segments = [Segment(slot, start, stop) for slot, start, stop in one_pass.segments]
        model_inputs: dict[str, Any] = {"input_ids": input_ids}
        if images:
            model_inputs, position_ids = self._with_images(batch, one_pass, input_ids, position_ids)
        with self.routing.bind(segments):
            hidden = self.decoder(
                **model_inputs,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
            ).last_hidden_state
        selected, token_segments, targets = self._selected(batch, one_pass, pieces, hidden)
        return self._target_logprobs(selected, targets, token_segments, training)

    def _target_logprobs(
        self,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        segments: list[Segment],
        training: bool,
    ) -> torch.Tensor:
        """`target_logprobs` through this model's output layer, recomputed in a training
        pass's backward."""
        return target_logprobs(
            hidden,
            targets,
            self.head,
            segments,
            self.chunk_tokens,
            recompute=training,
            output=self.output,
        )

    def _split_logprobs(
        self,
        batch: Sequence[FwdBwdRequest],
        one_pass: PassLayout,
        pieces: list[Piece],
        training: bool,
    ) -> torch.Tensor:
        """`_logprobs` with the pass's positions split over the ranks (`context_parallel.py`):
        this rank runs its columns of every row, its positions' log-probabilities are gathered,
        and every rank returns the whole pass's."""
        collective = self.context.collective
        world = collective.world
        n_rows = len(one_pass.rows)
        width = -(-one_pass.width // world) * world
        input_ids, position_ids, _ = self._rows(batch, one_pass, width)
        if position_ids is None:  # padded rows (one datum each, its padding after it)
            position_ids = torch.arange(width, device=self.device).expand(n_rows, width)
        single = all(len(row) == 1 and row[0].offset == 0 for row in one_pass.rows)
        documents = None if single else torch.cumsum(position_ids == 0, dim=1)
        split = split_pass(collective, width // world, documents, n_rows, self.device)
        self.context.splits_run += 1
        if collective.rank == 0:
            log.info(
                "a pass of %d x %d positions split over %d ranks (%d each)",
                n_rows,
                one_pass.width,
                world,
                split.chunk,
            )
        targets_k = max(_k(batch[p.item].datums[p.datum].inputs[TARGET_TOKENS]) for p in pieces)
        grid = np.zeros((n_rows, width, targets_k), dtype=np.int64)
        for piece in pieces:
            target = batch[piece.item].datums[piece.datum].inputs[TARGET_TOKENS]
            block = target.reshape(piece.length, -1)
            grid[piece.row, piece.offset : piece.offset + piece.length, : block.shape[1]] = block
        targets = split.columns(self._long(grid)).reshape(-1, targets_k)
        segments = [Segment(slot, start, stop) for slot, start, stop in one_pass.segments]
        with self.routing.bind(segments), splitting(split):
            hidden = self.decoder(
                input_ids=split.columns(input_ids),
                attention_mask=None,
                position_ids=split.columns(position_ids),
                use_cache=False,
            ).last_hidden_state
        token_segments = [
            Segment(slot, start * split.chunk, stop * split.chunk)
            for slot, start, stop in one_pass.segments
        ]
        mine = self._target_logprobs(
            hidden.reshape(-1, hidden.shape[-1]), targets, token_segments, training
        )
        whole = gather_columns(mine.view(n_rows, split.chunk, targets_k), split, summed=False)
        return torch.cat([whole[p.row, p.offset : p.offset + p.length] for p in pieces])

    def _rows(
        self, batch: Sequence[FwdBwdRequest], one_pass: PassLayout, width: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(input ids, position ids or None, attention mask or None) of one pass's rows,
        `width` (at least the pass's) positions each."""
        n_rows = len(one_pass.rows)
        input_ids = np.zeros((n_rows, width), dtype=np.int64)
        if not self.packs:
            mask = np.zeros((n_rows, width), dtype=np.int64)
            for row, (piece,) in enumerate(one_pass.rows):
                tokens = batch[piece.item].datums[piece.datum].tokens
                input_ids[row, : piece.length] = tokens
                mask[row, : piece.length] = 1
            return self._long(input_ids), None, self._long(mask)
        # Packed: positions restart at every sequence and at the padding tail, which the
        # model's mask then treats as a sequence of its own (never attended by a datum).
        positions = np.zeros((n_rows, width), dtype=np.int64)
        for row, pieces in enumerate(one_pass.rows):
            end = 0
            for piece in pieces:
                tokens = batch[piece.item].datums[piece.datum].tokens
                input_ids[row, piece.offset : piece.offset + piece.length] = tokens
                positions[row, piece.offset : piece.offset + piece.length] = np.arange(piece.length)
                end = piece.offset + piece.length
            positions[row, end:] = np.arange(width - end)
        return self._long(input_ids), self._long(positions), None

    def _with_images(
        self,
        batch: Sequence[FwdBwdRequest],
        one_pass: PassLayout,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
    ) -> tuple[dict[str, Any], torch.Tensor]:
        """The decoder's inputs for a pass whose rows hold images, each image encoded once
        (`VisionTower.decoder_inputs`: the embeddings `[rows, width, H]`, and deepstack
        features where the tower has them), and the position ids `[4, rows, width]`: the text
        positions (what packed rows mask by), then the multimodal ones
        (`VisionTower.positions`; a text token's three are its text position)."""
        assert self.vision is not None
        n_rows, width = input_ids.shape
        placed = [piece for row in one_pass.rows for piece in row]  # the flat ids' order
        images = [image for p in placed for image in batch[p.item].datums[p.datum].images]
        pixel_values, grids = self.vision.pixels(images)
        embedding = cast(nn.Module, self.decoder.get_input_embeddings())  # type: ignore[operator]
        inputs = self.vision.decoder_inputs(embedding, input_ids, pixel_values, grids)
        if position_ids is None:  # padded rows: every row counts from 0
            position_ids = torch.arange(width, device=self.device).expand(n_rows, width)
        positions = position_ids.unsqueeze(0).repeat(4, 1, 1)
        grid_list = grids.tolist()
        for p in placed:
            datum = batch[p.item].datums[p.datum]
            if not datum.images:
                continue
            n = len(datum.images)
            ids = input_ids[p.row, p.offset : p.offset + p.length].cpu()
            mrope = self.vision.positions(ids, grid_list[:n])
            positions[1:, p.row, p.offset : p.offset + p.length] = mrope.to(self.device)
            grid_list = grid_list[n:]
        return inputs, positions

    def _selected(
        self,
        batch: Sequence[FwdBwdRequest],
        one_pass: PassLayout,
        pieces: list[Piece],
        hidden: torch.Tensor,
    ) -> tuple[torch.Tensor, list[Segment], torch.Tensor]:
        """Each piece's hidden states as token rows, their per-slot segments, and targets."""
        width = one_pass.width
        index = np.concatenate(
            [
                np.arange(p.row * width + p.offset, p.row * width + p.offset + p.length)
                for p in pieces
            ]
        )
        flat = hidden.reshape(-1, hidden.shape[-1])
        selected = flat.index_select(0, self._long(index))
        targets_k = max(_k(batch[p.item].datums[p.datum].inputs[TARGET_TOKENS]) for p in pieces)
        targets = np.zeros((index.shape[0], targets_k), dtype=np.int64)
        token_segments: list[Segment] = []
        start = 0
        piece_at = 0
        for slot, row_start, row_stop in one_pass.segments:
            segment_start = start
            while piece_at < len(pieces) and pieces[piece_at].row < row_stop:
                piece = pieces[piece_at]
                assert piece.row >= row_start
                target = batch[piece.item].datums[piece.datum].inputs[TARGET_TOKENS]
                block = target.reshape(piece.length, -1)
                targets[start : start + piece.length, : block.shape[1]] = block
                start += piece.length
                piece_at += 1
            token_segments.append(Segment(slot, segment_start, start))
        return selected, token_segments, self._long(targets)

    def _long(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        dtype = torch.int64 if array.dtype.kind in "iu" else torch.float32
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, dtype)


def _custom_datum(
    item: _Custom, index: int, logprobs: torch.Tensor, inputs: dict[str, torch.Tensor]
) -> torch.Tensor:
    """One datum's custom loss, its metrics added to the item's; a failure marks the item."""
    if item.error is not None:
        return logprobs.new_zeros(())
    try:
        loss, metrics = item.program.run(item.program.inputs_of(logprobs, inputs), item.budget)
    except CustomLossError as err:
        item.error = custom_failed(item.program.loss, index, err)
        return logprobs.new_zeros(())
    for key, value in metrics.items():
        item.metrics.setdefault(key, []).append(value.detach().float().reshape(()).cpu())
    return loss


def target_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: nn.Module,
    segments: Sequence[Segment],
    chunk_tokens: int,
    *,
    recompute: bool,
    output: OutputScaling | None = None,
) -> torch.Tensor:
    """log softmax(head(hidden))[t, targets[t, k]] for token rows `hidden` [T, H], fp32 [T, K].

    `segments` route the rows to their slots' LoRA term of the output layer (if it has one).
    Computed `chunk_tokens` rows at a time; with `recompute`, each chunk's logits are dropped
    after the forward and computed again in the backward, so at most one chunk's [chunk, vocab]
    logits (and their gradient) exist at once.
    """
    chunks: list[torch.Tensor] = []
    last = (hidden.shape[0] - 1) // chunk_tokens * chunk_tokens
    for start in range(0, hidden.shape[0], chunk_tokens):
        stop = min(start + chunk_tokens, hidden.shape[0])
        local = [
            Segment(s.slot, max(s.start, start) - start, min(s.stop, stop) - start)
            for s in segments
            if s.start < stop and s.stop > start
        ]

        def chunk(x: torch.Tensor, t: torch.Tensor, local: list[Segment] = local) -> torch.Tensor:
            logits = head_logits(head, x, local, output).float()
            return cast(torch.Tensor, _TargetLogprobs.apply(logits, t))  # type: ignore[no-untyped-call]

        x, t = hidden[start:stop], targets[start:stop]
        # The last chunk's backward runs first, right after the forward: keeping its logits
        # until then costs no more than computing them again.
        if recompute and start != last and torch.is_grad_enabled():
            part = checkpoint(chunk, x, t, use_reentrant=False, preserve_rng_state=False)
        else:
            part = chunk(x, t)
        chunks.append(part)
    return torch.cat(chunks, dim=0)


class _TargetLogprobs(torch.autograd.Function):
    """`logits.gather(-1, targets) - logsumexp(logits)` with a backward of three passes over
    `[T, V]` (softmax, its scaling, the targets' scatter) into one buffer, where autograd's
    composition of the two ops takes six and three more buffers."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        ctx.save_for_backward(logits, lse, targets)
        return logits.gather(-1, targets) - lse

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, lse, targets = ctx.saved_tensors
        grad = grads[0]
        out = torch.sub(logits, lse).exp_().mul_(-grad.sum(-1, keepdim=True))
        return out.scatter_add_(-1, targets, grad), None


@dataclass(frozen=True)
class OutputScaling:
    """What a family's causal LM does around its output layer beyond `head(hidden)`: Inkling
    divides the hidden state by `logits_mup_width_multiplier` first and drops the logits of
    its padding vocabulary (`unpadded_vocab_size`)."""

    divide_by: float = 1.0
    vocab: int | None = None


def output_of(model: nn.Module) -> OutputScaling | None:
    """`model`'s `OutputScaling`, or None where its logits are `head(hidden)` as they are."""
    text = model.config.get_text_config()  # type: ignore[union-attr, operator]
    divide_by = float(getattr(text, "logits_mup_width_multiplier", None) or 1.0)
    unpadded = getattr(text, "unpadded_vocab_size", None)
    vocab = int(unpadded) if unpadded and int(unpadded) < int(text.vocab_size) else None
    if divide_by == 1.0 and vocab is None:
        return None
    return OutputScaling(divide_by, vocab)


def head_logits(
    head: nn.Module,
    x: torch.Tensor,
    segments: Sequence[Segment],
    output: OutputScaling | None = None,
) -> torch.Tensor:
    """The output layer's logits of token rows `x`, each segment with its slot's LoRA term,
    as the family's causal LM computes them (`output`)."""
    if output is not None and output.divide_by != 1.0:
        x = x / output.divide_by
    logits: torch.Tensor = (
        head.with_segments(x, segments) if isinstance(head, MultiSlotLoraLinear) else head(x)
    )
    if output is not None and output.vocab is not None:
        logits = logits[..., : output.vocab]
    return logits


def _k(target: np.ndarray) -> int:
    return 1 if target.ndim == 1 else int(target.shape[1])


def not_finite(what: str, detail: str) -> UserError:
    """The error of a training request whose loss or gradient overflowed float32."""
    return UserError(
        f"forward_backward: the {what} is not finite ({detail}); check the loss inputs "
        "(weights, advantages, logprobs) for values too large for float32. This request "
        "added no gradient."
    )


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to("cpu", torch.float32).numpy()


def tune_malloc(mmap_bytes: int = 16 << 20, keep_bytes: int = 512 << 20) -> bool:
    """Serve allocations of `mmap_bytes` and more with their own pages, and keep up to
    `keep_bytes` of freed heap instead of returning it to the system (glibc `mallopt`).

    glibc raises its mmap threshold each time a large block is freed (up to 32 MiB), after
    which the per-chunk logits and their temporaries come from the heap, which fragments: in
    one pass of 8192 tokens at vocabulary 32k the loss part's peak grew to 1.4 GB instead of
    0.2 GB. A fixed threshold returns each such block's memory when it is freed. But fixing it
    also fixes the trim threshold at its 128 KiB default, so the heap gave its top back after
    almost every tensor and the next pass faulted it in again, page by page: 55,000 faults in a
    1024-token pass of `bench/engine_merge.py`'s model, a third of its time on a 2-core VM.
    Keeping 512 MiB of freed heap (and growing it 16 MiB at a time), with the CPU's logits
    chunk (8 MiB, see `Engine`) under the threshold so the heap reuses it too, leaves a few
    thousand faults a pass; the 8192-token pass's peak went from 635 to 685 MiB
    (`bench/pass_memory.py`). No-op off glibc.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
        return all(
            bool(libc.mallopt(option, value))
            for option, value in (
                (m_mmap_threshold, mmap_bytes),
                (m_trim_threshold, keep_bytes),
                (m_top_pad, 16 << 20),
            )
        )
    except (OSError, AttributeError):
        return False

"""A slot's state between one rank's layout and the whole one, for snapshots of a worker group.

Job: a rank of a group whose experts are split (`workers.engine.expert_parallel`) holds, per
slot, the factors every rank holds alike and its own experts' factors. A snapshot must not
depend on the group's size (a group of 4 takes over what a single device saved, and the other
way round), so it is written in the layout of one device: `whole_state` gathers a slot's
state from every rank (a collective: every rank calls it; the result is rank 0's to write),
`own_state` cuts this rank's part out of a whole one.

A `SlotState` row is either the adapter's own values (its rank and trained layer groups, layer
by layer, A then B: `workers.trainer.parking`) or the whole bank row (`whole_row`). Both are
read here as pieces, one per factor; a per-expert factor of a split block is `[experts, …]`,
this rank's experts along the first dimension.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from workers.engine.lora import LayerGroup, LayerLayout, LoraBank
from workers.trainer.parking import HostRow, SlotState, trained_groups

_BUFFERS = ("weights", "grads", "exp_avg", "exp_avg_sq")
_ABSENT, _PACKED, _WHOLE = 0, 1, 2  # a row's form, most complete last (agreed by maximum)


@dataclass(frozen=True)
class _Piece:
    """One factor's place in a row's values."""

    start: int
    shape: tuple[int, ...]
    split: bool  # one matrix per expert of a split block: this rank's experts on dim 0
    expert_offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _pieces(
    layouts: Sequence[LayerLayout],
    max_rank: int,
    rank: int,
    groups: frozenset[LayerGroup],
    whole_row: bool,
) -> list[_Piece]:
    pieces = []
    cursor = 0
    width = max_rank if whole_row else rank
    for layout in layouts:
        if not whole_row and layout.group not in groups:
            continue
        for matrix in ("A", "B"):
            experts = layout.a_experts if matrix == "A" else layout.b_experts
            lead = (experts,) if experts else ()
            if matrix == "A":
                shape = (*lead, width, layout.in_features)
                start = layout.a_offset
            else:
                shape = (*lead, layout.out_features, width)
                start = layout.b_offset
            piece = _Piece(
                start if whole_row else cursor,
                shape,
                bool(layout.experts_total and experts),
                layout.expert_offset,
            )
            cursor += piece.numel
            pieces.append(piece)
    return pieces


def _row_length(bank: LoraBank, pieces: list[_Piece], whole_row: bool, whole: bool) -> int:
    if whole_row:
        return bank.whole_numel if whole else bank.weights.shape[1]
    return sum(piece.numel for piece in pieces)


def whole_state(bank: LoraBank, state: SlotState) -> SlotState:
    """`state` (this rank's part of a slot) with every rank's experts, in one device's layout.

    Every rank of the group calls it with its own part, in the same order; rank 0's result is
    the slot's whole state (the other ranks' results are theirs to drop)."""
    collective = bank.collective
    rank, groups = state.spec.rank, trained_groups(state.spec)
    forms = [
        _ABSENT if name not in state.rows else (_WHOLE if state.rows[name].whole_row else _PACKED)
        for name in _BUFFERS
    ]
    agreed = collective.agree_max(forms)
    rows: dict[str, HostRow] = {}
    for name, form in zip(_BUFFERS, agreed, strict=True):
        if form == _ABSENT:
            continue
        whole_row = form == _WHOLE
        mine = _pieces(bank.layouts, bank.max_rank, rank, groups, whole_row)
        theirs = _pieces(bank.whole_layouts, bank.max_rank, rank, groups, whole_row)
        values = _values(bank, state.rows.get(name), mine, rank, groups, whole_row)
        split = [values[p.start : p.start + p.numel] for p in mine if p.split]
        gathered = collective.all_gather_rows(torch.cat(split)) if split else None
        out = torch.zeros(_row_length(bank, theirs, whole_row, whole=True), dtype=values.dtype)
        cursor = 0
        for here, there in zip(mine, theirs, strict=True):
            if here.split:
                assert gathered is not None
                chunk = gathered[:, cursor : cursor + here.numel].reshape(-1)
                cursor += here.numel
            else:
                chunk = values[here.start : here.start + here.numel]
            out[there.start : there.start + there.numel] = chunk
        rows[name] = HostRow(out, whole_row=whole_row)
    return replace(state, rows=rows)


def own_state(bank: LoraBank, state: SlotState) -> SlotState:
    """This rank's part of a slot's whole state (one device's layout)."""
    rank, groups = state.spec.rank, trained_groups(state.spec)
    rows: dict[str, HostRow] = {}
    for name, row in state.rows.items():
        mine = _pieces(bank.layouts, bank.max_rank, rank, groups, row.whole_row)
        theirs = _pieces(bank.whole_layouts, bank.max_rank, rank, groups, row.whole_row)
        out = torch.zeros(
            _row_length(bank, mine, row.whole_row, whole=False), dtype=row.values.dtype
        )
        for here, there in zip(mine, theirs, strict=True):
            chunk = row.values[there.start : there.start + there.numel].view(there.shape)
            if here.split:
                count = here.shape[0]
                chunk = chunk[here.expert_offset : here.expert_offset + count]
            out[here.start : here.start + here.numel] = chunk.reshape(-1)
        rows[name] = HostRow(out, whole_row=row.whole_row)
    return replace(state, rows=rows)


def _values(
    bank: LoraBank,
    row: HostRow | None,
    pieces: list[_Piece],
    rank: int,
    groups: frozenset[LayerGroup],
    whole_row: bool,
) -> torch.Tensor:
    """This rank's row in the agreed form: as it is, zeros where it had none, or a packed row
    spread over a whole one (another rank's part needed the whole row)."""
    length = _row_length(bank, pieces, whole_row, whole=False)
    if row is None:
        return torch.zeros(length, dtype=bank.weights.dtype)
    if row.whole_row == whole_row:
        return row.values
    packed = _pieces(bank.layouts, bank.max_rank, rank, groups, whole_row=False)
    out = torch.zeros(length, dtype=row.values.dtype)
    spread = _pieces(bank.layouts, bank.max_rank, rank, groups, whole_row=True)
    for target, source in zip(_matching(spread, bank, groups), packed, strict=True):
        view = out[target.start : target.start + target.numel].view(target.shape)
        # A [.., rank, in] into [.., max_rank, in]; B [.., out, rank] into [.., out, max_rank]
        view[..., : source.shape[-2], : source.shape[-1]] = row.values[
            source.start : source.start + source.numel
        ].view(source.shape)
    return out


def _matching(spread: list[_Piece], bank: LoraBank, groups: frozenset[LayerGroup]) -> list[_Piece]:
    """The whole-row pieces of the layers a packed row holds (its trained groups)."""
    kept = []
    index = 0
    for layout in bank.layouts:
        pair = spread[index : index + 2]
        index += 2
        if layout.group in groups:
            kept.extend(pair)
    return kept

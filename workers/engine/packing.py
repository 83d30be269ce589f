"""How one engine call's sequences become passes of at most a token budget. Pure, no torch.

Job: lay out every datum (one token sequence) of a call's items into passes of rows, so that no
pass holds more than `budget` token positions (rows × width, padding included) and no position
is wasted where it can be avoided:
- datums are grouped slot by slot (a slot's rows are contiguous: one LoRA segment per slot and
  pass), in increasing slot order (a pass's slots are then often one range of the bank, which
  the LoRA kernels select as a view, without a copy);
- within a slot, longer datums come first (first-fit decreasing), and with `pack=True` a datum
  goes into an existing row of its slot when it fits in the row's free tail, so short sequences
  share a row instead of each being padded to the longest (the model then needs position ids
  that restart per sequence and a block-diagonal causal mask);
- a pass closes when the next datum would take it over the budget; a datum longer than the
  budget gets a pass of its own (a sequence is never cut: its tokens attend to each other).

A call larger than the budget therefore runs as several passes; each datum is in exactly one,
and the engine sums every pass's gradients into the slots, so the result is the gradient of the
whole call.

Invariants (property-tested): every datum appears exactly once; pieces of a row do not overlap
and end within the pass's width; each pass's `segments` tile its rows, one slot each, and a slot
has one segment per pass; a pass costs at most `budget` positions unless it holds one datum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Piece:
    """One datum's tokens inside a pass: row `row`, positions [offset, offset + length)."""

    item: int
    datum: int
    row: int
    offset: int
    length: int


@dataclass
class PassLayout:
    """One pass: its rows (each a list of pieces), their width, and each slot's row range."""

    rows: list[list[Piece]] = field(default_factory=list)
    width: int = 0
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (slot, start, stop)

    @property
    def cost(self) -> int:
        """Token positions this pass computes, padding included."""
        return len(self.rows) * self.width

    def pieces(self) -> list[Piece]:
        """Every piece, row by row: the order of the pass's selected tokens."""
        return [piece for row in self.rows for piece in row]


def layout(
    items: Sequence[tuple[int, Sequence[int]]], budget: int, *, pack: bool
) -> list[PassLayout]:
    """Passes for `items`, each (slot, its datums' lengths); see the module docstring."""
    if budget < 1:
        raise ValueError(f"budget={budget} must be >= 1")
    by_slot: dict[int, list[tuple[int, int, int]]] = {}  # slot → (length, item, datum)
    for index, (slot, lengths) in enumerate(items):
        entries = by_slot.setdefault(slot, [])
        for datum, length in enumerate(lengths):
            if length < 1:
                raise ValueError(f"item {index} datum {datum}: length {length} must be >= 1")
            entries.append((length, index, datum))
    passes: list[PassLayout] = []
    current = PassLayout()
    for slot, entries in sorted(by_slot.items()):
        entries.sort(key=lambda entry: -entry[0])  # stable: equal lengths keep request order
        slot_start = len(current.rows)
        used: list[int] = []  # free-tail bookkeeping for this slot's rows in `current`
        for length, item, datum in entries:
            row = _fitting_row(used, length, current.width) if pack else None
            if row is None:
                width = max(current.width, length)
                if current.rows and (len(current.rows) + 1) * width > budget:
                    _close_segment(current, slot, slot_start)
                    passes.append(current)
                    current, slot_start, used = PassLayout(), 0, []
                    width = length
                current.width = width
                current.rows.append([])
                used.append(0)
                row = len(used) - 1
            absolute = slot_start + row
            current.rows[absolute].append(Piece(item, datum, absolute, used[row], length))
            used[row] += length
        _close_segment(current, slot, slot_start)
    if current.rows:
        passes.append(current)
    return passes


def _fitting_row(used: list[int], length: int, width: int) -> int | None:
    """The first of the slot's rows whose free tail holds `length` tokens (first fit)."""
    for row, filled in enumerate(used):
        if filled + length <= width:
            return row
    return None


def _close_segment(current: PassLayout, slot: int, start: int) -> None:
    if len(current.rows) > start:
        current.segments.append((slot, start, len(current.rows)))

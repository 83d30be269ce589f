"""The multi-slot LoRA update of one linear, computed three ways: a segment loop, padded bmm, and
grouped GEMM.

Job: given a pass's rows `x[T, in]`, every slot's adapter `A[S, r, in]`, `B[S, out, r]` and the
pass's segments `(slot, start, stop, scale)`, return the LoRA update `[T, out]` only (the caller
adds it to the frozen base output):

    update[start:stop] = scale · (x[start:stop] · A[slot]ᵀ) · B[slot]ᵀ

Invariants:
- Rows outside every segment, rows of a segment with scale 0 or slot `BASE_SLOT` (-1), and rows of
  an empty segment get an update of exactly 0.
- Adapters are cast to `x.dtype` inside the function; the cast is part of the autograd graph, so
  fp32 gradients reach `A` and `B`. Where an adapter is a leaf whose `.grad` is already set (a
  view of the bank's gradient rows), the pass's slots' gradients are added straight into their
  rows (`select_rows`): no gradient of the full `[S, ...]` size is built, zeroed and added. Slots
  absent from the pass receive exactly-zero gradient.
- Every kind computes the same maths in the same order (shrink, scale the rank-r intermediate,
  expand), so in fp32 they agree to rounding.

Kinds:
- "loop": one pair of `F.linear` per active segment: a CPU's choice for a few segments,
  where one segment already fills a core (`choose_kind` gathers from four on).
- "gather": the active segments' rows gathered into a zero-padded `[n, L, in]` batch (a free
  view when the segments are back to back and of equal length) and one `bmm` per matrix.
- "grouped": torch's grouped GEMM over the active rows with per-segment offsets, one call per
  matrix and no padding. Used only on CUDA in bf16, where torch provides it (checked at import,
  and probed once per device), and with 16-byte aligned shapes.

Place in the flow: `MultiSlotLoraLinear.forward` flattens its rows and calls `segment_lora`;
`workers.engine.kernels` reports which kind a device runs.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F

LoraKind = Literal["loop", "gather", "grouped"]
LORA_KINDS: tuple[LoraKind, ...] = ("loop", "gather", "grouped")
SegmentSpec = tuple[int, int, int, float]  # (slot, start, stop, scale)

_CPU_GATHER_FROM = 4  # active segments from which a CPU pass gathers instead of looping
_BASE_SLOT = (
    -1
)  # `workers.engine.lora.BASE_SLOT`; not imported, so this module has no model imports

GroupedMM = Callable[..., torch.Tensor]
# The public name where torch has it, else the private op that MoE code calls.
_GROUPED_MM: GroupedMM | None = cast(
    "GroupedMM | None", getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
)


def segment_lora(
    x: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    segments: Sequence[SegmentSpec],
    *,
    kind: LoraKind | None = None,
    into_grad: bool = False,
) -> torch.Tensor:
    """The LoRA update `[T, out]` of rows `x[T, in]` for `segments`; `kind=None` picks one.

    `segments` are `(slot, start, stop, scale)` in increasing row order, not overlapping, within
    `[0, T)`; they need not cover every row. `lora_A` is `[S, r, in]`, `lora_B` `[S, out, r]`.
    `into_grad`: a backward adds the factors' gradients straight into their `.grad` where it
    is set (`select_rows`); only for a `backward()`, never for `torch.autograd.grad`.
    """
    if x.dim() != 2 or lora_A.dim() != 3 or lora_B.dim() != 3:
        raise ValueError(
            f"expected x [T, in], A [S, r, in], B [S, out, r]; got {tuple(x.shape)}, "
            f"{tuple(lora_A.shape)}, {tuple(lora_B.shape)}"
        )
    n_slots, rank, in_features = lora_A.shape
    out_features = lora_B.shape[1]
    if in_features != x.shape[1] or tuple(lora_B.shape) != (n_slots, out_features, rank):
        raise ValueError(
            f"shapes do not chain: x {tuple(x.shape)}, A {tuple(lora_A.shape)}, "
            f"B {tuple(lora_B.shape)}"
        )
    active = _active_segments(segments, n_rows=x.shape[0], n_slots=n_slots)
    if not active:
        return x.new_zeros(x.shape[0], out_features)
    chosen = kind or choose_kind(
        x.device, x.dtype, shapes=(in_features, out_features, rank), n_segments=len(active)
    )
    if chosen == "loop":
        return _loop(x, lora_A, lora_B, active, into_grad)
    if chosen == "gather":
        return _gather(x, lora_A, lora_B, active, into_grad)
    if chosen == "grouped":
        reason = grouped_unavailable_reason(x.device, x.dtype, (in_features, out_features, rank))
        if reason is not None:
            raise ValueError(f"LoRA kind 'grouped' is not available here: {reason}")
        return _grouped(x, lora_A, lora_B, active, into_grad)
    raise ValueError(f"unknown LoRA kind {chosen!r}: expected one of {LORA_KINDS}")


def choose_kind(
    device: torch.device,
    dtype: torch.dtype,
    *,
    shapes: tuple[int, ...] = (),
    n_segments: int = 1,
) -> LoraKind:
    """The kind `segment_lora` runs by default: grouped where available; on a CPU, loop for a
    few segments and gather from `_CPU_GATHER_FROM` on (one bmm beats many small matmuls:
    16 tenants of 32 tokens, `bench/engine_merge.py`, pass 1.38x → 1.19x a one-tenant pass)."""
    if device.type != "cuda":
        return "gather" if n_segments >= _CPU_GATHER_FROM else "loop"
    if grouped_unavailable_reason(device, dtype, shapes) is None:
        return "grouped"
    return "gather"


def grouped_unavailable_reason(
    device: torch.device, dtype: torch.dtype, shapes: tuple[int, ...] = ()
) -> str | None:
    """None if the grouped GEMM path can run for these inputs; otherwise why not, in words.

    `shapes` are the matrix sizes involved (in, out, rank); each must be a multiple of 8 so that
    bf16 rows and columns are 16-byte aligned, as the CUDA kernel requires.
    """
    if _GROUPED_MM is None:
        return f"torch {torch.__version__} has no grouped GEMM (F.grouped_mm / torch._grouped_mm)"
    if device.type != "cuda":
        return f"the grouped GEMM path runs only on CUDA (this device is {device.type})"
    if dtype != torch.bfloat16:
        return f"the grouped GEMM path needs bf16 activations (got {dtype})"
    misaligned = [size for size in shapes if size % 8]
    if misaligned:
        return f"sizes {misaligned} are not multiples of 8 (16-byte bf16 alignment)"
    return _probe_grouped(_device_index(device))


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _probe_grouped(device_index: int) -> str | None:
    """One tiny forward+backward on the device: a build whose kernel is missing fails here."""
    assert _GROUPED_MM is not None
    try:
        device = torch.device("cuda", device_index)
        x = torch.randn(32, 16, device=device, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.randn(2, 8, 16, device=device, dtype=torch.bfloat16, requires_grad=True)
        offs = torch.tensor([16, 32], device=device, dtype=torch.int32)
        out = _GROUPED_MM(x, weight.transpose(1, 2), offs=offs)
        out.backward(torch.ones_like(out))  # type: ignore[no-untyped-call]
        torch.cuda.synchronize(device)
    except Exception as exc:  # any failure means "not available": the caller falls back
        return f"the grouped GEMM probe failed on cuda:{device_index}: {exc}"
    return None


def _active_segments(
    segments: Sequence[SegmentSpec], *, n_rows: int, n_slots: int
) -> list[SegmentSpec]:
    """The segments that change rows, after checking every segment is in bounds and in order."""
    active: list[SegmentSpec] = []
    previous_stop = 0
    for slot, start, stop, scale in segments:
        if not (previous_stop <= start <= stop <= n_rows) or not (-1 <= slot < n_slots):
            raise ValueError(
                f"bad LoRA segment (slot={slot}, start={start}, stop={stop}) for {n_rows} rows "
                f"and {n_slots} slots: segments must be in order, disjoint and in bounds"
            )
        previous_stop = stop
        if slot != _BASE_SLOT and scale != 0.0 and stop > start:
            active.append((slot, start, stop, float(scale)))
    return active


def _loop(
    x: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    active: list[SegmentSpec],
    into_grad: bool = False,
) -> torch.Tensor:
    # The active slots' rows selected once, then one unbind: its backward stacks the
    # per-segment gradients into one `[segments, ...]` tensor.
    plan = _plan(tuple(active), x.device)
    a_slots = select_rows(lora_A, plan.slots, into_grad=into_grad, span=plan.span).unbind(0)
    b_slots = select_rows(lora_B, plan.slots, into_grad=into_grad, span=plan.span).unbind(0)
    out_features = lora_B.shape[1]
    pieces: list[torch.Tensor] = []
    row = 0
    for k, (_, start, stop, scale) in enumerate(active):
        if start > row:
            pieces.append(x.new_zeros(start - row, out_features))
        # Scale the rank-r intermediate rather than the [*, out] result: same value, less work.
        shrunk = F.linear(x[start:stop], a_slots[k].to(x.dtype)) * scale
        pieces.append(F.linear(shrunk, b_slots[k].to(x.dtype)))
        row = stop
    if row < x.shape[0]:
        pieces.append(x.new_zeros(x.shape[0] - row, out_features))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)


def _gather(
    x: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    active: list[SegmentSpec],
    into_grad: bool = False,
) -> torch.Tensor:
    n = len(active)
    lengths = [stop - start for _, start, stop, _ in active]
    longest = max(lengths)
    first, last = active[0][1], active[-1][2]
    back_to_back = all(active[i][2] == active[i + 1][1] for i in range(n - 1))
    plan = _plan(tuple(active), x.device)
    if back_to_back and all(length == longest for length in lengths):
        x_padded = x[first:last].reshape(n, longest, x.shape[1])  # a view: no copy
        valid = None
    else:
        # Padding positions repeat their segment's first row; their outputs are never read, so
        # they receive zero gradient and add exactly 0 to every gradient.
        x_padded = x.index_select(0, plan.padded_rows.view(-1)).view(n, longest, x.shape[1])
        valid = plan.valid_positions
    expanded = cast(
        torch.Tensor,
        _BatchedLora.apply(  # type: ignore[no-untyped-call]
            x_padded, lora_A, lora_B, plan.slots, plan.span, plan.segment_scales, into_grad
        ),
    ).reshape(n * longest, -1)
    if valid is not None:
        expanded = expanded.index_select(0, valid)
    return _place(expanded, x.shape[0], first, last, back_to_back, plan.rows)


class _BatchedLora(torch.autograd.Function):
    """`gather`'s maths on a padded batch `x [n, L, in]`, segment k on slot `slots[k]`:
    `(scales[k] · x[k] · A[slot]ᵀ) · B[slot]ᵀ`, as two `bmm`, with a backward of its own.

    One node in the graph where autograd's way took seven (two row selections, two casts, the
    scale, two `bmm`), and the backward adds each factor's gradient rows straight into the
    factor's `.grad` rows when `into_grad` holds (a view of the bank's gradient buffer), as
    `select_rows` does. Paired runs of a 16-tenant pass of 32 tokens each
    (`bench/engine_merge.py`'s model, one thread): about 2 % faster. A factor this backward
    does not reach (`torch.autograd.grad` of other inputs) is left alone.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        lora_A: torch.Tensor,
        lora_B: torch.Tensor,
        slots: torch.Tensor,
        span: tuple[int, int] | None,
        scales: torch.Tensor,
        into_grad: bool,
    ) -> torch.Tensor:
        a = _rows(lora_A, slots, span).to(x.dtype)
        b = _rows(lora_B, slots, span).to(x.dtype)
        shrunk = torch.bmm(x, a.transpose(1, 2))
        shrunk = (shrunk * scales.view(-1, 1, 1)).to(x.dtype)
        ctx.save_for_backward(x, a, b, shrunk, slots, scales)
        ctx.factors, ctx.span, ctx.into_grad = (lora_A, lora_B), span, into_grad
        return torch.bmm(shrunk, b.transpose(1, 2))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, a, b, shrunk, slots, scales = ctx.saved_tensors
        lora_A, lora_B = ctx.factors
        need_x, need_a, need_b = ctx.needs_input_grad[:3]
        grad_b = (
            _factor_grad(ctx, 2, lora_B, slots, grad.transpose(1, 2), shrunk) if need_b else None
        )
        grad_x = grad_a = None
        if need_x or need_a:
            grad_shrunk = (torch.bmm(grad, b) * scales.view(-1, 1, 1)).to(x.dtype)
            if need_a:
                grad_a = _factor_grad(ctx, 1, lora_A, slots, grad_shrunk.transpose(1, 2), x)
            if need_x:
                grad_x = torch.bmm(grad_shrunk, a)
        return grad_x, grad_a, grad_b, None, None, None, None


def _factor_grad(
    ctx: Any,
    position: int,
    factor: torch.Tensor,
    slots: torch.Tensor,
    left: torch.Tensor,
    right: torch.Tensor,
) -> torch.Tensor | None:
    """`left @ right` (one gradient row per segment) added to the factor's slots' rows: into
    its `.grad` (returns None) or into a zero full-size gradient (returns it); None where this
    backward does not reach the factor. Under `torch.autograd.grad` a factor that is a leaf
    always gets the full-size gradient (torch cannot tell here whether it was asked for)."""
    node = ctx.next_functions[position][0]
    if node is None:
        return None
    into_grad = ctx.into_grad
    try:
        if not torch._C._will_engine_execute_node(node):
            return None
    except RuntimeError:  # `torch.autograd.grad` is running: it takes gradients, adds none
        into_grad = False
    product = torch.bmm(left, right).to(factor.dtype)
    return _add_rows(factor, slots, ctx.span, product, into_grad=into_grad)


def _grouped(
    x: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    active: list[SegmentSpec],
    into_grad: bool = False,
) -> torch.Tensor:
    assert _GROUPED_MM is not None
    first, last = active[0][1], active[-1][2]
    back_to_back = all(active[i][2] == active[i + 1][1] for i in range(len(active) - 1))
    plan = _plan(tuple(active), x.device)
    x_rows = x[first:last] if back_to_back else x.index_select(0, plan.rows)
    a = select_rows(lora_A, plan.slots, into_grad=into_grad, span=plan.span).to(x.dtype)
    b = select_rows(lora_B, plan.slots, into_grad=into_grad, span=plan.span).to(x.dtype)
    # Row-major activations, column-major (transposed) adapters: the layout the kernel takes.
    shrunk = _GROUPED_MM(x_rows.contiguous(), a.transpose(1, 2), offs=plan.offsets)
    shrunk = (shrunk * plan.row_scales).to(x.dtype)
    expanded = _GROUPED_MM(shrunk, b.transpose(1, 2), offs=plan.offsets)
    # The kernel's backward rejects a broadcast (stride-0) gradient such as `.sum()` gives.
    expanded = _ContiguousGrad.apply(expanded)  # type: ignore[no-untyped-call]
    return _place(expanded, x.shape[0], first, last, back_to_back, plan.rows)


def _place(
    updates: torch.Tensor,
    n_rows: int,
    first: int,
    last: int,
    back_to_back: bool,
    rows: torch.Tensor,
) -> torch.Tensor:
    """The active rows' updates put at their rows of a `[n_rows, out]` result, zeros elsewhere."""
    if back_to_back:
        if first == 0 and last == n_rows:
            return updates
        return F.pad(updates, (0, 0, first, n_rows - last))
    return updates.new_zeros(n_rows, updates.shape[1]).index_copy(0, rows, updates)


def select_rows(
    source: torch.Tensor,
    index: torch.Tensor,
    dim: int | None = None,
    length: int = 0,
    *,
    into_grad: bool = False,
    span: tuple[int, int] | None = None,
) -> torch.Tensor:
    """`source[index]` (narrowed to its first `length` along `dim` when `dim` is given).

    `span=(first, n)` says `index` is `first, first + 1, …, first + n - 1`: the rows are then a
    view, and their gradient one add.

    `into_grad`, for a leaf whose `.grad` is set (a view of the bank's gradient rows): the
    backward adds into `.grad`'s rows `index` in place and hands autograd nothing. Autograd's
    own way builds a zero gradient of the full `[S, ...]` size, copies the rows in and adds all
    of it (16 tenants in a bank of 65 slots: 0.34-0.37 s → 0.32-0.33 s a CPU MoE pass of
    `bench/moe_merge.py`'s model). Only for a `backward()`: `torch.autograd.grad` would see no
    gradient reach `source`."""
    return cast(
        torch.Tensor,
        _SelectRows.apply(source, index, dim, length, into_grad, span),  # type: ignore[no-untyped-call]
    )


class _SelectRows(torch.autograd.Function):
    """`select_rows`; see there."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        source: torch.Tensor,
        index: torch.Tensor,
        dim: int | None,
        length: int,
        into_grad: bool,
        span: tuple[int, int] | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.source, ctx.dim, ctx.length = source, dim, length  # type: ignore[attr-defined]
        ctx.into_grad, ctx.span = into_grad, span  # type: ignore[attr-defined]
        return _rows(source if dim is None else source.narrow(dim, 0, length), index, span)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None, None, None, None]:
        (index,) = ctx.saved_tensors  # type: ignore[attr-defined]
        source: torch.Tensor = ctx.source  # type: ignore[attr-defined]
        dim: int | None = ctx.dim  # type: ignore[attr-defined]
        length: int = ctx.length  # type: ignore[attr-defined]
        into_grad: bool = ctx.into_grad  # type: ignore[attr-defined]
        span: tuple[int, int] | None = ctx.span  # type: ignore[attr-defined]
        full = _add_rows(source, index, span, grad, into_grad=into_grad, dim=dim, length=length)
        return full, None, None, None, None, None


def _rows(source: torch.Tensor, index: torch.Tensor, span: tuple[int, int] | None) -> torch.Tensor:
    """Rows `index` of `source`: a view where they are the span `(first, n)`."""
    return source.narrow(0, *span) if span is not None else source.index_select(0, index)


def _add_rows(
    source: torch.Tensor,
    index: torch.Tensor,
    span: tuple[int, int] | None,
    grad: torch.Tensor,
    *,
    into_grad: bool,
    dim: int | None = None,
    length: int = 0,
) -> torch.Tensor | None:
    """`grad`, the gradient of `_rows(source narrowed to length along dim, index, span)`,
    added into `source.grad` where `into_grad` holds and `source` is a leaf whose `.grad` is set
    (returns None), else into a zero full-size gradient, autograd's way (returns it)."""
    into = source.grad if into_grad and source.is_leaf else None
    full = None
    if into is None:
        into = full = grad.new_zeros(source.shape)
    target = into if dim is None else into.narrow(dim, 0, length)
    if span is not None:
        target.narrow(0, *span).add_(grad)
    else:
        target.index_add_(0, index, grad.to(target.dtype))
    return full


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class _Plan:
    """Index tensors of one pass's active segments on one device, built once for every layer."""

    def __init__(self, active: tuple[SegmentSpec, ...], device: torch.device) -> None:
        lengths = [stop - start for _, start, stop, _ in active]
        longest = max(lengths)
        rows = [r for _, start, stop, _ in active for r in range(start, stop)]
        padded = [
            [start + min(i, stop - start - 1) for i in range(longest)]
            for _, start, stop, _ in active
        ]
        valid = [k * longest + i for k, length in enumerate(lengths) for i in range(length)]
        row_scales = [scale for _, start, stop, scale in active for _ in range(stop - start)]
        offsets = list(itertools.accumulate(lengths))

        def on_device(values: object, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        slots = [slot for slot, _, _, _ in active]
        self.slots = on_device(slots, torch.long)
        self.span = slot_span(slots)
        self.rows = on_device(rows, torch.long)
        self.padded_rows = on_device(padded, torch.long)
        self.valid_positions = on_device(valid, torch.long)
        self.segment_scales = on_device([scale for *_, scale in active], torch.float32)
        self.row_scales = on_device(row_scales, torch.float32).view(-1, 1)
        self.offsets = on_device(offsets, torch.int32)


def slot_span(slots: Sequence[int]) -> tuple[int, int] | None:
    """`(first, n)` when `slots` are `first, first + 1, …` (for `select_rows`), else None."""
    first = slots[0] if slots else 0
    return (first, len(slots)) if list(slots) == list(range(first, first + len(slots))) else None


@functools.lru_cache(maxsize=16)
def _plan(active: tuple[SegmentSpec, ...], device: torch.device) -> _Plan:
    # Every adapted linear of a pass sees the same segments: build the index tensors once.
    return _Plan(active, device)

"""segment_lora: every kind gives the same update and the same gradients as the segment loop.

fp32 on the CPU. The grouped GEMM kind runs only on CUDA in bf16; its test is skipped elsewhere
with the reason `grouped_unavailable_reason` gives, and its maths is checked here through the
CPU grouped GEMM where torch provides one.
"""

from __future__ import annotations

import random

import pytest
import torch

from workers.engine.lora import BASE_SLOT, LoraBank, Segment, SlotRouting
from workers.engine.lora_kernels import (
    LoraKind,
    SegmentSpec,
    _active_segments,
    _grouped,
    choose_kind,
    grouped_unavailable_reason,
    segment_lora,
    select_rows,
    slot_span,
)

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def random_case(
    seed: int, *, aligned: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[SegmentSpec], torch.Tensor]:
    """x, A and B (views of one flat buffer whose grads are views of another, as in LoraBank),
    segments with gaps, empty, zero-scale and base segments, and the loss weights.

    `aligned`: sizes in multiples of 8 (what a grouped GEMM takes) and at least one segment.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n_slots, rank = rng.randint(1, 6), rng.randint(1, 8)
    in_f, out_f = rng.randint(1, 40), rng.randint(1, 40)
    if aligned:
        rank, in_f, out_f = 8 * rng.randint(1, 2), 8 * rng.randint(1, 5), 8 * rng.randint(1, 5)
    segments: list[SegmentSpec] = []
    row = 0
    for _ in range(rng.randint(0, 7)):
        row += rng.choice([0, 0, 0, 1, 3])  # sometimes a gap no segment covers
        length = rng.choice([0, 1, 2, 5, 9, 16])
        slot = rng.choice([*range(n_slots), BASE_SLOT])
        scale = rng.choice([0.0, 0.5, 2.0, 32 / 24])
        segments.append((slot, row, row + length, scale))
        row += length
    if aligned:
        segments.append((rng.randrange(n_slots), row, row + 5, 1.5))
        row += 5
    n_rows = row + rng.choice([0, 2])
    x = torch.randn(n_rows, in_f, generator=gen, requires_grad=True)
    size_a, size_b = rank * in_f, out_f * rank
    weights = torch.zeros(n_slots, size_a + size_b + 3)
    grads = torch.zeros_like(weights)
    weights[:, :size_a] = torch.randn(n_slots, size_a, generator=gen) / in_f**0.5
    weights[:, size_a : size_a + size_b] = torch.randn(n_slots, size_b, generator=gen) / rank**0.5
    lora_A = torch.nn.Parameter(weights[:, :size_a].view(n_slots, rank, in_f))
    lora_A.grad = grads[:, :size_a].view(n_slots, rank, in_f)
    lora_B = torch.nn.Parameter(weights[:, size_a : size_a + size_b].view(n_slots, out_f, rank))
    lora_B.grad = grads[:, size_a : size_a + size_b].view(n_slots, out_f, rank)
    loss_weights = torch.randn(n_rows, out_f, generator=gen) / out_f**0.5
    return x, lora_A, lora_B, segments, loss_weights


def reference(
    x: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, segments: list[SegmentSpec]
) -> torch.Tensor:
    """Row by row, in float64: the update the docstring promises."""
    out = torch.zeros(x.shape[0], lora_B.shape[1], dtype=torch.float64)
    for slot, start, stop, scale in segments:
        if slot == BASE_SLOT:
            continue
        for r in range(start, stop):
            a, b = lora_A[slot].double(), lora_B[slot].double()
            out[r] = scale * (b @ (a @ x[r].double()))
    return out


def run(
    kind: LoraKind, seed: int, *, aligned: bool = False, into_grad: bool = False
) -> tuple[torch.Tensor, ...]:
    x, lora_A, lora_B, segments, loss_weights = random_case(seed, aligned=aligned)
    outputs = []
    for _ in range(2):  # twice: gradients accumulate into the shared buffer
        update = segment_lora(x, lora_A, lora_B, segments, kind=kind, into_grad=into_grad)
        if update.requires_grad:
            (update * loss_weights).sum().backward()
        outputs.append(update.detach())
    assert torch.equal(outputs[0], outputs[1])
    assert lora_A.grad is not None and lora_B.grad is not None
    x_grad = x.grad if x.grad is not None else torch.zeros_like(x)
    return outputs[0], x_grad, lora_A.grad.clone(), lora_B.grad.clone()


@pytest.mark.parametrize("seed", range(40))
def test_loop_and_gather_agree_in_value_and_gradient(seed: int) -> None:
    x, lora_A, lora_B, segments, _ = random_case(seed)
    loop, gather = run("loop", seed), run("gather", seed)
    # adding straight into the bank's gradient rows gives autograd's gradients (a repeated
    # slot's segments may be summed in another order)
    for kind, autograds in (("loop", loop), ("gather", gather)):
        for name, a, b in zip(
            ("update", "dx", "dA", "dB"), autograds, run(kind, seed, into_grad=True), strict=True
        ):
            assert a.shape == b.shape, (kind, name)
            if a.numel():
                assert (a - b).abs().max().item() <= 1e-6 * max(1.0, a.abs().max().item()), name
    for name, a, b in zip(("update", "dx", "dA", "dB"), loop, gather, strict=True):
        assert a.shape == b.shape, name
        if a.numel():  # within 1e-6 of the magnitude (values here are O(1))
            assert (a - b).abs().max().item() <= 1e-6 * max(1.0, a.abs().max().item()), name
    expected = reference(x, lora_A, lora_B, segments)
    assert torch.allclose(loop[0].double(), expected, atol=1e-5), "loop differs from the maths"
    # Rows no active segment changes are exactly zero; so are the gradients of absent slots.
    changed = torch.zeros(x.shape[0], dtype=torch.bool)
    trained_slots = set()
    for slot, start, stop, _ in _active_segments(
        segments, n_rows=x.shape[0], n_slots=lora_A.shape[0]
    ):
        changed[start:stop] = True
        trained_slots.add(slot)
    for update, _, grad_a, grad_b in (loop, gather):
        assert torch.all(update[~changed] == 0)
        for slot in set(range(lora_A.shape[0])) - trained_slots:
            assert torch.all(grad_a[slot] == 0) and torch.all(grad_b[slot] == 0)


def test_segments_tiling_all_rows_give_the_same_result_through_the_bmm_view() -> None:
    """Back-to-back equal segments take gather's no-copy path; it must match the loop."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4 * 6, 10, generator=gen, requires_grad=True)
    lora_A = torch.randn(5, 3, 10, generator=gen, requires_grad=True)
    lora_B = torch.randn(5, 7, 3, generator=gen, requires_grad=True)
    segments = [(3, 0, 6, 2.0), (0, 6, 12, 0.5), (4, 12, 18, 1.0), (1, 18, 24, 4.0)]
    results = {}
    for kind in ("loop", "gather"):
        update = segment_lora(x, lora_A, lora_B, segments, kind=kind)  # type: ignore[arg-type]
        grads = torch.autograd.grad(update.square().sum(), (x, lora_A, lora_B))
        results[kind] = (update, *grads)
    for a, b in zip(results["loop"], results["gather"], strict=True):
        assert (a - b).abs().max().item() <= 1e-5 * max(1.0, a.abs().max().item())


@pytest.mark.parametrize("into_grad", [False, True], ids=["autograd", "into-grad"])
@pytest.mark.parametrize(
    "slots",
    [(1, 2, 3), (0, 1, 2, 3, 4), (3, 0, 4), (2, 4, 0), (1, 1, 2), (4, 2, 4)],
    ids=["range", "whole-bank", "unique", "descending", "repeat-adjacent", "repeat-apart"],
)
def test_slot_selections_add_into_the_banks_gradient_rows_as_the_loop_does(
    slots: tuple[int, ...], into_grad: bool
) -> None:
    """Runs of slots, unique, descending and repeated slots each equal the loop, and the
    gradient accumulates into the bank's buffer, onto what was pending there, touching no other
    slot's row: through autograd's accumulation, or added straight into the rows."""
    gen = torch.Generator().manual_seed(len(slots) + sum(slots))
    x = torch.randn(5 * len(slots), 10, generator=gen, requires_grad=True)
    segments = [(slot, 5 * i, 5 * i + 5, 0.5 + i) for i, slot in enumerate(slots)]
    results = {}
    kinds: tuple[LoraKind, ...] = ("loop", "gather")
    for kind in kinds:
        weights = torch.randn(5, 3 * 10 + 7 * 3, generator=torch.Generator().manual_seed(1))
        grads = torch.ones_like(weights)  # a gradient already pending: it must be added to
        lora_A = torch.nn.Parameter(weights[:, :30].view(5, 3, 10))
        lora_A.grad = grads[:, :30].view(5, 3, 10)
        lora_B = torch.nn.Parameter(weights[:, 30:].view(5, 7, 3))
        lora_B.grad = grads[:, 30:].view(5, 7, 3)
        update = segment_lora(x, lora_A, lora_B, segments, kind=kind, into_grad=into_grad)
        (dx,) = torch.autograd.grad(update.square().sum(), (x,), retain_graph=True)
        update.square().sum().backward()
        assert lora_A.grad.data_ptr() == grads.data_ptr()  # still the bank's buffer
        results[kind] = (update.detach(), dx, grads.clone())
    for a, b in zip(results["loop"], results["gather"], strict=True):
        assert (a - b).abs().max().item() <= 1e-5 * max(1.0, a.abs().max().item())
    untouched = sorted(set(range(5)) - set(slots))
    for _, _, grads in results.values():
        assert torch.all(grads[untouched] == 1.0)


@pytest.mark.parametrize("rows", [(2, 0, 2), (1, 2)], ids=["gathered", "span"])
@pytest.mark.parametrize("dim", [None, 1, -1], ids=["whole", "narrowed", "narrowed-last"])
def test_select_rows_adds_into_the_rows_of_a_leafs_grad_and_no_other(
    dim: int | None, rows: tuple[int, ...]
) -> None:
    """`select_rows(..., into_grad=True)` on a leaf whose `.grad` is a view of a bank: the
    selected rows' gradients (repeats summed, only the narrowed part) land in that view, equal
    to autograd's own; a leaf without `.grad` gets autograd's gradient as usual. Consecutive
    rows (a span) are a view of the leaf."""
    gen = torch.Generator().manual_seed(5)
    bank = torch.randn(4, 2, 6, 5, generator=gen)
    grads = torch.full_like(bank, 3.0)
    leaf = torch.nn.Parameter(bank[:, 1])
    leaf.grad = grads[:, 1]
    plain = torch.nn.Parameter(bank[:, 1].clone())
    index = torch.tensor(rows)
    span = slot_span(rows)
    assert (span is not None) == (rows == (1, 2))
    length = 4
    selected = select_rows(leaf, index, dim, length, into_grad=True, span=span)
    if span is not None:
        assert selected.data_ptr() == leaf[1:].data_ptr()  # a view, no copy
    weights = torch.randn(selected.shape, generator=gen)
    (selected * weights).sum().backward()
    source = plain if dim is None else plain.narrow(dim, 0, length)
    (source.index_select(0, index) * weights).sum().backward()
    assert plain.grad is not None
    assert torch.allclose(grads[:, 1] - 3.0, plain.grad, atol=1e-6)
    assert torch.all(grads[:, 0] == 3.0) and torch.all(grads[3] == 3.0)  # other rows as were
    fresh = torch.nn.Parameter(bank[:, 1].clone())
    (select_rows(fresh, index, dim, length, into_grad=True, span=span) * weights).sum().backward()
    assert fresh.grad is not None and torch.equal(fresh.grad, plain.grad)


def test_no_active_segment_gives_zeros_and_no_graph() -> None:
    x = torch.randn(5, 4, requires_grad=True)
    lora_A, lora_B = torch.randn(2, 2, 4), torch.randn(2, 3, 2)
    update = segment_lora(x, lora_A, lora_B, [(0, 0, 2, 0.0), (BASE_SLOT, 2, 5, 1.0)])
    assert update.shape == (5, 3) and torch.all(update == 0) and not update.requires_grad


@pytest.mark.parametrize(
    "segments",
    [[(0, 2, 1, 1.0)], [(0, 0, 3, 1.0), (1, 2, 4, 1.0)], [(0, 0, 9, 1.0)], [(2, 0, 1, 1.0)]],
)
def test_bad_segments_are_refused(segments: list[SegmentSpec]) -> None:
    x, lora_A, lora_B = torch.randn(5, 4), torch.randn(2, 2, 4), torch.randn(2, 3, 2)
    with pytest.raises(ValueError, match="bad LoRA segment"):
        segment_lora(x, lora_A, lora_B, segments)


def test_the_cpu_runs_the_loop_and_refuses_grouped_with_its_reason() -> None:
    assert choose_kind(torch.device("cpu"), torch.float32) == "loop"
    reason = grouped_unavailable_reason(torch.device("cpu"), torch.bfloat16)
    assert reason is not None and ("CUDA" in reason or "no grouped GEMM" in reason)
    x, lora_A, lora_B = torch.randn(5, 8), torch.randn(2, 8, 8), torch.randn(2, 8, 8)
    with pytest.raises(ValueError, match="not available"):
        segment_lora(x, lora_A, lora_B, [(0, 0, 5, 1.0)], kind="grouped")


@pytest.mark.parametrize("seed", range(12))
def test_grouped_maths_on_the_cpu_grouped_gemm(seed: int) -> None:
    """The grouped kind's offsets, transposes and placement, through torch's CPU grouped GEMM."""
    x, lora_A, lora_B, segments, loss_weights = random_case(seed, aligned=True)
    active = _active_segments(segments, n_rows=x.shape[0], n_slots=lora_A.shape[0])
    try:
        update = _grouped(x, lora_A, lora_B, active)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"torch {torch.__version__} has no CPU grouped GEMM for fp32: {exc}")
    grads = torch.autograd.grad((update * loss_weights).sum(), (x, lora_A, lora_B))
    loop = run("loop", seed, aligned=True)
    for name, a, b in zip(("update", "dx", "dA", "dB"), loop, (update, *grads), strict=True):
        # `run` accumulated two backward passes into the gradients; one pass here.
        scale = 1.0 if name == "update" else 2.0
        assert (a - scale * b.detach()).abs().max().item() <= 1e-5, name


def test_grouped_kind_matches_gather_in_bf16_on_cuda() -> None:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    reason = grouped_unavailable_reason(device, torch.bfloat16, (64, 96, 16))
    if reason is not None:
        pytest.skip(reason)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3 * 128, 64, generator=gen).to(device, torch.bfloat16).requires_grad_()
    lora_A = (torch.randn(4, 16, 64, generator=gen) / 8).to(device).requires_grad_()
    lora_B = torch.randn(4, 96, 16, generator=gen).to(device).requires_grad_()
    segments = [(2, 0, 100, 2.0), (0, 100, 128, 0.0), (1, 128, 384, 0.5)]
    results = []
    for kind in ("gather", "grouped"):
        update = segment_lora(x, lora_A, lora_B, segments, kind=kind)  # type: ignore[arg-type]
        grads = torch.autograd.grad(update.float().square().sum(), (x, lora_A, lora_B))
        results.append((update, *grads))
    for a, b in zip(*results, strict=True):
        assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2 * a.abs().max().item())


def test_matches_what_lora_py_computes_for_a_wrapped_linear() -> None:
    """The base output plus segment_lora over flattened rows equals MultiSlotLoraLinear's."""
    model = torch.nn.Module()
    model.mlp = torch.nn.Module()
    model.mlp.up_proj = torch.nn.Linear(12, 20, bias=False)
    routing = SlotRouting()
    bank = LoraBank(model, max_slots=3, max_rank=4, routing=routing, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for slot, rank in ((0, 4), (2, 2)):
        bank.init_slot(slot, rank=rank, groups=["mlp"], lora_alpha=8.0, generator=gen)
        for _, _, b in bank.slot_views(bank.weights, slot, rank):
            b.copy_(torch.randn(b.shape, generator=gen))
    layer = bank.layers["mlp.up_proj"]
    x = torch.randn(5, 7, 12, generator=gen)  # 5 rows of 7 tokens
    row_segments = [Segment(2, 0, 2), Segment(1, 2, 3), Segment(0, 3, 5)]
    with routing.bind(row_segments):
        expected = layer(x)
    tokens = [
        (s.slot, s.start * 7, s.stop * 7, layer.slot_scales[s.slot] if s.slot >= 0 else 0.0)
        for s in row_segments
    ]
    update = segment_lora(x.reshape(-1, 12), layer.lora_A, layer.lora_B, tokens)
    got = layer.base_layer(x) + update.view(5, 7, 20)
    assert (got - expected).abs().max().item() <= 1e-6

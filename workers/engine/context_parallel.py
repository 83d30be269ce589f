"""Context parallelism: a long pass's token positions split over the ranks of a worker group.

Job: let a worker group (`--devices N`) train a datum whose activations do not fit one device.
Each rank runs the decoder on 1/N of every row's positions (rank r: columns `r·c .. r·c + c - 1`
of a row padded to `N·c`), so each rank keeps about 1/N of the pass's activations. What mixes
positions is exchanged:

- **Attention: the keys and values are all-gathered per layer** (not passed round a ring).
  Each rank sends its `c` positions' K and V once and receives everyone's: per layer and row,
  `2 · (N - 1) · c · kv_heads · head_dim` values in, the same out (the backward's reduction of
  their gradients costs the same again). Rank r then attends with its own queries to the first
  `(r + 1) · c` keys, causally (bottom-right aligned), or with the block-diagonal mask of the
  packed sequences. A ring would overlap the exchange with the attention blocks and hold two
  blocks instead of all N; on gloo over loopback, or NCCL within one host, the gather is one
  call per layer and its K/V are small next to the activations it saves (grouped-query
  attention: kv_heads · head_dim is an eighth of the hidden size or less on the models we
  serve). It is the one to swap for a ring when sequences outgrow a host.
- **Experts (with the expert split of `workers.engine.expert_parallel`)**: the routed tokens
  are all-gathered before the experts block and its output reduced back (each rank keeps its
  positions' sum): every rank's experts see every position, as in the expert split alone.
- **Log-probabilities**: each rank computes its positions' log-probabilities (output layer and
  loss in chunks, as ever), then they are all-gathered, so every rank runs each datum's loss on
  the whole datum, the same bits everywhere; the backward keeps each rank's own positions.
- **Gradients**: each rank's backward adds its positions' share to the slot's replicated
  factors; `LoraBank.sum_over_ranks` sums what a split pass added.

Which passes split: `ContextParallel.splits` (a pass over the pass token budget, from
`SPLIT_FLOOR` tokens, on a group whose model `supports` it). Which models: every decoder layer's
token mixing is attention through transformers' attention interface without a sliding window
(dense and MoE Qwen3, Llama, DeepSeek-V3's MLA); a model with recurrent or convolutional
mixers (Qwen3.5's Gated DeltaNet, Mamba2, short convolutions), sliding windows, attention
sinks or images runs its long datums whole on every rank (its memory plan is one device's).

Invariants: every rank calls the same collectives in the same order (the layers run in order,
and a recomputed layer runs again at the same point of every rank's backward); a split pass's
log-probabilities, losses and adapter gradients equal one device's up to float rounding.
"""

from __future__ import annotations

import contextvars
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.nn.attention.bias import causal_lower_right
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface

from protocol.errors import ServerError
from workers.engine.collective import Collective

# the shortest pass a group splits when it is over the pass token budget (below it, the
# exchanges cost more than the activations they save)
SPLIT_FLOOR = 4096
# the fewest positions of a row a rank runs (a convolution's reach back stays within the rank
# before)
MIN_CHUNK = 8


@dataclass(frozen=True)
class SequenceSplit:
    """One split pass as this rank runs it: `rows` rows of `world · chunk` positions, this
    rank's `chunk` columns from `offset`, and the attention mask of its queries."""

    collective: Collective
    rows: int
    chunk: int
    mask: Any  # this rank's queries against the first `offset + chunk` keys (`split_pass`)

    @property
    def offset(self) -> int:
        return self.collective.rank * self.chunk

    @property
    def width(self) -> int:
        return self.collective.world * self.chunk

    def columns(self, grid: torch.Tensor) -> torch.Tensor:
        """This rank's columns of `grid` `[rows, width, ...]`."""
        return grid[:, self.offset : self.offset + self.chunk]


def split_pass(
    collective: Collective,
    chunk: int,
    documents: torch.Tensor | None,
    rows: int,
    device: torch.device,
) -> SequenceSplit:
    """This rank's split of a pass of `rows` rows of `world · chunk` positions. `documents`
    `[rows, world · chunk]`: the packed sequence each position belongs to (None: one causal
    sequence a row). The mask:
    - packed sequences: a boolean mask `[rows, 1, chunk, visible]`;
    - one sequence a row, on a GPU: `causal_lower_right` (its kernels take it as a flag; a
      tensor subclass, made here before any layer runs: it cannot be made under the
      recomputation's dispatch modes);
    - one sequence a row, on the CPU: None, for `prefix_causal_attention` (the CPU's SDPA would turn
      any mask into a float `[chunk, visible]` one: 2 GiB at 16 Ki queries)."""
    offset = collective.rank * chunk
    visible = offset + chunk
    mask: Any
    if documents is None:
        mask = None if device.type == "cpu" else causal_lower_right(chunk, visible)
    else:
        queries = documents[:, offset:visible]
        keys = documents[:, :visible]
        at = torch.arange(visible, device=keys.device)
        mask = (queries[:, :, None] == keys[:, None, :]) & (
            at[None, None, :] <= at[offset:visible][None, :, None]
        )
        mask = mask.unsqueeze(1)
    return SequenceSplit(collective, rows, chunk, mask)


_current: contextvars.ContextVar[SequenceSplit | None] = contextvars.ContextVar(
    "sequence_split", default=None
)


def current() -> SequenceSplit | None:
    """The split of the pass running on this thread (None: a whole pass)."""
    return _current.get()


@contextmanager
def splitting(split: SequenceSplit | None) -> Iterator[None]:
    """Run the calls inside as this rank's share of `split` (None: as a whole pass)."""
    token = _current.set(split)
    try:
        yield
    finally:
        _current.reset(token)


class _Gather(torch.autograd.Function):
    """Every rank's `[rows, chunk, ...]` along dim 1 into `[rows, width, ...]`. Backward:
    `summed` (the ranks' gradients of the whole summed, this rank's columns kept: each rank's
    gather fed its own part of the loss), else this rank's columns of its own gradient (every
    rank computed the same loss from the gathered values)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, split: SequenceSplit, summed: bool) -> torch.Tensor:
        ctx.split, ctx.summed = split, summed
        return _gather(x, split)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        split: SequenceSplit = ctx.split
        grad = grads[0]
        if ctx.summed:
            grad = split.collective.all_reduce_sum(grad.contiguous().clone())
        return split.columns(grad).contiguous(), None, None


class _Reduce(torch.autograd.Function):
    """The ranks' `[rows, width, ...]` partial sums summed, this rank's columns kept. Backward:
    the gradient's columns of every rank gathered; zeros for `inputs` (what `partial` was
    computed from, so that their gathers' backward runs on every rank whatever this rank's
    experts computed), which `anchor` keeps in the graph on every rank alike."""

    @staticmethod
    def forward(
        ctx: Any,
        partial: torch.Tensor,
        split: SequenceSplit,
        anchor: torch.Tensor,
        *inputs: torch.Tensor,
    ) -> torch.Tensor:
        ctx.split = split
        ctx.inputs = [(t.shape, t.dtype, t.device) for t in inputs]
        total = split.collective.all_reduce_sum(partial.contiguous().clone())
        return split.columns(total).contiguous()

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        whole = _gather(grads[0], ctx.split)
        zeros = [
            torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.inputs
        ]
        return whole, None, None, *zeros


def _gather(x: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
    """Every rank's `x` `[rows, chunk, ...]` as `[rows, width, ...]` (no autograd)."""
    world = split.collective.world
    part = x.movedim(1, 0).contiguous()
    out = part.new_empty((world * part.shape[0], *part.shape[1:]))
    split.collective.all_gather_into(out, part)
    return out.movedim(0, 1)


def gather_columns(x: torch.Tensor, split: SequenceSplit, *, summed: bool) -> torch.Tensor:
    """`_Gather` of `x` `[rows, chunk, ...]` (a plain gather for a tensor without grad)."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return _gather(x, split)
    return cast(torch.Tensor, _Gather.apply(x, split, summed))  # type: ignore[no-untyped-call]


def gather_tokens(x: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
    """A layer's flattened tokens `[rows · chunk, ...]` as the pass's `[rows · width, ...]`."""
    shaped = x.reshape(split.rows, split.chunk, *x.shape[1:])
    return gather_columns(shaped, split, summed=True).reshape(-1, *x.shape[1:])


def reduce_tokens(
    partial: torch.Tensor, split: SequenceSplit, anchor: torch.Tensor, *inputs: torch.Tensor
) -> torch.Tensor:
    """The ranks' partial outputs `[rows · width, ...]` summed, this rank's `[rows · chunk,
    ...]` kept (`_Reduce`)."""
    shaped = partial.reshape(split.rows, split.width, *partial.shape[1:])
    if torch.is_grad_enabled() and (partial.requires_grad or anchor.requires_grad):
        mine = cast(torch.Tensor, _Reduce.apply(shaped, split, anchor, *inputs))  # type: ignore[no-untyped-call]
    else:
        total = split.collective.all_reduce_sum(shaped.contiguous().clone())
        mine = split.columns(total)
    return mine.reshape(-1, *partial.shape[1:])


def split_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' `sdpa` attention, or within a split pass this rank's queries against
    every rank's keys and values (the module docstring)."""
    split = current()
    if split is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("sliding_window") is not None or kwargs.get("s_aux") is not None:
        raise ServerError("a split pass cannot run attention with a sliding window or sinks")
    visible = split.offset + split.chunk
    # [rows, heads, positions, dim]: the positions are dim 2
    key = gather_columns(key.transpose(1, 2), split, summed=True)[:, :visible].transpose(1, 2)
    value = gather_columns(value.transpose(1, 2), split, summed=True)[:, :visible].transpose(1, 2)
    groups = int(getattr(module, "num_key_value_groups", 1))
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    if split.mask is None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out, _ = prefix_causal_attention(query, key, value, split.offset, scale)
    else:
        out = F.scaled_dot_product_attention(
            query, key.contiguous(), value.contiguous(), attn_mask=split.mask, scale=scaling
        )
    return out.transpose(1, 2).contiguous(), None


_aten = torch.ops.aten


@torch.library.custom_op("twinkle::prefix_causal_attention", mutates_args=())
def prefix_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, offset: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `c` queries at positions `offset ..` to keys `0 .. offset + c - 1`,
    causally, without a mask (CPU): the keys before `offset` in one SDPA call, the rank's own
    `c` causally in another, the two merged by their log-sum-exps; (output, log-sum-exp). One
    operator, so that recomputation keeps its output as it keeps SDPA's
    (`workers.engine.recompute.ATTENTION_OPS`), not the two calls' outputs."""
    q = query.contiguous()
    own_k, own_v = key[:, :, offset:].contiguous(), value[:, :, offset:].contiguous()
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
        q, own_k, own_v, 0.0, True, scale=scale
    )
    if offset:
        pre_k, pre_v = key[:, :, :offset].contiguous(), value[:, :, :offset].contiguous()
        before, lse_before = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, pre_k, pre_v, 0.0, False, scale=scale
        )
        merged = torch.logaddexp(lse_before, lse)
        out = before * torch.exp(lse_before - merged).unsqueeze(-1) + out * torch.exp(
            lse - merged
        ).unsqueeze(-1)
        lse = merged
    return out, lse


@prefix_causal_attention.register_fake
def _(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, offset: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, heads, length, _ = query.shape
    out = query.new_empty((rows, heads, length, value.shape[-1]))
    return out, query.new_empty((rows, heads, length), dtype=torch.float32)


def _prefix_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    query, key, value, offset, scale = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse)
    ctx.offset, ctx.scale = offset, scale


def _prefix_backward(
    ctx: Any, grad_out: torch.Tensor, grad_lse: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    """Each SDPA call's backward with the merged output and log-sum-exp: each returns its keys'
    exact share (the way ring attention's blocks are differentiated)."""
    query, key, value, out, lse = ctx.saved_tensors
    offset, scale = ctx.offset, ctx.scale
    q, grad = query.contiguous(), grad_out.contiguous()
    own_k, own_v = key[:, :, offset:].contiguous(), value[:, :, offset:].contiguous()
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, own_k, own_v, out, lse, 0.0, True, scale=scale
    )
    if offset:
        pre_k, pre_v = key[:, :, :offset].contiguous(), value[:, :, :offset].contiguous()
        dq_before, dk_before, dv_before = (
            _aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad, q, pre_k, pre_v, out, lse, 0.0, False, scale=scale
            )
        )
        dq = dq + dq_before
        dk = torch.cat([dk_before, dk], dim=2)
        dv = torch.cat([dv_before, dv], dim=2)
    return dq, dk, dv, None, None


prefix_causal_attention.register_autograd(_prefix_backward, setup_context=_prefix_context)


# -- Gated DeltaNet (Qwen3.5's `linear_attn`): the state carried from rank to rank ------------


def install_linear_attention(model: nn.Module) -> int:
    """Wrap the `forward` of every Gated DeltaNet layer of `model` so that within a split pass
    it runs `split_linear_attention` (as it was outside one); how many were wrapped."""
    wrapped = 0
    for name, module in model.named_modules():
        if name.endswith("linear_attn") and is_gated_deltanet(module):
            module.forward = _split_or(module, module.forward)
            wrapped += 1
    return wrapped


def is_gated_deltanet(module: nn.Module) -> bool:
    """Whether `module` is transformers' Gated DeltaNet (Qwen3.5's, Qwen3-Next's layout)."""
    return all(
        hasattr(module, name)
        for name in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "conv1d", "A_log")
    )


def _split_or(module: nn.Module, forward: Any) -> Any:
    def linear_attn_forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        split = current()
        if split is None:
            return forward(hidden_states, *args, **kwargs)
        return split_linear_attention(module, hidden_states, split)

    return linear_attn_forward


def split_linear_attention(
    module: Any, hidden_states: torch.Tensor, split: SequenceSplit
) -> torch.Tensor:
    """A Gated DeltaNet layer's forward (transformers' torch path, no cache) on this rank's
    positions of a split pass:
    - its causal convolution reads the last `kernel - 1` positions of the rank before
      (`_Halo`: one small all-gather);
    - its recurrence starts from the state the rank before ended with and hands its own on
      (`_CarriedScan`: the ranks run their scans in turn, so this layer's time is not
      divided, only its memory)."""
    rows, length, _ = hidden_states.shape
    mixed = module.in_proj_qkv(hidden_states)  # [rows, length, conv_dim]
    z = module.in_proj_z(hidden_states).reshape(rows, length, -1, module.head_v_dim)
    b = module.in_proj_b(hidden_states)
    a = module.in_proj_a(hidden_states)
    kernel = int(module.conv_kernel_size)
    before = _halo(mixed[:, length - (kernel - 1) :], split)
    extended = torch.cat([before, mixed], dim=1).transpose(1, 2)  # [rows, conv_dim, K-1+len]
    weight = module.conv1d.weight  # [conv_dim, 1, K]
    conv = F.conv1d(extended.to(weight.dtype), weight, module.conv1d.bias, groups=weight.shape[0])
    mixed = F.silu(conv).to(hidden_states.dtype).transpose(1, 2)  # [rows, length, conv_dim]
    query, key, value = torch.split(
        mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1
    )
    query = query.reshape(rows, length, -1, module.head_k_dim)
    key = key.reshape(rows, length, -1, module.head_k_dim)
    value = value.reshape(rows, length, -1, module.head_v_dim)
    beta = b.sigmoid()
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    repeat = module.num_v_heads // module.num_k_heads
    if repeat > 1:
        query = query.repeat_interleave(repeat, dim=2)
        key = key.repeat_interleave(repeat, dim=2)
    scan = sys.modules[type(module).__module__].torch_chunk_gated_delta_rule
    out = cast(
        torch.Tensor,
        _CarriedScan.apply(split, scan, query, key, value, g, beta),  # type: ignore[no-untyped-call]
    )
    out = module.norm(out.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return cast(torch.Tensor, module.out_proj(out.reshape(rows, length, -1)))


def _halo(tail: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
    if torch.is_grad_enabled() and tail.requires_grad:
        return cast(torch.Tensor, _Halo.apply(tail, split))  # type: ignore[no-untyped-call]
    return _Halo.exchange(tail, split)


class _Halo(torch.autograd.Function):
    """The rank before's `tail` `[rows, k, ...]` (zeros on rank 0). Backward: each rank's
    gradient of what it received goes back to the rank before (all-gathered, each rank
    keeping the one from the rank after it)."""

    @staticmethod
    def exchange(
        tail: torch.Tensor, split: SequenceSplit, *, backward: bool = False
    ) -> torch.Tensor:
        collective = split.collective
        world, rank = collective.world, collective.rank
        part = tail.contiguous()
        every = part.new_empty((world * part.shape[0], *part.shape[1:]))
        collective.all_gather_into(every, part)
        pieces = every.chunk(world)
        source = rank + 1 if backward else rank - 1
        if not 0 <= source < world:
            return torch.zeros_like(part)
        return pieces[source].clone()

    @staticmethod
    def forward(ctx: Any, tail: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
        ctx.split = split
        return _Halo.exchange(tail, split)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _Halo.exchange(grads[0], ctx.split, backward=True), None


class _CarriedScan(torch.autograd.Function):
    """The gated delta rule over the whole row, each rank scanning its own positions in turn:
    rank t starts from the state rank t - 1 broadcast, and broadcasts its final state for rank
    t + 1. Backward, in the reverse turn: rank t runs its scan again (from its saved inputs and
    initial state) and backpropagates it with the gradient of its final state that rank t + 1
    broadcast, then broadcasts the gradient of its initial state for rank t - 1. Every rank
    takes part in every broadcast, in the same order."""

    @staticmethod
    def forward(ctx: Any, split: SequenceSplit, scan: Any, *inputs: torch.Tensor) -> torch.Tensor:
        collective = split.collective
        world, rank = collective.world, collective.rank
        query, value = inputs[0], inputs[2]
        rows, _, heads, k_dim = query.shape
        shape = (rows, heads, k_dim, value.shape[-1])
        initial = torch.zeros(shape, dtype=torch.float32, device=query.device)
        out = None
        for turn in range(world):
            if turn == rank:
                out, final = _scan(scan, inputs, initial if rank else None)
                sent = final.float().contiguous()
            else:
                sent = torch.zeros(shape, dtype=torch.float32, device=query.device)
            if turn < world - 1:
                _broadcast(collective, sent, turn)
                if rank == turn + 1:
                    initial = sent
        assert out is not None
        ctx.split, ctx.scan = split, scan
        ctx.save_for_backward(initial, *inputs)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        split: SequenceSplit = ctx.split
        collective = split.collective
        world, rank = collective.world, collective.rank
        initial, *inputs = ctx.saved_tensors
        grad_final = torch.zeros_like(initial)
        found: list[torch.Tensor | None] = [None] * len(inputs)
        for turn in reversed(range(world)):
            sent = torch.zeros_like(initial)
            if turn == rank:
                with torch.enable_grad():
                    leaves = [t.detach().requires_grad_(t.dtype.is_floating_point) for t in inputs]
                    start = initial.detach().requires_grad_(rank > 0)
                    out, final = _scan(ctx.scan, leaves, start if rank else None)
                    torch.autograd.backward(
                        [out, final], [grads[0].to(out.dtype), grad_final.to(final.dtype)]
                    )
                found = [leaf.grad for leaf in leaves]
                if start.grad is not None:
                    sent = start.grad.float().contiguous()
            if turn > 0:
                _broadcast(collective, sent, turn)
                if rank == turn - 1:
                    grad_final = sent
        return (None, None, *found)


def _scan(
    scan: Any, inputs: Sequence[torch.Tensor], initial: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    query, key, value, g, beta = inputs
    out, final = scan(
        query,
        key,
        value,
        g=g,
        beta=beta,
        initial_state=initial,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return out, final


def _broadcast(collective: Collective, tensor: torch.Tensor, source: int) -> None:
    """`tensor` of rank `source` onto every rank's `tensor`, in place (a group's collective)."""
    import torch.distributed as dist

    if collective.parallel:
        dist.broadcast(tensor, source)


def install_attention() -> None:
    """Route transformers' `sdpa` attention through `split_attention` (the same function
    outside a split pass); idempotent."""
    if AttentionInterface._global_mapping.get("sdpa") is not split_attention:
        AttentionInterface.register("sdpa", split_attention)


class ContextParallel:
    """Which passes of one model a worker group splits (see the module docstring)."""

    def __init__(self, model: nn.Module, collective: Collective) -> None:
        self.collective = collective
        # why this model's passes are never split (None: they can be)
        self.refused = supports(model)
        self.supported = self.refused is None and collective.parallel
        self.tokens: int | None = None  # split every pass of at least this many positions
        self.floor = SPLIT_FLOOR
        # the most positions a rank's memory plan holds whole (`MultiSlotModel` sets it): a
        # longer pass is split whatever `floor` says
        self.whole_tokens: int | None = None
        self.splits_run = 0  # split passes run (a count for tests and logs)
        if self.supported:
            install_attention()
            install_linear_attention(model)

    def splits(self, tokens: int, width: int, pass_tokens: int) -> bool:
        """Whether a pass of `tokens` positions in rows of `width` is split over the ranks:
        `tokens` or more where that is set, else a pass over the token budget (a datum longer
        than it, in a pass of its own) of at least `SPLIT_FLOOR` or longer than a rank holds
        whole (`whole_tokens`); never rows of fewer than `MIN_CHUNK` positions a rank."""
        if not self.supported or width < MIN_CHUNK * self.collective.world:
            return False
        if self.tokens is not None:
            return tokens >= self.tokens
        beyond = self.whole_tokens is not None and tokens > self.whole_tokens
        return tokens > pass_tokens and (tokens >= self.floor or beyond)


def supports(model: nn.Module) -> str | None:
    """Why `model`'s passes cannot be split over ranks (None: they can)."""
    config: Any = model.config
    text = config.get_text_config()
    if getattr(text, "_attn_implementation", None) != "sdpa":
        return f"its attention runs as {getattr(text, '_attn_implementation', None)!r}, not sdpa"
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        return "it has sliding-window attention"
    types = set(getattr(text, "layer_types", None) or ["full_attention"])
    if types - {"full_attention", "linear_attention"}:
        return f"its layers include {sorted(types - {'full_attention', 'linear_attention'})}"
    if hasattr(config, "vision_config"):
        return "it takes images"
    for name, module in model.named_modules():
        if name.endswith("linear_attn") and is_gated_deltanet(module):
            continue
        if ".linear_attn." in f"{name}.":
            continue  # inside a Gated DeltaNet layer
        if (
            isinstance(getattr(module, "A_log", None), torch.Tensor)
            or isinstance(module, nn.Conv1d)
            or name.endswith(".compressor")
        ):
            return f"its layers carry a state along the row other than Gated DeltaNet's ({name})"
    return None

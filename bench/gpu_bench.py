"""GPU benchmark of the shared multi-tenant LoRA training pass: tokens/s and MFU per LoRA kind.

Builds random-weight models in memory (no hub, nothing saved): a Qwen3-4B-shaped Qwen3 (hidden
2560, 36 layers, FFN 9728, 32 query / 8 KV heads of 128, vocab 151936, tied) and a small
Qwen3.5-shaped hybrid (Gated DeltaNet linear attention + full attention), and Qwen3-30B-A3B's MoE
layer sizes with 6 layers (128 fused experts, top-8; the experts' shared-outer LoRA); on request
(`--models deepseek_v3`, run by `bench/gpu_check.sh` as a step of its own) one DeepSeek-V3 decoder
layer at full size (multi-head latent attention, 256 experts top-8, one shared expert). Wraps each with the
project's `workers.engine.lora.LoraBank` (fp32 adapters, rank 16 on attention and MLP, one slot per
tenant) and times merged training passes: forward + backward over N = 1, 4, 16 tenants' rows,
each tenant `--seqs` sequences of `--seq-len` tokens, one segment per tenant, the loss a chunked
cross-entropy over the final hidden states (the [tokens, vocab] logits are never all held).

Rows of the table:
- `loop` / `gather` / `grouped`: the merged pass with `MultiSlotLoraLinear` routed through
  `workers.engine.lora_kernels.segment_lora(kind=...)` (patched here, in this process only).
- `base`: the frozen base alone, the input embeddings requiring grad so that the backward still
  runs through every layer: the ceiling for any LoRA kind.
- `solo`: the same N tenants as N one-tenant passes, with the device's default kind: what
  merging saves.
- `per-expert` (MoE models, where the grouped GEMM runs): the default kind with the experts'
  frozen products as one matmul per expert instead of one grouped GEMM; before the table, the
  two are compared on one pass's LoRA gradients.

FLOPs and MFU. P = parameters of every linear layer (the tied lm_head counted once, the
embedding lookup not at all) plus, on a MoE model, the active experts' (top-k of E), T = tokens of the pass, s = sequence length.
- `MFU6` = 6·P·T / time / peak: 2·P·T forward + 4·P·T backward, the full-training count.
- `MFUlora` = (4·P·T + attention + LoRA) / time / peak, the work a frozen-base LoRA step does:
  forward and activation gradient (no base weight gradient), attention 6·s·d_attn per token and
  full-attention layer (linear-attention layers not counted; multi-head latent attention's
  d_attn = heads · (query-key dim + value dim) / 2), LoRA 6·r·Σ(in+out) per token.
  The lm_head recomputed by the checkpointed loss (2·V·h per token) is in neither count.
Peak: 989 TFLOP/s, dense bf16 of an H100 or H200 (`--peak-tflops`).

    python bench/gpu_bench.py               # on a CUDA machine; see bench/gpu_check.sh
    python bench/gpu_bench.py --tiny        # tiny shapes on the CPU, 1 thread: checks the script
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM, Qwen3Config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

from workers.engine import lora_kernels, moe_kernels  # noqa: E402
from workers.engine.kernels import linear_attention_path, lora_path  # noqa: E402
from workers.engine.lora import BASE_SLOT, LoraBank, Segment, SlotRouting  # noqa: E402

RANK, ALPHA = 16, 32.0
_GRAD_LAYOUT_RELAXED = getattr(
    torch.autograd, "enforce_grad_layout_policy", lambda enable: contextlib.nullcontext()
)
LOSS_CHUNK_TOKENS = 4096


# --tiny: every model at these sizes (and 2 layers, 4 for the hybrid), on the CPU in fp32.
TINY = dict(
    hidden_size=64, intermediate_size=128, vocab_size=512, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2,
    linear_key_head_dim=32, linear_value_head_dim=32,
)  # fmt: skip


def qwen3_4b(tiny: bool) -> Qwen3Config:
    shape = dict(
        hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
        max_position_embeddings=40960, rope_theta=1_000_000.0,
    )  # fmt: skip
    if tiny:
        shape |= {k: v for k, v in TINY.items() if not k.startswith("linear")}
        shape["num_hidden_layers"] = 2
    return Qwen3Config(**shape)


def qwen3_5_small(tiny: bool) -> Any:
    """Qwen3.5-0.8B's widths with 8 layers: 6 Gated DeltaNet + 2 full attention."""
    from transformers.models.qwen3_5 import Qwen3_5TextConfig  # transformers >= 5.2

    layers = 4 if tiny else 8
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    shape = dict(
        hidden_size=1024, intermediate_size=3584, num_hidden_layers=layers, vocab_size=248320,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, layer_types=types,
        linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen3_5TextConfig(**(shape | TINY if tiny else shape))


def qwen3_moe(tiny: bool) -> Any:
    """Qwen3-30B-A3B's layer sizes (128 experts top-8, moe_intermediate 768) with 6 layers."""
    from transformers import Qwen3MoeConfig

    shape = dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, num_hidden_layers=6, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, vocab_size=151936, decoder_sparse_step=1, mlp_only_layers=[],
        tie_word_embeddings=False, max_position_embeddings=40960, rope_theta=1_000_000.0,
    )  # fmt: skip
    if tiny:
        shape |= {k: v for k, v in TINY.items() if not k.startswith("linear")}
        shape |= {"moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2}
        shape["num_hidden_layers"] = 2
    return Qwen3MoeConfig(**shape)


def deepseek_v3(tiny: bool) -> Any:
    """One DeepSeek-V3 decoder layer at full size (the MoE layers of DeepSeek-V3.1 and Kimi-K2
    have the same shapes): multi-head latent attention (128 heads, query and KV ranks 1536 and
    512, query-key heads of 128 + 64 rotary dims, values of 128), 256 routed experts of width
    2048, top-8 from 4 of 8 groups, one shared expert, the 129280-token vocabulary untied.
    13.4B parameters (27 GB in bf16): 11.3B the experts, 1.9B the embeddings and the head. One
    layer leaves room on an 80 GB GPU for 16 tenants' adapters. Tiny: the same routing (256
    experts, top-8, groups) at hidden 64."""
    from transformers import DeepseekV3Config

    shape = dict(
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, num_hidden_layers=1,
        first_k_dense_replace=0, num_attention_heads=128, num_key_value_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, vocab_size=129280, tie_word_embeddings=False,
        max_position_embeddings=163840,
    )  # fmt: skip
    if tiny:
        shape |= dict(
            hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_attention_heads=2, num_key_value_heads=2, q_lora_rank=48, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32, vocab_size=512,
        )  # fmt: skip
    return DeepseekV3Config(**shape)


def attention_width(text: Any) -> int:
    """d_attn of the attention FLOPs: heads · head_dim, or for multi-head latent attention
    heads · (query-key dim + value dim) / 2 (its scores and its values differ in width)."""
    query_key = getattr(text, "qk_nope_head_dim", 0) + getattr(text, "qk_rope_head_dim", 0)
    if query_key:
        return int(text.num_attention_heads * (query_key + text.v_head_dim) // 2)
    return int(text.num_attention_heads * text.head_dim)


@dataclass
class Bench:
    """One model on the device, wrapped with a LoraBank of `max_slots` trained slots."""

    name: str
    model: Any
    bank: LoraBank
    routing: SlotRouting
    device: torch.device
    matmul_params: int
    attn_flops_per_token_per_s: int  # 6·d_attn·(full-attention layers): × s gives per token
    lora_flops_per_token: int
    vocab: int


def build(name: str, config: Any, device: torch.device, dtype: torch.dtype, slots: int) -> Bench:
    started = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):  # random weights made on the device: nothing is copied or saved
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        except TypeError:  # transformers 4 names it torch_dtype
            model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    model.requires_grad_(False).eval()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    matmul_params = sum(m.weight.numel() for m in linears)
    text = model.config.get_text_config()
    # A MoE block's fused experts are not linears: a token runs top-k of them (active params).
    for module in model.modules():
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if (
            isinstance(gate_up, torch.Tensor)
            and gate_up.dim() == 3
            and isinstance(down, torch.Tensor)
        ):
            active = text.num_experts_per_tok / gate_up.shape[0]
            matmul_params += int(active * (gate_up.numel() + down.numel()))
    layer_types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    full_layers = sum(t == "full_attention" for t in layer_types)
    d_attn = attention_width(text)
    routing = SlotRouting()
    bank = LoraBank(model, max_slots=slots, max_rank=RANK, routing=routing, device=device)
    generator = torch.Generator().manual_seed(0)
    for slot in range(slots):
        bank.init_slot(
            slot, rank=RANK, groups=["attn", "mlp"], lora_alpha=ALPHA, generator=generator
        )
        for _, _, b in bank.slot_views(bank.weights, slot, RANK):  # B ≠ 0: every product is real
            b.normal_(0.0, 1e-3)
    lora_sum = sum(
        lay.in_features + lay.out_features for lay in bank.layouts if lay.group != "unembed"
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    print(
        f"[{name}] built in {time.perf_counter() - started:.1f} s: {matmul_params / 1e6:,.1f}M "
        f"matmul params, {text.num_hidden_layers} layers ({full_layers} full attention), "
        f"LoRA bank {bank.weights.numel() / 1e6:.1f}M fp32 values per buffer; "
        f"linear attention: {linear_attention_path(model)}",
        flush=True,
    )
    return Bench(
        name, model, bank, routing, device, matmul_params, 6 * d_attn * full_layers,
        6 * RANK * lora_sum, int(text.vocab_size),
    )  # fmt: skip


# -- one training pass -------------------------------------------------------------------------


def _chunk_loss(hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="sum")


def train_pass(bench: Bench, ids: torch.Tensor, segments: list[Segment] | None) -> None:
    """Forward + backward of one pass; `segments=None` runs the frozen base with dX only."""
    model = bench.model
    head = model.get_output_embeddings()
    weight = getattr(head, "base_layer", head).weight
    labels = ids.roll(-1, dims=1).reshape(-1)
    # As the engine calls it: a mask (all ones: rows are full) and no KV cache.
    common = {"attention_mask": torch.ones_like(ids), "use_cache": False}
    if segments is None:
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        hidden = model.model(inputs_embeds=embeds, **common).last_hidden_state
    else:
        with bench.routing.bind(segments):
            hidden = model.model(input_ids=ids, **common).last_hidden_state
    flat = hidden.reshape(-1, hidden.shape[-1])
    loss = flat.new_zeros((), dtype=torch.float32)
    for start in range(0, flat.shape[0], LOSS_CHUNK_TOKENS):
        stop = start + LOSS_CHUNK_TOKENS
        loss = loss + checkpoint(
            _chunk_loss, flat[start:stop], labels[start:stop], weight, use_reentrant=False
        )
    # The bank's grads are strided views of one buffer: accumulate in place (as the engine does).
    with _GRAD_LAYOUT_RELAXED(False):
        loss.backward()


def timed(device: torch.device, reps: int, work: Callable[[], None]) -> float:
    """Median seconds of `reps` runs after one warm-up run."""
    times = []
    for rep in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if rep:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


@dataclass
class Row:
    model: str
    mode: str
    tenants: int
    tokens: int
    seconds: float | None = None
    peak_gb: float | None = None
    note: str = ""


@contextlib.contextmanager
def experts_per_expert(enabled: bool) -> Any:
    """The experts' frozen products one matmul per expert (`enabled`), or as the device runs them."""
    default = moe_kernels.grouped_experts
    if enabled:
        moe_kernels.grouped_experts = lambda *_: False  # type: ignore[assignment]
    try:
        yield
    finally:
        moe_kernels.grouped_experts = default  # type: ignore[assignment]


def compare_expert_products(bench: Bench, args: argparse.Namespace, tenants: int) -> str:
    """One merged pass's LoRA gradients with the experts' products grouped and per expert."""
    ids = torch.randint(0, bench.vocab, (tenants * args.seqs, args.seq_len), device=bench.device)
    segments = [Segment(i, i * args.seqs, (i + 1) * args.seqs) for i in range(tenants)]
    bench.bank.set_kind(None)
    grads = []
    for per_expert in (False, True):
        bench.bank.grads.zero_()
        with experts_per_expert(per_expert):
            train_pass(bench, ids, segments)
        grads.append(bench.bank.grads.float().clone())
    bench.bank.grads.zero_()
    error = (grads[0] - grads[1]).abs().max().item() / max(grads[1].abs().max().item(), 1e-30)
    return (
        f"[{bench.name}] experts' products grouped vs per expert ({args.dtype}, {tenants} "
        f"tenants): max relative difference of the LoRA gradients {error:.1e}"
    )


def measure(bench: Bench, mode: str, tenants: int, args: argparse.Namespace) -> Row:
    tokens = tenants * args.seqs * args.seq_len
    row = Row(bench.name, mode, tenants, tokens)
    ids = torch.randint(0, bench.vocab, (tenants * args.seqs, args.seq_len), device=bench.device)
    segments = [Segment(i, i * args.seqs, (i + 1) * args.seqs) for i in range(tenants)]
    kind = None if mode in ("base", "solo", "per-expert") else mode
    bench.bank.set_kind(kind)  # type: ignore[arg-type]

    def work() -> None:
        if mode == "per-expert":
            with experts_per_expert(True):
                train_pass(bench, ids, segments)
        elif mode == "solo":
            for i, rows in enumerate(ids.split(args.seqs)):
                train_pass(bench, rows, [Segment(i, 0, args.seqs)])
        else:
            train_pass(bench, ids, None if mode == "base" else segments)

    if mode == "solo":
        row.note = f"{tenants} one-tenant passes, kind {lora_path(bench.device, args.dtype)}"
    if bench.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(bench.device)
    try:
        row.seconds = timed(bench.device, args.reps, work)
    except torch.cuda.OutOfMemoryError:
        row.note = "out of memory"
    except Exception as exc:  # one failing kind must not end the run: report it in the table
        row.note = f"error: {type(exc).__name__}: {str(exc)[:120]}"
    gc.collect()  # what a failed pass left behind
    bench.bank.grads.zero_()
    if bench.device.type == "cuda":
        row.peak_gb = torch.cuda.max_memory_allocated(bench.device) / 2**30
        torch.cuda.empty_cache()
    return row


def format_row(row: Row, bench: Bench, args: argparse.Namespace) -> str:
    head = f"{row.model:<10} {row.mode:<10} {row.tenants:>3} {row.tokens:>7}"
    if row.seconds is None:
        return f"{head}  {row.note}".rstrip()
    t = row.tokens
    flops6 = 6 * bench.matmul_params * t
    lora = 0 if row.mode == "base" else bench.lora_flops_per_token * t
    flops_lora = (
        4 * bench.matmul_params * t + bench.attn_flops_per_token_per_s * args.seq_len * t + lora
    )
    tflops = flops6 / row.seconds / 1e12
    if bench.device.type == "cuda":
        mfu = f"{100 * flops6 / row.seconds / (args.peak_tflops * 1e12):6.1f}% "
        mfu += f"{100 * flops_lora / row.seconds / (args.peak_tflops * 1e12):6.1f}%"
    else:
        mfu = f"{'-':>7} {'-':>7}"
    peak = f"{row.peak_gb:6.1f}" if row.peak_gb is not None else f"{'-':>6}"
    return (
        f"{head} {row.seconds * 1e3:9.1f} {t / row.seconds:10.0f} {tflops:8.2f} {mfu} {peak}"
        f"  {row.note}"
    ).rstrip()


HEADER = (
    f"{'model':<10} {'mode':<10} {'N':>3} {'tokens':>7} {'ms/pass':>9} {'tok/s':>10} "
    f"{'TFLOP/s':>8} {'MFU6':>7} {'MFUlora':>7} {'peakGB':>6}"
)


def environment(device: torch.device, dtype: torch.dtype) -> list[str]:
    import importlib.util

    import transformers

    lines = [f"torch {torch.__version__}, transformers {transformers.__version__}, device {device}"]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        lines.append(
            f"GPU {props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}"
        )
    optional = ("fla", "causal_conv1d", "kernels", "flash_attn", "triton")
    found = [name for name in optional if importlib.util.find_spec(name)]
    lines.append(f"optional kernel packages importable: {', '.join(found) or 'none'}")
    reason = lora_kernels.grouped_unavailable_reason(device, dtype, (8,))
    lines.append(f"grouped GEMM: {'available' if reason is None else reason}")
    lines.append(f"default LoRA kind on {device.type}: {lora_path(device, dtype)}")
    return lines


def spot_check(device: torch.device, dtype: torch.dtype, kinds: list[str]) -> list[str]:
    """Each kind against the loop on one Qwen3-4B-sized q_proj, 4 tenants, update and grads."""
    gen = torch.Generator().manual_seed(1)
    rows, in_f, out_f = (4 * 256, 2560, 4096) if device.type == "cuda" else (64, 64, 96)
    x = torch.randn(rows, in_f, generator=gen).to(device, dtype)
    lora_A = (torch.randn(6, RANK, in_f, generator=gen) / in_f**0.5).to(device)
    lora_B = (torch.randn(6, out_f, RANK, generator=gen) / RANK**0.5).to(device)
    q = rows // 4
    segments = [(5, 0, q, 2.0), (BASE_SLOT, q, 2 * q, 0.0), (1, 2 * q, 3 * q, 1.5), (2, 3 * q, rows, 2.0)]  # fmt: skip
    results, lines = {}, []
    for kind in list(kinds):
        inputs = [t.clone().requires_grad_() for t in (x, lora_A, lora_B)]
        try:
            update = lora_kernels.segment_lora(*inputs, segments, kind=kind)  # type: ignore[arg-type]
            grads = torch.autograd.grad(update.float().square().sum(), inputs)
        except Exception as exc:  # a kind that cannot run here is dropped from the table
            lines.append(f"{kind}: FAILED, left out of the table: {type(exc).__name__}: {exc}")
            kinds.remove(kind)
            continue
        results[kind] = [update.float(), *(g.float() for g in grads)]
    for kind in kinds[1:]:
        errors = [
            (a - b).abs().max().item() / max(a.abs().max().item(), 1e-30)
            for a, b in zip(results[kinds[0]], results[kind], strict=True)
        ]
        lines.append(
            f"{kind} vs {kinds[0]} ({dtype}): max relative difference update/dx/dA/dB = "
            + " / ".join(f"{e:.1e}" for e in errors)
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU, 1 thread")
    parser.add_argument("--tenants", default="1,4,16")
    parser.add_argument("--seqs", type=int, help="sequences per tenant (default 2; tiny 2)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default 512; tiny 16)")
    parser.add_argument("--reps", type=int, help="timed passes per row (default 3; tiny 1)")
    parser.add_argument(
        "--models", default="qwen3,qwen3_5,qwen3_moe", help="of qwen3,qwen3_5,qwen3_moe,deepseek_v3"
    )
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--budget-s", type=float, default=230.0, help="skip rows past this")
    args = parser.parse_args()
    args.seqs = args.seqs or 2
    args.seq_len = args.seq_len or (16 if args.tiny else 512)
    args.reps = args.reps or (1 if args.tiny else 3)
    started = time.monotonic()
    deadline = started + args.budget_s
    if args.tiny:
        torch.set_num_threads(1)
        device, dtype = torch.device("cpu"), torch.float32
    elif torch.cuda.is_available():
        device, dtype = torch.device("cuda"), torch.bfloat16
    else:
        sys.exit("no CUDA device: run with --tiny on a CPU (see bench/gpu_check.sh)")
    args.dtype = dtype
    tenants = [int(n) for n in args.tenants.split(",")]
    kinds = [k for k in lora_kernels.LORA_KINDS if k != "grouped"]
    if lora_kernels.grouped_unavailable_reason(device, dtype, (8,)) is None:
        kinds.append("grouped")
    for line in environment(device, dtype) + spot_check(device, dtype, kinds):
        print(line, flush=True)
    print(f"tokens per tenant: {args.seqs} x {args.seq_len}; LoRA rank {RANK} on attention + MLP")
    print(
        "TFLOP/s = 6*P*T/t; MFU6 = 6*P*T/t/peak; "
        "MFUlora = (4*P*T + 6*s*d_attn*L_full*T + 6*r*sum(in+out)*T)/t/peak; "
        f"peak {args.peak_tflops:g} TFLOP/s"
    )
    builders = {
        "qwen3": ("qwen3-4b", qwen3_4b),
        "qwen3_5": ("qwen3.5-s", qwen3_5_small),
        "qwen3_moe": ("qwen3-30b-a3b-6l", qwen3_moe),
        "deepseek_v3": ("dsv3-1l", deepseek_v3),
    }
    for key in args.models.split(","):
        name, make_config = builders[key]
        if time.monotonic() > deadline:
            print(f"[{name}] skipped: past the time budget")
            continue
        try:
            config = make_config(args.tiny)
        except ImportError as exc:
            print(f"[{name}] skipped: this transformers cannot build it: {exc}")
            continue
        try:
            bench = build(name, config, device, dtype, max(tenants))
        except Exception as exc:  # e.g. out of memory: the next model may still run
            print(f"[{name}] could not be built: {type(exc).__name__}: {exc}", flush=True)
            continue
        modes = kinds if key == "qwen3" else [lora_path(device, dtype)]
        if key in ("qwen3_moe", "deepseek_v3") and "grouped" in kinds:
            modes.append("per-expert")
            try:
                print(compare_expert_products(bench, args, min(4, max(tenants))), flush=True)
            except Exception as exc:  # reported, and the table still runs
                print(f"[{name}] grouped vs per expert: {type(exc).__name__}: {exc}", flush=True)
        print(HEADER, flush=True)
        for mode in ["base", *modes, "solo"]:
            for n in tenants:
                row = (
                    measure(bench, mode, n, args)
                    if time.monotonic() < deadline
                    else Row(name, mode, n, 0, note="skipped: time budget")
                )
                print(format_row(row, bench, args), flush=True)
        del bench
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"done in {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()

"""Every family of the lineup trains Tinker's adapter on the shared pass, on a tiny random model
that `workers.tiny_model --arch` builds offline (`workers/tiny_families.py`).

Per family: tenants of different ranks and adapter kinds (full, MLP-only, attention-only,
unembed-only) in one shared pass get their solo outputs and gradients; each kind's loss falls
under a few optimizer steps; a saved adapter loads back bit-exactly; and a PEFT-loaded export
computes the engine's logprobs. The export names the linears PEFT would not adapt as modules by
their weight (`workers.trainer.checkpoints.by_weight_paths`). PEFT refuses any LoRA on a Mamba2
block's `out_proj` (its fused CUDA kernel reads the weight directly), where Tinker puts
Nemotron-H's attention adapter: that family's export is checked with its MLP and output layer,
and a merged export computes its full adapter (below).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from protocol.api import AdamParams, LoraConfig
from protocol.errors import TwinkleError
from protocol.tensors import FwdBwdOutput, FwdBwdRequest
from tests.conftest import build_model
from tests.engine_helpers import (
    PEFT_TIED_WARNING,
    Trainer,
    assert_same_outputs,
    cross_entropy_request,
    max_diff,
    perturb_b,
)

FAMILIES = ["llama", "deepseek_v3", "glm_moe_dsa", "deepseek_v4", "nemotron_h", "inkling_mm_model"]
KINDS = {
    "full": LoraConfig(rank=8, seed=1),
    "mlp": LoraConfig(rank=4, seed=2, train_attn=False, train_unembed=False),
    "attn": LoraConfig(rank=2, seed=3, train_mlp=False, train_unembed=False),
    "unembed": LoraConfig(rank=4, seed=4, train_mlp=False, train_attn=False),
}
TOLERANCE = 1e-5
# PEFT warns that the experts' rank_pattern key (`gate_up_proj`, rank 2r) matched no module: it
# matches the wrapped parameter, which PEFT looks up separately
PEFT_PATTERN_WARNING = "ignore:The following (rank|alpha)_pattern keys did not match:RuntimeWarning"


def _train_request(model_id: str, lengths: list[int], vocab: int, seed: int) -> FwdBwdRequest:
    return cross_entropy_request(model_id, lengths, vocab, seed, forward_only=False)


def _loss(output: FwdBwdOutput | TwinkleError) -> float:
    assert not isinstance(output, TwinkleError)
    return float(output.metrics["loss:sum"])


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_adapter_kind_trains_alone_and_shared(
    arch: str, tmp_path_factory: pytest.TempPathFactory, torch_one_thread: None
) -> None:
    model_dir = build_model(tmp_path_factory.mktemp(arch), arch)
    engine = Trainer(str(model_dir), max_slots=4, max_rank=8)
    vocab = engine.core.vocab_size
    for kind, spec in KINDS.items():
        engine.create(kind, spec)
        perturb_b(engine, kind, seed=hash(kind) % 1000)
    batch = [(kind, _train_request(kind, [6, 3], vocab, seed=i)) for i, kind in enumerate(KINDS)]
    shared = engine.forward_backward(batch)
    shared_grads = engine.bank.grads.clone()
    for (kind, request), together in zip(batch, shared, strict=True):
        engine.bank.grads.zero_()
        [alone] = engine.forward_backward([(kind, request)])
        assert not isinstance(together, Exception) and not isinstance(alone, Exception)
        assert_same_outputs(together, alone)
        slot = engine.slot(kind)
        scale = float(engine.bank.grads[slot].abs().max())
        error = max_diff(shared_grads[slot], engine.bank.grads[slot])
        assert error <= TOLERANCE * max(1.0, scale), (arch, kind, error, scale)
        assert engine.bank.grads[slot].abs().sum() > 0, (arch, kind)
    engine.bank.grads.zero_()

    # each kind learns its batch
    adam = AdamParams(learning_rate=5e-3)
    first = [_loss(out) for out in engine.forward_backward(batch)]
    for _ in range(5):
        engine.optim_step([(kind, adam) for kind in KINDS])
        last = [_loss(out) for out in engine.forward_backward(batch)]
    for kind, before, after in zip(KINDS, first, last, strict=True):
        assert after < before, (arch, kind, before, after)

    # a saved adapter loads back to the same bits and outputs
    ckpt = tmp_path_factory.mktemp("ckpt") / "full"
    engine.save("full", ckpt, kind="weights", meta={})
    saved = engine.bank.weights[engine.slot("full")].clone()
    engine.release("full")
    engine.load("full", ckpt, with_optimizer=True)
    assert torch.equal(engine.bank.weights[engine.slot("full")], saved)


@pytest.mark.filterwarnings(PEFT_TIED_WARNING, PEFT_PATTERN_WARNING)
@pytest.mark.parametrize("arch", FAMILIES)
def test_a_peft_loaded_export_gives_the_engines_logprobs(
    arch: str, tmp_path_factory: pytest.TempPathFactory, torch_one_thread: None
) -> None:
    from peft import PeftModel

    from workers.engine.model import load_causal_lm

    model_dir = build_model(tmp_path_factory.mktemp(arch), arch)
    engine = Trainer(str(model_dir), max_slots=1, max_rank=8)
    engine.create("m", LoraConfig(rank=4, seed=5, train_attn=arch != "nemotron_h"))
    perturb_b(engine, "m", seed=7)
    vocab = engine.core.vocab_size
    request = _train_request("m", [9], vocab, seed=3)
    request = FwdBwdRequest("m", 1, "cross_entropy", True, {}, request.datums)
    [result] = engine.forward_backward([("m", request)])
    out = tmp_path_factory.mktemp("export") / "m"
    engine.save("m", out, kind="sampler_weights", meta={})
    # the stock model; Inkling's composite as the worker loads it (AutoModelForCausalLM knows
    # only its text config)
    if arch == "inkling_mm_model":
        base = load_causal_lm(str(model_dir), torch.float32)
    else:
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, out).eval()
    tokens = torch.as_tensor(request.datums[0].tokens, dtype=torch.long)[None]
    targets = torch.as_tensor(request.datums[0].inputs["target_tokens"])[:, None]
    with torch.no_grad():
        logits = peft_model(input_ids=tokens).logits[0]
    theirs = torch.log_softmax(logits.float(), dim=-1).gather(1, targets)[:, 0]
    ours = torch.as_tensor(result.loss_fn_outputs[0]["logprobs"])
    assert max_diff(ours, theirs) <= 1e-4, arch
    with torch.no_grad():
        plain = load_causal_lm(str(model_dir), torch.float32).eval()(input_ids=tokens).logits[0]
    untrained = torch.log_softmax(plain.float(), dim=-1).gather(1, targets)[:, 0]
    assert max_diff(ours, untrained) > 1e-3, arch  # the adapter changes what the model computes


@pytest.mark.parametrize("arch", ["nemotron_h", "inkling_mm_model", "qwen3_5"])
def test_a_merged_model_computes_what_the_engine_computes(
    arch: str, tmp_path_factory: pytest.TempPathFactory, torch_one_thread: None
) -> None:
    """`W += alpha/r · B·A` on the stock model (what a merged export writes) gives the engine's
    logprobs for the layouts whose pairs span several frozen tensors or a slice of one: Mamba2's
    in_proj slices and non-gated experts, Inkling's shared-expert bank and its one A over a dense
    gate and up, Qwen3.5's in_proj_qkv slices."""
    from workers.engine.model import load_causal_lm
    from workers.trainer.transfer import _merge

    model_dir = build_model(tmp_path_factory.mktemp(arch), arch)
    engine = Trainer(str(model_dir), max_slots=1, max_rank=8)
    engine.create("m", LoraConfig(rank=4, seed=9))
    perturb_b(engine, "m", seed=11)
    request = _train_request("m", [9], engine.core.vocab_size, seed=4)
    request = FwdBwdRequest("m", 1, "cross_entropy", True, {}, request.datums)
    [result] = engine.forward_backward([("m", request)])
    assert not isinstance(result, TwinkleError)
    out = tmp_path_factory.mktemp("merged") / "m"
    engine.save("m", out, kind="sampler_weights", meta={})
    merged = load_causal_lm(str(model_dir), torch.float32).eval()
    _merge(merged, engine.residency.files.read(out, with_optimizer=False))
    tokens = torch.as_tensor(request.datums[0].tokens, dtype=torch.long)[None]
    targets = torch.as_tensor(request.datums[0].inputs["target_tokens"])[:, None]
    with torch.no_grad():
        logits = merged(input_ids=tokens).logits[0]
    theirs = torch.log_softmax(logits.float(), dim=-1).gather(1, targets)[:, 0]
    assert max_diff(torch.as_tensor(result.loss_fn_outputs[0]["logprobs"]), theirs) <= 1e-4, arch


def test_a_kimi_k2_checkpoint_loads_as_deepseek_v3(
    tmp_path_factory: pytest.TempPathFactory, torch_one_thread: None
) -> None:
    """Kimi-K2(-Thinking)'s `config.json` names its own model type, `kimi_k2`, for the
    DeepSeek-V3 architecture, which transformers has no class for: the worker reads it as
    `deepseek_v3` (`workers.engine.configs`) and trains and samples it like the original."""
    import json
    import shutil

    from workers.engine.model import load_causal_lm

    original = build_model(tmp_path_factory.mktemp("deepseek_v3"), "deepseek_v3")
    kimi = tmp_path_factory.mktemp("kimi") / "kimi-k2"
    shutil.copytree(original, kimi)
    fields = json.loads((kimi / "config.json").read_text())
    fields.update(model_type="kimi_k2", architectures=["KimiK2ForCausalLM"])
    (kimi / "config.json").write_text(json.dumps(fields))
    tokens = torch.arange(3, 12)[None]
    with torch.no_grad():
        want = load_causal_lm(str(original), torch.float32).eval()(input_ids=tokens).logits
        got = load_causal_lm(str(kimi), torch.float32).eval()(input_ids=tokens).logits
    assert torch.equal(got, want)
    engine = Trainer(str(kimi), max_slots=1, max_rank=4)
    engine.create("m", LoraConfig(rank=4))
    [out] = engine.forward_backward([("m", _train_request("m", [5], engine.core.vocab_size, 1))])
    assert not isinstance(out, TwinkleError)
    assert engine.sampler().tokenizer is not None

"""The trainer engine on tiny random MoE models (Qwen3-MoE, gpt-oss, Qwen3.5-MoE; fp32, CPU):
expert LoRA in the shared pass gives each tenant its solo gradient, an MLP-only adapter trains
the experts, checkpoints round-trip bit-exactly in PEFT's `target_parameters` expert layout and
load as they are in `peft.PeftModel.from_pretrained` with the engine's logprobs, parking keeps
the expert factors, a merged export computes what the engine computes (ours, and
tinker-cookbook's from the Tinker-layout export), and a model whose experts cannot be adapted
refuses an MLP adapter.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from transformers import (
    AutoModelForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from protocol.api import AdamParams, LoraConfig
from protocol.errors import UserError
from protocol.tensors import FwdBwdRequest
from tests.engine_helpers import (
    PEFT_TIED_WARNING,
    Trainer,
    assert_same_outputs,
    export_layout,
    make_request,
    max_diff,
)
from workers.tiny_model import build_tiny_model

pytestmark = pytest.mark.usefixtures("torch_one_thread")

MLP_ONLY = {"train_attn": False, "train_unembed": False}
# PEFT checks rank_pattern/alpha_pattern keys against target_modules only, not against the
# target_parameters they also select (and are applied to): a false alarm for our files.
PEFT_PATTERN_WARNING = "ignore:The following (rank|alpha)_pattern keys did not match:RuntimeWarning"


def _qwen3_moe_config() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=True,
        initializer_range=0.1,
    )


def _gpt_oss_config() -> GptOssConfig:
    return GptOssConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        layer_types=["sliding_attention", "full_attention"],
        initializer_range=0.1,
    )


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss", "qwen3_5_moe"])
def moe_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3_5_moe":
        # composite model: linear attention, a shared expert and its gate, the text model under
        # `model.language_model`
        return build_tiny_model(directory, "qwen3_5_moe", vocab_size=259)
    torch.manual_seed(0)
    if request.param == "qwen3_moe":
        model: torch.nn.Module = Qwen3MoeForCausalLM(_qwen3_moe_config())
    else:
        model = GptOssForCausalLM(_gpt_oss_config())
        with torch.no_grad():  # the router and biases start at 0; make them count
            for name, param in model.named_parameters():
                if "router" in name or name.endswith("_bias"):
                    param.normal_(0, 0.1)
    model.save_pretrained(directory)
    return directory


@pytest.fixture
def make_moe(moe_model: Path) -> Callable[..., Trainer]:
    """Trainers on this run's MoE model; keywords as `Trainer` takes them."""
    return functools.partial(Trainer, str(moe_model))


def _perturb(engine: Trainer, model_id: str, seed: int) -> None:
    """Non-zero B everywhere the adapter trains, so every factor gets a gradient."""
    generator = torch.Generator().manual_seed(seed)
    spec = engine.spec(model_id)
    for _, _, b in engine.bank.slot_views(engine.bank.weights, engine.slot(model_id), spec.rank):
        b.copy_(torch.randn(b.shape, generator=generator) * 0.05)


def _expert_rows(engine: Trainer, buffer: torch.Tensor, model_id: str) -> list[torch.Tensor]:
    spec = engine.spec(model_id)
    return [
        view.clone()
        for layout, a, b in engine.bank.slot_views(buffer, engine.slot(model_id), spec.rank)
        if layout.b_experts or layout.a_experts
        for view in (a, b)
    ]


def test_the_shared_pass_gives_each_tenant_its_solo_gradient(
    make_moe: Callable[..., Trainer],
) -> None:
    engine = make_moe(max_slots=3, max_rank=8)
    rng = np.random.default_rng(1)
    specs = {"t0": LoraConfig(rank=4, seed=0), "t1": LoraConfig(rank=8, seed=1, **MLP_ONLY)}
    specs["t2"] = LoraConfig(rank=2, seed=2)
    for index, (model_id, spec) in enumerate(specs.items()):
        engine.create(model_id, spec)
        _perturb(engine, model_id, 10 + index)
    batch = [
        ("t1", make_request("t1", [5, 3], rng)),
        ("t0", make_request("t0", [7], rng)),
        ("t2", make_request("t2", [4, 6], rng)),
    ]
    shared = engine.forward_backward(batch)
    shared_grads = {m: _expert_rows(engine, engine.bank.grads, m) for m in specs}
    engine.bank.grads.zero_()
    for (model_id, request), together in zip(batch, shared, strict=True):
        [alone] = engine.forward_backward([(model_id, request)])
        assert isinstance(alone, type(together))
        assert_same_outputs(together, alone)  # type: ignore[arg-type]
        solo = _expert_rows(engine, engine.bank.grads, model_id)
        scale = max(float(g.abs().max()) for g in solo)
        assert scale > 0, "the experts' factors received no gradient"
        for got, want in zip(shared_grads[model_id], solo, strict=True):
            assert max_diff(got, want) <= 1e-5 * scale
        engine.bank.grads.zero_()


def test_an_mlp_only_adapter_trains_the_experts(make_moe: Callable[..., Trainer]) -> None:
    engine = make_moe(max_slots=2, max_rank=8)
    engine.create("m", LoraConfig(rank=8, seed=3, **MLP_ONLY))
    rng = np.random.default_rng(2)
    request = make_request("m", [12, 9], rng, weights=False)
    before = _expert_rows(engine, engine.bank.weights, "m")
    losses = []
    for _ in range(6):
        [out] = engine.forward_backward([("m", request)])
        losses.append(out.metrics["loss:sum"])  # type: ignore[union-attr]
        [metrics] = engine.optim_step([("m", AdamParams(learning_rate=2e-2))])
        assert not isinstance(metrics, Exception)
    after = _expert_rows(engine, engine.bank.weights, "m")
    assert all(not torch.equal(x, y) for x, y in zip(before, after, strict=True))
    assert losses[-1] < losses[0] - 0.05, losses


def test_checkpoints_round_trip_in_peft_expert_layout(
    make_moe: Callable[..., Trainer], tmp_path: Path
) -> None:
    engine = make_moe(max_slots=2, max_rank=8)
    engine.create("a", LoraConfig(rank=4, seed=5))
    rng = np.random.default_rng(3)
    request = make_request("a", [8, 5], rng, weights=False)
    for _ in range(2):
        engine.forward_backward([("a", request)])
        engine.optim_step([("a", AdamParams(learning_rate=1e-2))])
    directory = tmp_path / "weights"
    engine.save("a", directory, kind="weights", meta={})
    tensors = safetensors.torch.load_file(str(directory / "adapter_model.safetensors"))
    config = json.loads((directory / "adapter_config.json").read_text())
    layers = engine.bank.expert_layers
    first = next(iter(layers))
    shape = layers[first].shape
    n, hidden, inter = shape.num_experts, shape.hidden, shape.intermediate
    key = f"base_model.model.{first}"
    # PEFT's nested wrappers: gate_up_proj inside at rank 2r, down_proj outside at rank r
    assert tensors[f"{key}.base_layer.lora_A.weight"].shape == (8 * n, hidden)
    assert tensors[f"{key}.base_layer.lora_B.weight"].shape == (2 * inter, 8 * n)
    assert tensors[f"{key}.lora_A.weight"].shape == (4 * n, inter)
    assert tensors[f"{key}.lora_B.weight"].shape == (hidden, 4 * n)
    assert not any(".w1." in k or ".w2." in k for k in tensors)
    assert f"{first}.gate_up_proj" in config["target_parameters"]
    assert f"{first}.down_proj" in config["target_parameters"]
    # (beside them, Qwen3.5's sliced `in_proj_qkv`: a block LoRA of rank 3r, sliced_files.py)
    assert config["r"] == 4 and config["rank_pattern"]["experts.gate_up_proj"] == 8
    assert config["alpha_pattern"]["experts.gate_up_proj"] == 2 * config["lora_alpha"]
    # moments stay in the compact shared-outer form
    moments = safetensors.torch.load_file(str(directory / "optimizer.safetensors"))
    assert moments[f"{key}.w1.lora_A.weight.exp_avg"].shape == (1, 4, hidden)
    assert moments[f"{key}.w2.lora_B.weight.exp_avg_sq"].shape == (1, hidden, 4)

    engine.load("b", directory, with_optimizer=True)
    for buffer in (engine.bank.weights, engine.optimizer.exp_avg, engine.optimizer.exp_avg_sq):
        for x, y in zip(
            _expert_rows(engine, buffer, "a"), _expert_rows(engine, buffer, "b"), strict=True
        ):
            assert torch.equal(x, y)
    [out_a] = engine.forward_backward([("a", _forward_only(request, "a"))])
    [out_b] = engine.forward_backward([("b", _forward_only(request, "b"))])
    assert_same_outputs(out_a, out_b)  # type: ignore[arg-type]


@pytest.mark.filterwarnings(PEFT_TIED_WARNING, PEFT_PATTERN_WARNING)
@pytest.mark.parametrize("kind", ["sampler_weights", "weights"])
def test_checkpoints_load_in_peft_with_the_engines_logprobs(
    make_moe: Callable[..., Trainer], moe_model: Path, tmp_path: Path, kind: str
) -> None:
    from peft import PeftModel

    engine = make_moe(max_slots=1, max_rank=8)
    engine.create("m", LoraConfig(rank=4, seed=12))  # attention, experts (+ shared), lm_head
    _perturb(engine, "m", 13)
    rng = np.random.default_rng(6)
    request = _forward_only(make_request("m", [11], rng, weights=False), "m")
    [out] = engine.forward_backward([("m", request)])
    want = torch.as_tensor(out.loss_fn_outputs[0]["logprobs"])  # type: ignore[union-attr]
    engine.save("m", tmp_path / kind, kind=kind, meta={})  # type: ignore[arg-type]

    base = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(tmp_path / kind)).eval()
    datum = request.datums[0]
    got = _logprobs(model, datum.tokens, datum.inputs["target_tokens"])
    assert max_diff(got, want) <= 1e-4
    plain = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32)
    assert max_diff(_logprobs(plain, datum.tokens, datum.inputs["target_tokens"]), want) > 1e-3


def _forward_only(request: FwdBwdRequest, model_id: str) -> FwdBwdRequest:
    return FwdBwdRequest(model_id, 1, request.loss_fn, True, {}, request.datums)


def test_parking_keeps_the_expert_factors(make_moe: Callable[..., Trainer]) -> None:
    engine = make_moe(max_slots=1, max_rank=8, max_parked=4)
    engine.create("p", LoraConfig(rank=4, seed=6, **MLP_ONLY))
    _perturb(engine, "p", 7)
    rng = np.random.default_rng(4)
    request = make_request("p", [6], rng, weights=False)
    [before] = engine.forward_backward([("p", _forward_only(request, "p"))])
    weights = _expert_rows(engine, engine.bank.weights, "p")
    engine.create("q", LoraConfig(rank=8, seed=8))  # takes the only slot: "p" is parked
    assert "p" in engine.parked
    [after] = engine.forward_backward([("p", _forward_only(request, "p"))])
    assert_same_outputs(before, after)  # type: ignore[arg-type]
    for x, y in zip(weights, _expert_rows(engine, engine.bank.weights, "p"), strict=True):
        assert torch.equal(x, y)


def _logprobs(model: torch.nn.Module, tokens: np.ndarray, targets: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.as_tensor(tokens, dtype=torch.long)[None]).logits[0].float()
    return logits.log_softmax(-1).gather(1, torch.as_tensor(targets)[:, None])[:, 0]


def test_a_merged_model_computes_what_the_engine_computes(
    make_moe: Callable[..., Trainer], moe_model: Path, tmp_path: Path
) -> None:
    from tinker_cookbook import weights as cookbook_weights

    from workers.trainer.transfer import _merge

    engine = make_moe(max_slots=1, max_rank=8)
    # The cookbook merges no tied lm_head (Tinker names it `unembed_tokens`): attention and experts.
    engine.create("m", LoraConfig(rank=4, seed=9, train_unembed=False))
    _perturb(engine, "m", 11)
    rng = np.random.default_rng(5)
    request = _forward_only(make_request("m", [10], rng, weights=False), "m")
    [out] = engine.forward_backward([("m", request)])
    want = torch.as_tensor(out.loss_fn_outputs[0]["logprobs"])  # type: ignore[union-attr]
    datum = request.datums[0]
    directory = tmp_path / "sampler"
    engine.save("m", directory, kind="sampler_weights", meta={})

    ours = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32)
    _merge(ours, engine.residency.files.read(directory, with_optimizer=False))
    got = _logprobs(ours, datum.tokens, datum.inputs["target_tokens"])
    assert max_diff(got, want) <= 1e-4

    # The cookbook reads Tinker's own layout: the `--layout tinker` export writes it.
    tinker = export_layout(engine, directory, tmp_path / "root", "tinker")
    tensors = safetensors.torch.load_file(str(tinker / "adapter_model.safetensors"))
    assert any(key.endswith(".experts.w1.lora_A.weight") for key in tensors)
    if "qwen3_5" in moe_model.name:
        # The cookbook fuses Tinker's in_proj_q/k/v into in_proj_qkv only for the Qwen3.5
        # checkpoints (`model_type` qwen3_5 / qwen3_5_moe); the tiny text-only model here is
        # `qwen3_5_moe_text`. Our own merge above covers it.
        return
    merged = tmp_path / "cookbook-merged"
    cookbook_weights.build_hf_model(
        base_model=str(moe_model), adapter_path=str(tinker), output_path=str(merged)
    )
    theirs = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    got = _logprobs(theirs, datum.tokens, datum.inputs["target_tokens"])
    assert max_diff(got, want) <= 1e-4


def test_an_mlp_adapter_is_refused_where_the_experts_cannot_be_adapted(
    make_moe: Callable[..., Trainer],
) -> None:
    engine = make_moe(max_slots=2, max_rank=8)
    engine.bank.unwrappable_experts = ["model.layers.0.mlp.experts"]
    with pytest.raises(UserError, match="train_mlp"):
        engine.create("x", LoraConfig(rank=4, **MLP_ONLY))
    engine.create("y", LoraConfig(rank=4, train_mlp=False))  # attention only still trains

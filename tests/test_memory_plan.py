"""The memory plan per token (`workers.engine.memory.plan_tokens`): the longest datum a worker
trains and the longest sequence it samples, from the model's config and the memory left after
the model and its slots; the engine refuses a longer datum with the gateway's message, and
keeps serving."""

from __future__ import annotations

import pytest
import transformers

from protocol.api import LoraConfig
from protocol.errors import UserError
from protocol.tensors import FwdBwdOutput, datum_too_long
from tests.conftest import build_model
from tests.engine_helpers import Trainer, cross_entropy_request
from workers.engine.memory import PLAN_SHARE, plan_tokens

MiB = 2**20


def test_the_plan_covers_what_a_long_datum_measured() -> None:
    """docs/long-context.md: 1742 MiB for a 16 Ki-token step of the mid Qwen3 (hidden 512,
    8 layers, fp32) with layers recomputed; the plan's bytes a token are at least that."""
    config = transformers.Qwen3Config(
        hidden_size=512,
        num_hidden_layers=8,
        intermediate_size=1024,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=32,
        vocab_size=4096,
    )
    plan = plan_tokens(config, dtype_bytes=4, free_bytes=20 * 2**30, max_context=2**18)
    assert plan.train_bytes_per_token >= 1742 * MiB // 16384
    assert plan.train_tokens == int(20 * 2**30 * PLAN_SHARE) // plan.train_bytes_per_token
    # a sequence keeps its KV cache (2 · 8 KV heads · 32 a layer), not a layer's backward
    assert 4 * 8 * 2 * 8 * 32 < plan.sample_bytes_per_token < plan.train_bytes_per_token
    # never more than the model's context
    small = plan_tokens(config, dtype_bytes=4, free_bytes=2**40, max_context=4096)
    assert (small.train_tokens, small.sample_tokens) == (4096, 4096)


def test_a_group_splitting_a_datum_plans_a_share_of_it_a_rank() -> None:
    """Over 2 and 8 ranks (`workers.engine.context_parallel`), a rank keeps 1/N of a token's
    activations and the gathered keys and values (and a MoE layer's tokens) of one layer:
    the longest datum grows by less than N times, by more than N/2 on Qwen3-8B."""
    dense = transformers.Qwen3Config(
        hidden_size=4096,
        num_hidden_layers=36,
        intermediate_size=12288,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    )
    one = plan_tokens(dense, dtype_bytes=2, free_bytes=40 * 2**30, max_context=2**20)
    for ranks in (2, 8):
        split = plan_tokens(
            dense, dtype_bytes=2, free_bytes=40 * 2**30, max_context=2**20, ranks=ranks
        )
        assert ranks / 2 * one.train_tokens < split.train_tokens < ranks * one.train_tokens
        assert split.sample_tokens == one.sample_tokens  # sampling is not split
        assert f"split over {ranks} ranks" in split.describe()
    # MLA gathers its decompressed keys and values: more a token than its latent cache
    mla = transformers.DeepseekV3Config()
    cache = plan_tokens(mla, dtype_bytes=2, free_bytes=2**36, max_context=2**20)
    split = plan_tokens(mla, dtype_bytes=2, free_bytes=2**36, max_context=2**20, ranks=8)
    heads = mla.num_attention_heads
    gathered = 2 * heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim)
    assert split.train_bytes_per_token > cache.train_bytes_per_token / 8 + 2 * gathered


def test_the_engine_refuses_a_datum_over_its_plan_and_keeps_serving(
    tmp_path_factory: pytest.TempPathFactory, torch_one_thread: None
) -> None:
    model_dir = build_model(tmp_path_factory.mktemp("qwen3"), "qwen3")
    engine = Trainer(str(model_dir), max_slots=1, max_rank=4, memory_limit=MiB)
    plan = engine.core.token_plan
    assert 1 < plan.train_tokens < engine.core.max_context, plan.describe()
    engine.create("m", LoraConfig(rank=4))
    vocab = engine.core.vocab_size
    long = cross_entropy_request("m", [4, plan.train_tokens + 1], vocab, 0, forward_only=False)
    with pytest.raises(UserError) as refused:
        engine.validate("m", long)
    assert str(refused.value) == datum_too_long(1, plan.train_tokens + 1, plan.train_tokens)
    fits = cross_entropy_request("m", [plan.train_tokens], vocab, 1, forward_only=False)
    [out] = engine.forward_backward([("m", fits)])
    assert isinstance(out, FwdBwdOutput)


def test_vllm_max_model_len_comes_from_its_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A standalone vLLM sampler's `max_model_len`: the sequence its KV cache holds
    (`VLLM_CPU_KVCACHE_SPACE` on a CPU, fp32), at most the model's context; None (vLLM's own
    choice) where the cache's size is not known before the engine starts."""
    from workers.sampler.main import planned_model_len

    model_dir = build_model(tmp_path_factory.mktemp("qwen3"), "qwen3")
    config = transformers.AutoConfig.from_pretrained(model_dir)
    text = config.get_text_config()
    per_token = 4 * text.num_hidden_layers * 2 * text.num_key_value_heads * text.head_dim
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert planned_model_len(str(model_dir), config) is None
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", str(per_token * 100 / 2**30))
    assert planned_model_len(str(model_dir), config) == 100
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "64")
    assert planned_model_len(str(model_dir), config) == text.max_position_embeddings

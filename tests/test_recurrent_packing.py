"""Packing on models whose layers mix tokens along the row beyond the attention mask: Gated
DeltaNet (Qwen3.5's `linear_attn`) and Mamba2 (Nemotron-H's `mixer`) scan a state, Inkling's
short convolutions see the tokens before, DeepSeek-V4's compressors pool consecutive tokens.
transformers' torch paths of all of them ignore sequence boundaries inside a row, so two datums
sharing a row would leak one into the other (DeepSeek-V4's logprobs moved by 0.3, Inkling's by
0.06). The pass runner pads such models instead of packing: a request of several short datums
gives each datum what it gives alone."""

from __future__ import annotations

import numpy as np
import pytest

from protocol.api import LoraConfig
from protocol.tensors import FwdBwdRequest
from tests.conftest import build_model
from tests.engine_helpers import Trainer, cross_entropy_request
from workers.engine.passes import carries_state


@pytest.mark.parametrize("arch", ["nemotron_h", "qwen3_5", "deepseek_v4", "inkling_mm_model"])
def test_a_packed_row_equals_its_datums_one_by_one(
    arch: str, tmp_path_factory: pytest.TempPathFactory, torch_one_thread: None
) -> None:
    model_dir = build_model(tmp_path_factory.mktemp(arch), arch)
    engine = Trainer(str(model_dir), max_slots=2, max_rank=8)
    assert carries_state(engine.core.decoder)
    engine.create("m", LoraConfig(rank=4))
    vocab = engine.core.vocab_size
    lengths = [5, 3, 7, 2]
    [together] = engine.forward_backward(
        [("m", cross_entropy_request("m", lengths, vocab, seed=1))]
    )
    assert not isinstance(together, Exception)
    single = cross_entropy_request("m", lengths, vocab, seed=1)
    for i, datum in enumerate(single.datums):
        alone_request = FwdBwdRequest("m", 1, "cross_entropy", True, {}, [datum])
        [alone] = engine.forward_backward([("m", alone_request)])
        assert not isinstance(alone, Exception)
        got = together.loss_fn_outputs[i]["logprobs"]
        want = alone.loss_fn_outputs[0]["logprobs"]
        assert np.abs(got - want).max() <= 1e-5, (arch, i)


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v3", "kimi_k25"])
def test_a_model_whose_tokens_mix_only_by_attention_packs(
    arch: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model_dir = build_model(tmp_path_factory.mktemp(arch), arch)
    engine = Trainer(str(model_dir), max_slots=1, max_rank=8)
    assert not carries_state(engine.core.decoder)
    assert engine.core.passes.packs

"""workers.tiny_model: both architectures build offline and load through the Auto classes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tinker.lib.public_interfaces.sampling_client import _load_tokenizer_from_model_info
from transformers import AutoModelForCausalLM, AutoTokenizer

from workers.tiny_model import CONTEXT_LENGTH, EOS_ID, PAD_ID, build_tiny_model, main

ARCHS = ["qwen3", "qwen3_5"]
TEXT = "Hello wörld!  The answer is 42.\n\n<|im_start|>user\nnaïve café 😀<|im_end|>"


@pytest.fixture(scope="module", params=ARCHS)
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


def test_tokenizer_round_trips_and_matches_the_model_vocab(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = AutoModelForCausalLM.from_pretrained(model_dir).config
    assert len(tokenizer) == config.vocab_size == 512
    ids = tokenizer(TEXT)["input_ids"]
    assert tokenizer.decode(ids) == TEXT
    assert max(ids) < config.vocab_size and min(ids) >= 0
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        0,
        1,
        2,
    ]
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (EOS_ID, PAD_ID)
    assert (config.eos_token_id, config.pad_token_id) == (EOS_ID, PAD_ID)
    assert tokenizer.model_max_length == CONTEXT_LENGTH


def test_tokenizer_loads_the_way_the_sdk_asks(model_dir: Path) -> None:
    # TrainingClient.get_tokenizer() ends in AutoTokenizer.from_pretrained(id, fast=True).
    tokenizer = _load_tokenizer_from_model_info(str(model_dir), str(model_dir))
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=True, return_dict=False
    )
    assert ids[0] == 1 and EOS_ID in ids


def test_forward_and_backward(model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    input_ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    out = model(input_ids=input_ids, labels=input_ids)
    assert out.logits.shape == (1, input_ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_qwen3_5_mixes_linear_and_full_attention(tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path, "qwen3_5"))
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert model.config.layer_types == ["linear_attention", "full_attention"]
    assert model.config.head_dim == 32


def test_builds_are_deterministic_and_leave_the_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    first = build_tiny_model(tmp_path / "a", vocab_size=300, seed=7)
    assert torch.rand(1) == expected
    second = build_tiny_model(tmp_path / "b", vocab_size=300, seed=7)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    other_seed = build_tiny_model(tmp_path / "c", vocab_size=300, seed=8)
    assert (other_seed / "model.safetensors").read_bytes() != (
        first / "model.safetensors"
    ).read_bytes()


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_model(tmp_path, vocab_size=100)
    with pytest.raises(ValueError, match="hidden_size"):
        build_tiny_model(tmp_path, hidden_size=48)


def test_cli_prints_the_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main([str(tmp_path / "cli"), "--arch", "qwen3", "--vocab-size", "300", "--num-layers", "1"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "cli").config.num_hidden_layers == 1

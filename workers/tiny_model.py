"""Build a tiny random-init causal LM and its tokenizer, fully offline, for tests and demos.

No hub access and no download: the tokenizer is a byte-level BPE trained with the `tokenizers`
library on a corpus generated here from a fixed seed, and the model is a freshly initialised
Qwen3 (or Qwen3.5 text model, which mixes linear- and full-attention layers). Both load with
`AutoModelForCausalLM.from_pretrained(dir)` / `AutoTokenizer.from_pretrained(dir)`, exactly like
a real checkpoint, which is what the trainer, the samplers and the SDK's `get_tokenizer()` do.

Invariants: the same arguments give the same files; special tokens are `<|endoftext|>` = 0 (pad),
`<|im_start|>` = 1 and `<|im_end|>` = 2 (eos); the model's `vocab_size` equals the tokenizer's
length, so every id the tokenizer produces is a valid model input. `head_dim` is 32, a size
vLLM's CPU attention supports.

Run as `python -m workers.tiny_model DIR [--arch qwen3|qwen3_5]`; it prints DIR.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any, Literal

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.utils import logging as transformers_logging

Arch = Literal["qwen3", "qwen3_5"]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PAD_ID, IM_START_ID, EOS_ID = 0, 1, 2
HEAD_DIM = 32
CONTEXT_LENGTH = 4096
_MIN_VOCAB = len(SPECIAL_TOKENS) + 256  # every byte is a token, so any text round-trips

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_WORDS = (
    "the a of to and in is it you that he was for on are with as his they be at one have this "
    "from or had by word but what some we can out other were all there when up use your how said "
    "an each she which do their time if will way about many then them write would like so these "
    "her long make thing see him two has look more day could go come did number sound no most "
    "people my over know water than call first who may down side been now find user assistant "
    "system model train loss step sample token weight answer question hello world yes"
).split()
_ROLES = ("system", "user", "assistant")


def _corpus(lines: int = 4000) -> list[str]:
    """A fixed training text: English words, pseudo-words, numbers, punctuation and chat turns.

    Pseudo-words from random syllables give the BPE enough distinct pairs to reach a few
    thousand merges; the fixed seed makes the trained vocabulary identical on every build.
    """
    rng = random.Random(20261129)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "sh", "ng", "qu"]
    pseudo = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(3000)]
    text: list[str] = []
    for i in range(lines):
        words = [
            rng.choice(_WORDS) if rng.random() < 0.6 else rng.choice(pseudo)
            for _ in range(rng.randint(3, 14))
        ]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 10 ** rng.randint(1, 5))))
        line = " ".join(words)
        line = line[0].upper() + line[1:] + rng.choice([".", "?", "!", ",", ":", ""])
        text.append(f"{_ROLES[i % 3]}\n{line}\n" if i % 5 == 0 else line)
    return text


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE of at most `vocab_size` tokens (fewer if the corpus runs out of merges)."""
    if vocab_size < _MIN_VOCAB:
        raise ValueError(f"vocab_size must be at least {_MIN_VOCAB} (3 special tokens + 256 bytes)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,  # first, so they get ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=CONTEXT_LENGTH,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _config(
    arch: Arch, *, vocab_size: int, hidden_size: int, num_layers: int
) -> Qwen3Config | Qwen3_5TextConfig:
    if hidden_size % HEAD_DIM or hidden_size < HEAD_DIM:
        raise ValueError(f"hidden_size must be a positive multiple of {HEAD_DIM}")
    if num_layers < 1:
        raise ValueError("num_layers must be at least 1")
    heads = hidden_size // HEAD_DIM
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=HEAD_DIM,
        max_position_embeddings=CONTEXT_LENGTH,
        tie_word_embeddings=True,
        # Wider than the usual 0.02 so that a random model's logits have some range: with tiny
        # embeddings a LoRA on attention/MLP alone can barely move the output distribution.
        initializer_range=0.1,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    if arch == "qwen3":
        return Qwen3Config(**common)
    if arch == "qwen3_5":
        # Qwen3.5 puts one full-attention layer after every three linear-attention (gated
        # DeltaNet) layers; a shorter period keeps both kinds present in a 2-layer model.
        period = min(4, num_layers)
        layer_types = [
            "full_attention" if (i + 1) % period == 0 else "linear_attention"
            for i in range(num_layers)
        ]
        return Qwen3_5TextConfig(
            **common,
            layer_types=layer_types,
            linear_key_head_dim=HEAD_DIM,
            linear_value_head_dim=HEAD_DIM,
            linear_num_key_heads=max(1, heads // 2),
            linear_num_value_heads=heads,
        )
    raise ValueError(f"unknown arch {arch!r}: expected 'qwen3' or 'qwen3_5'")


def build_tiny_model(
    directory: Path,
    arch: Arch = "qwen3",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_size: int = 512,
    seed: int = 0,
) -> Path:
    """Write a tiny random-init causal LM and its tokenizer into `directory`; return it."""
    directory = Path(directory)
    tokenizer = build_tokenizer(vocab_size)
    config = _config(
        arch, vocab_size=len(tokenizer), hidden_size=hidden_size, num_layers=num_layers
    )
    # A private RNG scope: building a model must not disturb the caller's torch RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = (Qwen3ForCausalLM if arch == "qwen3" else Qwen3_5ForCausalLM)(config)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=None, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m workers.tiny_model",
        description="Build a tiny offline causal LM and tokenizer.",
    )
    parser.add_argument("directory", type=Path)
    parser.add_argument("--arch", choices=["qwen3", "qwen3_5"], default="qwen3")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    path = build_tiny_model(
        args.directory,
        args.arch,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        vocab_size=args.vocab_size,
        seed=args.seed,
    )
    print(path)


if __name__ == "__main__":
    main()

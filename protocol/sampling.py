"""Sampling, as data: a validated `SampleSpec` from an `asample` body, the backends' output, and
the protobuf `SampleResponse` the SDK requires.

Both sampler backends (torch in the trainer, vLLM in its own process) take a `SampleSpec` and
return a `SampleOutput`; the sampler service encodes it with `encode_sample_response`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from protocol import api
from protocol import tinker_wire_pb2 as pb
from protocol.errors import UserError

MAX_NUM_SAMPLES = 128
DEFAULT_MAX_TOKENS = 128


@dataclass(frozen=True)
class SampleSpec:
    """One `asample` request, validated. `stop_strings`/`stop_token_ids` are empty and
    `stop_at_eos` True when the client sent no `stop`; `stop: []` turns every stop off."""

    prompt: tuple[int, ...]
    num_samples: int = 1
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stop_at_eos: bool = True
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    record_stability_info: bool = False  # keep each sequence for stable_reinforce


@dataclass
class SampledSequence:
    """One completion: its tokens, the raw logprob of each (model distribution, before
    temperature), and why it ended."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]


@dataclass
class SampleOutput:
    """What a backend returns for one `SampleSpec`."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None  # first entry None (nothing predicts it)
    topk_prompt_logprobs: list[list[tuple[int, float]]] | None = field(default=None)


def sample_spec(
    body: api.SampleRequest, *, max_context: int | None, vocab_size: int | None
) -> SampleSpec:
    """Validate an `asample` body; every problem is a one-line user error naming the field."""
    prompt = body.prompt.to_tokens()
    params = body.sampling_params
    if not prompt:
        raise UserError("prompt: empty; at least one token is needed")
    if vocab_size is not None and any(t < 0 or t >= vocab_size for t in prompt):
        bad = next(t for t in prompt if t < 0 or t >= vocab_size)
        raise UserError(f"prompt: token id {bad} is outside the vocabulary (size {vocab_size})")
    if not 1 <= body.num_samples <= MAX_NUM_SAMPLES:
        raise UserError(f"num_samples: {body.num_samples} is out of range 1..{MAX_NUM_SAMPLES}")
    max_tokens = DEFAULT_MAX_TOKENS if params.max_tokens is None else params.max_tokens
    if max_tokens < 1:
        raise UserError(f"sampling_params.max_tokens: {max_tokens} must be >= 1")
    if max_context is not None and len(prompt) + max_tokens > max_context:
        raise UserError(
            f"prompt: {len(prompt)} tokens + max_tokens {max_tokens} exceed the model's context of {max_context}"
        )
    if not math.isfinite(params.temperature) or params.temperature < 0:
        raise UserError(f"sampling_params.temperature: {params.temperature} must be >= 0")
    if not math.isfinite(params.top_p) or not 0 < params.top_p <= 1:
        raise UserError(f"sampling_params.top_p: {params.top_p} must be in (0, 1]")
    if params.top_k == 0 or params.top_k < -1:
        raise UserError(f"sampling_params.top_k: {params.top_k} must be -1 (off) or >= 1")
    if body.topk_prompt_logprobs < 0:
        raise UserError("topk_prompt_logprobs: must be >= 0")
    if (
        body.prompt_alt_tokens_k
        or body.target_prompt_logprobs is not None
        or body.prompt_logprobs_last_n
    ):
        raise UserError(
            "prompt_alt_tokens_k, target_prompt_logprobs and prompt_logprobs_last_n are not supported yet"
        )
    stop = params.stop
    strings: tuple[str, ...] = ()
    token_ids: tuple[int, ...] = ()
    if isinstance(stop, str):
        strings = (stop,)
    elif isinstance(stop, list):
        if all(isinstance(s, str) for s in stop):
            strings = tuple(str(s) for s in stop)
        elif all(isinstance(s, int) for s in stop):
            token_ids = tuple(int(s) for s in stop)
        else:
            raise UserError(
                "sampling_params.stop: a list of strings or a list of token ids, not both"
            )
    return SampleSpec(
        prompt=tuple(prompt),
        num_samples=body.num_samples,
        max_tokens=max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed,
        stop_strings=strings,
        stop_token_ids=token_ids,
        stop_at_eos=stop is None,
        prompt_logprobs=bool(body.prompt_logprobs) or body.topk_prompt_logprobs > 0,
        topk_prompt_logprobs=body.topk_prompt_logprobs,
        record_stability_info=bool(body.record_stability_info),
    )


def encode_sample_response(output: SampleOutput) -> bytes:
    """The protobuf `SampleResponse`: int32 tokens, float32 logprobs, NaN where not computed."""
    msg = pb.SampleResponse()
    for seq in output.sequences:
        item = msg.sequences.add()
        item.stop_reason = (
            pb.STOP_REASON_STOP if seq.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        )
        item.tokens = np.asarray(seq.tokens, dtype="<i4").tobytes()
        item.logprobs = np.asarray(seq.logprobs, dtype="<f4").tobytes()
    if output.prompt_logprobs is not None:
        values = [math.nan if v is None else v for v in output.prompt_logprobs]
        msg.prompt_logprobs = np.asarray(values, dtype="<f4").tobytes()
    if output.topk_prompt_logprobs is not None:
        k = max((len(row) for row in output.topk_prompt_logprobs), default=0)
        ids = np.zeros((len(output.topk_prompt_logprobs), k), dtype="<i4")
        lps = np.full((len(output.topk_prompt_logprobs), k), -99999.0, dtype="<f4")
        for i, row in enumerate(output.topk_prompt_logprobs):
            for j, (token, lp) in enumerate(row):
                ids[i, j], lps[i, j] = token, lp
        msg.topk_prompt_logprobs.token_ids = ids.tobytes()
        msg.topk_prompt_logprobs.logprobs = lps.tobytes()
        msg.topk_prompt_logprobs.k = k
        msg.topk_prompt_logprobs.length = len(output.topk_prompt_logprobs)
    return bytes(msg.SerializeToString())

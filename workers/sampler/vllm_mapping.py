"""Our sampling spec to vLLM's types and back: `SampleSpec` -> `SamplingParams`, and a finished
`RequestOutput` -> `SampleOutput`.

Job: the pure half of the vLLM backend (no engine, no I/O). `VllmSampler.sample`
(workers/sampler/vllm_sampler.py) maps a validated `SampleSpec` (protocol/sampling.py) with
`sampling_params` (its step 3), runs one `generate`, and maps the final output back with
`sample_output` (its step 4): sampled tokens, their raw logprobs (and top-k), the stop reason,
prompt logprobs (first entry None) and top-k prompt logprobs (first row empty), blanked before
the last n when asked.

Target-id logprobs and alternative-token draws (`needs_full_rows`) are asked of vLLM as
full-vocabulary prompt rows; the sampler bounds their size before it asks. The draws are made
here, from those rows, with a generator seeded from the request's seed.

Invariants: logprobs are raw (the engine runs with `logprobs_mode="raw_logprobs"`); a greedy
spec is drawn once (vLLM refuses n > 1 when greedy) and repeated `num_samples` times; with a
seed, sample i is vLLM's parallel sample i (seed + i), ordered by its index; every seed vLLM
sees is in [0, `SEED_RANGE`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

import numpy as np
from vllm import SamplingParams
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind

from protocol.errors import ServerError
from protocol.sampling import SampledSequence, SampleOutput, SampleSpec, TopK, keep_last_n

# torch generators take 64-bit seeds; vLLM seeds sample i with seed + i (see `sampling_params`).
SEED_RANGE = 2**63


def is_greedy(spec: SampleSpec) -> bool:
    """Whether `spec` is sampled greedily: vLLM treats temperatures below its
    `_SAMPLING_EPS` (1e-5, our `protocol.sampling.GREEDY_TEMPERATURE`) as 0."""
    return spec.greedy


def needs_full_rows(spec: SampleSpec) -> bool:
    """Whether `spec` needs every vocabulary logprob at its prompt positions."""
    return spec.target_prompt_logprobs is not None or spec.prompt_alt_tokens_k > 0


def sampling_params(spec: SampleSpec) -> SamplingParams:
    """vLLM's parameters for one spec: n samples, final output only, sampled-token logprobs.

    vLLM refuses n > 1 when greedy; every greedy sample is the same, so one is drawn and
    `sample_output` repeats it.
    """
    return SamplingParams(
        n=1 if is_greedy(spec) else spec.num_samples,
        max_tokens=spec.max_tokens,
        # Exactly 0 when greedy, so nothing (here or in vLLM) divides by a tiny temperature.
        temperature=0.0 if is_greedy(spec) else spec.temperature,
        top_k=spec.top_k,
        top_p=spec.top_p,
        # torch generators take 64-bit seeds and vLLM seeds sample i with seed + i; an
        # out-of-range seed would fail inside the engine step and take the engine down.
        seed=None if spec.seed is None else spec.seed % SEED_RANGE,
        stop=list(spec.stop_strings) or None,
        stop_token_ids=list(spec.stop_token_ids) or None,
        ignore_eos=not spec.stop_at_eos,
        logprobs=spec.topk_sample_logprobs,  # and always the sampled token's own
        prompt_logprobs=(
            -1
            if needs_full_rows(spec)
            else spec.topk_prompt_logprobs
            if spec.prompt_logprobs
            else None
        ),
        flat_logprobs=needs_full_rows(spec),
        # Text is only needed to find stop strings.
        detokenize=bool(spec.stop_strings),
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def sample_output(spec: SampleSpec, output: RequestOutput) -> SampleOutput:
    """The protocol's view of a finished `RequestOutput`."""
    # parallel samples can finish in any order; `index` is sample i (seeded with seed + i)
    completions = sorted(output.outputs, key=lambda completion: completion.index)
    sequences = [
        _sequence(output.request_id, completion, spec.topk_sample_logprobs)
        for completion in completions
    ]
    if is_greedy(spec) and len(sequences) == 1:
        (only,) = sequences
        sequences = [
            replace(
                only,
                tokens=list(only.tokens),
                logprobs=list(only.logprobs),
                topk_logprobs=None if only.topk_logprobs is None else list(only.topk_logprobs),
            )
            for _ in range(spec.num_samples)
        ]
    if len(sequences) != spec.num_samples:
        raise ServerError(
            f"{output.request_id}: {len(sequences)} sequences for num_samples={spec.num_samples}"
        )
    result = SampleOutput(sequences=sequences)
    rows = output.prompt_logprobs
    if spec.needs_prompt_rows and (rows is None or len(rows) != len(spec.prompt)):
        raise ServerError(f"{output.request_id}: vLLM returned no prompt logprobs")
    if rows is not None and needs_full_rows(spec):
        _fill_from_full_rows(spec, result, [rows[i] for i in range(1, len(spec.prompt))])
    if rows is not None and spec.prompt_logprobs:
        values: list[float | None] = [None]
        topk: list[list[tuple[int, float]]] = [[]]
        for token, row in zip(spec.prompt[1:], rows[1:], strict=True):
            if row is None or token not in row:
                raise ServerError(f"{output.request_id}: prompt logprob of token {token} missing")
            values.append(float(row[token].logprob))
            ranked = sorted(
                (lp.rank, token_id, float(lp.logprob))
                for token_id, lp in row.items()
                if lp.rank is not None and lp.rank <= spec.topk_prompt_logprobs
            )
            topk.append([(token_id, logprob) for _, token_id, logprob in ranked])
        result.prompt_logprobs = values
        if spec.topk_prompt_logprobs > 0:
            result.topk_prompt_logprobs = topk
        keep_last_n(spec, result)
    return result


def _fill_from_full_rows(spec: SampleSpec, result: SampleOutput, rows: list[Any]) -> None:
    """Target-id logprobs and alternative draws from full-vocabulary prompt rows (row i is
    the distribution over prompt token i + 1)."""
    if not rows:
        table = np.zeros((0, 1))
    else:
        width = max(max(row) for row in rows) + 1
        table = np.full((len(rows), width), -np.inf)
        for i, row in enumerate(rows):
            for token_id, logprob in row.items():
                table[i, token_id] = logprob.logprob
    target = spec.target_prompt_logprobs
    if target is not None:
        positions, ids = target.cells()
        result.target_prompt_logprobs = [
            0.0 if token < 0 else float(table[r, token])
            for r, token in zip(positions, ids, strict=True)
        ]
    k = spec.prompt_alt_tokens_k
    if k > 0:
        if is_greedy(spec) or not rows:
            draws = np.repeat(table.argmax(axis=1)[:, None], k, axis=1)[: len(rows)]
        else:
            rng = np.random.default_rng(None if spec.seed is None else [spec.seed % 2**64, 2**32])
            scaled = table / spec.temperature
            probs = np.exp(scaled - scaled.max(axis=1, keepdims=True))
            probs /= probs.sum(axis=1, keepdims=True)
            draws = np.stack([rng.choice(probs.shape[1], size=k, p=p) for p in probs])
        result.prompt_alt_tokens = draws.tolist()
        result.prompt_alt_logprobs = np.take_along_axis(table, draws, axis=1).tolist()


def _sequence(request_id: str, completion: CompletionOutput, top: int = 0) -> SampledSequence:
    stop_reason: Literal["stop", "length"]
    if completion.finish_reason == "stop":
        stop_reason = "stop"
    elif completion.finish_reason == "length":
        stop_reason = "length"
    else:
        raise ServerError(f"{request_id}: sequence ended with {completion.finish_reason!r}")
    tokens = list(completion.token_ids)
    steps = completion.logprobs or []
    if len(steps) != len(tokens):
        raise ServerError(f"{request_id}: {len(steps)} logprobs for {len(tokens)} tokens")
    logprobs: list[float] = []
    topk: list[TopK] = []
    for token, step in zip(tokens, steps, strict=True):
        if step is None:
            raise ServerError(f"{request_id}: no logprob for sampled token {token}")
        logprobs.append(float(step[token].logprob))
        ranked = sorted(
            (lp.rank, token_id, float(lp.logprob))
            for token_id, lp in step.items()
            if lp.rank is not None and lp.rank <= top
        )
        topk.append([(token_id, logprob) for _, token_id, logprob in ranked])
    return SampledSequence(
        tokens=tokens,
        logprobs=logprobs,
        stop_reason=stop_reason,
        topk_logprobs=topk if top > 0 else None,
    )

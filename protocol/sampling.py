"""Sampling, as data: a validated `SampleSpec` from an `asample` body, the backends' output, and
the protobuf `SampleResponse` the SDK requires.

Both sampler backends (torch in the trainer, vLLM in its own process) take a `SampleSpec` and
return a `SampleOutput`; the sampler service encodes it with `encode_sample_response`.

Invariants: every per-position width a client picks (top-k prompt and sample logprobs, the
columns of `target_prompt_logprobs`, `prompt_alt_tokens_k`) is at most `MAX_LOGPROBS_K`, so a
request's extra output is bounded by its own prompt and completion lengths; every token id a
client names is inside the vocabulary; a request has at most `MAX_STOP_SEQUENCES` stop strings
(each 1..`MAX_STOP_STRING_CHARS` characters) or stop token ids, since the samplers check every
stop at every decode step. Logprobs are the raw model distribution (before temperature, top-k
and top-p), as the trainer's forward computes them. A temperature below `GREEDY_TEMPERATURE`
samples greedily in both backends.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from protocol import api
from protocol import tinker_wire_pb2 as pb
from protocol.errors import UserError
from protocol.images import DatumImage, VisionGeometry, read_request_image

MAX_NUM_SAMPLES = 128
DEFAULT_MAX_TOKENS = 128
# The widest per-position top-k, target-id row or alternative-token draw a request may ask for.
MAX_LOGPROBS_K = 20
# Below this temperature sampling is greedy (vLLM's `_SAMPLING_EPS`): dividing logits by a
# smaller one overflows float32 and turns the distribution into NaN.
GREEDY_TEMPERATURE = 1e-5
# Stop strings or stop token ids per request (as common inference servers allow), and the
# longest stop string: each is searched for in every row's decoded tail at every decode step,
# and that tail is `_BYTES_PER_CHAR` tokens per character long (workers.sampler.torch_sampler). The
# tinker-cookbook renderers send at most three.
MAX_STOP_SEQUENCES = 16
MAX_STOP_STRING_CHARS = 256
# The placeholder of an empty top-k slot (the SDK's `MASK_LOGPROB`, token id 0).
TOPK_MASK_LOGPROB = -99999.0


@dataclass(frozen=True)
class TargetIds:
    """`target_prompt_logprobs`, validated: token ids to score at prompt positions.

    `values` are the request's own cells in its layout: all `rows * cols` of them row-major when
    dense, else the listed cells of a CSR matrix (`crow`, `col`). A cell of -1 asks nothing.
    Row i scores prompt position i + 1. The answer has the same layout (`cells` order).
    """

    rows: int
    cols: int
    values: tuple[int, ...]
    crow: tuple[int, ...] | None = None
    col: tuple[int, ...] | None = None

    def cells(self) -> tuple[list[int], list[int]]:
        """(row, token id) of every value in `values` order; -1 where nothing is asked."""
        if self.crow is None:
            rows = [i // self.cols for i in range(len(self.values))]
        else:
            rows = [r for r in range(self.rows) for _ in range(self.crow[r], self.crow[r + 1])]
        return rows, list(self.values)


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
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: TargetIds | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None  # score only the last n prompt tokens
    # a VL model's prompt images, in order; each stands as its placeholder tokens in `prompt`
    images: tuple[DatumImage, ...] = ()

    @property
    def greedy(self) -> bool:
        """Whether every sample takes the most likely token (temperature below
        `GREEDY_TEMPERATURE`)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_prompt_rows(self) -> bool:
        """Whether any output needs the model's distribution at the prompt positions."""
        return (
            self.prompt_logprobs
            or self.target_prompt_logprobs is not None
            or self.prompt_alt_tokens_k > 0
        )


TopK = list[tuple[int, float]]  # (token id, raw logprob), most likely first


@dataclass
class SampledSequence:
    """One completion: its tokens, the raw logprob of each (model distribution, before
    temperature), why it ended and, when asked, each position's top-k."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]
    topk_logprobs: list[TopK] | None = None


@dataclass
class SampleOutput:
    """What a backend returns for one `SampleSpec`."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None  # first entry None (nothing predicts it)
    topk_prompt_logprobs: list[TopK] | None = field(default=None)
    target_prompt_logprobs: list[float] | None = None  # one per `TargetIds.values`, 0.0 at -1
    # [len(prompt) - 1][k] draws and their raw logprobs; row i is for prompt position i + 1
    prompt_alt_tokens: list[list[int]] | None = None
    prompt_alt_logprobs: list[list[float]] | None = None


TEXT_ONLY = "this model takes text only"


def prompt_tokens(
    prompt: api.ModelInput, vision: VisionGeometry | None, no_images: str = TEXT_ONLY
) -> tuple[list[int], list[DatumImage]]:
    """A prompt's token ids, each image chunk standing as its placeholder tokens, and its
    images, read from their headers and checked against `vision`'s limits (a VL model's
    geometry; None refuses images, saying `no_images`). A text token equal to the
    placeholder id is refused: it would stand for an image that is not there."""
    tokens: list[int] = []
    images: list[DatumImage] = []
    for index, chunk in enumerate(prompt.chunks):
        where = f"prompt chunk {index}"
        if isinstance(chunk, api.EncodedTextChunk):
            if vision is not None and vision.image_token_id in chunk.tokens:
                raise UserError(
                    f"{where}: token id {vision.image_token_id} is the image placeholder; send"
                    " the image as an image chunk"
                )
            tokens.extend(chunk.tokens)
            continue
        if not isinstance(chunk, api.ImageChunk):
            kind = type(chunk).__struct_config__.tag
            detail = "image assets are not stored here; send the image inline as an image chunk"
            raise UserError(
                f"{where} is {kind!r}: "
                + (detail if isinstance(chunk, api.ImageAssetPointerChunk) else "not supported")
            )
        if vision is None:
            raise UserError(f"{where} is an image, and {no_images}")
        header, n_tokens = read_request_image(
            chunk.data, chunk.format, vision, chunk.expected_tokens, where, len(images)
        )
        images.append(DatumImage(header, chunk.data, len(tokens), n_tokens))
        tokens.extend([vision.image_token_id] * n_tokens)
    return tokens, images


def sample_spec(
    body: api.SampleRequest,
    *,
    max_context: int | None,
    vocab_size: int | None,
    vision: VisionGeometry | None = None,
    no_images: str = TEXT_ONLY,
) -> SampleSpec:
    """Validate an `asample` body; every problem is a one-line user error naming the field.
    `vision`: a VL model's image geometry (None: image chunks are refused, with `no_images`
    as the reason)."""
    prompt, images = prompt_tokens(body.prompt, vision, no_images)
    max_tokens, (strings, token_ids) = _checked(body, prompt, max_context, vocab_size)
    params = body.sampling_params
    target = body.target_prompt_logprobs
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
        stop_at_eos=params.stop is None,
        prompt_logprobs=_wants_prompt(body),
        topk_prompt_logprobs=body.topk_prompt_logprobs,
        record_stability_info=bool(body.record_stability_info),
        topk_sample_logprobs=body.topk_sample_logprobs,
        target_prompt_logprobs=None if target is None else _target_ids(target),
        prompt_alt_tokens_k=body.prompt_alt_tokens_k,
        prompt_logprobs_last_n=body.prompt_logprobs_last_n,
        images=tuple(images),
    )


def check_sample_request(
    body: api.SampleRequest,
    *,
    max_context: int | None,
    vocab_size: int | None,
    vision: VisionGeometry | None = None,
    no_images: str = TEXT_ONLY,
    max_sequence: int | None = None,
) -> None:
    """Every check of `sample_spec`, with the same errors, without building the spec: the
    gateway refuses a bad `asample` body before accepting it, and the sampler builds the spec
    from the same body. Images are read from their headers only. `max_sequence`: the longest
    prompt + max_tokens the model's samplers plan for (their memory plan; None: unknown)."""
    prompt, _ = prompt_tokens(body.prompt, vision, no_images)
    max_tokens, _ = _checked(body, prompt, max_context, vocab_size)
    if max_sequence is not None and len(prompt) + max_tokens > max_sequence:
        raise UserError(
            f"prompt: {len(prompt)} tokens + max_tokens {max_tokens} exceed the {max_sequence}"
            " tokens of the longest sequence this base model's samplers can run (their memory"
            " plan, reported by get_server_capabilities)"
        )


def _wants_prompt(body: api.SampleRequest) -> bool:
    return bool(body.prompt_logprobs) or body.topk_prompt_logprobs > 0


def _checked(
    body: api.SampleRequest, prompt: list[int], max_context: int | None, vocab_size: int | None
) -> tuple[int, tuple[tuple[str, ...], tuple[int, ...]]]:
    """The rules of an `asample` body whose prompt reads as `prompt`, in the order their errors
    are reported; returns the effective max_tokens and the stops (see `_stops`)."""
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
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        _check_width(name, getattr(body, name))
    last_n = body.prompt_logprobs_last_n
    if last_n is not None:
        if not _wants_prompt(body):
            raise UserError(
                "prompt_logprobs_last_n: applies to prompt logprobs; set prompt_logprobs"
            )
        if not 1 <= last_n <= len(prompt) - 1:
            raise UserError(
                f"prompt_logprobs_last_n: {last_n} is out of range 1..{len(prompt) - 1} "
                "(len(prompt) - 1)"
            )
    if body.target_prompt_logprobs is not None:
        _check_target_ids(body.target_prompt_logprobs, len(prompt), vocab_size)
    return max_tokens, _stops(params.stop, vocab_size)


def _stops(
    stop: str | list[str | int] | None, vocab_size: int | None
) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """`sampling_params.stop` as (stop strings, stop token ids), bounded: at most
    `MAX_STOP_SEQUENCES` of either, strings of 1..`MAX_STOP_STRING_CHARS` characters, ids in
    the vocabulary."""
    name = "sampling_params.stop"
    if stop is None:
        return (), ()
    items: list[str | int] = [stop] if isinstance(stop, str) else list(stop)
    if len(items) > MAX_STOP_SEQUENCES:
        raise UserError(
            f"{name}: {len(items)} stop sequences; at most {MAX_STOP_SEQUENCES} are allowed"
        )
    if all(isinstance(s, str) for s in items):
        strings = tuple(str(s) for s in items)
        bad = next((s for s in strings if not 1 <= len(s) <= MAX_STOP_STRING_CHARS), None)
        if bad is not None:
            raise UserError(
                f"{name}: a stop string of {len(bad)} characters; each must have "
                f"1..{MAX_STOP_STRING_CHARS}"
            )
        return strings, ()
    if all(isinstance(s, int) for s in items):
        token_ids = tuple(int(s) for s in items)
        limit = vocab_size if vocab_size is not None else 2**63
        bad_id = next((t for t in token_ids if not 0 <= t < limit), None)
        if bad_id is not None:
            raise UserError(
                f"{name}: token id {bad_id} is outside the vocabulary (size {vocab_size})"
            )
        return (), token_ids
    raise UserError(f"{name}: a list of strings or a list of token ids, not both")


def _check_width(name: str, k: int) -> None:
    if not 0 <= k <= MAX_LOGPROBS_K:
        raise UserError(f"{name}: {k} is out of range 0..{MAX_LOGPROBS_K}")


def _check_target_ids(tensor: api.TensorData, prompt_len: int, vocab_size: int | None) -> None:
    """`target_prompt_logprobs` checked: int64, [len(prompt) - 1, K <= MAX_LOGPROBS_K], dense
    or a well-formed CSR matrix, ids in the vocabulary or -1, at least one id."""
    name = "target_prompt_logprobs"
    if tensor.dtype != "int64":
        raise UserError(f"{name}: dtype must be int64 token ids, not {tensor.dtype}")
    shape = tensor.shape
    if shape is None or len(shape) != 2:
        raise UserError(f"{name}: shape must be [len(prompt) - 1, K], got {shape}")
    rows, cols = shape
    if rows != prompt_len - 1:
        raise UserError(
            f"{name}: {rows} rows for a prompt of {prompt_len} tokens; "
            f"len(prompt) - 1 = {prompt_len - 1} are needed"
        )
    if not 1 <= cols <= MAX_LOGPROBS_K:
        raise UserError(f"{name}: K = {cols} ids per position is out of range 1..{MAX_LOGPROBS_K}")
    values = tensor.data
    if any(type(v) is not int for v in values):
        raise UserError(f"{name}: data must be integer token ids")
    crow, col = tensor.sparse_crow_indices, tensor.sparse_col_indices
    if (crow is None) != (col is None):
        raise UserError(f"{name}: sparse_crow_indices and sparse_col_indices go together")
    if crow is None or col is None:
        if len(values) != rows * cols:
            raise UserError(f"{name}: {len(values)} values for shape [{rows}, {cols}]")
    else:
        _check_csr(name, crow, col, rows, cols, len(values))
    limit = vocab_size if vocab_size is not None else 2**63
    bad = next((v for v in values if v != -1 and not 0 <= v < limit), None)
    if bad is not None:
        raise UserError(f"{name}: token id {bad} is outside the vocabulary (size {vocab_size})")
    if all(v == -1 for v in values):
        raise UserError(f"{name}: names no token id (every cell is -1)")


def _target_ids(tensor: api.TensorData) -> TargetIds:
    """`target_prompt_logprobs` as `TargetIds`, once `_check_target_ids` has passed it."""
    assert tensor.shape is not None
    rows, cols = tensor.shape
    crow, col = tensor.sparse_crow_indices, tensor.sparse_col_indices
    return TargetIds(
        rows,
        cols,
        tuple(int(v) for v in tensor.data),
        None if crow is None else tuple(crow),
        None if col is None else tuple(col),
    )


def _check_csr(name: str, crow: list[int], col: list[int], rows: int, cols: int, nnz: int) -> None:
    """A CSR layout: rows + 1 nondecreasing row pointers from 0 to nnz, and within each row
    strictly increasing column indices in [0, cols)."""
    if len(crow) != rows + 1 or crow[0] != 0 or crow[-1] != nnz or len(col) != nnz:
        raise UserError(
            f"{name}: sparse_crow_indices must be {rows + 1} row pointers from 0 to the "
            f"{nnz} values, with one sparse_col_indices entry per value"
        )
    for r in range(rows):
        start, end = crow[r], crow[r + 1]
        if end < start:
            raise UserError(f"{name}: sparse_crow_indices must not decrease")
        row = col[start:end]
        if any(not 0 <= c < cols for c in row) or any(a >= b for a, b in itertools.pairwise(row)):
            raise UserError(
                f"{name}: sparse_col_indices of row {r} must increase strictly within 0..{cols - 1}"
            )


def keep_last_n(spec: SampleSpec, output: SampleOutput) -> None:
    """Blank the prompt logprobs (NaN) and top-k rows before the last
    `prompt_logprobs_last_n` prompt tokens, as the SDK requires."""
    n = spec.prompt_logprobs_last_n
    if n is None:
        return
    cut = len(spec.prompt) - n
    if output.prompt_logprobs is not None:
        output.prompt_logprobs[:cut] = [None] * cut
    if output.topk_prompt_logprobs is not None:
        output.topk_prompt_logprobs[:cut] = [[] for _ in range(cut)]


def encode_sample_response(output: SampleOutput, spec: SampleSpec | None = None) -> bytes:
    """The protobuf `SampleResponse`: int32 tokens, float32 logprobs, NaN where not computed;
    `spec` gives the layout of `target_prompt_logprobs` (and the sampled top-k width)."""
    msg = pb.SampleResponse()
    sample_k = 0 if spec is None else spec.topk_sample_logprobs
    for seq in output.sequences:
        item = msg.sequences.add()
        item.stop_reason = (
            pb.STOP_REASON_STOP if seq.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        )
        item.tokens = np.asarray(seq.tokens, dtype="<i4").tobytes()
        item.logprobs = np.asarray(seq.logprobs, dtype="<f4").tobytes()
        if seq.topk_logprobs is not None:
            _fill_topk(item.topk_sampled_logprobs, seq.topk_logprobs, sample_k)
    if output.prompt_logprobs is not None:
        values = [math.nan if v is None else v for v in output.prompt_logprobs]
        msg.prompt_logprobs = np.asarray(values, dtype="<f4").tobytes()
    if output.topk_prompt_logprobs is not None:
        _fill_topk(msg.topk_prompt_logprobs, output.topk_prompt_logprobs, 0)
    target = None if spec is None else spec.target_prompt_logprobs
    if output.target_prompt_logprobs is not None and target is not None:
        values_f4 = np.asarray(output.target_prompt_logprobs, dtype="<f4")
        tensor = msg.target_prompt_logprobs
        tensor.dtype = pb.DTYPE_FLOAT32
        tensor.shape.extend([target.rows, target.cols])
        if target.crow is None or target.col is None:
            tensor.dense = values_f4.tobytes()
        else:
            tensor.sparse_csr.values = values_f4.tobytes()
            tensor.sparse_csr.crow_indices = np.asarray(target.crow, dtype="<i8").tobytes()
            tensor.sparse_csr.col_indices = np.asarray(target.col, dtype="<i8").tobytes()
    if output.prompt_alt_tokens is not None and output.prompt_alt_logprobs is not None:
        rows = len(output.prompt_alt_tokens)
        k = 0 if spec is None else spec.prompt_alt_tokens_k
        alt = msg.prompt_alt_tokens
        alt.tokens.dtype = pb.DTYPE_INT64
        alt.tokens.shape.extend([rows, k])
        alt.tokens.dense = (
            np.asarray(output.prompt_alt_tokens, dtype="<i8").reshape(rows, k).tobytes()
        )
        alt.logprobs.dtype = pb.DTYPE_FLOAT32
        alt.logprobs.shape.extend([rows, k])
        alt.logprobs.dense = (
            np.asarray(output.prompt_alt_logprobs, dtype="<f4").reshape(rows, k).tobytes()
        )
    return bytes(msg.SerializeToString())


def _fill_topk(msg: pb.TopkLogprobs, rows: list[TopK], k: int) -> None:
    """Dense [len(rows), k] matrices (k: the widest row if 0); short rows are padded with the
    SDK's empty-slot placeholder (token 0, TOPK_MASK_LOGPROB)."""
    k = max(k, max((len(row) for row in rows), default=0))
    ids = np.zeros((len(rows), k), dtype="<i4")
    lps = np.full((len(rows), k), TOPK_MASK_LOGPROB, dtype="<f4")
    for i, row in enumerate(rows):
        for j, (token, lp) in enumerate(row):
            ids[i, j], lps[i, j] = token, lp
    msg.token_ids = ids.tobytes()
    msg.logprobs = lps.tobytes()
    msg.k = k
    msg.length = len(rows)

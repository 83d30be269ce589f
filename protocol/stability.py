"""Stability information for `stable_reinforce`: what a sampler records per sequence, and how a
training datum's provenance spans are resolved against it. Pure: no I/O.

Job, in the order of the flow:
1. A sampling client made with `record_stability_info=True` samples; for each sequence the
   sampler stores a `StabilityRecord` (the sampled tokens, the sampler's log-prob of each, the
   prompt's length, the owner) in KV `tw_stability` under `sequence_key(sequence_id)`. The
   bucket keeps an entry a day after its last write; using a record rewrites it when it is older
   than `RENEW_AFTER_S`, so a record in use does not expire.
2. A `forward_backward` with `loss_fn="stable_reinforce"` names, through each datum's
   `loss_fn_input_spans`, the sequence (and the run of its prompt or sampled tokens) behind
   every target position. The gateway checks the spans (`datum_spans`), reads the records they
   name, checks that they belong to the caller, and cuts from them only the runs the spans cover
   (`slices_for`): the job carries those `SpanSlice`s, so the worker needs no lookup and a
   replayed job resolves the same way after the records have expired.
3. The worker (`apply_slices`) checks each slice's tokens against the datum's `target_tokens`,
   puts the recorded log-probs in as the datum's `logprobs` input (what the client sent there is
   replaced: the server trusts its own record), and refuses a non-zero advantage on a position
   no sampled span covers.

Invariants: every client-controlled number (offsets, lengths, counts, ids) is checked before it
indexes anything, and each problem is a one-line `UserError` naming the datum and the span.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec
import numpy as np
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]  # no stubs here

from protocol import tinker_wire_pb2 as pb
from protocol.errors import UserError
from protocol.tensors import FwdBwdRequest

LOSS_NAME = "stable_reinforce"
RECORD_TTL_S = 24 * 3600.0  # the bucket's entry lifetime: a day after the last write
RENEW_AFTER_S = 3600.0  # a record used this long after its last write is written again
MAX_SEQUENCES_PER_REQUEST = 4096  # distinct sequence ids one request may name
MAX_SEQUENCE_ID_CHARS = 200
_SEQUENCE_ID_RE = re.compile(r"[A-Za-z0-9_=.-]+")  # what KV keys allow, and what we hand out

# The cookbook's text (tinker_cookbook.rl.train), so users meet the message they know.
MISSING_PROVENANCE = (
    "loss_fn='stable_reinforce' needs provenance on every datum. A datum has none when one of"
    " its actions lacks a Tinker sequence_id (TokensWithLogprobs.sequence_id, which a custom"
    " TokenCompleter must set) or when none of its targets is a sampled token. Fix the data or"
    " train with a different loss_fn."
)


def sequence_id(request_id: str, index: int) -> str:
    """The `SampledSequence.sequence_id` of sample `index` of an `asample` request."""
    return f"{request_id}-seq{index}"


def sequence_key(sequence: str) -> str:
    """KV key of a sequence's record in `tw_stability`."""
    return f"seq.{sequence}"


class StabilityRecord(msgspec.Struct, frozen=True):
    """What the sampler recorded of one sampled sequence (tokens int32, logprobs float32, LE)."""

    sequence_id: str
    tenant_id: str
    sampling_session_id: str
    prompt_length: int
    tokens: bytes
    logprobs: bytes
    written_at: float = 0.0


class SpanSlice(msgspec.Struct, frozen=True, array_like=True):
    """The recorded run behind a datum's sampled span: target positions `[position, position +
    n)` of datum `datum` were sampled as `tokens` with the sampler log-probs `logprobs`."""

    datum: int
    position: int
    sequence_id: str
    tokens: bytes  # int32 LE
    logprobs: bytes  # float32 LE


_record_encoder = msgspec.msgpack.Encoder()
_record_decoder = msgspec.msgpack.Decoder(StabilityRecord)
_slices_decoder = msgspec.msgpack.Decoder(list[SpanSlice])


def encode_record(record: StabilityRecord) -> bytes:
    return _record_encoder.encode(record)


def decode_record(data: bytes) -> StabilityRecord:
    return _record_decoder.decode(data)


def encode_slices(slices: Sequence[SpanSlice]) -> bytes:
    return _record_encoder.encode(list(slices))


def decode_slices(data: bytes) -> list[SpanSlice]:
    return _slices_decoder.decode(data) if data else []


def new_record(
    *,
    sequence: str,
    tenant_id: str,
    sampling_session_id: str,
    prompt_length: int,
    tokens: Sequence[int],
    logprobs: Sequence[float],
    written_at: float,
) -> StabilityRecord:
    """A sampler's record of one sequence (tokens and log-probs of equal length)."""
    if len(tokens) != len(logprobs):
        raise ValueError(f"{len(tokens)} tokens but {len(logprobs)} logprobs")
    return StabilityRecord(
        sequence_id=sequence,
        tenant_id=tenant_id,
        sampling_session_id=sampling_session_id,
        prompt_length=prompt_length,
        tokens=np.asarray(tokens, dtype="<i4").tobytes(),
        logprobs=np.asarray(logprobs, dtype="<f4").tobytes(),
        written_at=written_at,
    )


@dataclass(frozen=True)
class Span:
    """One provenance span of a datum's targets."""

    kind: Literal["prompt", "sampled"]
    sequence_id: str
    offset: int
    length: int


def datum_spans(body: bytes) -> list[list[Span]]:
    """Each datum's `loss_fn_input_spans`, checked: ids well formed, numbers in range, runs
    tiling exactly the datum's targets (one per `model_input` token). A datum without spans,
    or whose spans name no sampled token, gets the cookbook's message."""
    try:
        msg = pb.ForwardBackwardRequest.FromString(body)
    except DecodeError as exc:
        raise UserError(
            f"forward_backward body is not a valid ForwardBackwardRequest: {exc}"
        ) from None
    result: list[list[Span]] = []
    named: set[str] = set()
    for i, datum in enumerate(msg.data):
        n_targets = sum(
            len(chunk.encoded_text.tokens) // 4
            for chunk in datum.model_input
            if chunk.WhichOneof("chunk") == "encoded_text"
        )
        if not datum.loss_fn_input_spans:
            raise UserError(f"datums[{i}].loss_fn_input_spans: missing. {MISSING_PROVENANCE}")
        if len(datum.loss_fn_input_spans) > n_targets + 16:
            raise UserError(
                f"datums[{i}].loss_fn_input_spans: {len(datum.loss_fn_input_spans)} spans for"
                f" {n_targets} targets; spans tile the targets, so at most one per position"
            )
        spans: list[Span] = []
        covered = 0
        for j, wire in enumerate(datum.loss_fn_input_spans):
            where = f"datums[{i}].loss_fn_input_spans[{j}]"
            arm = wire.WhichOneof("span")
            if arm is None:
                raise UserError(f"{where}: neither prompt_tokens nor sampled_tokens")
            run = wire.prompt_tokens if arm == "prompt_tokens" else wire.sampled_tokens
            _check_sequence_id(where, run.sequence_id)
            if not 0 <= run.offset < 2**31 or not 0 <= run.length < 2**31:
                raise UserError(
                    f"{where}: offset {run.offset} and length {run.length} must be in [0, 2**31)"
                )
            covered += run.length
            kind: Literal["prompt", "sampled"] = "prompt" if arm == "prompt_tokens" else "sampled"
            spans.append(Span(kind, run.sequence_id, int(run.offset), int(run.length)))
            named.add(run.sequence_id)
        if covered != n_targets:
            raise UserError(
                f"datums[{i}].loss_fn_input_spans: the spans cover {covered} positions but the"
                f" datum has {n_targets} targets; spans must tile target_tokens exactly"
            )
        if not any(span.kind == "sampled" and span.length for span in spans):
            raise UserError(
                f"datums[{i}].loss_fn_input_spans: no sampled token. {MISSING_PROVENANCE}"
            )
        result.append(spans)
    if len(named) > MAX_SEQUENCES_PER_REQUEST:
        raise UserError(
            f"loss_fn_input_spans: {len(named)} distinct sequences in one request; at most"
            f" {MAX_SEQUENCES_PER_REQUEST} (send fewer datums per request)"
        )
    return result


def _check_sequence_id(where: str, value: str) -> None:
    if not value or len(value) > MAX_SEQUENCE_ID_CHARS or _SEQUENCE_ID_RE.fullmatch(value) is None:
        raise UserError(
            f"{where}: sequence_id {value[:MAX_SEQUENCE_ID_CHARS]!r} is not a sequence id this"
            " server handed out (SampledSequence.sequence_id)"
        )


def referenced(spans: Sequence[Sequence[Span]]) -> list[str]:
    """The distinct sequence ids the spans name, in first-use order."""
    return list(dict.fromkeys(span.sequence_id for datum in spans for span in datum))


def slices_for(
    spans: Sequence[Sequence[Span]],
    records: Mapping[str, StabilityRecord | None],
    tenant_id: str,
) -> list[SpanSlice]:
    """The recorded runs behind every sampled span; a missing record, another tenant's, or a
    run outside its sequence is a `UserError` (the same text for missing and foreign, so a
    tenant learns nothing of another's ids)."""
    slices: list[SpanSlice] = []
    for i, datum in enumerate(spans):
        position = 0
        for j, span in enumerate(datum):
            where = f"datums[{i}].loss_fn_input_spans[{j}]"
            record = records.get(span.sequence_id)
            if record is None or record.tenant_id != tenant_id:
                raise UserError(
                    f"{where}: sequence_id {span.sequence_id!r} has no stability record: sample"
                    " with a client made with record_stability_info=True; records are kept for"
                    " a day after their last use"
                )
            size = (len(record.tokens) // 4) if span.kind == "sampled" else record.prompt_length
            if span.offset + span.length > size:
                raise UserError(
                    f"{where}: positions {span.offset}..{span.offset + span.length} are outside"
                    f" the {size} {span.kind} tokens of sequence {span.sequence_id!r}"
                )
            if span.kind == "sampled" and span.length:
                lo, hi = 4 * span.offset, 4 * (span.offset + span.length)
                slices.append(
                    SpanSlice(
                        datum=i,
                        position=position,
                        sequence_id=span.sequence_id,
                        tokens=record.tokens[lo:hi],
                        logprobs=record.logprobs[lo:hi],
                    )
                )
            position += span.length
    return slices


def apply_slices(request: FwdBwdRequest, slices: Sequence[SpanSlice]) -> None:
    """Put the recorded sampler log-probs in as each datum's `logprobs` input (0 where no
    sampled span covers a position), after checking the slices' tokens against
    `target_tokens` and that advantages are zero off the sampled positions."""
    by_datum: dict[int, list[SpanSlice]] = {}
    for piece in slices:
        by_datum.setdefault(piece.datum, []).append(piece)
    if not slices or max(by_datum) >= len(request.datums) or min(by_datum) < 0:
        raise UserError(f"{LOSS_NAME}: the request's provenance does not match its datums")
    for i, datum in enumerate(request.datums):
        prefix = f"datums[{i}].loss_fn_inputs"
        targets = datum.inputs.get("target_tokens")
        advantages = datum.inputs.get("advantages")
        n = int(datum.tokens.shape[0])
        if targets is None or targets.shape != (n,):
            raise UserError(f"{prefix}.target_tokens ({LOSS_NAME}): one token id per position")
        if advantages is None or advantages.shape != (n,):
            raise UserError(f"{prefix}.advantages ({LOSS_NAME}): one value per position")
        behaviour = np.zeros(n, dtype=np.float32)
        sampled = np.zeros(n, dtype=bool)
        for piece in by_datum.get(i, []):
            tokens = np.frombuffer(piece.tokens, dtype="<i4")
            stop = piece.position + tokens.shape[0]
            if stop > n or len(piece.logprobs) != len(piece.tokens):
                raise UserError(f"{prefix}: provenance outside the datum's {n} positions")
            if not np.array_equal(targets[piece.position : stop], tokens):
                raise UserError(
                    f"{prefix}.target_tokens ({LOSS_NAME}): positions {piece.position}..{stop}"
                    f" differ from the tokens sequence {piece.sequence_id!r} sampled"
                )
            behaviour[piece.position : stop] = np.frombuffer(piece.logprobs, dtype="<f4")
            sampled[piece.position : stop] = True
        stray = np.flatnonzero((advantages != 0) & ~sampled)
        if stray.size:
            raise UserError(
                f"{prefix}.advantages ({LOSS_NAME}): non-zero at position {stray[0]}, which is"
                " not a sampled token; stable_reinforce only accepts non-zero advantages on"
                " sampled tokens"
            )
        datum.inputs["logprobs"] = behaviour

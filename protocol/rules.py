"""Validation rules for fields a client controls, each written once and used by every process.

The gateway applies them at the edge (a 400 naming the field) and a worker applies the same
function again where it must not trust its input; nobody re-states a rule. Every function is
pure: it returns the value (possibly normalised) or raises a `UserError` whose one-line message
names the field and the accepted form.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

import msgspec

from protocol.api import AdamParams, LoraConfig
from protocol.errors import UserError

# -- ids ----------------------------------------------------------------------------------------

MAX_ID_CHARS = 128
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")


def check_id(field: str, value: str) -> str:
    """An id the client sends back to us (session, model, sampler, request, run).

    Every id we hand out is built from `[A-Za-z0-9._:-]`; anything else can only be a typo or an
    attack, and must not reach a KV key, a subject or a path.
    """
    if not value:
        raise UserError(f"{field}: empty; expected an id this server returned")
    if len(value) > MAX_ID_CHARS or not _ID_RE.fullmatch(value):
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise UserError(
            f"{field}: {shown!r} is not a valid id (at most {MAX_ID_CHARS} characters of"
            " A-Z a-z 0-9 . _ : -)"
        )
    return value


_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9_-]+")


def check_request_id(field: str, value: str) -> str:
    """A request id: what `new_request_id` makes, `req-<hex>-<kind>`; it is used as a KV key."""
    if not value or len(value) > MAX_ID_CHARS or not _REQUEST_ID_RE.fullmatch(value):
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise UserError(
            f"{field}: {shown!r} is not a request id this server returned (at most"
            f" {MAX_ID_CHARS} characters of A-Z a-z 0-9 _ -)"
        )
    return value


_TENANT_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")


def check_tenant_name(field: str, name: str) -> str:
    """A tenant's name: its id everywhere (records, keys, metrics labels)."""
    if not _TENANT_RE.fullmatch(name):
        shown = name if len(name) <= 40 else name[:40] + "..."
        raise UserError(
            f"{field}: {shown!r} is not a valid tenant name (1 to 63 characters of a-z 0-9 _ -,"
            " starting with a letter or digit)"
        )
    return name


def check_label(field: str, label: str) -> str:
    """A short free-text label (an API key's), printable, at most 200 characters."""
    if len(label) > 200 or not label.isprintable():
        raise UserError(f"{field}: at most 200 printable characters")
    return label


# -- user metadata ------------------------------------------------------------------------------

# Counted in UTF-8 bytes, not characters: a record is stored and listed as bytes, and every
# listing and sweep reads all of a tenant's records. Per record (a session's tags and metadata
# together, a run's or a checkpoint's metadata) at most 16 KiB; characters would let four times
# that through.
MAX_METADATA_ENTRIES = 64
MAX_METADATA_ENTRY_BYTES = 1024
MAX_METADATA_BYTES = 16 * 1024
METADATA_RULE = (
    f"at most {MAX_METADATA_ENTRIES} entries, each key, value or tag at most"
    f" {MAX_METADATA_ENTRY_BYTES} bytes of UTF-8, {MAX_METADATA_BYTES // 1024} KiB in all"
)


def check_user_metadata(field: str, metadata: dict[str, Any] | None) -> dict[str, str]:
    """Free-form labels, stored and listed as strings (the SDK reads them back as `str`).

    The SDK lets a client send any JSON value; a non-string is kept as its JSON text, so
    `{"epoch": 3}` lists as `{"epoch": "3"}`. Bounded in entries and UTF-8 bytes
    (`METADATA_RULE`).
    """
    metadata = metadata or {}
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise UserError(f"{field}: {len(metadata)} entries; {METADATA_RULE}")
    stored: dict[str, str] = {}
    for key, value in metadata.items():
        text = value if isinstance(value, str) else _JSON.encode(value).decode()
        _check_entry(field, "key", key, key)
        _check_entry(field, "the value of", key, text)
        stored[key] = text
    _check_total(field, _utf8_bytes(stored.keys()) + _utf8_bytes(stored.values()))
    return stored


_JSON = msgspec.json.Encoder()


def check_tags(field: str, tags: list[str]) -> list[str]:
    """A session's tags: a few short labels, bounded as metadata is."""
    if len(tags) > MAX_METADATA_ENTRIES:
        raise UserError(f"{field}: {len(tags)} tags; {METADATA_RULE}")
    for tag in tags:
        _check_entry(field, "tag", tag, tag)
    _check_total(field, _utf8_bytes(tags))
    return list(tags)


def check_session_labels(
    tags: list[str], metadata: dict[str, Any] | None
) -> tuple[list[str], dict[str, str]]:
    """A session's tags and user metadata, which share one record and so one byte budget."""
    checked_tags = check_tags("tags", tags)
    stored = check_user_metadata("user_metadata", metadata)
    total_bytes = (
        _utf8_bytes(checked_tags) + _utf8_bytes(stored.keys()) + _utf8_bytes(stored.values())
    )
    _check_total("tags and user_metadata", total_bytes)
    return checked_tags, stored


def _utf8_bytes(texts: Iterable[str]) -> int:
    return sum(len(text.encode()) for text in texts)


def _check_entry(field: str, what: str, name: str, text: str) -> None:
    size_bytes = len(text.encode())
    if size_bytes > MAX_METADATA_ENTRY_BYTES:
        shown = name if len(name) <= 40 else name[:40] + "..."
        raise UserError(f"{field}: {what} {shown!r} is {size_bytes} bytes; {METADATA_RULE}")


def _check_total(field: str, total_bytes: int) -> None:
    if total_bytes > MAX_METADATA_BYTES:
        raise UserError(f"{field}: {total_bytes} bytes in all; {METADATA_RULE}")


# -- checkpoint names ---------------------------------------------------------------------------

MAX_NAME_BYTES = 128
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._=+@-]*")
NAME_RULE = (
    f"1 to {MAX_NAME_BYTES} characters of A-Z a-z 0-9 _ . = + @ -, not starting with '.' or '-'"
)


def check_checkpoint_name(field: str, name: str) -> str:
    """A checkpoint name becomes one directory name: a fixed safe alphabet, a byte cap."""
    if not name:
        raise UserError(f"{field}: empty; a checkpoint needs a name ({NAME_RULE})")
    if len(name.encode()) > MAX_NAME_BYTES or not _NAME_RE.fullmatch(name):
        shown = name if len(name) <= 40 else name[:40] + "..."
        raise UserError(f"{field}: {shown!r} is not a valid checkpoint name ({NAME_RULE})")
    return name


# -- checkpoint lifetimes -----------------------------------------------------------------------

MAX_TTL_S = 10 * 365 * 24 * 3600


def check_ttl_seconds(field: str, ttl_seconds: int | None) -> int | None:
    """A checkpoint's time to live in seconds, up to ten years; None means it never expires."""
    if ttl_seconds is not None and not 1 <= ttl_seconds <= MAX_TTL_S:
        raise UserError(f"{field}: {ttl_seconds} is out of range 1..{MAX_TTL_S} (or null)")
    return ttl_seconds


# -- sequence numbers ---------------------------------------------------------------------------

# The SDK numbers a model's calls 1, 2, 3, ... (creation is 0). A seq far ahead of the highest
# one seen could only wedge the model, so the gateway refuses it.
MAX_SEQ_ID = 2**31 - 2
MAX_SEQ_AHEAD = 65536


def check_seq_id(field: str, seq_id: int | None, *, first: int = 1) -> int:
    """A call's `seq_id` in the SDK's range: a training model's calls count from 1, a sampling
    client's from 0 (`first`)."""
    if seq_id is None:
        raise UserError(f"{field}: missing; every call on a training model carries a seq_id")
    if not first <= seq_id <= MAX_SEQ_ID:
        raise UserError(f"{field}: {seq_id} is out of range {first}..{MAX_SEQ_ID}")
    return seq_id


def check_seq_ahead(field: str, seq_id: int, highest_seen: int) -> None:
    """Refuse a seq so far past the model's highest one that nothing could ever precede it."""
    if seq_id > highest_seen + MAX_SEQ_AHEAD:
        raise UserError(
            f"{field}: {seq_id} is more than {MAX_SEQ_AHEAD} ahead of this model's latest call"
            f" ({highest_seen}); seq_ids count the model's calls from 1"
        )


# -- hyper-parameters ---------------------------------------------------------------------------


def check_adam(params: AdamParams) -> AdamParams:
    """AdamW hyper-parameters AdamW can use; the message names the field.

    Only values no AdamW step can use are refused here. A learning rate large enough to overflow
    is a finite number the step itself detects; it fails that tenant's step alone.
    """
    for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
        value = getattr(params, name)
        if not math.isfinite(value):
            raise UserError(f"adam_params.{name}: {value} is not a finite number")
    if params.learning_rate < 0:
        raise UserError(f"adam_params.learning_rate: {params.learning_rate} < 0")
    for name in ("beta1", "beta2"):
        value = getattr(params, name)
        if not 0.0 <= value < 1.0:
            raise UserError(f"adam_params.{name}: {value} outside [0, 1)")
    if params.eps <= 0:
        # eps = 0 would turn the 0/0 of zero padding into NaN.
        raise UserError(f"adam_params.eps: {params.eps} must be > 0")
    if params.weight_decay < 0:
        raise UserError(f"adam_params.weight_decay: {params.weight_decay} < 0")
    if params.grad_clip_norm < 0:
        raise UserError(f"adam_params.grad_clip_norm: {params.grad_clip_norm} < 0 (0 = off)")
    return params


# -- base models --------------------------------------------------------------------------------

# Tinker base models whose family (`model_type`) has no model class in the transformers this
# service runs (5.19): no worker can load them, so a request naming one is refused with its family
# rather than with the answer for a model that is merely not served here. A family leaves this
# table when a transformers release the workers use gains its class.
UNBUILDABLE_FAMILIES: dict[str, str] = {"moonshotai/Kimi-K3.1-Pro": "kimi_k3"}


def check_buildable(field: str, base_model: str, served: Iterable[str]) -> None:
    """Refuse a base model of a family we have no implementation of, naming it and its family;
    `served` (the base models served now) is listed as the alternatives."""
    family = UNBUILDABLE_FAMILIES.get(base_model)
    if family is not None:
        names = ", ".join(sorted(served)) or "none"
        raise UserError(
            f"{field}: {base_model!r} is of the {family} family, which has no implementation"
            f" here (the installed transformers has no {family} model class), so it cannot be"
            f" served; served base models: {names}",
            code="unsupported_family",
        )


def check_lora_config(config: LoraConfig, max_rank: int | None) -> LoraConfig:
    """An adapter shape a worker with adapters up to `max_rank` can hold (None: rank >= 1)."""
    if config.rank < 1 or (max_rank is not None and config.rank > max_rank):
        limit = max_rank if max_rank is not None else "the worker's max rank"
        raise UserError(f"lora_config.rank: {config.rank} is out of range 1..{limit}")
    if not (config.train_attn or config.train_mlp or config.train_unembed):
        raise UserError(
            "lora_config: at least one of train_attn, train_mlp, train_unembed must be true"
        )
    if config.seed is not None and not -(2**63) <= config.seed < 2**64:
        raise UserError(f"lora_config.seed: {config.seed} outside the 64-bit range")
    return config

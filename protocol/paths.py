"""`tinker://<run_id>/<kind>/<name>` checkpoint paths: parse and build, with clear errors.

`twinkle://` is read as the same path (Twinkle's clients name checkpoints so); what the server
writes is always `tinker://`, and a checkpoint's JSON carries both forms.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import msgspec

from protocol import rules
from protocol.errors import UserError

# `external_weights`: an adapter exported for use elsewhere (`save_weights_external`), PEFT layout
CheckpointKind = Literal["weights", "sampler_weights", "external_weights"]
_KINDS: tuple[str, ...] = ("weights", "sampler_weights", "external_weights")
SCHEME = "tinker://"
ALIAS_SCHEME = "twinkle://"
_KIND_OF: dict[str, CheckpointKind] = {
    "weights": "weights",
    "sampler_weights": "sampler_weights",
    "external_weights": "external_weights",
}


class TinkerPath(msgspec.Struct, frozen=True):
    """A parsed checkpoint path; `checkpoint_id` is `<kind>/<name>` as the REST API names it."""

    run_id: str
    kind: CheckpointKind
    name: str

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"

    def __str__(self) -> str:
        return f"{SCHEME}{self.run_id}/{self.kind}/{self.name}"

    @property
    def twinkle_path(self) -> str:
        return f"{ALIAS_SCHEME}{self.run_id}/{self.kind}/{self.name}"


def parse_path(path: str, field: str = "path") -> TinkerPath:
    """Parse a `tinker://` (or `twinkle://`) path; anything else is a user error naming the expected form.

    The run id and the name are checked with the same rules as when they were made, so a parsed
    path is always safe to turn into a KV key or a directory.
    """
    scheme = next((s for s in (SCHEME, ALIAS_SCHEME) if path.startswith(s)), None)
    if scheme is None:
        shown = path if len(path) <= 60 else path[:60] + "..."
        raise UserError(
            f"{field}: {shown!r} is not a tinker:// path (tinker://<run_id>/weights/<name>)"
        )
    parts = path[len(scheme) :].split("/")
    if len(parts) != 3 or parts[1] not in _KINDS:
        shown = path if len(path) <= 60 else path[:60] + "..."
        raise UserError(
            f"{field}: {shown!r} is malformed: expected"
            " tinker://<run_id>/<weights|sampler_weights|external_weights>/<name>"
        )
    run_id = rules.check_id(f"{field} run id", parts[0])
    name = rules.check_checkpoint_name(f"{field} name", parts[2])
    kind: CheckpointKind = _KIND_OF[parts[1]]
    return TinkerPath(run_id=run_id, kind=kind, name=name)


# -- where checkpoint files live ---------------------------------------------------------------

CONTENT_ID_FILE = "content_id"
_VERSIONS = ".versions"  # names never start with '.', so this never collides with one
# A checkpoint is a PEFT folder (what `peft.PeftModel.from_pretrained` and vLLM load): these two
# files; a `weights` checkpoint adds the AdamW moments. An adapter import uploads the same two,
# as multipart parts of these names.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
OPTIMIZER_STATE = "optimizer.safetensors"


def checkpoint_dir(root: Path, path: TinkerPath) -> Path:
    """The current content of a checkpoint: `<root>/<run_id>/<kind>/<name>/` (PEFT layout)."""
    return root / path.run_id / path.kind / path.name


def version_dir(root: Path, path: TinkerPath, content_id: str) -> Path:
    """Where the content `content_id` of a name lives once an overwrite has replaced it."""
    return root / path.run_id / path.kind / _VERSIONS / path.name / content_id


# -- keys in an artifact store (`workers.artifacts`): content-addressed, never overwritten ------

STATE_PREFIX = ".state"  # starts with '.', which no checkpoint kind or name does
# uploaded last under a prefix: each file's size and sha256 (`{"files": {name: {...}}}`)
STORE_MANIFEST = "MANIFEST.json"


def checkpoint_key(path: TinkerPath, content_id: str) -> str:
    """The store prefix of one content of a checkpoint: `<run_id>/<kind>/<name>/<content_id>`."""
    rules.check_id("content id", content_id)
    return f"{path.run_id}/{path.kind}/{path.name}/{content_id}"


def checkpoint_name_key(path: TinkerPath) -> str:
    """The store prefix holding every content a checkpoint name ever had."""
    return f"{path.run_id}/{path.kind}/{path.name}"


def snapshot_prefix(run_id: str) -> str:
    """The store prefix of a model's state snapshots."""
    return f"{rules.check_id('run id', run_id)}/{STATE_PREFIX}"


def snapshot_key(run_id: str, seq_id: int, unique: str) -> str:
    """One snapshot's prefix: `<run_id>/.state/<seq>-<unique>` (the seq first, for pruning)."""
    return f"{snapshot_prefix(run_id)}/{seq_id}-{rules.check_id('snapshot id', unique)}"


def snapshot_seq(key: str) -> int | None:
    """The seq of a snapshot prefix made by `snapshot_key`, None for anything else."""
    digits = key.rsplit("/", 1)[-1].split("-", 1)[0]
    return int(digits) if digits.isdigit() else None


def parse_store_url(url: str) -> tuple[str, str]:
    """(bucket, key prefix) of `s3://BUCKET[/PREFIX]`; `ValueError` naming what is wrong."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
        raise ValueError(f"artifact store {url!r} is not s3://BUCKET/PREFIX")
    prefix = parts.path.strip("/")
    if any(segment in ("", ".", "..") for segment in prefix.split("/")) and prefix:
        raise ValueError(f"artifact store {url!r}: the prefix has an empty or dot segment")
    return parts.netloc, prefix

"""`tinker://<run_id>/<kind>/<name>` checkpoint paths: parse and build, with clear errors."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

from protocol import rules
from protocol.errors import UserError

# `external_weights`: an adapter exported for use elsewhere (`save_weights_external`), PEFT layout
CheckpointKind = Literal["weights", "sampler_weights", "external_weights"]
_KINDS: tuple[str, ...] = ("weights", "sampler_weights", "external_weights")
SCHEME = "tinker://"
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


def parse_path(path: str, field: str = "path") -> TinkerPath:
    """Parse a `tinker://` path; anything else is a user error naming the expected form.

    The run id and the name are checked with the same rules as when they were made, so a parsed
    path is always safe to turn into a KV key or a directory.
    """
    if not path.startswith(SCHEME):
        shown = path if len(path) <= 60 else path[:60] + "..."
        raise UserError(
            f"{field}: {shown!r} is not a tinker:// path (tinker://<run_id>/weights/<name>)"
        )
    parts = path[len(SCHEME) :].split("/")
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


def checkpoint_dir(root: Path, path: TinkerPath) -> Path:
    """The current content of a checkpoint: `<root>/<run_id>/<kind>/<name>/` (PEFT layout)."""
    return root / path.run_id / path.kind / path.name


def version_dir(root: Path, path: TinkerPath, content_id: str) -> Path:
    """Where the content `content_id` of a name lives once an overwrite has replaced it."""
    return root / path.run_id / path.kind / _VERSIONS / path.name / content_id

"""`tinker://<run_id>/<kind>/<name>` checkpoint paths: parse and build, with clear errors."""

from __future__ import annotations

from typing import Literal

import msgspec

from protocol.errors import UserError

CheckpointKind = Literal["weights", "sampler_weights"]
_KINDS: tuple[str, ...] = ("weights", "sampler_weights")
SCHEME = "tinker://"


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


def parse_path(path: str) -> TinkerPath:
    """Parse a `tinker://` path; anything else is a user error naming the expected form."""
    if not path.startswith(SCHEME):
        raise UserError(f"path {path!r} is not a tinker:// path (tinker://<run_id>/weights/<name>)")
    parts = path[len(SCHEME) :].split("/")
    if len(parts) != 3 or not all(parts) or parts[1] not in _KINDS:
        raise UserError(
            f"path {path!r} is malformed: expected tinker://<run_id>/<weights|sampler_weights>/<name>"
        )
    kind: CheckpointKind = "weights" if parts[1] == "weights" else "sampler_weights"
    return TinkerPath(run_id=parts[0], kind=kind, name=parts[2])


def check_name(name: str) -> str:
    """A checkpoint name must be one path segment of safe characters."""
    if not name or "/" in name or name in (".", "..") or len(name) > 200:
        raise UserError(
            f"checkpoint name {name!r} is invalid: one path segment, at most 200 characters"
        )
    return name

"""Checkpoint files as the gateway touches them: deletion, hard-linked copies, the files a
download serves, and a tar stream of them.

The workers write checkpoints under the shared `checkpoint_root` (`protocol.paths` has the
layout), or into an artifact store (`store_files`, for records with a `store_key`); the gateway
deletes them (REST DELETE and the TTL sweeper), copies them (`copy_weights`) and serves them
(signed downloads).

Invariants:
- Paths are built from a parsed `TinkerPath` (ids and names checked by `protocol.rules`), never
  from a stored directory string, so nothing outside the root is touched.
- A deletion removes the current content and every older content of the name (`.versions`);
  files go before the record, so a retried or interrupted delete still finishes the job.
- A copy hard-links the files (no bytes duplicated, and deleting either side leaves the other
  whole: workers replace files by rename, never write into them).
- The synchronous functions do blocking file I/O: call them through `asyncio.to_thread`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from protocol import paths
from protocol.errors import ServerError
from protocol.paths import CONTENT_ID_FILE, TinkerPath
from protocol.records import CheckpointRecord
from twinkle_async.gateway.store_files import StoreFiles
from twinkle_async.registry import Registry

log = logging.getLogger(__name__)

_TAR_BLOCK = 512
TAR_END = b"\0" * (2 * _TAR_BLOCK)  # two zero blocks close a tar


def versions_dir(root: Path, path: TinkerPath) -> Path:
    """Where the older contents of a name live (one subdirectory per content id)."""
    return paths.version_dir(root, path, "-").parent


def downloadable_files(directory: Path) -> list[Path]:
    """The files a download of a checkpoint serves: everything but our bookkeeping."""
    if not directory.is_dir():
        return []
    return sorted(
        entry
        for entry in directory.iterdir()
        if entry.is_file() and entry.name != CONTENT_ID_FILE and not entry.name.endswith(".tmp")
    )


def delete_files(root: Path, path: TinkerPath) -> None:
    """Remove a checkpoint's current content and its older contents; absent ones are fine."""
    for directory in (paths.checkpoint_dir(root, path), versions_dir(root, path)):
        shutil.rmtree(directory, ignore_errors=True)
        if directory.exists():
            raise OSError(f"could not delete {directory}")


def link_copy(source: Path, target: Path) -> None:
    """Make `target` a copy of the files of `source` by hard links (a plain copy across
    filesystems). A `target` left by an interrupted copy is replaced."""
    files = [entry for entry in source.iterdir() if entry.is_file()] if source.is_dir() else []
    if not files:
        raise FileNotFoundError(f"no checkpoint files in {source}")
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for entry in files:
        try:
            os.link(entry, target / entry.name)
        except OSError:
            shutil.copy2(entry, target / entry.name)


async def remove_checkpoint(
    registry: Registry, root: Path | None, store: StoreFiles | None, ckpt: CheckpointRecord
) -> None:
    """Delete a checkpoint: its files (in the artifact store, or under the root when this
    gateway knows it), then its record. A stored checkpoint on a gateway without the store
    is refused: its record must not go while its objects stay (they would block a new save
    of the name)."""
    path = paths.parse_path(ckpt.path)
    if ckpt.store_key:
        if store is None:
            raise ServerError(
                f"checkpoint {ckpt.path} is in an artifact store this gateway has not been"
                " given (--artifact-store)",
                code="no_checkpoint_store",
                status=501,
            )
        await store.delete_tree(paths.checkpoint_name_key(path))
    elif root is not None:
        await asyncio.to_thread(delete_files, root, path)
    else:
        log.warning("no checkpoint root configured: the files of %s stay on disk", ckpt.path)
    await registry.delete_checkpoint_record(ckpt.run_id, ckpt.checkpoint_id)
    log.info("deleted checkpoint %s of tenant %s", ckpt.path, ckpt.tenant_id)


# -- a tar, streamed --------------------------------------------------------------------------


@dataclass
class TarEntry:
    """One file of an archive: its flat name, size and time."""

    name: str
    size: int
    mtime: int

    def header(self) -> bytes:
        info = tarfile.TarInfo(self.name)
        info.size = self.size
        info.mtime = self.mtime
        info.mode = 0o644
        return info.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8", errors="strict")

    def padding(self) -> bytes:
        return b"\0" * (-self.size % _TAR_BLOCK)


@dataclass
class TarMember(TarEntry):
    """A local file of an archive, opened before the first byte is sent: a concurrent
    overwrite renames the directory away, and open handles keep reading the content that was
    signed."""

    handle: BinaryIO


def open_members(directory: Path) -> list[TarMember]:
    """Open every downloadable file of a checkpoint, flat (it extracts into the folder you pick)."""
    members: list[TarMember] = []
    try:
        for entry in downloadable_files(directory):
            handle = open(entry, "rb")  # noqa: SIM115 - closed by the caller, after streaming
            stat = os.fstat(handle.fileno())
            members.append(TarMember(entry.name, stat.st_size, int(stat.st_mtime), handle))
    except OSError:
        close_members(members)
        raise
    return members


def close_members(members: list[TarMember]) -> None:
    for member in members:
        member.handle.close()


def tar_size(members: Sequence[TarEntry]) -> int:
    """The exact length of the tar `members` make: headers, data, padding and the end blocks."""
    return sum(_TAR_BLOCK + m.size + len(m.padding()) for m in members) + len(TAR_END)

"""The artifact store of a worker: checkpoint and snapshot files in an S3-compatible object store,
so that workers and samplers on different hosts share them without a shared disk.

Job: upload a directory of files under a key prefix, and give back a local copy of a prefix's
files, through a cache. Without `--artifact-store` a worker keeps today's local layout under
`<data-dir>/checkpoints` (`protocol.paths`), and none of this runs.

Keys (`protocol.paths`: `checkpoint_key`, `snapshot_key`) are content-addressed and never
overwritten: a checkpoint's content lives under `<run>/<kind>/<name>/<content_id>/`, a snapshot
under `<run>/.state/<seq>-<id>/`. The files go up first, then the KV record that names the prefix
(`store_key`, with the bytes and a sha256 of the manifest) is written: the record is the commit
point, so a reader never follows a record to a prefix whose files are not all there.

Invariants:
- A prefix's content never changes once its record exists, so a cached copy is valid for ever;
  the cache (`<data-dir>/artifact-cache`) is keyed by prefix and bounded in bytes, the least
  recently used copies removed first.
- Each upload writes `MANIFEST.json` last (every file's size and sha256); a download checks each
  file against it, so a truncated or foreign object is an error, not a silently wrong adapter.
- Calls are blocking (obstore's sync API, which retries transient HTTP errors itself): they run
  in the worker's executor threads, as the file I/O they replace did.

Settings: the store URL `s3://BUCKET/PREFIX`; endpoint, region and credentials from the standard
`AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` (an `http://`
endpoint is allowed: a store on loopback or a private network).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import obstore
from obstore.store import S3Store

from protocol.errors import ServerError
from protocol.paths import STORE_MANIFEST, parse_store_url

log = logging.getLogger(__name__)

MANIFEST = STORE_MANIFEST
DEFAULT_CACHE_BYTES = 16 * 1024**3
_CHUNK_BYTES = 8 * 1024 * 1024  # multipart part size; files above it go up in parts


@dataclass(frozen=True)
class Uploaded:
    """What an upload put under its prefix: the bytes of its files and its manifest's sha256."""

    size_bytes: int
    sha256: str


class ArtifactStore:
    """An S3 bucket (under a prefix) plus the local cache of what was read from it."""

    def __init__(self, url: str, cache_dir: Path, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        bucket, prefix = parse_store_url(url)
        endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
        self.url = url
        self.store = S3Store(
            bucket,
            prefix=prefix or None,
            client_options={"allow_http": endpoint.startswith("http://")},
        )
        self.cache_dir = cache_dir
        self.cache_bytes = cache_bytes
        self._lock = threading.Lock()  # one cache bookkeeping at a time (executor threads)

    # -- writing --------------------------------------------------------------------------------

    def upload(self, prefix: str, directory: Path) -> Uploaded:
        """Every file of `directory` (not recursive) under `prefix/`, then the manifest."""
        files: dict[str, dict[str, int | str]] = {}
        for path in sorted(p for p in directory.iterdir() if p.is_file()):
            if path.name == MANIFEST or path.name.endswith(".tmp"):
                continue
            files[path.name] = {"size": path.stat().st_size, "sha256": _sha256(path)}
            obstore.put(self.store, f"{prefix}/{path.name}", path, chunk_size=_CHUNK_BYTES)
        manifest = json.dumps({"files": files}, sort_keys=True).encode()
        obstore.put(self.store, f"{prefix}/{MANIFEST}", manifest)
        size = sum(int(entry["size"]) for entry in files.values())
        return Uploaded(size_bytes=size, sha256=hashlib.sha256(manifest).hexdigest())

    def delete(self, prefix: str) -> None:
        """Remove every object under `prefix/`."""
        paths = [meta["path"] for batch in obstore.list(self.store, f"{prefix}/") for meta in batch]
        if paths:
            obstore.delete(self.store, paths)

    def exists(self, prefix: str) -> bool:
        """Whether any object lies under `prefix/`."""
        for batch in obstore.list(self.store, f"{prefix}/", chunk_size=1):
            if batch:
                return True
        return False

    def children(self, prefix: str) -> list[str]:
        """The immediate sub-prefixes of `prefix/` (their full keys)."""
        listed = obstore.list_with_delimiter(self.store, f"{prefix}/")
        return sorted(str(common).rstrip("/") for common in listed["common_prefixes"])

    # -- reading --------------------------------------------------------------------------------

    def download(self, prefix: str) -> Path:
        """A local copy of `prefix`'s files (from the cache when there), checked against its
        manifest; `ServerError` if the prefix is missing or a file does not match."""
        target = self.cache_dir / _cache_name(prefix)
        if (target / MANIFEST).is_file():
            os.utime(target)  # recently used
            return target
        staging = target.with_name(f"{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            try:
                manifest = obstore.get(self.store, f"{prefix}/{MANIFEST}").bytes()
            except FileNotFoundError as err:
                raise ServerError(f"artifact {prefix!r} is not in the store {self.url}") from err
            files = json.loads(bytes(manifest))["files"]
            for name, entry in files.items():
                if "/" in name or name in (".", ".."):
                    raise ServerError(f"artifact {prefix!r}: bad file name {name!r}")
                path = staging / name
                with path.open("wb") as out:
                    for chunk in obstore.get(self.store, f"{prefix}/{name}").stream():
                        out.write(chunk)
                if path.stat().st_size != entry["size"] or _sha256(path) != entry["sha256"]:
                    raise ServerError(f"artifact {prefix}/{name} does not match its manifest")
            (staging / MANIFEST).write_bytes(bytes(manifest))
            with self._lock:
                if (target / MANIFEST).is_file():  # another thread got there first
                    shutil.rmtree(staging, ignore_errors=True)
                else:
                    shutil.rmtree(target, ignore_errors=True)
                    os.replace(staging, target)
                self._trim(keep=target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target

    def _trim(self, keep: Path) -> None:
        """Remove the least recently used cached copies until the cache fits its bound."""
        entries = []
        total = 0
        for entry in self.cache_dir.iterdir():
            if entry.name.endswith(".tmp") or not entry.is_dir():
                continue
            size = sum(p.stat().st_size for p in entry.iterdir() if p.is_file())
            entries.append((entry.stat().st_mtime, size, entry))
            total += size
        for _, size, entry in sorted(entries, key=lambda e: e[0]):
            if total <= self.cache_bytes:
                return
            if entry == keep:
                continue
            shutil.rmtree(entry, ignore_errors=True)
            total -= size
            log.info("artifact cache: dropped %s (%d bytes)", entry.name, size)


def _cache_name(prefix: str) -> str:
    readable = prefix.replace("/", "~")[-80:]
    return f"{hashlib.sha256(prefix.encode()).hexdigest()[:16]}-{readable}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while block := source.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def staging_dir(data_dir: Path, name: str) -> Path:
    """A fresh local directory for files about to be uploaded."""
    directory = data_dir / "artifact-staging" / f"{name}-{time.time_ns()}"
    directory.mkdir(parents=True)
    return directory

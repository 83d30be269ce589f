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
- Calls are blocking (obstore's sync API): they run in the worker's executor threads, as the
  file I/O they replace did.
- A call never hangs on a store that is away. Each request gives up on its own: a refused
  connection at once, a connect after `_CONNECT_TIMEOUT_S`, a request with no answer (a frozen
  server, whose kernel still accepts connections) after its read timeout (`_READ_TIMEOUT_S`,
  or the wait if shorter). obstore's own retries are off; this module retries instead, so
  that the whole wait has one bound: a call that finds the store away keeps trying (a quick
  look, `reachable`, then the request again) until `wait_s` (the worker's
  `artifact_store_wait_s`) has passed since the store was first found away, then raises
  `ArtifactStoreUnavailable` (a frozen store may add the last look, `_PROBE_TIMEOUT_S`). The
  clock runs from the start of the outage, not of the call: a call in an outage that has lasted
  longer than `wait_s` gets one quick look and fails at once. The first call that succeeds ends
  the outage.
- A failed upload leaves no content a reader follows: its manifest, written last, is missing,
  and `exists` counts only contents with a manifest, so a save retried under the same name is
  not refused as a duplicate.

Settings: the store URL `s3://BUCKET/PREFIX`; endpoint, region and credentials from the standard
`AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` (an `http://`
endpoint is allowed: a store on loopback or a private network); the wait bound `wait_s`.

Errors: a store that stays away raises `ArtifactStoreUnavailable`, a retryable server error
whose message names the store, what failed (the save of checkpoint X, its upload) and that a
retry is safe: nothing is committed before the record, so the client retries the same call.
A failed future carries only the category (`server`): the SDK raises `RequestFailedError` and
retries nothing by itself, so the message is what tells the user to retry. It is not
`protocol.errors.Unavailable`: in a worker that one means the bus stayed away, which ends the
process (`workers.trainer.service`); a store outage must not.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import obstore
from obstore.exceptions import GenericError, PermissionDeniedError, UnauthenticatedError
from obstore.store import S3Store

from protocol.errors import ServerError
from protocol.paths import STATE_PREFIX, STORE_MANIFEST, parse_store_url

log = logging.getLogger(__name__)

T = TypeVar("T")

MANIFEST = STORE_MANIFEST
DEFAULT_CACHE_BYTES = 16 * 1024**3
DEFAULT_WAIT_S = 30.0
_CHUNK_BYTES = 8 * 1024 * 1024  # multipart part size; files above it go up in parts
_CONNECT_TIMEOUT_S = 2.0
# A data request with no answer this long is given up. It is also the longest a healthy request
# may go without the server sending a byte (a part of `_CHUNK_BYTES` must go up within it).
_READ_TIMEOUT_S = 10.0
_PROBE_TIMEOUT_S = 2.0  # `reachable`: a HEAD, whose answer is small and quick
_FIRST_PAUSE_S = 0.25  # between tries in an outage, doubling up to `_MAX_PAUSE_S`
_MAX_PAUSE_S = 2.0
# what a failed step of each call was part of, as its message says it
_ACTIONS = {
    "existence check": "save",
    "upload": "save",
    "download": "load",
    "listing": "pruning",
    "deletion": "pruning",
}


class ArtifactStoreUnavailable(ServerError):
    """The artifact store did not answer within the wait bound: retry the call later.

    Retryable (503 where it answers a request directly; a failed future's `server` category).
    """

    code = "artifact_store_unavailable"
    status = 503
    retryable = True

    def __init__(self, url: str, step: str, prefix: str, waited_s: float, cause: str) -> None:
        action = _ACTIONS.get(step, step)
        super().__init__(
            f"the artifact store {url} is unreachable: the {action} of {_subject(prefix)}"
            f" failed ({step}: {cause}; away for {waited_s:.0f} s). Nothing was committed;"
            " retrying the request is safe and will succeed once the store is back."
        )
        self.step = step
        self.prefix = prefix


@dataclass(frozen=True)
class Uploaded:
    """What an upload put under its prefix: the bytes of its files and its manifest's sha256."""

    size_bytes: int
    sha256: str


class ArtifactStore:
    """An S3 bucket (under a prefix) plus the local cache of what was read from it.

    `wait_s`: how long a call keeps trying a store that is away before it raises
    `ArtifactStoreUnavailable` (counted from the start of the outage).
    """

    def __init__(
        self,
        url: str,
        cache_dir: Path,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        wait_s: float = DEFAULT_WAIT_S,
    ) -> None:
        bucket, prefix = parse_store_url(url)
        self.url = url
        self.wait_s = wait_s
        # A frozen store costs a try its read timeout: no longer than the wait, which the
        # outage's first try starts.
        read_s = min(_READ_TIMEOUT_S, max(1.0, wait_s))
        self.store = _client(bucket, prefix, read_s)
        self._probe = _client(bucket, prefix, _PROBE_TIMEOUT_S)
        self.cache_dir = cache_dir
        self.cache_bytes = cache_bytes
        self._lock = threading.Lock()  # one cache bookkeeping at a time (executor threads)
        self._away_lock = threading.Lock()
        self._away_since: float | None = None  # monotonic start of the outage; None: none

    # -- the outage -----------------------------------------------------------------------------

    @property
    def away(self) -> bool:
        """Whether the last word from the store was a failure (no request is made)."""
        return self._away_since is not None

    def reachable(self) -> bool:
        """One quick look at the store (a HEAD with `_PROBE_TIMEOUT_S` timeouts): whether it
        answers. Any answer counts, a missing key or a refusal included; an outage starts or
        ends with it."""
        started = time.monotonic()
        return self._look(started) is None

    def _look(self, started: float) -> str | None:
        """`reachable`'s look: None if the store answered, else why not."""
        try:
            obstore.head(self._probe, f"{STATE_PREFIX}/reachable")
        except FileNotFoundError:
            pass
        except GenericError as err:
            self._went_away(started)
            return _cause(err)
        except obstore.exceptions.BaseError:
            pass  # an answer, if a refusal
        self._came_back()
        return None

    def _went_away(self, started: float) -> None:
        with self._away_lock:
            if self._away_since is None:
                self._away_since = started
                log.warning("artifact store %s: away (outage starts)", self.url)

    def _came_back(self) -> None:
        with self._away_lock:
            if self._away_since is not None:
                log.warning(
                    "artifact store %s: back after %.1f s",
                    self.url,
                    time.monotonic() - self._away_since,
                )
                self._away_since = None

    def _call(self, step: str, prefix: str, call: Callable[[], T], wait_s: float | None) -> T:
        """`call()` (one obstore request, or a file's), tried until it succeeds or the outage
        has lasted `wait_s` (None: the store's own; 0: one try). In an outage each try starts
        with a quick look, so a frozen store costs `_PROBE_TIMEOUT_S` a try, not a data
        request's read timeout."""
        bound_s = self.wait_s if wait_s is None else wait_s
        pause_s = _FIRST_PAUSE_S
        while True:
            started = time.monotonic()
            cause = self._look(started) if self.away else None
            if cause is None:
                try:
                    result = call()
                except GenericError as err:
                    log.warning(
                        "artifact store %s: %s of %s failed: %s", self.url, step, prefix, err
                    )
                    self._went_away(started)
                    cause = _cause(err)
                except (PermissionDeniedError, UnauthenticatedError) as err:
                    raise ServerError(
                        f"the artifact store {self.url} refused the {step} of {_subject(prefix)}:"
                        f" {type(err).__name__} (check the worker's AWS_* credentials)"
                    ) from err
                else:
                    self._came_back()
                    return result
            since = self._away_since
            now = time.monotonic()
            if since is None:  # another call ended the outage meanwhile
                continue
            left_s = since + bound_s - now
            if left_s <= 0:
                raise ArtifactStoreUnavailable(self.url, step, prefix, now - since, cause)
            time.sleep(min(pause_s, left_s))
            pause_s = min(2 * pause_s, _MAX_PAUSE_S)

    # -- writing --------------------------------------------------------------------------------

    def upload(self, prefix: str, directory: Path, wait_s: float | None = None) -> Uploaded:
        """Every file of `directory` (not recursive) under `prefix/`, then the manifest."""
        files: dict[str, dict[str, int | str]] = {}
        for path in sorted(p for p in directory.iterdir() if p.is_file()):
            if path.name == MANIFEST or path.name.endswith(".tmp"):
                continue
            files[path.name] = {"size": path.stat().st_size, "sha256": _sha256(path)}
            key = f"{prefix}/{path.name}"
            put = functools.partial(obstore.put, self.store, key, path, chunk_size=_CHUNK_BYTES)
            self._call("upload", prefix, put, wait_s)
        manifest = json.dumps({"files": files}, sort_keys=True).encode()
        self._call(
            "upload",
            prefix,
            lambda: obstore.put(self.store, f"{prefix}/{MANIFEST}", manifest),
            wait_s,
        )
        size = sum(int(entry["size"]) for entry in files.values())
        return Uploaded(size_bytes=size, sha256=hashlib.sha256(manifest).hexdigest())

    def delete(self, prefix: str, wait_s: float | None = None) -> None:
        """Remove every object under `prefix/`."""

        def delete() -> None:
            listed = obstore.list(self.store, f"{prefix}/")
            paths = [meta["path"] for batch in listed for meta in batch]
            if paths:
                obstore.delete(self.store, paths)

        self._call("deletion", prefix, delete, wait_s)

    def exists(self, prefix: str, wait_s: float | None = None) -> bool:
        """Whether a whole content lies under `prefix/`: a manifest (written last) at any depth.
        The files of an upload that failed half-way do not count."""

        def exists() -> bool:
            for batch in obstore.list(self.store, f"{prefix}/"):
                if any(str(meta["path"]).endswith(f"/{MANIFEST}") for meta in batch):
                    return True
            return False

        return self._call("existence check", prefix, exists, wait_s)

    def children(self, prefix: str, wait_s: float | None = None) -> list[str]:
        """The immediate sub-prefixes of `prefix/` (their full keys)."""
        listed = self._call(
            "listing", prefix, lambda: obstore.list_with_delimiter(self.store, f"{prefix}/"), wait_s
        )
        return sorted(str(common).rstrip("/") for common in listed["common_prefixes"])

    # -- reading --------------------------------------------------------------------------------

    def download(self, prefix: str, wait_s: float | None = None) -> Path:
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
                manifest = self._call(
                    "download",
                    prefix,
                    lambda: bytes(obstore.get(self.store, f"{prefix}/{MANIFEST}").bytes()),
                    wait_s,
                )
            except FileNotFoundError as err:
                raise ServerError(f"artifact {prefix!r} is not in the store {self.url}") from err
            files = json.loads(manifest)["files"]
            for name, entry in files.items():
                if "/" in name or name in (".", ".."):
                    raise ServerError(f"artifact {prefix!r}: bad file name {name!r}")
                path = staging / name
                fetch = functools.partial(self._fetch, f"{prefix}/{name}", path)
                self._call("download", prefix, fetch, wait_s)
                if path.stat().st_size != entry["size"] or _sha256(path) != entry["sha256"]:
                    raise ServerError(f"artifact {prefix}/{name} does not match its manifest")
            (staging / MANIFEST).write_bytes(manifest)
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

    def _fetch(self, key: str, path: Path) -> None:
        """One object into `path` (written again from the start on a retry)."""
        with path.open("wb") as out:
            for chunk in obstore.get(self.store, key).stream():
                out.write(chunk)

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


def _client(bucket: str, prefix: str, read_s: float) -> S3Store:
    """An S3 client that gives up on a dead or frozen store by itself and never retries."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
    return S3Store(
        bucket,
        prefix=prefix or None,
        client_options={
            "allow_http": endpoint.startswith("http://"),
            "connect_timeout": timedelta(seconds=min(_CONNECT_TIMEOUT_S, read_s)),
            "read_timeout": timedelta(seconds=read_s),
        },
        retry_config={"max_retries": 0},
    )


def _cause(err: Exception) -> str:
    """Why a request to the store failed, in words (obstore's text names the endpoint)."""
    text = str(err)
    if "kind: Timeout" in text:
        return "no answer in time"
    if "kind: Connect" in text:
        return "connection refused or dropped"
    return text.split("\n", 1)[0].split(" - ", 1)[-1][:200]


def _subject(prefix: str) -> str:
    """What a key prefix holds, as a message names it: a checkpoint, a state snapshot."""
    parts = prefix.split("/")
    if len(parts) >= 2 and parts[1] == STATE_PREFIX:
        return f"a state snapshot of {parts[0]}"
    if len(parts) >= 3 and parts[1] in ("weights", "sampler_weights", "external_weights"):
        return f"checkpoint tinker://{parts[0]}/{parts[1]}/{parts[2]}"
    return repr(prefix)


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

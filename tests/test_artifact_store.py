"""The worker's artifact store against a real S3 server (SeaweedFS on loopback): uploads with a
manifest, checked downloads through a bounded cache, store URLs refused with a reason, and a
store that goes away (killed, frozen) failing within its wait bound with a retryable error that
names it, then working again when it is back."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import obstore
import pytest

from protocol.errors import ErrorCategory, ServerError
from protocol.paths import parse_store_url, snapshot_key, snapshot_seq
from tests.s3_server import S3Server
from workers.__main__ import parse_args
from workers.artifacts import MANIFEST, ArtifactStore, ArtifactStoreUnavailable


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server(tmp_path_factory.mktemp("s3"))
    server.start()
    try:
        with server.client_env():
            yield server
    finally:
        server.stop()


def _files(directory: Path, sizes: dict[str, int]) -> Path:
    directory.mkdir(parents=True)
    for name, size in sizes.items():
        (directory / name).write_bytes(os.urandom(size))
    return directory


def test_an_upload_comes_back_whole_and_checked(s3: S3Server, tmp_path: Path) -> None:
    store = ArtifactStore("s3://twinkle/unit", tmp_path / "cache")
    source = _files(tmp_path / "src", {"big.bin": 9 * 1024 * 1024, "small.json": 10})
    uploaded = store.upload("run/weights/a/c1", source)
    assert uploaded.size_bytes == 9 * 1024 * 1024 + 10 and len(uploaded.sha256) == 64
    assert store.exists("run/weights/a") and not store.exists("run/weights/b")
    copy = store.download("run/weights/a/c1")
    for name in ("big.bin", "small.json"):
        assert (copy / name).read_bytes() == (source / name).read_bytes()
    assert (copy / MANIFEST).is_file()
    assert store.download("run/weights/a/c1") == copy  # from the cache
    store.delete("run/weights/a/c1")
    assert not store.exists("run/weights/a")


def test_a_changed_or_missing_object_is_an_error_not_a_wrong_adapter(
    s3: S3Server, tmp_path: Path
) -> None:
    store = ArtifactStore("s3://twinkle/unit", tmp_path / "cache")
    store.upload("run/weights/t/c1", _files(tmp_path / "src", {"adapter.bin": 1000}))
    obstore.put(store.store, "run/weights/t/c1/adapter.bin", b"not the adapter")
    with pytest.raises(ServerError, match="does not match its manifest"):
        store.download("run/weights/t/c1")
    with pytest.raises(ServerError, match="is not in the store"):
        store.download("run/weights/never/c1")
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.endswith(".tmp")]


def test_the_cache_keeps_to_its_bound(s3: S3Server, tmp_path: Path) -> None:
    store = ArtifactStore("s3://twinkle/unit", tmp_path / "cache", cache_bytes=2500)
    for index in range(4):
        store.upload(f"run/sampler_weights/n/{index}", _files(tmp_path / f"s{index}", {"f": 1000}))
        store.download(f"run/sampler_weights/n/{index}")
    cached = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert len(cached) == 2  # the two most recent, 2000 bytes of 2500
    assert any(p.name.endswith("n~3") for p in cached)


def test_snapshot_prefixes_sort_and_prune_by_seq(s3: S3Server, tmp_path: Path) -> None:
    store = ArtifactStore("s3://twinkle/unit", tmp_path / "cache")
    for seq in (3, 12, 7):
        store.upload(snapshot_key("run-s", seq, f"u{seq}"), _files(tmp_path / f"{seq}", {"x": 1}))
    children = store.children("run-s/.state")
    assert sorted(snapshot_seq(key) for key in children) == [3, 7, 12]


def test_a_half_finished_upload_does_not_count_as_there(s3: S3Server, tmp_path: Path) -> None:
    store = ArtifactStore("s3://twinkle/unit", tmp_path / "cache")
    obstore.put(store.store, "run/weights/half/c1/adapter.bin", b"the first file, no manifest")
    assert not store.exists("run/weights/half")  # a retried save is no duplicate
    store.upload("run/weights/half/c2", _files(tmp_path / "src", {"adapter.bin": 10}))
    assert store.exists("run/weights/half")


def _unavailable(call: object, bound_s: float, what: str) -> ArtifactStoreUnavailable:
    """The error `call()` raises, checked to come within `bound_s` and to name the store,
    what failed and that a retry is safe."""
    assert callable(call)
    started = time.monotonic()
    with pytest.raises(ArtifactStoreUnavailable) as raised:
        call()
    elapsed_s = time.monotonic() - started
    assert elapsed_s < bound_s, f"{what}: failed after {elapsed_s:.1f} s, over {bound_s} s"
    err = raised.value
    assert err.retryable and err.category is ErrorCategory.SERVER and err.status == 503
    assert "the artifact store s3://twinkle/outage is unreachable" in err.message
    assert what in err.message and "retrying the request is safe" in err.message
    return err


def test_a_store_that_goes_away_fails_within_the_bound_and_works_again_when_back(
    tmp_path: Path,
) -> None:
    server = S3Server(tmp_path / "s3")
    server.start()
    try:
        with server.client_env():
            source = _files(tmp_path / "src", {"adapter.bin": 3000})
            # the first upload waits for weed to grow its volumes: with the default read timeout
            ArtifactStore("s3://twinkle/outage", tmp_path / "c").upload("run/weights/a/c1", source)
            store = ArtifactStore("s3://twinkle/outage", tmp_path / "cache", wait_s=3.0)

            # frozen: connections accepted, never answered; the wait is 3 s from the outage's start
            server.freeze()
            _unavailable(lambda: store.exists("run/weights/b"), 3.0 + 1.5, "save of checkpoint")
            assert store.away
            # later in the same outage: one quick look (2 s at most), then the error
            _unavailable(lambda: store.upload("run/weights/b/c1", source), 2.0 + 1.0, "upload")
            _unavailable(lambda: store.download("run/weights/a/c1"), 2.0 + 1.0, "download")
            server.thaw()
            copy = store.download("run/weights/a/c1")
            assert (copy / "adapter.bin").read_bytes() == (source / "adapter.bin").read_bytes()
            assert not store.away

            # killed: connections refused
            server.kill()
            err = _unavailable(
                lambda: store.upload("run/weights/c/c1", source), 3.0 + 1.0, "upload"
            )
            assert "checkpoint tinker://run/weights/c" in err.message
            _unavailable(lambda: store.children("run/.state"), 1.0, "listing")
            # a call with a longer wait waits for the store to come back, then succeeds
            patient = ArtifactStore("s3://twinkle/outage", tmp_path / "cache-2", wait_s=30.0)
            restart = threading.Timer(1.0, server.start)
            restart.start()
            try:
                patient.upload("run/weights/c/c1", source)
            finally:
                restart.join()
            assert not patient.away
            store.upload("run/weights/d/c1", source)  # and the first store's next call too
            copy = patient.download("run/weights/c/c1")
            assert (copy / "adapter.bin").read_bytes() == (source / "adapter.bin").read_bytes()
    finally:
        server.stop()


def test_the_wait_is_a_worker_setting_with_a_default() -> None:
    settings = parse_args(["--base-model", "m"])
    assert settings.artifact_store_wait_s == 30.0
    args = ["--base-model", "m", "--artifact-store-wait-s", "5"]
    assert parse_args(args).artifact_store_wait_s == 5.0


@pytest.mark.parametrize(
    "url",
    ["", "s3://", "http://bucket/x", "s3://bucket/a//b", "s3://bucket/../x", "s3://b/x?y=1"],
)
def test_a_bad_store_url_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="artifact store"):
        parse_store_url(url)


def test_the_worker_command_line_checks_the_store_url() -> None:
    assert parse_args(["--base-model", "m", "--artifact-store", "s3://b/p"]).artifact_store == (
        "s3://b/p"
    )
    with pytest.raises(Exception, match="not s3://BUCKET/PREFIX"):
        parse_args(["--base-model", "m", "--artifact-store", "file:///tmp/x"])


# -- the gateway's side: list, sign, stream, copy, delete ------------------------------------------


def test_the_gateway_lists_signs_streams_copies_and_deletes(s3: S3Server, tmp_path: Path) -> None:
    import asyncio
    import urllib.parse

    from protocol.paths import CONTENT_ID_FILE
    from twinkle_async.gateway.store_files import StoreFiles

    worker = ArtifactStore("s3://twinkle/gw", tmp_path / "cache")
    source = _files(tmp_path / "src", {"adapter_model.safetensors": 3 * 1024 * 1024 + 5})
    (source / "adapter_config.json").write_text('{"r": 4}')
    (source / CONTENT_ID_FILE).write_text("c1")
    worker.upload("run/weights/a/c1", source)
    worker.upload("run/weights/a/c0", source)  # an older content of the same name
    worker.upload("run/weights/ab/c1", source)  # a name sharing a prefix of characters

    async def scenario() -> None:
        store = StoreFiles("s3://twinkle/gw")
        listed = await store.files("run/weights/a/c1")
        assert [(f.name, f.size) for f in listed] == [
            ("adapter_config.json", 8),
            ("adapter_model.safetensors", 3 * 1024 * 1024 + 5),
        ]  # the content id file and the manifest are bookkeeping, not downloads
        assert await store.files("run/weights/a/none") == []
        url = await store.sign("run/weights/a/c1", "adapter_model.safetensors", 60)
        assert "X-Amz-Signature=" in url and "/gw/run/weights/a/c1/" in url
        fetched = await asyncio.to_thread(_fetch, url)  # no credentials
        assert fetched == (source / "adapter_model.safetensors").read_bytes()
        streamed = b"".join(
            [c async for c in store.chunks("run/weights/a/c1", "adapter_config.json")]
        )
        assert streamed == b'{"r": 4}'

        public = StoreFiles("s3://twinkle/gw", public_url="https://s3.example.test:9443")
        signed = await public.sign("run/weights/a/c1", "adapter_config.json", 60)
        assert urllib.parse.urlsplit(signed).netloc == "s3.example.test:9443"

        await store.copy("run/weights/a/c1", "copy/weights/a/c1")
        with pytest.raises(FileNotFoundError):
            await store.copy("run/weights/a/none", "copy/weights/b/c1")
        await store.delete_tree("run/weights/a")  # every content of the name, nothing else
        assert await store.files("run/weights/a/c1") == [] == await store.files("run/weights/a/c0")
        assert len(await store.files("run/weights/ab/c1")) == 2
        assert len(await store.files("copy/weights/a/c1")) == 2

    asyncio.run(scenario())
    copy = worker.download("copy/weights/a/c1")  # the copy passes the manifest check
    assert (copy / "adapter_model.safetensors").read_bytes() == (
        source / "adapter_model.safetensors"
    ).read_bytes()
    assert not worker.exists("run/weights/a")


def _fetch(url: str) -> bytes:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as response:
        return bytes(response.read())


def test_the_gateway_refuses_a_foreign_manifest(s3: S3Server) -> None:
    import asyncio

    from twinkle_async.gateway.store_files import StoreFiles

    store = StoreFiles("s3://twinkle/gw")
    for body in (b"not json", b'{"files": {"../escape": {"size": 1}}}', b'{"files": {"a": {}}}'):
        obstore.put(store.store, f"bad/weights/x/c1/{MANIFEST}", body)
        with pytest.raises(ServerError):
            asyncio.run(store.files("bad/weights/x/c1"))

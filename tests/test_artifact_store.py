"""The worker's artifact store against a real S3 server (SeaweedFS on loopback): uploads with a
manifest, checked downloads through a bounded cache, and store URLs refused with a reason."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import obstore
import pytest

from protocol.errors import ServerError
from protocol.paths import parse_store_url, snapshot_key, snapshot_seq
from tests.s3_server import S3Server
from workers.__main__ import parse_args
from workers.artifacts import MANIFEST, ArtifactStore


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

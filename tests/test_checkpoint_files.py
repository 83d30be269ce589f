"""The pure and file-level pieces behind checkpoint deletion, copies and signed downloads:
URL signatures, the streamed tar, hard-linked copies, deletion with versions, the TTL choice."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from protocol.api import LoraConfig
from protocol.errors import UserError
from protocol.paths import CONTENT_ID_FILE, TinkerPath, checkpoint_dir, version_dir
from protocol.records import CheckpointRecord
from twinkle_async.gateway import signed_urls
from twinkle_async.gateway.checkpoint_files import (
    TAR_END,
    close_members,
    delete_files,
    link_copy,
    open_members,
    tar_size,
)
from twinkle_async.gateway.sweeper import expired

SECRET = b"k" * 32
PATH = TinkerPath(run_id="sess-1:train:0", kind="external_weights", name="final")


def query_of(url: str) -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}


def test_a_signed_url_holds_for_its_content_until_it_expires() -> None:
    url = signed_urls.file_url("http://h:1", SECRET, PATH, "a.json", "c1", expires=1000)
    assert (
        urlsplit(url).path == "/files/v1/checkpoints/sess-1:train:0/external_weights/final/a.json"
    )
    resource = signed_urls.file_resource(PATH, "a.json")
    signed_urls.check(SECRET, resource, "c1", query_of(url), now=999.0)
    refused = [
        (SECRET, resource, "c1", 1001.0),  # expired
        (SECRET, resource, "c2", 999.0),  # overwritten since
        (SECRET, resource, None, 999.0),  # deleted since
        (b"other", resource, "c1", 999.0),  # another gateway's key
        (SECRET, signed_urls.file_resource(PATH, "b.json"), "c1", 999.0),  # another file
        (SECRET, signed_urls.archive_resource(PATH), "c1", 999.0),  # not an archive grant
    ]
    for secret, what, content, now in refused:
        with pytest.raises(UserError) as err:
            signed_urls.check(secret, what, content, query_of(url), now)
        assert err.value.status == 403


@pytest.mark.parametrize(
    "query",
    [{}, {"expires": "1000"}, {"expires": "x", "sig": "0"}, {"expires": "1000", "sig": "é"},
     {"expires": "9" * 40, "sig": "0"}, {"expires": "-1", "sig": "0"}],
)  # fmt: skip
def test_malformed_signatures_are_refused_not_crashed_on(query: dict[str, str]) -> None:
    with pytest.raises(UserError) as err:
        signed_urls.check(SECRET, "archive/x", "c1", query, now=0.0)
    assert err.value.status == 403


def test_the_streamed_tar_is_exactly_as_long_as_promised_and_flat(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text('{"r": 4}')
    (tmp_path / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 5)
    (tmp_path / CONTENT_ID_FILE).write_text("c1")
    (tmp_path / "half.tmp").write_text("being written")
    members = open_members(tmp_path)
    try:
        data = b"".join(m.header() + m.handle.read() + m.padding() for m in members) + TAR_END
        assert len(data) == tar_size(members)
    finally:
        close_members(members)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert tar.getnames() == ["adapter_config.json", "adapter_model.safetensors"]
        extracted = tar.extractfile("adapter_model.safetensors")
        assert extracted is not None and extracted.read() == bytes(range(256)) * 5


def test_a_copy_shares_the_files_and_outlives_its_source(tmp_path: Path) -> None:
    source = checkpoint_dir(tmp_path, PATH)
    source.mkdir(parents=True)
    (source / "adapter_model.safetensors").write_bytes(b"weights")
    (version_dir(tmp_path, PATH, "old")).mkdir(parents=True)
    copy = TinkerPath(run_id="copy-1", kind="external_weights", name="final")
    link_copy(source, checkpoint_dir(tmp_path, copy))
    copied = checkpoint_dir(tmp_path, copy) / "adapter_model.safetensors"
    assert copied.stat().st_ino == (source / "adapter_model.safetensors").stat().st_ino
    delete_files(tmp_path, PATH)
    assert not source.exists() and not version_dir(tmp_path, PATH, "old").parent.exists()
    assert copied.read_bytes() == b"weights"
    delete_files(tmp_path, PATH)  # deleting again is fine
    with pytest.raises(FileNotFoundError):
        link_copy(source, checkpoint_dir(tmp_path, copy))


def test_only_checkpoints_past_their_ttl_are_swept() -> None:
    def ckpt(name: str, expires_at: float | None) -> CheckpointRecord:
        return CheckpointRecord(
            run_id="r", tenant_id="t", checkpoint_id=f"weights/{name}", kind="weights",
            path=f"tinker://r/weights/{name}", directory="", created_at=0.0, size_bytes=0,
            base_model="m", lora=LoraConfig(), expires_at=expires_at,
        )  # fmt: skip

    records = [ckpt("forever", None), ckpt("past", 10.0), ckpt("now", 20.0), ckpt("later", 30.0)]
    assert [c.checkpoint_id for c in expired(records, now=20.0)] == ["weights/past", "weights/now"]

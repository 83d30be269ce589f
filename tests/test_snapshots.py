"""Snapshot files on disk: pruning after a write keeps what may be another worker's."""

from __future__ import annotations

from pathlib import Path

from workers.trainer.snapshots import prune


def test_prune_removes_only_older_snapshots(tmp_path: Path) -> None:
    """After a handover the next owner writes newer snapshots into the same directory; a late
    write of the previous owner must not delete them, nor a file being written."""
    names = [
        "state-3.json",
        "state-3.safetensors",
        "state-5.json",
        "state-5.safetensors",
        "state-9.json",  # the next owner's, newer
        "state-9.safetensors",
        "state-12.safetensors.tmp",  # being written
        "state-4.json.tmp",  # a crashed write, older
    ]
    for name in names:
        (tmp_path / name).write_text("x")
    prune(tmp_path, tmp_path / "state-5.json")
    left = sorted(path.name for path in tmp_path.iterdir())
    assert left == [
        "state-12.safetensors.tmp",
        "state-5.json",
        "state-5.safetensors",
        "state-9.json",
        "state-9.safetensors",
    ]

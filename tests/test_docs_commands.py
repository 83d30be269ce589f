"""Every command in docs/ that can run here runs, against a real cluster.

A fenced block whose info string is `bash test` or `python test` is run (bash with `-euo
pipefail`), in page order, with the cluster's coordinates in the environment the pages name:
`TWINKLE_GATEWAY`, `TWINKLE_ADMIN_KEY`, `TINKER_BASE_URL`, `TINKER_API_KEY`, `BASE_MODEL`, and a
scratch directory in `TMP`. Every other `bash`/`sh`/`python` block must say on its first line why
it cannot run here (`# not run here: ...`), so no command is left untried by accident.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Cluster

pytestmark = pytest.mark.e2e

DOCS = Path(__file__).resolve().parents[1] / "docs"
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)
LANGUAGES = {"bash", "sh", "python"}


def blocks() -> list[tuple[str, int, str, str]]:
    """(page, index, language, code) of every block marked to run, pages in name order."""
    found = []
    for page in sorted(DOCS.glob("*.md")):
        for index, match in enumerate(FENCE.finditer(page.read_text())):
            words = match.group(1).split()
            if len(words) == 2 and words[0] in LANGUAGES and words[1] == "test":
                found.append((page.name, index, words[0], match.group(2)))
    return found


def test_every_block_either_runs_or_says_why_not() -> None:
    for page in sorted(DOCS.glob("*.md")):
        for match in FENCE.finditer(page.read_text()):
            words = match.group(1).split()
            if not words or words[0] not in LANGUAGES or words[1:] == ["test"]:
                continue
            first = match.group(2).lstrip().splitlines()[0]
            assert first.startswith("# not run here:"), (page.name, first)


@pytest.mark.parametrize(
    ("page", "index", "language", "code"),
    blocks(),
    ids=[f"{page}-{index}" for page, index, _, _ in blocks()],
)
def test_the_block_runs(
    cluster: Cluster,
    tmp_path_factory: pytest.TempPathFactory,
    page: str,
    index: int,
    language: str,
    code: str,
) -> None:
    scratch = tmp_path_factory.getbasetemp() / "docs-commands"  # shared by a page's blocks
    scratch.mkdir(exist_ok=True)
    bin_dir = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
        "TWINKLE_GATEWAY": cluster.base_url,
        "TWINKLE_ADMIN_KEY": cluster.admin_key,
        "TINKER_BASE_URL": cluster.base_url,
        "TINKER_API_KEY": cluster.api_key,
        "BASE_MODEL": cluster.base_models[0],
        "TMP": str(scratch),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    command = (
        ["bash", "-euo", "pipefail", "-c", code]
        if language in ("bash", "sh")
        else [sys.executable, "-c", code]
    )
    done = subprocess.run(
        command, cwd=scratch, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, (
        f"{page} block {index} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    )
    # what the pages show is the SDK's current use: no deprecated call (a future used as its
    # result, say), which warns today and breaks in a later SDK
    assert "FutureWarning" not in done.stderr, f"{page} block {index}:\n{done.stderr[-3000:]}"

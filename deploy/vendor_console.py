"""Vendor the console's charting library from the npm registry: `make vendor-console`.

Downloads uPlot's package at the pinned version, checks it against the registry's integrity
hash, and writes the two files the console loads (and the license) into
`twinkle_async/gateway/console/vendor/`, where they are committed: the console needs no CDN and
no network at run time. `tests/test_console_session.py` checks the committed files against the
hashes recorded in `vendor/VENDOR.json`.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import tarfile
import urllib.request
from pathlib import Path

PACKAGE = "uplot"
VERSION = "1.6.32"
INTEGRITY = "sha512-KIMVnG68zvu5XXUbC4LQEPnhwOxBuLyW1AHtpm6IKTXImkbLgkMy+jabjLgSLMasNuGGzQm/ep3tOkyTxpiQIw=="
FILES = {  # in the package -> in vendor/
    "package/dist/uPlot.iife.min.js": "uPlot.iife.min.js",
    "package/dist/uPlot.min.css": "uPlot.min.css",
    "package/LICENSE": "uPlot.LICENSE",
}
VENDOR = Path(__file__).resolve().parents[1] / "twinkle_async" / "gateway" / "console" / "vendor"


def main() -> None:
    url = f"https://registry.npmjs.org/{PACKAGE}/-/{PACKAGE}-{VERSION}.tgz"
    with urllib.request.urlopen(url, timeout=60) as response:
        tarball = response.read()
    got = "sha512-" + base64.b64encode(hashlib.sha512(tarball).digest()).decode()
    if got != INTEGRITY:
        raise SystemExit(f"{url}: integrity {got} is not the pinned {INTEGRITY}")
    VENDOR.mkdir(parents=True, exist_ok=True)
    written = {}
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as archive:
        for member, name in FILES.items():
            extracted = archive.extractfile(member)
            assert extracted is not None, member
            data = extracted.read()
            (VENDOR / name).write_bytes(data)
            written[name] = hashlib.sha256(data).hexdigest()
    record = {"package": PACKAGE, "version": VERSION, "integrity": INTEGRITY, "sha256": written}
    (VENDOR / "VENDOR.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"vendored {PACKAGE}@{VERSION} into {VENDOR}")


if __name__ == "__main__":
    main()

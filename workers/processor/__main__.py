"""`python -m workers.processor ...`: run the Twinkle processor service until SIGTERM.

It works in a private temporary directory (twinkle writes `.locks/` where it runs, datasets its
caches), removed at exit, and never downloads: the hub is offline, data comes from `--data-root`
and templates from the `--model` directories.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path


def _positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m workers.processor", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: a free port")
    p.add_argument("--ready-file", type=Path, required=True, help='gets {"url": ...} once up')
    p.add_argument("--secret-file", type=Path, required=True, help="the gateway's secret")
    p.add_argument("--data-root", type=Path, required=True, help="where dataset files may be")
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a served model: its name, and its directory (or hub id in the local cache)",
    )
    p.add_argument("--ttl-s", type=_positive(float), default=3600.0, help="idle object expiry")
    p.add_argument("--max-objects", type=_positive(int), default=32, help="per session")
    p.add_argument("--max-rows", type=_positive(int), default=100_000, help="per dataset")
    p.add_argument("--max-file-bytes", type=_positive(int), default=256 << 20)
    return p


def offline_env(workdir: str) -> None:
    """No downloads; caches in `workdir` unless set; twinkle in one process."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[name] = "1"
    os.environ["TWINKLE_MODE"] = "local"
    os.environ.setdefault("HF_DATASETS_CACHE", os.path.join(workdir, "datasets"))
    os.environ.setdefault("MODELSCOPE_CACHE", os.path.join(workdir, "modelscope"))
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # a handler of our own: twinkle's logger setup turns the root's stream handlers to ERROR
    log = logging.getLogger("workers.processor")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    if not args.data_root.is_dir():
        sys.exit(f"--data-root: {args.data_root} is not a directory")
    try:
        secret = args.secret_file.read_text().strip()
    except OSError as exc:
        sys.exit(f"--secret-file: {exc}")
    if not secret:
        sys.exit(f"--secret-file: {args.secret_file} is empty")
    data_root = os.path.realpath(args.data_root)
    ready_file = args.ready_file.resolve()
    workdir = tempfile.mkdtemp(prefix="twinkle-processor-")
    sys.path[:] = [os.path.abspath(entry) for entry in sys.path]  # before leaving the cwd
    offline_env(workdir)
    os.chdir(workdir)
    try:
        from workers.processor.checks import Models
        from workers.processor.objects import Context
        from workers.processor.service import Service, serve

        try:
            models = Models.parse(args.model)
        except ValueError as exc:
            sys.exit(str(exc))
        ctx = Context(data_root, models, args.max_rows, args.max_file_bytes, 16 << 20)
        service = Service(ctx, secret, args.max_objects, args.ttl_s)
        asyncio.run(serve(service, args.host, args.port, ready_file))
    finally:
        os.chdir("/")
        shutil.rmtree(workdir, ignore_errors=True)
        log.info("removed %s", workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())

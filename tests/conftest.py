"""Shared fixtures: offline settings, a real nats-server per test, a tiny model, a real local
cluster (`twinkle-async up` as a child process: nats-server, gateway, CPU worker) and the
official SDK's client of it (`service`).

No fixed ports anywhere: nats-server and the gateway pick their own and report them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import safetensors.numpy

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# vLLM on the CPU: a 1 GiB KV cache (not sized from free RAM), no usage reports
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

from twinkle_async.nats_server import NatsServer  # noqa: E402

API_KEY = "tml-test-key-0123456789"
OTHER_TENANT_KEY = "tml-other-tenant-key-9876543210"
if TYPE_CHECKING:
    import tinker

    from tests.s3_server import S3Server

ADMIN_KEY = "twa-test-admin-key"  # every test cluster's admin key (`/admin/v1`, twinkle-admin)
TEST_PASS_TOKENS = 2048  # a test cluster's pass size: what calibration picks most often here
# twinkle-kit's interpreter (`make install` builds it): the Twinkle processor service, the
# article's programs
TWINKLE_PYTHON = (
    Path(__file__).resolve().parents[1] / ".venv-sdk" / "twinkle-0.5.1" / "bin" / "python"
)


@pytest.fixture(scope="module")
def torch_one_thread() -> Iterator[None]:
    """Two cores shared with other work: one intra-op thread avoids OpenMP oversubscription."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def random_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Engine-level tests' model: a tiny random Qwen3 (vocab 256, tied embeddings), no tokenizer."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    directory = tmp_path_factory.mktemp("random-qwen3")
    config = Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(directory)
    return directory


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path / "nats")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def build_model(directory: Path, arch: str) -> Path:
    """A tiny model built offline, in a child process so the test process stays torch-free."""
    if not (directory / "config.json").exists():
        subprocess.run(
            [sys.executable, "-m", "workers.tiny_model", str(directory), "--arch", arch], check=True
        )
    return directory


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("models") / "tiny-qwen3", "qwen3")


@pytest.fixture(scope="session")
def tiny_model_35(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("models") / "tiny-qwen3_5", "qwen3_5")


@pytest.fixture(scope="session")
def tiny_model_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3-MoE (fused experts, 8 experts top-2): the expert LoRA path."""
    return build_model(tmp_path_factory.mktemp("models") / "tiny-qwen3_moe", "qwen3_moe")


@dataclass
class Cluster:
    """A running `twinkle-async up`."""

    base_url: str
    api_key: str
    nats_url: str
    data_dir: Path
    base_models: list[str]
    process: subprocess.Popen[bytes]
    admin_key: str = ""


def saved_adapter(cluster: Cluster, path: str) -> dict[str, np.ndarray]:
    """The adapter tensors of a checkpoint the cluster saved in its local checkpoint store."""
    run_id, kind, name = path.removeprefix("tinker://").split("/")
    directory = cluster.data_dir / "checkpoints" / run_id / kind / name
    return safetensors.numpy.load_file(str(directory / "adapter_model.safetensors"))


def start_cluster(
    data_dir: Path,
    base_models: list[Path],
    *extra: str,
    timeout_s: float = 240.0,
    env: dict[str, str] | None = None,
    keys: dict[str, str] | None = None,
    calibrate: bool = False,
) -> Cluster:
    """`up` with the test keys, `keys` (key -> tenant) more tenants in its key file
    (`<data_dir>/keys.txt`). Passes of `TEST_PASS_TOKENS` unless `extra` sets `--token-budget`
    or `calibrate` asks for the workers' own measurement (5-25 s a cluster on 2 cores; the
    session's `cluster` measures, so the default path stays covered end to end)."""
    ready = data_dir / "ready.json"
    data_dir.mkdir(parents=True, exist_ok=True)
    key_file = data_dir / "keys.txt"
    lines = {OTHER_TENANT_KEY: "other", **(keys or {})}
    key_file.write_text("".join(f"{key} {tenant}\n" for key, tenant in lines.items()))
    log = open(data_dir.parent / f"{data_dir.name}.log", "wb")  # noqa: SIM115 - closed by the child's exit
    cmd = [
        sys.executable,
        "-m",
        "twinkle_async",
        "up",
        "--port",
        "0",
        "--data-dir",
        str(data_dir),
        "--api-key",
        API_KEY,
        "--admin-key",
        ADMIN_KEY,
        "--ready-file",
        str(ready),
        "--key-file",
        str(key_file),
        "--threads",
        "1",
        "--max-rank",
        "16",
        "--max-slots",
        "48",
        "--log-level",
        "INFO",
        *extra,
    ]
    if not calibrate and "--token-budget" not in extra:
        cmd += ["--token-budget", str(TEST_PASS_TOKENS)]
    for model in base_models:
        cmd += ["--base-model", str(model)]
    data_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(
                f"cluster failed to start; log: {log.name}\n" + Path(log.name).read_text()[-4000:]
            )
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    return Cluster(
        info["base_url"],
        info["api_key"],
        info["nats_url"],
        data_dir,
        info["base_models"],
        proc,
        info.get("admin_key", ""),
    )


def cluster_log(cluster: Cluster) -> Path:
    """The file `start_cluster` sends the cluster's output to."""
    return cluster.data_dir.parent / f"{cluster.data_dir.name}.log"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> object:
    """A failed test on a cluster reports the tail of that cluster's log beside its traceback."""
    report = yield
    if report.failed and call.when == "call":
        values = getattr(item, "funcargs", {}).values()
        flat = [v for value in values for v in (value if isinstance(value, tuple) else (value,))]
        for running in (v for v in flat if isinstance(v, Cluster)):
            log = cluster_log(running)
            if log.exists():
                tail = log.read_bytes()[-12000:].decode("utf-8", "replace")
                report.sections.append((f"cluster log {log}", tail))
    return report


def stop_cluster(cluster: Cluster) -> None:
    cluster.process.send_signal(signal.SIGTERM)
    try:
        cluster.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        cluster.process.kill()
        cluster.process.wait()


@pytest.fixture(scope="session")
def cluster(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model: Path,
    tiny_model_35: Path,
    tiny_model_moe: Path,
) -> Iterator[Cluster]:
    # the Twinkle processor service too (its datasets under `<data-dir>/twinkle-data`), where
    # `make install` built twinkle-kit's virtualenv
    twinkle = ["--twinkle-python", str(TWINKLE_PYTHON)] if TWINKLE_PYTHON.exists() else []
    running = start_cluster(
        tmp_path_factory.mktemp("cluster") / "data",
        [tiny_model, tiny_model_35, tiny_model_moe],
        *twinkle,
        calibrate=True,
    )
    try:
        yield running
    finally:
        stop_cluster(running)


@pytest.fixture
def service(cluster: Cluster) -> Iterator[tinker.ServiceClient]:
    """The official SDK's client of the session's `cluster`, closed after each test. A module
    whose tests run on a cluster of its own overrides it with a fixture over `sdk_service`."""
    from tests.sdk_helpers import sdk_service  # the SDK is imported by the tests that use it

    with sdk_service(cluster) as client:
        yield client


@pytest.fixture(scope="session")
def chunked_cluster(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path
) -> Iterator[Cluster]:
    """A second cluster whose client/config splits forward_backward calls into 3-datum chunks."""
    running = start_cluster(
        tmp_path_factory.mktemp("chunked") / "data", [tiny_model], "--fwdbwd-max-chunk-len", "3"
    )
    try:
        yield running
    finally:
        stop_cluster(running)


@pytest.fixture(scope="session")
def vllm_cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Cluster]:
    """A cluster whose samples are served by a vLLM sampler process instead of the trainer."""
    running = start_cluster(
        tmp_path_factory.mktemp("vllm") / "data", [tiny_model], "--sampler", "vllm"
    )
    try:
        yield running
    finally:
        stop_cluster(running)


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A real S3 server (SeaweedFS) on loopback for the module's tests."""
    from tests.s3_server import S3Server as Server

    server = Server(tmp_path_factory.mktemp("s3"))
    server.start()
    try:
        yield server
    finally:
        server.stop()

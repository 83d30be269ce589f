"""The rest of the SDK's REST surface against a real cluster: the `RestClient` and the `tinker`
command line list, publish, unpublish, expire, download and delete checkpoints and list runs
and sessions; a downloaded checkpoint loads in PEFT; another tenant gets the 404 of an unknown
id for everything of ours, and may only read (load, sample, copy) what we published; an expired
checkpoint is swept; `unload_model` and `copy_weights` work as older and newer SDKs call them."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import safetensors.numpy
import tinker
from tinker import types
from tinker.lib.client_connection_pool_type import ClientConnectionPoolType

from tests.conftest import API_KEY, OTHER_TENANT_KEY, Cluster
from tests.sdk_helpers import toy_batch, train_steps
from tests.wire import Wire

pytestmark = pytest.mark.e2e

TINKER = str(Path(sys.executable).with_name("tinker"))
PEFT_FILES = {"adapter_config.json", "adapter_model.safetensors"}


@dataclass
class Trained:
    """One trained run of ours with a checkpoint of every kind."""

    service: tinker.ServiceClient
    client: tinker.TrainingClient
    run_id: str
    session_id: str
    state: str  # tinker://<run>/weights/rest-state
    sampler: str  # tinker://<run>/sampler_weights/rest-sampler
    export: str  # tinker://<run>/external_weights/rest-export


@pytest.fixture(scope="module")
def trained(cluster: Cluster, tiny_model: Path) -> Iterator[Trained]:
    service = tinker.ServiceClient(base_url=cluster.base_url, api_key=cluster.api_key)
    client = service.create_lora_training_client(
        base_model=str(tiny_model), rank=4, seed=11
    ).result()
    train_steps(client, toy_batch(n=2), 2)
    state = client.save_state("rest-state").result().path
    sampler = client.save_weights_for_sampler("rest-sampler").result().path
    export = client.save_weights_external("rest-export").result().path
    run_id = client.model_id
    yield Trained(service, client, run_id, run_id.split(":train:")[0], state, sampler, export)
    service.close("success").result()


@pytest.fixture(scope="module")
def rest(cluster: Cluster) -> tinker.RestClient:
    return tinker.RestClient(base_url=cluster.base_url, api_key=cluster.api_key)


@pytest.fixture(scope="module")
def other_rest(cluster: Cluster) -> tinker.RestClient:
    return tinker.RestClient(base_url=cluster.base_url, api_key=OTHER_TENANT_KEY)


def by_path(rest: tinker.RestClient, run_id: str) -> dict[str, types.Checkpoint]:
    return {c.tinker_path: c for c in rest.list_checkpoints(run_id).result().checkpoints}


def checkpoint_dir(cluster: Cluster, tinker_path: str) -> Path:
    run, kind, name = tinker_path.removeprefix("tinker://").split("/")
    return cluster.data_dir / "checkpoints" / run / kind / name


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as response:
        return bytes(response.read())


def cli(cluster: Cluster, *args: str, key: str = API_KEY, cwd: Path | None = None) -> Any:
    """Run `tinker --format json ARGS`; the parsed JSON it printed, or None when it printed none."""
    env = {**os.environ, "TINKER_BASE_URL": cluster.base_url, "TINKER_API_KEY": key}
    done = subprocess.run(
        [TINKER, "--format", "json", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return json.loads(done.stdout) if done.stdout.strip() else None


def cli_fails(cluster: Cluster, *args: str) -> str:
    env = {**os.environ, "TINKER_BASE_URL": cluster.base_url, "TINKER_API_KEY": API_KEY}
    done = subprocess.run(
        [TINKER, *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode != 0, (args, done.stdout)
    return done.stdout + done.stderr


def not_found(call: Callable[[], object]) -> None:
    with pytest.raises(tinker.NotFoundError):
        call()


# -- RestClient ------------------------------------------------------------------------------


def test_rest_client_lists_publishes_expires_and_pages(
    trained: Trained, rest: tinker.RestClient
) -> None:
    mine = by_path(rest, trained.run_id)
    assert {trained.state, trained.sampler, trained.export} <= set(mine)
    assert mine[trained.export].checkpoint_type == "external"
    assert mine[trained.export].checkpoint_id == "external_weights/rest-export"

    # Other tests' sessions of this cluster end meanwhile and save `session-end` checkpoints:
    # a page is compared with a full listing taken while nothing changed around it.
    for _ in range(20):
        everything = rest.list_user_checkpoints(limit=1000).result()
        second = rest.list_user_checkpoints(limit=1, offset=1).result()
        again = rest.list_user_checkpoints(limit=1000).result()
        if everything.checkpoints == again.checkpoints:
            break
        time.sleep(0.5)
    assert everything.cursor is not None and everything.cursor.total_count >= 3
    times = [c.time for c in everything.checkpoints]
    assert times == sorted(times, reverse=True)  # newest first
    assert {trained.state, trained.sampler, trained.export} <= {
        c.tinker_path for c in everything.checkpoints
    }
    assert [c.tinker_path for c in second.checkpoints] == [everything.checkpoints[1].tinker_path]
    assert second.cursor is not None and second.cursor.limit == 1 and second.cursor.offset == 1

    rest.set_checkpoint_ttl_from_tinker_path(trained.state, 7200).result()
    expires = by_path(rest, trained.run_id)[trained.state].expires_at
    assert expires is not None and expires.tzinfo is not None
    assert 7100 < expires.timestamp() - time.time() <= 7200
    rest.set_checkpoint_ttl_from_tinker_path(trained.state, None).result()
    assert by_path(rest, trained.run_id)[trained.state].expires_at is None
    with pytest.raises(tinker.BadRequestError):
        rest.set_checkpoint_ttl_from_tinker_path(trained.state, -5).result()

    rest.publish_checkpoint_from_tinker_path(trained.sampler).result()
    rest.publish_checkpoint_from_tinker_path(trained.sampler).result()  # idempotent
    assert by_path(rest, trained.run_id)[trained.sampler].public
    rest.unpublish_checkpoint_from_tinker_path(trained.sampler).result()
    assert not by_path(rest, trained.run_id)[trained.sampler].public


def test_rest_client_sessions(trained: Trained, rest: tinker.RestClient) -> None:
    sessions = rest.list_sessions(limit=1000).result().sessions
    assert trained.session_id in sessions
    session = rest.get_session(trained.session_id).result()
    assert trained.run_id in session.training_run_ids
    assert rest.list_sessions(limit=1, offset=0).result().sessions == sessions[:1]


def test_external_weights_urls_are_signed_and_expire_with_content(
    cluster: Cluster, trained: Trained, rest: tinker.RestClient
) -> None:
    signed = rest.get_external_weights_urls(trained.export).result()
    assert set(signed.urls) == PEFT_FILES
    assert 60 < signed.expires.timestamp() - time.time() <= 900
    on_disk = checkpoint_dir(cluster, trained.export)
    for name, url in signed.urls.items():
        assert fetch(url) == (on_disk / name).read_bytes()  # no API key needed
    url = signed.urls["adapter_config.json"]
    for forged in (
        url.replace("sig=", "sig=0"),
        url.split("?")[0],
        url.replace("expires=", "expires=1"),
    ):
        with pytest.raises(urllib.error.HTTPError) as refused:
            fetch(forged)
        assert refused.value.code == 403


def test_delete_removes_record_files_and_versions(
    cluster: Cluster, trained: Trained, rest: tinker.RestClient
) -> None:
    first = trained.client.save_state("rolling").result().path
    again = trained.client.save_state("rolling", overwrite=True).result().path
    assert first == again
    versions = checkpoint_dir(cluster, first).parent / ".versions" / "rolling"
    assert checkpoint_dir(cluster, first).is_dir() and any(versions.iterdir())
    rest.delete_checkpoint_from_tinker_path(first).result()
    assert first not in by_path(rest, trained.run_id)
    assert not checkpoint_dir(cluster, first).exists() and not versions.exists()
    not_found(lambda: rest.delete_checkpoint_from_tinker_path(first).result())


def test_delete_of_an_id_without_its_kind_names_the_form(
    cluster: Cluster, trained: Trained, rest: tinker.RestClient
) -> None:
    run = quote(trained.run_id, safe=":")
    with httpx.Client(base_url=cluster.base_url, headers={"X-API-Key": API_KEY}) as http:
        for bare in ("rest-state", "x" * 5000, "%2E%2E"):
            answer = http.delete(f"/api/v1/training_runs/{run}/checkpoints/{bare}")
            assert answer.status_code == 400, answer.text
            assert "must start with 'weights/' or 'sampler_weights/'" in answer.text
            assert len(answer.text) < 1000
    assert trained.state in by_path(rest, trained.run_id)  # nothing was deleted


# -- downloads load in PEFT ----------------------------------------------------------------------


PEFT_CHECK = """
import json, sys, torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
base_dir, folders = sys.argv[1], sys.argv[2:]
torch.manual_seed(0)
tokens = torch.tensor([[7, 19, 23, 42, 101]])
base = AutoModelForCausalLM.from_pretrained(base_dir)
reference = base(tokens).logits
moved = []
for folder in folders:
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), folder)
    moved.append(float((model(tokens).logits - reference).abs().max()))
print(json.dumps(moved))
"""


def test_downloads_load_in_peft(
    cluster: Cluster, trained: Trained, rest: tinker.RestClient, tiny_model: Path, tmp_path: Path
) -> None:
    # SDK 0.38: `tinker checkpoint download` of a training checkpoint exports it through a
    # temporary external checkpoint and fetches each file by its signed URL
    out = cli(cluster, "checkpoint", "download", trained.state, "--output", str(tmp_path))
    downloaded = Path(out["destination"])
    assert {p.name for p in downloaded.iterdir()} == PEFT_FILES
    leftovers = rest.list_user_checkpoints(limit=1000).result().checkpoints
    assert not [c for c in leftovers if c.tinker_path.endswith("/external_weights/download")]

    # older SDKs: `archive` answers a 302 to a signed tar, extracted into a folder
    run = quote(trained.run_id, safe=":")
    with httpx.Client(base_url=cluster.base_url, headers={"X-API-Key": API_KEY}) as http:
        redirect = http.get(
            f"/api/v1/training_runs/{run}/checkpoints/external_weights/rest-export/archive"
        )
        assert redirect.status_code == 302 and redirect.headers["Expires"].endswith("GMT")
        archive = httpx.get(redirect.headers["Location"], timeout=30)  # no API key
    assert archive.status_code == 200 and archive.headers["content-type"] == "application/x-tar"
    extracted = tmp_path / "from-archive"
    with tarfile.open(fileobj=io.BytesIO(archive.content)) as tar:
        assert set(tar.getnames()) == PEFT_FILES
        tar.extractall(extracted, filter="data")

    # what came down is what was saved, tensor for tensor
    for folder, saved in ((downloaded, trained.state), (extracted, trained.export)):
        got = safetensors.numpy.load_file(folder / "adapter_model.safetensors")
        want = safetensors.numpy.load_file(
            checkpoint_dir(cluster, saved) / "adapter_model.safetensors"
        )
        assert got.keys() == want.keys() and all((got[k] == want[k]).all() for k in want)

    check = subprocess.run(
        [sys.executable, "-c", PEFT_CHECK, str(tiny_model), str(downloaded), str(extracted)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert check.returncode == 0, check.stderr[-3000:]
    moved = json.loads(check.stdout.strip().splitlines()[-1])
    assert all(delta > 1e-6 for delta in moved), moved  # the trained adapter is really applied


# -- the tinker command line --------------------------------------------------------------------


def test_sdk_clients_use_httpx_own_transport(rest: tinker.RestClient) -> None:
    # The gateway's client config turns pyqwest off: its runtime threads abort a client process
    # that exits while one of them calls into Python (about 1 `tinker` CLI run in 50, loaded).
    assert rest.holder.get_client_config().use_pyqwest_transport is False

    async def transport() -> object:  # a pool's client, on the holder's own loop
        with rest.holder.aclient(ClientConnectionPoolType.TRAIN) as client:
            return client._client._transport

    used = rest.holder.run_coroutine_threadsafe(transport()).result(timeout=30)
    assert isinstance(used, httpx.AsyncHTTPTransport), type(used)


def test_tinker_cli_commands(
    cluster: Cluster, trained: Trained, rest: tinker.RestClient, tmp_path: Path
) -> None:
    # The CLI takes seconds to start: the calls that only read run beside the ones that write.
    with ThreadPoolExecutor(max_workers=3) as pool:
        reads = {
            args: pool.submit(cli, cluster, *args)
            for args in (
                ("checkpoint", "list", "--limit", "0"),
                ("checkpoint", "list", "--run-id", trained.run_id),
                ("checkpoint", "info", trained.state),
                ("run", "list", "--limit", "0"),
                ("run", "info", trained.run_id),
            )
        }
        trace = ("session", "export-trace", trained.session_id, "-o", str(tmp_path / "t"))
        refused = pool.submit(cli_fails, cluster, *trace)

        def shown(path: str) -> types.Checkpoint:
            return by_path(rest, trained.run_id)[path]

        assert cli(cluster, "checkpoint", "publish", trained.export) is None
        assert shown(trained.export).public
        cli(cluster, "checkpoint", "unpublish", trained.export)
        assert not shown(trained.export).public
        cli(cluster, "checkpoint", "set-ttl", trained.export, "--ttl", "86400")
        assert shown(trained.export).expires_at is not None
        cli(cluster, "checkpoint", "set-ttl", trained.export, "--remove")
        assert shown(trained.export).expires_at is None

        doomed = trained.client.save_weights_for_sampler("cli-doomed").result().path
        deleted = cli(cluster, "checkpoint", "delete", "-y", doomed)
        assert deleted == {"deleted_count": 1, "failed": []}
        assert not checkpoint_dir(cluster, doomed).exists()
        listed, by_run, info, runs, run = (future.result() for future in reads.values())
        assert "not supported" in refused.result()
        assert "Resource not found" not in refused.result()

    assert {trained.state, trained.sampler} <= {c["tinker_path"] for c in listed["checkpoints"]}
    assert by_run["run_id"] == trained.run_id
    assert trained.export in {c["tinker_path"] for c in by_run["checkpoints"]}
    assert info["checkpoint_type"] == "training" and info["lora_rank"] == 4
    assert trained.run_id in {r["training_run_id"] for r in runs["runs"]}
    assert run["training_run_id"] == trained.run_id and run["lora_rank"] == 4


# -- tenants -----------------------------------------------------------------------------------


def test_another_tenant_gets_404_for_everything_of_ours(
    cluster: Cluster, trained: Trained, other_rest: tinker.RestClient
) -> None:
    for path in (trained.state, trained.sampler, trained.export):
        not_found(lambda p=path: other_rest.delete_checkpoint_from_tinker_path(p).result())
        not_found(lambda p=path: other_rest.publish_checkpoint_from_tinker_path(p).result())
        not_found(lambda p=path: other_rest.unpublish_checkpoint_from_tinker_path(p).result())
        not_found(lambda p=path: other_rest.set_checkpoint_ttl_from_tinker_path(p, 7200).result())
        not_found(lambda p=path: other_rest.copy_weights(p, "proj").result())
    not_found(lambda: other_rest.get_external_weights_urls(trained.export).result())
    not_found(lambda: other_rest.list_checkpoints(trained.run_id).result())
    not_found(lambda: other_rest.get_session(trained.session_id).result())
    theirs = other_rest.list_user_checkpoints(limit=1000).result().checkpoints
    assert not [c for c in theirs if c.tinker_path.startswith(f"tinker://{trained.run_id}/")]
    assert trained.session_id not in other_rest.list_sessions(limit=1000).result().sessions
    env = {**os.environ, "TINKER_BASE_URL": cluster.base_url, "TINKER_API_KEY": OTHER_TENANT_KEY}
    done = subprocess.run(
        [TINKER, "checkpoint", "delete", "-y", trained.sampler],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "Deleted 0 checkpoint(s)" in done.stdout and "not found" in done.stdout
    assert checkpoint_dir(cluster, trained.sampler).is_dir()


def test_a_published_checkpoint_is_readable_by_all_and_writable_by_none_but_us(
    cluster: Cluster, trained: Trained, rest: tinker.RestClient, other_rest: tinker.RestClient
) -> None:
    for path in (trained.state, trained.sampler, trained.export):
        rest.publish_checkpoint_from_tinker_path(path).result()
    other = tinker.ServiceClient(base_url=cluster.base_url, api_key=OTHER_TENANT_KEY)
    try:
        sampling = other.create_sampling_client(model_path=trained.sampler).result()
        sample = sampling.sample(
            types.ModelInput.from_ints([7, 19, 23]), 1, types.SamplingParams(max_tokens=4, seed=1)
        ).result()
        assert len(sample.sequences[0].tokens) == 4
        loaded = other.create_training_client_from_state(trained.state).result()
        assert (
            loaded.get_info().model_data.model_name
            == rest.get_training_run(trained.run_id).result().base_model
        )
        assert set(other_rest.get_external_weights_urls(trained.export).result().urls) == PEFT_FILES
        # the copy is theirs, and counts toward their storage quota as a save would
        quota_url = f"{cluster.base_url}/admin/v1/quotas/other"
        admin = {"X-Admin-Key": cluster.admin_key}
        set_quota = httpx.put(quota_url, json={"max_checkpoint_bytes": 1}, headers=admin)
        assert set_quota.status_code == 200, set_quota.text
        try:
            with pytest.raises(tinker.PermissionDeniedError, match="max_checkpoint_bytes"):
                other_rest.copy_weights(trained.sampler, "their-project").result()
        finally:
            httpx.put(quota_url, json={"max_checkpoint_bytes": None}, headers=admin)
        copy = other_rest.copy_weights(trained.sampler, "their-project").result()
        assert copy.endswith("/sampler_weights/rest-sampler") and trained.run_id not in copy
        assert copy in {
            c.tinker_path for c in other_rest.list_user_checkpoints().result().checkpoints
        }
        for path in (trained.state, trained.sampler, trained.export):
            not_found(lambda p=path: other_rest.delete_checkpoint_from_tinker_path(p).result())
            not_found(lambda p=path: other_rest.unpublish_checkpoint_from_tinker_path(p).result())
            not_found(
                lambda p=path: other_rest.set_checkpoint_ttl_from_tinker_path(p, 7200).result()
            )
        assert all(
            c.public
            for c in by_path(rest, trained.run_id).values()
            if c.tinker_path in (trained.state, trained.sampler, trained.export)
        )
    finally:
        for path in (trained.state, trained.sampler, trained.export):
            rest.unpublish_checkpoint_from_tinker_path(path).result()
        other.close("success").result()
    not_found(lambda: other_rest.get_external_weights_urls(trained.export).result())


# -- copy_weights and unload_model ---------------------------------------------------------------


def test_copy_weights_shares_files_and_retries_find_the_same_copy(
    cluster: Cluster, trained: Trained, rest: tinker.RestClient
) -> None:
    copied = rest.copy_weights(trained.state, "archive", ttl_seconds=7200).result()
    run_id = copied.removeprefix("tinker://").split("/")[0]
    listed = by_path(rest, run_id)[copied]
    assert listed.checkpoint_type == "training" and listed.expires_at is not None
    source = checkpoint_dir(cluster, trained.state) / "adapter_model.safetensors"
    target = checkpoint_dir(cluster, copied) / "adapter_model.safetensors"
    assert source.stat().st_ino == target.stat().st_ino  # hard-linked: no bytes duplicated
    wire = Wire(cluster.base_url, API_KEY)
    try:
        body = {"source_path": trained.sampler, "destination_project_id": "p"}
        headers = {"X-Idempotency-Key": "key-1"}
        first = wire.post("copy_weights", body, headers=headers).json()["tinker_path"]
        assert wire.post("copy_weights", body, headers=headers).json()["tinker_path"] == first
        missing = wire.post("copy_weights", {"source_path": trained.sampler})
        assert missing.status_code == 400 and "destination_project_id" in missing.text
    finally:
        wire.close()


def test_unload_model_as_older_sdks_send_it(cluster: Cluster, tiny_model: Path) -> None:
    wire = Wire(cluster.base_url, API_KEY)
    try:
        model_id = wire.create_model(wire.session(), str(tiny_model), rank=2)
        accepted = wire.post("unload_model", {"model_id": model_id, "type": "unload_model"})
        assert accepted.status_code == 200, accepted.text
        result = wire.result(accepted.json()["request_id"]).json()
        assert result == {"model_id": model_id, "type": "unload_model"}
        # the model is gone: later calls answer 410 and name where its state was saved
        gone = wire.optim_step(model_id, 1)
        assert gone.status_code == 410 and "session-end" in gone.text
        other = Wire(cluster.base_url, OTHER_TENANT_KEY)
        assert other.post("unload_model", {"model_id": model_id}).status_code == 404
        other.close()
    finally:
        wire.close()


# -- the TTL sweeper -------------------------------------------------------------------------------


@pytest.fixture
def sweeping_gateway(cluster: Cluster, tmp_path: Path) -> Iterator[str]:
    """A second gateway on the cluster's bus and store that sweeps every half second."""
    ready = tmp_path / "gateway.json"
    keys = cluster.data_dir / "keys.txt"
    log = open(tmp_path / "gateway.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "twinkle_async", "gateway", "--nats-url", cluster.nats_url,
            "--port", "0", "--api-key", API_KEY, "--key-file", str(keys), "--data-dir",
            str(cluster.data_dir), "--checkpoint-sweep-s", "0.5", "--ready-file", str(ready),
        ],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (
                tmp_path / "gateway.log"
            ).read_text()
            time.sleep(0.05)
        yield json.loads(ready.read_text())["base_url"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_an_expired_checkpoint_is_swept(
    cluster: Cluster, trained: Trained, rest: tinker.RestClient, sweeping_gateway: str
) -> None:
    # The long-lived one first: under load a save can take seconds, and the short-lived one must
    # still be there when it is looked at right after its own save.
    kept = trained.client.save_state("long-lived", ttl_seconds=3600).result().path
    path = trained.client.save_state("short-lived", ttl_seconds=8).result().path
    assert checkpoint_dir(cluster, path).is_dir()
    deadline = time.monotonic() + 40
    while path in by_path(rest, trained.run_id):
        assert time.monotonic() < deadline, "the expired checkpoint was not swept"
        time.sleep(0.25)
    assert not checkpoint_dir(cluster, path).exists()
    assert kept in by_path(rest, trained.run_id) and checkpoint_dir(cluster, kept).is_dir()
    # the sweeping gateway serves the same API
    mine = tinker.RestClient(base_url=sweeping_gateway, api_key=API_KEY)
    assert kept in {
        c.tinker_path for c in mine.list_checkpoints(trained.run_id).result().checkpoints
    }


def test_the_rest_of_the_sdk_surface(trained: Trained, rest: tinker.RestClient) -> None:
    """The calls no other test makes: a run by checkpoint path, a sampler's record, a sampling
    client's base model and tokenizer, an `inflight` sampling client, and the two session
    calls this server refuses (projects, trace export) with their reasons."""
    run = rest.get_training_run_by_tinker_path(trained.state).result()
    assert run.training_run_id == trained.run_id
    sampling = trained.client.save_weights_and_get_sampling_client(kind="inflight").result()
    info = rest.get_sampler(sampling._sampling_session_id).result()  # the SDK's own id
    assert info.base_model == sampling.get_base_model() == run.base_model
    tokenizer = sampling.get_tokenizer()
    assert tokenizer.decode(tokenizer.encode("abc")) == "abc"
    out = sampling.sample(
        types.ModelInput.from_ints([5, 6, 7]), 2, types.SamplingParams(max_tokens=3, seed=1)
    ).result()
    assert [len(seq.tokens) for seq in out.sequences] == [3, 3]
    with pytest.raises(tinker.BadRequestError, match="projects are not supported"):
        rest.assign_session_project(trained.session_id, "p1").result()
    with pytest.raises(tinker.BadRequestError, match="trace export is not supported"):
        rest.export_session_trace(trained.session_id).result()

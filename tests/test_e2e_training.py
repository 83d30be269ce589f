"""End to end through the official tinker SDK 0.38 and a real local cluster: supervised
training, exact resume, runs and checkpoints listing, and both tiny model families."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import tinker

from tests.conftest import OTHER_TENANT_KEY, Cluster
from tests.sdk_helpers import toy_batch, train_steps

pytestmark = pytest.mark.e2e


def test_sft_loss_falls_below_half(service: tinker.ServiceClient, tiny_model: Path) -> None:
    client = service.create_lora_training_client(
        base_model=str(tiny_model), rank=8, seed=1
    ).result()
    losses = train_steps(client, toy_batch(), 30)
    assert len(losses) == 30
    assert losses[-1] < 0.5 * losses[0], losses


def test_exact_resume_with_and_without_optimizer(
    service: tinker.ServiceClient, tiny_model: Path
) -> None:
    batch = toy_batch(seed=3)
    client = service.create_lora_training_client(
        base_model=str(tiny_model), rank=8, seed=2
    ).result()
    train_steps(client, batch, 10)
    path = client.save_state("after-10").result().path
    assert path.startswith("tinker://") and path.endswith("/weights/after-10")
    original = train_steps(client, batch, 5)

    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    again = train_steps(resumed, batch, 5)
    assert max(abs(a - b) for a, b in zip(original, again, strict=True)) <= 1e-5, (original, again)

    weights_only = service.create_training_client_from_state(path).result()
    fresh_optimizer = train_steps(weights_only, batch, 5)
    # Same weights, so the first loss matches; a restarted AdamW then takes other steps.
    assert abs(fresh_optimizer[0] - original[0]) <= 1e-5
    assert max(abs(a - b) for a, b in zip(original[1:], fresh_optimizer[1:], strict=True)) > 1e-4


def test_rest_lists_runs_and_checkpoints(
    service: tinker.ServiceClient, cluster: Cluster, tiny_model: Path
) -> None:
    client = service.create_lora_training_client(
        base_model=str(tiny_model), rank=4, seed=5
    ).result()
    train_steps(client, toy_batch(n=2), 2)
    state = client.save_state("ckpt-a").result().path
    sampler = client.save_weights_for_sampler("snap-a").result().path
    model_id = client.model_id

    rest = tinker.RestClient(base_url=cluster.base_url, api_key=cluster.api_key)
    # the session's cluster holds every test's runs: page through them
    mine, offset = [], 0
    while True:
        runs = rest.list_training_runs(limit=100, offset=offset).result()
        assert runs.cursor.total_count >= 1
        mine += [run for run in runs.training_runs if run.training_run_id == model_id]
        offset += len(runs.training_runs)
        if not runs.training_runs or offset >= runs.cursor.total_count:
            break
    assert len(mine) == 1
    assert mine[0].base_model == str(tiny_model) and mine[0].lora_rank == 4 and mine[0].is_lora
    assert mine[0].last_checkpoint is not None and mine[0].last_checkpoint.tinker_path == state

    ckpts = rest.list_checkpoints(model_id).result().checkpoints
    by_path = {c.tinker_path: c for c in ckpts}
    assert set(by_path) == {state, sampler}
    assert (
        by_path[state].checkpoint_type == "training"
        and by_path[state].checkpoint_id == "weights/ckpt-a"
    )
    assert by_path[sampler].checkpoint_type == "sampler" and by_path[sampler].size_bytes > 0

    run = rest.get_training_run(model_id).result()
    assert run.training_run_id == model_id
    info = rest.get_weights_info_by_tinker_path(state).result()
    assert info.lora_rank == 4 and info.base_model == str(tiny_model)


def test_qwen3_5_trains_through_the_same_path(
    service: tinker.ServiceClient, tiny_model_35: Path
) -> None:
    client = service.create_lora_training_client(
        base_model=str(tiny_model_35), rank=8, seed=0
    ).result()
    info = client.get_info()
    assert info.model_data.model_name == str(tiny_model_35)
    losses = train_steps(client, toy_batch(), 12)
    assert losses[-1] < 0.8 * losses[0], losses


def test_tokenizer_and_capabilities(
    service: tinker.ServiceClient, cluster: Cluster, tiny_model: Path, tiny_model_35: Path
) -> None:
    caps = (
        tinker.RestClient(base_url=cluster.base_url, api_key=cluster.api_key)
        .get_server_capabilities()
        .result()
    )
    names = {m.model_name for m in caps.supported_models}
    assert {str(tiny_model), str(tiny_model_35)} <= names
    client = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    tokenizer = client.get_tokenizer()
    assert tokenizer.decode(tokenizer.encode("hello world")) == "hello world"


@pytest.mark.filterwarnings(
    "ignore::FutureWarning"
)  # load_state_* is deprecated in the SDK, still sent by old loops
def test_legacy_load_state_into_an_existing_client(
    service: tinker.ServiceClient, tiny_model: Path
) -> None:
    batch = toy_batch(seed=9)
    client = service.create_lora_training_client(
        base_model=str(tiny_model), rank=8, seed=4
    ).result()
    train_steps(client, batch, 4)
    path = client.save_state("legacy").result().path
    original = train_steps(client, batch, 3)
    client.load_state_with_optimizer(path).result()
    again = train_steps(client, batch, 3)
    assert max(abs(a - b) for a, b in zip(original, again, strict=True)) <= 1e-5, (original, again)


@contextmanager
def _quota(cluster: Cluster, tenant: str, **limits: int) -> Iterator[None]:
    """Set limits of `tenant` for the block, then restore the defaults."""
    url = f"{cluster.base_url}/admin/v1/quotas/{tenant}"
    admin = {"X-Admin-Key": cluster.admin_key}
    resp = httpx.put(url, json=limits, headers=admin)
    assert resp.status_code == 200, resp.text
    try:
        yield
    finally:
        httpx.put(url, json=dict.fromkeys(limits), headers=admin)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # load_state_* is deprecated in the SDK
def test_legacy_load_state_keeps_the_model_shape_and_the_rank_quota(
    cluster: Cluster, tiny_model: Path
) -> None:
    """A load into an existing model once took any checkpoint of its base model: a rank-8
    adapter went into a rank-4 model's slot, past `max_rank`, with its record still saying 4."""
    service = tinker.ServiceClient(base_url=cluster.base_url, api_key=OTHER_TENANT_KEY)
    try:
        wide = service.create_lora_training_client(base_model=str(tiny_model), rank=8).result()
        narrow = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
        no_attn = service.create_lora_training_client(
            base_model=str(tiny_model), rank=8, train_attn=False
        ).result()
        wide_path = wide.save_state("wide").result().path
        for model, differs in ((narrow, "rank=4"), (no_attn, "train_attn=False")):
            with pytest.raises(tinker.APIStatusError) as refused:
                model.load_state(wide_path).result()
            assert refused.value.status_code == 400, refused.value
            assert "rank=8" in str(refused.value) and differs in str(refused.value)
            assert "create_training_client_from_state" in str(refused.value)
        with _quota(cluster, "other", max_rank=4):
            with pytest.raises(tinker.APIStatusError, match="max_rank") as over:
                wide.load_state(wide_path).result()
            assert over.value.status_code == 403
        wide.load_state(wide_path).result()  # the same shape, within quota
        # every refusal settled its seq: the models go on
        assert narrow.get_info().lora_rank == 4
        for model in (wide, narrow, no_attn):
            assert len(train_steps(model, toy_batch(n=2), 1)) == 1
    finally:
        service.close("success").result()


def test_exports_and_new_models_count_toward_the_storage_quota(
    cluster: Cluster, tiny_model: Path
) -> None:
    """`save_weights_external` never checked `max_checkpoint_bytes`; a new model writes a
    session-end checkpoint when unloaded, so it is refused too once the tenant is full."""
    service = tinker.ServiceClient(base_url=cluster.base_url, api_key=OTHER_TENANT_KEY)
    try:
        client = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
        client.save_state("storage-quota").result()  # the tenant holds at least one checkpoint
        with _quota(cluster, "other", max_checkpoint_bytes=1):
            with pytest.raises(tinker.APIStatusError, match="max_checkpoint_bytes") as export:
                client.save_weights_external("over-quota").result()
            assert export.value.status_code == 403
            with pytest.raises(tinker.APIStatusError, match="max_checkpoint_bytes") as create:
                service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
            assert create.value.status_code == 403
        assert (
            client.save_weights_external("under-quota")
            .result()
            .path.endswith("/external_weights/under-quota")
        )
    finally:
        service.close("success").result()


def test_concurrent_clients_match_their_solo_runs(
    service: tinker.ServiceClient, tiny_model: Path
) -> None:
    """Several clients training at once share passes on the worker; each sees its solo numbers."""
    import concurrent.futures

    setups = [
        (rank, seed, toy_batch(n=2 + seed % 3, seed=40 + seed))
        for rank, seed in ((4, 1), (8, 2), (16, 3))
    ]

    def run(rank: int, seed: int, batch: list) -> list[float]:
        client = service.create_lora_training_client(
            base_model=str(tiny_model), rank=rank, seed=seed
        ).result()
        return train_steps(client, batch, 6)

    solo = [run(*setup) for setup in setups]
    with concurrent.futures.ThreadPoolExecutor(len(setups)) as pool:
        together = list(pool.map(lambda setup: run(*setup), setups))
    for a, b in zip(solo, together, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-4, (a, b)


def test_a_datum_over_the_memory_plan_is_refused_at_once(
    service: tinker.ServiceClient, cluster: Cluster, tiny_model: Path
) -> None:
    """The worker plans the longest datum it trains and the longest sequence it samples
    (`workers.engine.memory.plan_tokens`), reports both with its heartbeat, and the gateway
    shows them in `get_server_capabilities` and refuses a longer datum with a 400 naming the
    limit and the datum, before anything runs; the next step runs as usual."""
    import time

    caps = httpx.get(
        f"{cluster.base_url}/api/v1/get_server_capabilities",
        headers={"X-API-Key": cluster.api_key},
    ).json()
    [entry] = [m for m in caps["supported_models"] if m["model_name"] == str(tiny_model)]
    limit, longest = entry["max_train_tokens"], entry["max_sample_tokens"]
    assert 0 < limit <= entry["max_context_length"] and 0 < longest <= entry["max_context_length"]
    client = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    too_long = toy_batch(n=1, length=limit + 1)[0]
    started = time.monotonic()
    with pytest.raises(tinker.BadRequestError) as refused:
        client.forward_backward([toy_batch(n=1)[0], too_long], "cross_entropy").result()
    assert time.monotonic() - started < 1.0
    detail = str(refused.value)
    assert f"datums[1].model_input: {limit + 1} tokens exceed the {limit} tokens" in detail
    out = client.forward_backward(toy_batch(n=2), "cross_entropy").result()
    assert out.metrics["loss:sum"] > 0
    client.optim_step(tinker.AdamParams(learning_rate=1e-3)).result()

"""The article's client programs against the session's cluster, unmodified but for the model, the
data path and the base URL: the Tinker Client program with twinkle-kit 0.5.1's
`init_tinker_client()` on the tinker 0.16.1 its `[client]` extra pins, twinkle's
Dataset/Template/DataLoader preparing the batches on the client. It runs in the twinkle-kit
virtualenv (`make install` builds `.venv-sdk/twinkle-0.5.1`), in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from transformers import AutoTokenizer

from tests.conftest import TWINKLE_PYTHON, Cluster
from tests.sdk_helpers import PROMPT, toy_batch, train_steps

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]

# rows shaped as ModelScope's `swift/self-cognition` (query, response, tag), placeholders included
_ROWS = [
    ("你是谁？", "我是{{NAME}}，由{{AUTHOR}}训练的人工智能助手。", "zh"),
    ("who are you?", "I am {{NAME}}, an assistant trained by {{AUTHOR}}.", "en"),
    ("What is your name?", "My name is {{NAME}}, made by {{AUTHOR}}.", "en"),
    ("你叫什么名字？", "我叫{{NAME}}，是{{AUTHOR}}开发的。", "zh"),
]


def self_cognition_file(directory: Path, rows: int = 40) -> Path:
    path = directory / "self-cognition.jsonl"
    with path.open("w", encoding="utf-8") as out:
        for i in range(rows):
            query, response, tag = _ROWS[i % len(_ROWS)]
            record = {"query": query, "response": response, "tag": tag}
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def run_article_program(name: str, cluster: Cluster, model: Path, data: Path) -> dict[str, object]:
    assert TWINKLE_PYTHON.exists(), f"{TWINKLE_PYTHON} is missing: `make install` builds it"
    ran = subprocess.run(
        [str(TWINKLE_PYTHON), str(ROOT / "tests" / "twinkle_article" / name)],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=data.parent,
        env={
            **os.environ,
            "PYTHONPATH": "",
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TWINKLE_ARTICLE_MODEL": str(model),
            "TWINKLE_ARTICLE_DATA": str(data),
            "TWINKLE_ARTICLE_BASE_URL": cluster.base_url,
            "TWINKLE_ARTICLE_API_KEY": cluster.api_key,
        },
    )
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-6000:]
    summary: dict[str, object] = json.loads(ran.stdout.strip().splitlines()[-1])
    return summary


@pytest.mark.timeout(600)
def test_the_articles_tinker_client_program_trains_saves_and_samples(
    cluster: Cluster, tiny_model_35: Path, tmp_path: Path
) -> None:
    summary = run_article_program(
        "tinker_client.py", cluster, tiny_model_35, self_cognition_file(tmp_path)
    )
    losses = summary["losses"]
    assert isinstance(losses, list) and len(losses) == 3 * 63  # 500 rows in batches of 8
    assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 0.5  # it learns
    for metrics in summary["metrics"]:  # type: ignore[attr-defined]
        assert metrics["learning_rate:mean"] == pytest.approx(1e-4)
        assert metrics["unclipped_grad_l2:mean"] > 0
    saved = summary["saved"]
    assert isinstance(saved, list)
    run_id = saved[0].removeprefix("tinker://").split("/")[0]
    assert saved == [f"tinker://{run_id}/weights/twinkle-lora-{epoch}" for epoch in range(3)]
    responses = summary["responses"]  # sampled from `twinkle://<run>/weights/twinkle-lora-0`
    assert isinstance(responses, list) and len(responses) == 8
    assert all(1 <= len(tokens) <= 50 for tokens in responses)

    # the checkpoints carry the path in both forms
    listed = httpx.get(
        f"{cluster.base_url}/api/v1/training_runs/{run_id}/checkpoints",
        headers={"X-API-Key": cluster.api_key},
    ).json()["checkpoints"]
    by_path = {c["tinker_path"]: c for c in listed}
    for path in saved:
        assert by_path[path]["twinkle_path"] == "twinkle://" + path.split("://")[1]


def test_a_saved_state_samples_as_the_sampler_checkpoint_of_the_same_weights(
    service: tinker.ServiceClient, tiny_model: Path
) -> None:
    client = service.create_lora_training_client(
        base_model=str(tiny_model), rank=8, seed=5
    ).result()
    train_steps(client, toy_batch(seed=12), 3)
    state = client.save_state("state").result().path
    sampler_path = client.save_weights_for_sampler("weights").result().path
    prompt = types.ModelInput.from_ints(PROMPT)

    def logprobs(**where: str) -> np.ndarray:
        sampler = service.create_sampling_client(**where).result()
        return np.asarray(sampler.compute_logprobs(prompt).result()[1:], dtype=np.float64)

    from_state = logprobs(model_path=state)  # the article samples its saved state
    np.testing.assert_allclose(from_state, logprobs(model_path=sampler_path), atol=1e-5)
    assert not np.allclose(from_state, logprobs(base_model=str(tiny_model)), atol=1e-3)


def _base_model_losses(model: Path, batch: list[dict[str, list[int]]]) -> float:
    """twinkle's `CrossEntropyLoss` (the mean over the batch's labelled tokens) of the base
    model: what an adapter's first pass computes (its B factors are zero)."""
    code = (
        "import json, sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)\n"
        "total, count = 0.0, 0\n"
        "for row in json.load(sys.stdin):\n"
        "    ids, labels = torch.tensor([row['input_ids']]), torch.tensor(row['labels'])\n"
        "    logps = model(input_ids=ids).logits[0].float().log_softmax(-1)\n"
        "    mask = labels != -100\n"
        "    total += -logps[mask].gather(-1, labels[mask, None]).sum().item()\n"
        "    count += int(mask.sum())\n"
        "print(total / count)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(model)],
        input=json.dumps(batch),
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )
    return float(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(600)
def test_a_twinkle_client_trains_with_accumulation_clipping_a_scheduler_and_resumes(
    cluster: Cluster, service: tinker.ServiceClient, tiny_model_35: Path, tmp_path: Path
) -> None:
    summary = run_article_program(
        "model_client.py", cluster, tiny_model_35, self_cognition_file(tmp_path)
    )
    assert str(tiny_model_35) in summary["models"]  # type: ignore[operator]
    losses, norms = summary["losses"], summary["norms"]
    assert isinstance(losses, list) and isinstance(norms, list) and len(losses) == 12
    # twinkle's CrossEntropyLoss: the first pass's loss is the base model's mean over tokens
    first = summary["batches"][0]  # type: ignore[index]
    assert losses[0] == pytest.approx(_base_model_losses(tiny_model_35, first), rel=1e-4)
    # gradient_accumulation_steps=2 steps as twinkle's does: after backward 3, 5, 7, ...
    synced = [step for step, norm in enumerate(norms, start=1) if norm != "None"]
    assert synced == [3, 5, 7, 9, 11]
    assert all(float(norms[step - 1]) > 0 for step in synced)
    assert losses[1] == losses[0] and losses[2] == losses[0]  # no step before backward 3
    assert losses[-1] < losses[0] - 0.3  # it learns
    # LinearLR(1.0 -> 0.5 over 4 steps) after 5 syncs: half the optimizer's 1e-3
    assert summary["metric"]["lr"] == "5.000000e-04"  # type: ignore[index]
    configs = summary["configs"]
    assert configs["gradient_accumulation_steps"] == 2  # type: ignore[index]
    assert configs["optimizer"]["lr"] == 1e-3 and configs["optimizer"]["coupled"]  # type: ignore[index]
    saved = summary["saved"]
    assert isinstance(saved, str) and saved.endswith("/weights/twinkle-epoch-0")
    assert saved in summary["checkpoints"]  # type: ignore[operator]
    # the state saved after the last pass, loaded, gives that pass's loss on the same rows
    assert summary["after_load"] == pytest.approx(losses[-1], rel=1e-5)
    _check_samples(summary["samples"], service, tiny_model_35, saved)  # type: ignore[arg-type]


def _check_samples(
    samples: dict[str, Any], service: tinker.ServiceClient, model: Path, saved: str
) -> None:
    """vLLMSampler's answers: the trajectory encoded by the sampler's template, the saved
    checkpoint's own logprobs (as Tinker's SDK computes them on the same path), the template's
    decoding, and each sequence appended to its prompt's feature."""
    trained = samples["trained"][0]["sequences"][0]
    base = samples["base"][0]["sequences"][0]
    tokens = trained["tokens"]
    assert len(tokens) == 6 and trained["stop_reason"] == "length"
    ids = trained["new_input_feature"]["input_ids"]
    assert ids[-len(tokens) :] == tokens
    prompt = ids[: -len(tokens)]
    assert base["new_input_feature"]["input_ids"][: len(prompt)] == prompt
    tokenizer = AutoTokenizer.from_pretrained(model)
    chat = [{"role": "user", "content": "who are you?"}]
    encoded = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)
    assert prompt == list(encoded["input_ids"])
    assert trained["decoded"] == tokenizer.decode(tokens)
    sampled = [row[0][1] for row in trained["logprobs"]]
    assert [row[0][0] for row in trained["logprobs"]] == tokens
    sampling = service.create_sampling_client(
        model_path=saved.replace("twinkle://", "tinker://", 1)
    ).result()
    computed = sampling.compute_logprobs(types.ModelInput.from_ints(prompt + tokens)).result()
    np.testing.assert_allclose(sampled, computed[len(prompt) :], atol=2e-3)
    base_sampled = [row[0][1] for row in base["logprobs"]]
    assert base["tokens"] != tokens or not np.allclose(base_sampled, sampled, atol=1e-3)
    features = samples["feature"][0]["sequences"]
    assert len(features) == 3
    for seq in features:
        assert 1 <= len(seq["tokens"]) <= 4 and seq["logprobs"] is None
        assert seq["new_input_feature"]["input_ids"][8:] == seq["tokens"]


@pytest.mark.timeout(900)
def test_the_articles_twinkle_client_program_trains_on_remote_datasets_and_saves(
    cluster: Cluster, tiny_model_35: Path
) -> None:
    """The Twinkle Client program: its Dataset and DataLoader live in the cluster's processor
    service (the file in the cluster's Twinkle data directory), its model calls on the model
    routes; three epochs, a save after each."""
    data = self_cognition_file(cluster.data_dir / "twinkle-data")
    summary = run_article_program("twinkle_program.py", cluster, tiny_model_35, data)
    assert str(tiny_model_35) in summary["models"]  # type: ignore[operator]
    steps = summary["steps"]
    assert isinstance(steps, int) and steps == 3 * 125  # 500 rows in batches of 4, 3 epochs
    metrics = summary["metrics"]
    assert isinstance(metrics, list) and len(metrics) == 3 * 63
    losses = [float(m["loss"]) for m in metrics]  # type: ignore[index]
    assert np.mean(losses[-10:]) < np.mean(losses[:10])  # it learns
    configs = json.loads(summary["configs"])  # type: ignore[arg-type]
    assert configs["lr_scheduler"]["cls"] == "LinearLR"
    saved = summary["saved"]
    assert isinstance(saved, list) and len(saved) == 3
    assert [path.rsplit("/", 1)[1] for path in saved] == [f"twinkle-epoch-{e}" for e in range(3)]

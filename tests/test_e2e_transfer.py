"""Adapters out and in through `twinkle-admin checkpoints export|import`, on a real cluster.

Export: a checkpoint the SDK trained, written as a PEFT folder and as a merged model, gives the
trainer's own `forward` log-probabilities in `peft` and in `transformers` (and in stock vLLM,
one slow test). A MoE checkpoint loads the same way (PEFT's `target_parameters` layout) and
exports in the per-expert and Tinker layouts too, and its per-expert export imports back exactly.
Import: an adapter trained with plain PEFT becomes a tenant's checkpoint that the SDK loads with
`create_training_client_from_state`, scores like PEFT and trains further.
Refusals: each incompatible adapter is one clear `error:` line and exit 1.

Torch work (PEFT training, reference log-probabilities) runs in child processes: the test
process stays torch-free like the gateway. Tenants are named `xfer-*`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import safetensors.numpy
import tinker
from click.testing import Result
from tinker import types
from typer.testing import CliRunner

from admin_cli.app import app
from tests.conftest import Cluster
from tests.sdk_helpers import toy_batch, train_steps

pytestmark = pytest.mark.e2e

runner = CliRunner()
NO_ENV: dict[str, str | None] = {"TWINKLE_GATEWAY": None, "TWINKLE_ADMIN_KEY": None}
TOKENS = [5, 17, 42, 99, 7, 63, 120, 11, 250, 3, 77, 31]  # a fixed prompt, scored token by token
PEFT_FILES = {"adapter_config.json", "adapter_model.safetensors"}
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")

LOGPROBS = """
import json, sys, torch
from transformers import AutoModelForCausalLM
torch.set_num_threads(1)
base, kind, folder, tokens = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
if kind == "merged":
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
else:
    from peft import PeftModel
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, folder)
model.eval()
with torch.no_grad():
    logits = model(torch.tensor([tokens[:-1]])).logits[0].float()
picked = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
print(json.dumps(picked.tolist()))
"""

TRAIN_PEFT = """
import json, sys, torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
torch.set_num_threads(1)
torch.manual_seed(0)
base, out, tokens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=json.loads(sys.argv[4]))
model = get_peft_model(model, config)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
ids = torch.tensor([tokens])
for _ in range(5):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
model.save_pretrained(out)
model.eval()
with torch.no_grad():
    logits = model(torch.tensor([tokens[:-1]])).logits[0].float()
picked = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
print(json.dumps(picked.tolist()))
"""

VLLM_LOGPROBS = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest
base, folder, tokens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = LLM(model=base, dtype="float32", enforce_eager=True, enable_lora=True, max_lora_rank=8,
          max_loras=1, max_model_len=256, seed=0, disable_log_stats=True)
params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
prompt = TokensPrompt(prompt_token_ids=tokens)
[out] = llm.generate([prompt], params, lora_request=LoRARequest("exported", 1, folder))
rows = out.prompt_logprobs
print(json.dumps([rows[i][tokens[i]].logprob for i in range(1, len(tokens))]))
"""
VLLM_ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}


def cli(cluster: Cluster, *args: str) -> Result:
    argv = ["--gateway", cluster.base_url, "--admin-key", cluster.admin_key, *args]
    return runner.invoke(app, argv, env=NO_ENV)


def ok(cluster: Cluster, *args: str) -> Any:
    result = cli(cluster, "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def refused(result: Result, *details: str) -> None:
    """Exit 1, nothing on stdout, one `error:` line naming every detail."""
    assert result.exit_code == 1, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert all(detail in lines[0] for detail in details), lines[0]


def torch_child(script: str, *args: str, env: dict[str, str] | None = None) -> Any:
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def sdk_logprobs(client: tinker.TrainingClient) -> np.ndarray:
    out = client.forward([datum(TOKENS)], "cross_entropy").result()
    return np.asarray(out.loss_fn_outputs[0]["logprobs"].data, dtype=np.float64)


def tenant(cluster: Cluster, name: str) -> tinker.ServiceClient:
    ok(cluster, "tenants", "create", name)
    key = ok(cluster, "keys", "create", "--tenant", name)["key"]
    return tinker.ServiceClient(base_url=cluster.base_url, api_key=key)


# -- export -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(cluster: Cluster, tiny_model: Path) -> tuple[str, np.ndarray]:
    """A checkpoint the SDK trained (no lm_head, so vLLM takes it), and its forward logprobs."""
    service = tenant(cluster, "xfer-export")
    client = service.create_lora_training_client(
        base_model=str(tiny_model), rank=4, train_unembed=False
    ).result()
    train_steps(client, toy_batch(n=2), 3)
    path = client.save_state("to-export").result().path
    return path, sdk_logprobs(client)


def test_export_loads_in_peft_and_merged_in_transformers(
    cluster: Cluster, tiny_model: Path, trained: tuple[str, np.ndarray], tmp_path: Path
) -> None:
    path, expected = trained
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    answer = ok(cluster, "checkpoints", "export", path, str(adapter))
    assert answer["kind"] == "adapter" and {p.name for p in adapter.iterdir()} == PEFT_FILES
    answer = ok(cluster, "checkpoints", "export", path, str(merged), "--merged")
    names = {p.name for p in merged.iterdir()}
    assert answer["kind"] == "merged" and {"config.json", "model.safetensors"} <= names
    assert "tokenizer.json" in names and "adapter_config.json" not in names
    # the export is fetched and removed from the store
    assert not list((cluster.data_dir / "checkpoints" / ".exports").glob("*"))

    tokens = json.dumps(TOKENS)
    in_peft = torch_child(LOGPROBS, str(tiny_model), "peft", str(adapter), tokens)
    in_transformers = torch_child(LOGPROBS, str(tiny_model), "merged", str(merged), tokens)
    base = torch_child(LOGPROBS, str(tiny_model), "merged", str(tiny_model), tokens)
    np.testing.assert_allclose(in_peft, expected, atol=1e-4, rtol=0)
    np.testing.assert_allclose(in_transformers, expected, atol=1e-4, rtol=0)
    assert np.abs(np.asarray(base) - expected).max() > 1e-3  # the adapter really is applied

    # the human line, and a folder that is not empty is refused before anything is fetched
    result = cli(cluster, "checkpoints", "export", path, str(tmp_path / "again"))
    assert result.exit_code == 0 and "exported" in result.stdout
    result = cli(cluster, "checkpoints", "export", path, str(adapter))
    assert result.exit_code == 2 and "not an empty folder" in result.output
    refused(cli(cluster, "checkpoints", "export", path + "-nope", str(tmp_path / "x")), "not found")


def test_merged_export_of_a_trained_unembedding(
    cluster: Cluster, tiny_model: Path, tmp_path: Path
) -> None:
    """The tiny model ties lm_head to the embedding: a merged lm_head must come apart from it."""
    service = tenant(cluster, "xfer-unembed")
    client = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    train_steps(client, toy_batch(n=2), 3)
    path = client.save_state("with-unembed").result().path
    ok(cluster, "checkpoints", "export", path, str(tmp_path / "merged"), "--merged")
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    got = torch_child(
        LOGPROBS, str(tiny_model), "merged", str(tmp_path / "merged"), json.dumps(TOKENS)
    )
    np.testing.assert_allclose(got, sdk_logprobs(client), atol=1e-4, rtol=0)


def test_exported_adapter_loads_in_vllm(
    cluster: Cluster, tiny_model: Path, trained: tuple[str, np.ndarray], tmp_path: Path
) -> None:
    """Stock vLLM (not our sampler) loads the exported folder as a LoRA as is."""
    path, expected = trained
    ok(cluster, "checkpoints", "export", path, str(tmp_path / "adapter"))
    got = torch_child(
        VLLM_LOGPROBS, str(tiny_model), str(tmp_path / "adapter"), json.dumps(TOKENS), env=VLLM_ENV
    )
    np.testing.assert_allclose(got, expected, atol=1e-3, rtol=0)


@pytest.fixture(scope="module")
def trained_moe(cluster: Cluster, tiny_model_moe: Path) -> tuple[str, np.ndarray]:
    """A MoE checkpoint the SDK trained (attention and experts), and its forward logprobs."""
    service = tenant(cluster, "xfer-moe")
    client = service.create_lora_training_client(
        base_model=str(tiny_model_moe), rank=4, train_unembed=False
    ).result()
    train_steps(client, toy_batch(n=2), 3, lr=2e-2)
    path = client.save_state("moe-to-export").result().path
    return path, sdk_logprobs(client)


def test_a_moe_export_loads_in_peft_and_comes_in_every_layout(
    cluster: Cluster, tiny_model_moe: Path, trained_moe: tuple[str, np.ndarray], tmp_path: Path
) -> None:
    path, expected = trained_moe
    folders = {layout: tmp_path / layout for layout in ("peft", "per-expert", "tinker")}
    answer = ok(cluster, "checkpoints", "export", path, str(folders["peft"]))
    assert answer["kind"] == "adapter" and answer["layout"] == "peft"
    assert "export_id" not in answer  # served from the store as it is
    for layout in ("per-expert", "tinker"):
        answer = ok(
            cluster, "checkpoints", "export", path, str(folders[layout]), "--layout", layout
        )
        assert answer["kind"] == "adapter" and answer["layout"] == layout
        assert {p.name for p in folders[layout].iterdir()} == PEFT_FILES
    assert not list((cluster.data_dir / "checkpoints" / ".exports").glob("*"))

    def keys(layout: str) -> list[str]:
        folder = folders[layout] / "adapter_model.safetensors"
        return [key for key in safetensors.numpy.load_file(str(folder)) if ".experts." in key]

    assert any(key.endswith("mlp.experts.base_layer.lora_A.weight") for key in keys("peft"))
    assert any(".mlp.experts.7.gate_proj.lora_A.weight" in key for key in keys("per-expert"))
    assert any(key.endswith("mlp.experts.w2.lora_B.weight") for key in keys("tinker"))
    got = torch_child(
        LOGPROBS, str(tiny_model_moe), "peft", str(folders["peft"]), json.dumps(TOKENS)
    )
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
    result = cli(cluster, "checkpoints", "export", path, str(tmp_path / "x"), "--merged",
                 "--layout", "tinker")  # fmt: skip
    assert result.exit_code == 2 and "--layout" in result.output

    # the per-expert folder comes back in as a checkpoint that computes what the original does
    service = tenant(cluster, "xfer-moe-in")
    answer = ok(cluster, "checkpoints", "import", str(folders["per-expert"]), "--tenant",
                "xfer-moe-in", "--name", "per-expert", "--base-model", str(tiny_model_moe))  # fmt: skip
    client = service.create_training_client_from_state(answer["path"]).result()
    np.testing.assert_allclose(sdk_logprobs(client), expected, atol=1e-5, rtol=0)

    # one expert's copy of a shared factor changed: not shared-outer, refused by name
    tensors = safetensors.numpy.load_file(str(folders["per-expert"] / "adapter_model.safetensors"))
    gate_a = next(key for key in tensors if ".mlp.experts.5.gate_proj.lora_A" in key)
    tensors[gate_a] = tensors[gate_a] + np.float32(1e-3)
    own = tmp_path / "own-factor"
    own.mkdir()
    shutil.copy(folders["per-expert"] / "adapter_config.json", own / "adapter_config.json")
    safetensors.numpy.save_file(tensors, str(own / "adapter_model.safetensors"))
    refused(cli(cluster, "checkpoints", "import", str(own), "--tenant", "xfer-moe-in", "--name",
                "own", "--base-model", str(tiny_model_moe)), gate_a, "every expert")  # fmt: skip


# -- import -------------------------------------------------------------------------------------


def test_import_peft_adapter_loads_and_trains_on(
    cluster: Cluster, tiny_model: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "peft-adapter"
    # some projections of each block, as PEFT adapters often have: the others join at zero
    targets = json.dumps(["q_proj", "v_proj", "down_proj"])
    expected = torch_child(TRAIN_PEFT, str(tiny_model), str(folder), json.dumps(TOKENS), targets)
    service = tenant(cluster, "xfer-import")
    answer = ok(cluster, "checkpoints", "import", str(folder), "--tenant", "xfer-import",
                "--name", "from-peft")  # fmt: skip
    assert answer["tenant"] == "xfer-import" and answer["rank"] == 4
    path = answer["path"]
    assert path.startswith("tinker://import-") and path.endswith("/weights/from-peft")

    client = service.create_training_client_from_state(path).result()
    np.testing.assert_allclose(sdk_logprobs(client), expected, atol=1e-4, rtol=0)
    losses = train_steps(client, toy_batch(n=2), 4)
    assert losses[-1] < losses[0], losses

    # the tenant owns it; another tenant cannot see it
    listed = ok(cluster, "checkpoints", "list", "--tenant", "xfer-import")["checkpoints"]
    assert path in {c["path"] for c in listed}
    other = tenant(cluster, "xfer-stranger")
    with pytest.raises(tinker.NotFoundError):
        other.create_training_client_from_state(path).result()


def _shapes(model: Path, hidden_extra: int = 0) -> dict[str, tuple[int, int]]:
    """(out, in) of every attention and MLP linear of a tiny Qwen3, hidden size widened."""
    config = json.loads((model / "config.json").read_text())
    hidden = config["hidden_size"] + hidden_extra
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    inter = config["intermediate_size"]
    per_layer = {
        "self_attn.q_proj": (q, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, q),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    return {
        f"model.layers.{i}.{name}": shape
        for i in range(config["num_hidden_layers"])
        for name, shape in per_layer.items()
    }


def fake_adapter(
    folder: Path,
    base_model: str,
    shapes: dict[str, tuple[int, int]],
    rank: int = 4,
    **config: Any,
) -> Path:
    """A PEFT adapter folder written by hand: every matrix small and random."""
    rng = np.random.default_rng(0)
    tensors = {}
    for path, (out, inp) in shapes.items():
        prefix = f"base_model.model.{path}"
        tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, 0.01, (rank, inp)).astype(np.float32)
        tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.01, (out, rank)).astype(np.float32)
    folder.mkdir(parents=True)
    safetensors.numpy.save_file(tensors, str(folder / "adapter_model.safetensors"))
    settings = {
        "peft_type": "LORA",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": 8,
        "target_modules": list(ATTN + MLP),
        **config,
    }
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    return folder


def test_import_refusals(cluster: Cluster, tiny_model: Path, tmp_path: Path) -> None:
    tenant(cluster, "xfer-refused")
    served = str(tiny_model)
    shapes = _shapes(tiny_model)

    def imported(folder: Path, *extra: str) -> Result:
        args = ("--tenant", "xfer-refused", "--name", "x", *extra)
        return cli(cluster, "checkpoints", "import", str(folder), *args)

    # another base model: by its name, and (the name claimed) by its shapes
    wider = _shapes(tiny_model, hidden_extra=32)
    refused(imported(fake_adapter(tmp_path / "named", "org/other-model", wider)), "not served")
    refused(
        imported(
            fake_adapter(tmp_path / "named2", "org/other-model", wider), "--base-model", served
        ),
        "trained on 'org/other-model'",
    )
    refused(imported(fake_adapter(tmp_path / "wide", served, wider)), "has shape", "other shapes")
    # rank above the workers' cap (the cluster runs --max-rank 16)
    refused(imported(fake_adapter(tmp_path / "rank", served, shapes, rank=32)), "rank 32", "16")
    # a module the server cannot adapt
    embed = fake_adapter(tmp_path / "embed", served, shapes, target_modules=["embed_tokens"])
    refused(imported(embed), "target module 'embed_tokens'")
    stray = {**shapes, "model.embed_tokens": (64, 64)}
    refused(imported(fake_adapter(tmp_path / "stray", served, stray)), "model.embed_tokens")
    # a corrupt tensor file, values that are not finite
    corrupt = fake_adapter(tmp_path / "corrupt", served, shapes)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00not safetensors")
    refused(imported(corrupt), "adapter_model.safetensors")
    nan = fake_adapter(tmp_path / "nan", served, shapes)
    tensors = safetensors.numpy.load_file(str(nan / "adapter_model.safetensors"))
    next(iter(tensors.values()))[0, 0] = np.nan
    safetensors.numpy.save_file(tensors, str(nan / "adapter_model.safetensors"))
    refused(imported(nan), "non-finite")
    # a missing config (checked by the command, and by the gateway for any client)
    missing = fake_adapter(tmp_path / "missing", served, shapes)
    (missing / "adapter_config.json").unlink()
    refused(imported(missing), "adapter_config.json", "missing")
    # files too large for the tenant's checkpoint quota
    ok(cluster, "quotas", "set", "xfer-refused", "--max-checkpoint-bytes", "1000")
    refused(imported(fake_adapter(tmp_path / "big", served, shapes)), "over 1000 bytes")
    ok(cluster, "quotas", "set", "xfer-refused", "--clear", "max_checkpoint_bytes")
    # an unknown tenant, and a bad name, are refused before any upload
    refused(cli(cluster, "checkpoints", "import", str(tmp_path / "big"), "--tenant", "xfer-nobody",
                "--name", "x"), "not found")  # fmt: skip
    refused(imported(tmp_path / "big", "--name", "../x"), "name")

    # nothing of a refused import stays behind: no run, no checkpoint, no staged upload
    assert ok(cluster, "runs", "list", "--tenant", "xfer-refused")["runs"] == []
    assert ok(cluster, "checkpoints", "list", "--tenant", "xfer-refused")["checkpoints"] == []
    assert not list((cluster.data_dir / "checkpoints" / ".imports").glob("*"))
    # and the same adapter, made compatible, goes in
    answer = ok(cluster, "checkpoints", "import", str(tmp_path / "big"), "--tenant",
                "xfer-refused", "--name", "fits")  # fmt: skip
    assert answer["path"].endswith("/weights/fits")


def test_import_api_refuses_malformed_uploads(cluster: Cluster, tmp_path: Path) -> None:
    """What a client other than the CLI may send: each a 4xx naming what is wrong."""
    tenant(cluster, "xfer-api")
    params = {"tenant": "xfer-api", "name": "x"}
    url = f"{cluster.base_url}/admin/v1/checkpoints/import"
    admin = {"X-Admin-Key": cluster.admin_key}

    def post(files: Any = None, **kwargs: Any) -> httpx.Response:
        return httpx.post(url, params=params, files=files, timeout=30, **kwargs)

    no_key = post({"adapter_config.json": b"{}"})
    assert no_key.status_code == 401
    as_json = post(json={"x": 1}, headers=admin)
    assert as_json.status_code == 400 and "multipart" in as_json.json()["detail"]
    stray = post({"model.bin": b"x"}, headers=admin)
    assert stray.status_code == 400 and "unexpected part" in stray.json()["detail"]
    huge = post({"adapter_config.json": b" " * (65 << 10)}, headers=admin)
    assert huge.status_code == 413 and "adapter_config.json" in huge.json()["detail"]
    only_config = post({"adapter_config.json": b'{"r": 4}'}, headers=admin)
    assert only_config.status_code == 400
    assert "adapter_model.safetensors: missing" in only_config.json()["detail"]
    not_json = post({"adapter_config.json": b"{", "adapter_model.safetensors": b"x"}, headers=admin)
    assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["detail"]
    # a request id that is not a transfer
    unknown = httpx.get(
        f"{cluster.base_url}/admin/v1/transfers/req-0123-import_adapter", headers=admin
    )
    assert unknown.status_code == 404
    assert not list((cluster.data_dir / "checkpoints" / ".imports").glob("*"))

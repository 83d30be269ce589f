"""The Twinkle processor service (`workers.processor`), run by twinkle-kit's interpreter: the
article's Twinkle Client flow (a self-cognition file, a template of the served model, the
SelfCognitionProcessor, batches of 4) with the bodies twinkle's client sends, then twinkle's
client itself against it, then what it refuses: a bad secret, unknown classes and functions,
names off the allow-lists, files outside the data root, hub ids, budgets, other sessions' ids."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.wait_helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent
SDK_PYTHON = ROOT / ".venv-sdk" / "twinkle-0.5.1" / "bin" / "python"
SECRET = "processor-test-secret"
MAX_OBJECTS = 4
MAX_ROWS = 1000
MAX_FILE_BYTES = 200_000
NAME, AUTHOR = "twinkle模型", "ModelScope社区"
CACHED, UNCACHED = "tiny/qwen3_5", "tiny/not-downloaded"  # served hub models, offline

pytestmark = pytest.mark.skipif(not SDK_PYTHON.exists(), reason="no twinkle-kit virtualenv")


def self_cognition_rows() -> list[dict[str, str]]:
    rows = []
    for i in range(40):
        if i % 2:
            query, response = f"你是谁？{i}", f"我是{{{{NAME}}}}，由{{{{AUTHOR}}}}训练的助手。{i}"
            rows.append({"query": query, "response": response, "tag": "zh"})
        else:
            query = f"Who are you? {i}"
            response = f"I am {{{{NAME}}}}, an assistant trained by {{{{AUTHOR}}}}. {i}"
            rows.append({"query": query, "response": response, "tag": "en"})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return path


@dataclass
class Processor:
    url: str
    root: Path
    model: Path
    process: subprocess.Popen[bytes]
    log: Path

    def post(
        self,
        call: str,
        body: Any,
        *,
        tenant: str = "tenant-a",
        session: str = "session-1",
        secret: str | None = SECRET,
        content: bytes | None = None,
    ) -> httpx.Response:
        headers = {"Content-Type": "application/json", "X-Tenant": tenant, "X-Session": session}
        if secret is not None:
            headers["X-Processor-Secret"] = secret
        data = content if content is not None else json.dumps(body).encode()
        return httpx.post(f"{self.url}/{call}", content=data, headers=headers, timeout=120)


def start(directory: Path, model: Path, *extra: str, hub_cache: Path | None = None) -> Processor:
    """The service over `directory`/data, serving `model` under its own path as its name."""
    root = directory / "data"
    ready, log = directory / "ready.json", directory / "processor.log"
    (directory / "secret").write_text(SECRET + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    if hub_cache is not None:
        env["HF_HUB_CACHE"] = str(hub_cache)
    argv = [str(SDK_PYTHON), "-m", "workers.processor", "--host", "127.0.0.1", "--port", "0"]
    argv += ["--ready-file", str(ready), "--secret-file", str(directory / "secret")]
    argv += ["--data-root", str(root), "--model", f"{model}={model}", *extra]
    with log.open("wb") as out:
        process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: ready.exists() or process.poll() is not None, 120, "processor ready")
        assert process.poll() is None, log.read_text()
    except BaseException:
        stop(process)
        raise
    return Processor(json.loads(ready.read_text())["url"], root, model, process, log)


def stop(process: subprocess.Popen[bytes]) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


@pytest.fixture(scope="module")
def processor(tmp_path_factory: pytest.TempPathFactory, tiny_model_35: Path) -> Iterator[Processor]:
    directory = tmp_path_factory.mktemp("processor")
    root = directory / "data"
    (root / "sub").mkdir(parents=True)
    write_jsonl(root / "self-cognition.jsonl", self_cognition_rows())
    write_jsonl(root / "sub" / "nested.jsonl", self_cognition_rows()[:8])
    lines = ["query,response,tag"] + [f"q{i},r{i},csv" for i in range(6)]
    (root / "rows.csv").write_text("\n".join(lines) + "\n")
    many = [{"query": "q", "response": "r", "tag": "t"}] * (MAX_ROWS + 1)
    write_jsonl(root / "many.jsonl", many)
    (root / "big.jsonl").write_text('{"query": "q", "response": "r"}\n' * 8000)
    outside = directory / "outside.jsonl"
    write_jsonl(outside, self_cognition_rows()[:2])
    (root / "escape.jsonl").symlink_to(outside)
    (root / "notes.txt").write_text("not a data file\n")
    running = start(
        directory,
        tiny_model_35,
        *("--max-objects", str(MAX_OBJECTS), "--max-rows", str(MAX_ROWS)),
        *("--max-file-bytes", str(MAX_FILE_BYTES)),
        *("--model", f"{CACHED}={CACHED}", "--model", f"{UNCACHED}={UNCACHED}"),
        hub_cache=write_hub_cache(directory / "hub", tiny_model_35),
    )
    yield running
    assert stop(running.process) == 0, running.log.read_text()[-3000:]


def write_hub_cache(cache: Path, model: Path) -> Path:
    """A Hugging Face cache holding `model` as the hub model `CACHED` (its small files)."""
    snapshot = cache / f"models--{CACHED.replace('/', '--')}" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for file in model.iterdir():
        if file.suffix != ".safetensors":
            (snapshot / file.name).write_bytes(file.read_bytes())
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    return cache


@pytest.fixture
def session() -> str:
    return f"session-{uuid.uuid4().hex[:8]}"


# The bodies twinkle_client sends (twinkle_client/dataset/base.py, dataloader/dataloader.py;
# `DatasetMeta` as twinkle_client/common/serialize.py writes it: a JSON string).
def dataset_body(dataset_id: str, data_slice: Any = None) -> dict[str, Any]:
    if isinstance(data_slice, range):
        data_slice = {
            "_slice_type_": "range",
            "start": data_slice.start,
            "stop": data_slice.stop,
            "step": data_slice.step,
        }
    meta: dict[str, Any] = {"dataset_id": dataset_id, "subset_name": "default", "split": "train"}
    meta |= {"data_slice": data_slice, "data": None, "_TWINKLE_TYPE_": "DatasetMeta"}
    meta_json = json.dumps(meta, ensure_ascii=False)
    return {"processor_type": "dataset", "class_type": "Dataset", "dataset_meta": meta_json}


def set_template_body(pid: str, model_id: str, **kwargs: Any) -> dict[str, Any]:
    return {"processor_id": pid, "function": "set_template", "template_func": "Template"} | {
        "model_id": model_id,
        "max_length": 512,
        **kwargs,
    }


def map_body(pid: str, name: str = "SelfCognitionProcessor", **init: Any) -> dict[str, Any]:
    init_args = init or {"model_name": NAME, "model_author": AUTHOR}
    return {"processor_id": pid, "function": "map", "preprocess_func": name} | {
        "dataset_meta": None,
        "init_args": init_args,
    }


def encode_body(pid: str) -> dict[str, Any]:
    return {"processor_id": pid, "function": "encode", "add_generation_prompt": False} | {
        "batched": True
    }


def dataloader_body(dataset_pid: str, batch_size: Any = 4) -> dict[str, Any]:
    return {"processor_type": "dataloader", "class_type": "DataLoader"} | {
        "dataset": dataset_pid,
        "batch_size": batch_size,
    }


def call_body(pid: str, function: str, **kwargs: Any) -> dict[str, Any]:
    return {"processor_id": pid, "function": function, **kwargs}


def ok(response: httpx.Response) -> Any:
    assert response.status_code == 200, response.text
    return response.json()


def refused(response: httpx.Response, status: int, *words: str) -> str:
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    assert isinstance(detail, str) and "Traceback" not in detail
    for word in words:
        assert word in detail, detail
    return detail


def prepared(
    p: Processor, session: str, rows: range, tenant: str = "tenant-a", model: str = ""
) -> str:
    """A Dataset of the self-cognition file, templated, mapped and encoded: its pid."""
    body = dataset_body(str(p.root / "self-cognition.jsonl"), rows)
    pid: str = ok(p.post("create", body, session=session, tenant=tenant))["processor_id"]
    assert pid.startswith("pid:")
    model_id = model or f"ms://{p.model}"
    assert ok(p.post("call", set_template_body(pid, model_id), session=session, tenant=tenant)) == {
        "result": None
    }
    ok(p.post("call", map_body(pid), session=session, tenant=tenant))
    ok(p.post("call", encode_body(pid), session=session, tenant=tenant))
    return pid


def drain(
    p: Processor, loader: str, session: str, tenant: str = "tenant-a"
) -> list[list[dict[str, Any]]]:
    """`for batch in dataloader`: `__iter__`, then `__next__` until 410."""
    assert ok(p.post("call", call_body(loader, "__iter__"), session=session, tenant=tenant)) == {
        "result": "ok"
    }
    batches: list[list[dict[str, Any]]] = []
    while True:
        answer = p.post("call", call_body(loader, "__next__"), session=session, tenant=tenant)
        if answer.status_code == 410:
            assert answer.json() == {"detail": "Iterator exhausted"}
            return batches
        batches.append(ok(answer)["result"])


def check_row(row: dict[str, Any]) -> None:
    ids, labels = row["input_ids"], row["labels"]
    assert len(ids) == len(labels) == row["length"] and 0 < len(ids) <= 512
    assert all(isinstance(t, int) for t in ids)
    # labels are shifted: label i is the next input token, or -100 where nothing is learned
    assert all(label in (-100, ids[i + 1]) for i, label in enumerate(labels[:-1]))
    assert any(label != -100 for label in labels)
    answer = row["messages"][-1]
    assert answer["role"] == "assistant"
    assert NAME in answer["content"] or AUTHOR in answer["content"]


def test_the_articles_flow_gives_shifted_batches_of_four_then_410(
    processor: Processor, session: str
) -> None:
    dataset = prepared(processor, session, range(500))  # twinkle wraps past the 40 rows
    assert ok(processor.post("call", call_body(dataset, "__len__"), session=session)) == {
        "result": 500
    }
    loader = ok(processor.post("create", dataloader_body(dataset), session=session))
    loader = loader["processor_id"]
    length = ok(processor.post("call", call_body(loader, "__len__"), session=session))
    assert length == {"result": 125}
    batches = drain(processor, loader, session)
    assert len(batches) == 125 and all(len(batch) == 4 for batch in batches)
    for batch in batches[:3] + batches[-2:]:
        for row in batch:
            check_row(row)
    assert {row["tag"] for batch in batches[:5] for row in batch} == {"zh", "en"}
    again = processor.post("call", call_body(loader, "__next__"), session=session)
    refused(again, 410, "Iterator exhausted")
    state = ok(processor.post("call", call_body(loader, "get_state"), session=session))
    assert state == {"result": {"consumed_train_samples": 500}}

    # resuming: skip the first 100 samples, then the pass starts at batch 26
    skip = call_body(loader, "skip_consumed_samples", consumed_train_samples=100)
    assert ok(processor.post("call", skip, session=session)) == {"result": None}
    resumed = drain(processor, loader, session)
    assert len(resumed) == 100 and resumed[0] == batches[25] and resumed[-1] == batches[-1]


def test_twinkle_clients_own_classes_run_the_article_program(
    processor: Processor, session: str
) -> None:
    """twinkle_client's Dataset and DataLoader, unchanged, with `requests.post` sent here (and
    the gateway's headers added): what they send is what the tests above send."""
    data = str(processor.root / "self-cognition.jsonl")
    script = CLIENT_PROGRAM.format(secret=SECRET, session=session)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [str(SDK_PYTHON), "-c", script, processor.url, str(processor.model), data],
        capture_output=True,
        text=True,
        env=env,
        cwd=processor.log.parent,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["len"] == 125 and summary["sizes"] == [4] * 125
    assert summary["resumed"] == 100
    check_row(summary["first"])
    sent = summary["sent"]
    dataset_pid, loader_pid = sent[1]["processor_id"], sent[5]["processor_id"]
    first = dict(sent[0], dataset_meta=json.loads(sent[0]["dataset_meta"]))
    expected = dataset_body(data, range(500))
    assert first == dict(expected, dataset_meta=json.loads(expected["dataset_meta"]))
    assert sent[1] == set_template_body(dataset_pid, f"ms://{processor.model}")
    assert sent[2] == map_body(dataset_pid)
    assert sent[3] == encode_body(dataset_pid)
    assert sent[4] == dataloader_body(dataset_pid)
    assert sent[5] == call_body(loader_pid, "__len__")
    assert sent[6] == call_body(loader_pid, "__iter__")
    assert sent[7] == call_body(loader_pid, "__next__")
    skip = call_body(loader_pid, "skip_consumed_samples", consumed_train_samples=100)
    assert skip in sent


CLIENT_PROGRAM = """
import json, sys
import requests
from twinkle.dataset import DatasetMeta
from twinkle_client.dataloader import DataLoader
from twinkle_client.dataset import Dataset

url, base_model, data = sys.argv[1:4]
sent, real_post = [], requests.post
gateway = {{"X-Processor-Secret": "{secret}", "X-Tenant": "client", "X-Session": "{session}"}}

def post(target, headers=None, json=None, data=None, timeout=None):
    prefix, _, call = target.rpartition("/")
    assert prefix.endswith("/api/v1/processor/twinkle"), target
    sent.append(json)
    return real_post(url + "/" + call, headers={{**headers, **gateway}}, json=json, timeout=timeout)

requests.post = post
dataset = Dataset(dataset_meta=DatasetMeta(data, data_slice=range(500)))
dataset.set_template("Template", model_id=f"ms://{{base_model}}", max_length=512)
dataset.map("SelfCognitionProcessor", init_args={{"model_name": "twinkle模型", "model_author": "ModelScope社区"}})
dataset.encode(batched=True)
dataloader = DataLoader(dataset=dataset, batch_size=4)
length = len(dataloader)
batches = [batch for batch in dataloader]
dataloader.skip_consumed_samples(100)
resumed = [batch for batch in dataloader]
print(json.dumps({{"len": length, "sizes": [len(b) for b in batches], "resumed": len(resumed),
                  "first": batches[0][0], "sent": sent}}, ensure_ascii=False))
"""


def test_a_csv_file_and_a_file_in_a_subdirectory_load(processor: Processor, session: str) -> None:
    for name, rows in (("rows.csv", 6), ("sub/nested.jsonl", 8)):
        pid = ok(processor.post("create", dataset_body(name), session=session))["processor_id"]
        answer = ok(processor.post("call", call_body(pid, "__len__"), session=session))
        assert answer == {"result": rows}


def test_a_row_past_max_length_fails_encode_with_a_400(processor: Processor, session: str) -> None:
    body = dataset_body("self-cognition.jsonl", [0, 1])
    pid = ok(processor.post("create", body, session=session))["processor_id"]
    short = set_template_body(pid, str(processor.model).lstrip("/"), max_length=8)
    ok(processor.post("call", short, session=session))  # the model's name, its "/" dropped
    ok(processor.post("call", map_body(pid), session=session))
    answer = processor.post("call", encode_body(pid), session=session)
    refused(answer, 400, "encode failed", "max_length 8")


def dataset_pid(p: Processor, session: str) -> str:
    body = dataset_body("self-cognition.jsonl", range(8))
    pid: str = ok(p.post("create", body, session=session))["processor_id"]
    return pid


@pytest.mark.parametrize("call", ["create", "call"])
@pytest.mark.parametrize("secret", [None, "", "wrong", SECRET + "x"])
def test_a_missing_or_wrong_secret_is_a_401(
    processor: Processor, call: str, secret: str | None
) -> None:
    answer = processor.post(call, dataset_body("self-cognition.jsonl"), secret=secret)
    refused(answer, 401, "X-Processor-Secret")


@pytest.mark.parametrize("missing", ["X-Tenant", "X-Session"])
def test_a_missing_tenant_or_session_is_a_400(processor: Processor, missing: str) -> None:
    headers = {"X-Processor-Secret": SECRET, "X-Tenant": "t", "X-Session": "s"}
    del headers[missing]
    body = json.dumps(dataset_body("self-cognition.jsonl"))
    answer = httpx.post(f"{processor.url}/create", content=body, headers=headers)
    refused(answer, 400, missing)


@pytest.mark.parametrize(
    "content", [b"", b"{", b"\xff\xfe", b"[]", b"1", b'"Dataset"', b"null", b"[{}]"]
)
@pytest.mark.parametrize("call", ["create", "call"])
def test_a_body_that_is_not_a_json_object_is_a_400(
    processor: Processor, call: str, content: bytes
) -> None:
    refused(processor.post(call, None, content=content), 400, "body")


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"processor_type": "dataset", "class_type": "os"}, ["class_type", "Dataset, DataLoader"]),
        ({"processor_type": "dataset", "class_type": "Dataset; rm"}, ["class_type"]),
        ({"processor_type": "dataset", "class_type": "LazyDataset"}, ["class_type"]),
        ({"processor_type": "template", "class_type": "Template"}, ["class_type"]),
        ({"processor_type": "os", "class_type": "Dataset"}, ["processor_type"]),
        ({"class_type": "Dataset"}, ["processor_type"]),
        ({"processor_type": "dataset"}, ["class_type: missing"]),
        ({"processor_type": "dataset", "class_type": "Dataset"}, ["dataset_meta: missing"]),
        (dataset_body("self-cognition.jsonl") | {"streaming": True}, ["'streaming'"]),
        (dataset_body("self-cognition.jsonl") | {"trust_remote_code": True}, ["unexpected"]),
    ],
)
def test_a_class_or_field_off_the_list_is_a_400(
    processor: Processor, session: str, body: dict[str, Any], words: list[str]
) -> None:
    refused(processor.post("create", body, session=session), 400, *words)


@pytest.mark.parametrize(
    ("dataset_id", "status", "words"),
    [
        ("/etc/passwd", 400, ["outside"]),
        ("../x.jsonl", 400, ["climbs out"]),
        ("sub/../../x.jsonl", 400, ["climbs out"]),
        ("escape.jsonl", 400, ["outside"]),
        ("sub", 400, ["directory"]),
        ("nope.jsonl", 400, ["offline"]),
        ("ms://swift/self-cognition", 400, ["hub", "offline"]),
        ("hf://datasets/x/y", 400, ["hub", "offline"]),
        ("swift/self-cognition", 400, ["offline"]),
        ("notes.txt", 400, ["file types"]),
        ("*.jsonl", 400, ["characters"]),
        ("", 400, ["dataset_id"]),
        ("big.jsonl", 413, ["bytes", str(MAX_FILE_BYTES)]),
        ("many.jsonl", 413, ["rows", str(MAX_ROWS)]),
    ],
)
def test_only_files_under_the_data_root_are_read(
    processor: Processor, session: str, dataset_id: str, status: int, words: list[str]
) -> None:
    answer = processor.post("create", dataset_body(dataset_id), session=session)
    refused(answer, status, "dataset_meta", *words)


@pytest.mark.parametrize(
    ("meta", "status", "words"),
    [
        ({"data_slice": {"_slice_type_": "range", "start": 0, "stop": 10**9, "step": 1}}, 413, []),
        ({"data_slice": list(range(MAX_ROWS + 1))}, 413, ["data_slice"]),
        ({"data_slice": [0, -1]}, 400, ["data_slice"]),
        ({"data_slice": {"_slice_type_": "range", "start": -5, "stop": 2, "step": 1}}, 400, []),
        ({"data_slice": {"_slice_type_": "eval", "values": []}}, 400, ["_slice_type_"]),
        ({"data": [{"query": "q", "response": "r"}]}, 400, ["dataset_meta.data"]),
        ({"_TWINKLE_TYPE_": "LoraConfig"}, 400, ["_TWINKLE_TYPE_"]),
        ({"revision": "main"}, 400, ["'revision'"]),
    ],
)
def test_a_bad_dataset_meta_is_refused(
    processor: Processor, session: str, meta: dict[str, Any], status: int, words: list[str]
) -> None:
    body = dataset_body("self-cognition.jsonl")
    body["dataset_meta"] = json.dumps(json.loads(body["dataset_meta"]) | meta)
    refused(processor.post("create", body, session=session), status, "dataset_meta", *words)


@pytest.mark.parametrize(
    "function", ["__class__", "_load_dataset", "save_to_disk", "save_as", "add_dataset", "filter"]
)
def test_a_dataset_method_off_the_list_is_a_400(
    processor: Processor, session: str, function: str
) -> None:
    pid = dataset_pid(processor, session)
    answer = processor.post("call", call_body(pid, function, output_path="/tmp/x"), session=session)
    refused(answer, 400, "function", repr(function), "set_template, map, encode, __len__")


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"template_func": "DeepseekV4Template"}, ["template_func", "Qwen3_5Template"]),
        ({"template_func": "twinkle.template.Template"}, ["template_func"]),
        ({"model_id": "ms://Qwen/Qwen3-8B"}, ["model_id", "served"]),
        ({"model_id": "/etc"}, ["model_id"]),
        ({"max_length": 10**9}, ["max_length"]),
        ({"max_length": 0}, ["max_length"]),
        ({"max_length": "512"}, ["max_length"]),
        ({"truncation_strategy": "split"}, ["truncation_strategy"]),
        ({"trust_remote_code": True}, ["'trust_remote_code'"]),
    ],
)
def test_a_template_off_the_list_is_a_400(
    processor: Processor, session: str, changes: dict[str, Any], words: list[str]
) -> None:
    pid = dataset_pid(processor, session)
    body = set_template_body(pid, f"ms://{processor.model}") | changes
    refused(processor.post("call", body, session=session), 400, *words)


@pytest.mark.parametrize(
    ("name", "init", "words"),
    [
        ("EmojiDPOProcessor", {}, ["preprocess_func", "SelfCognitionProcessor"]),
        ("Plugin", {}, ["preprocess_func"]),
        ("SelfCognitionProcessor", {"model_name": {"a": 1}}, ["init_args.model_name"]),
        ("SelfCognitionProcessor", {"model_name": ["x"]}, ["init_args.model_name"]),
        ("SelfCognitionProcessor", {"model_name": "x" * 1_000_000}, ["init_args.model_name"]),
        ("SelfCognitionProcessor", {"__class__": "x"}, ["init_args", "model_name"]),
        ("GSM8KProcessor", {"add_assistant": "yes"}, ["init_args.add_assistant"]),
    ],
)
def test_a_preprocessor_off_the_list_is_a_400(
    processor: Processor, session: str, name: str, init: dict[str, Any], words: list[str]
) -> None:
    pid = dataset_pid(processor, session)
    refused(processor.post("call", map_body(pid, name, **init), session=session), 400, *words)


def test_encode_before_a_template_is_a_400(processor: Processor, session: str) -> None:
    pid = dataset_pid(processor, session)
    refused(processor.post("call", encode_body(pid), session=session), 400, "set_template")


@pytest.mark.parametrize("batch_size", [0, -1, 10**9, "4", 4.0, True, None])
def test_a_batch_size_out_of_range_is_a_400(
    processor: Processor, session: str, batch_size: Any
) -> None:
    body = dataloader_body(dataset_pid(processor, session), batch_size)
    refused(processor.post("create", body, session=session), 400, "batch_size")


def test_a_loader_method_off_the_list_or_a_loader_over_a_loader_is_a_400(
    processor: Processor, session: str
) -> None:
    dataset = dataset_pid(processor, session)
    loader = ok(processor.post("create", dataloader_body(dataset), session=session))
    loader = loader["processor_id"]
    for function in ("set_processor", "__class__", "dataset", "_lazy_init_dataloader"):
        answer = processor.post("call", call_body(loader, function), session=session)
        refused(answer, 400, "function", "__iter__, __next__, __len__")
    answer = processor.post("create", dataloader_body(loader), session=session)
    refused(answer, 400, "dataset", "DataLoader")
    answer = processor.post("create", dataloader_body("not-a-pid"), session=session)
    refused(answer, 400, "dataset")
    skip = call_body(loader, "skip_consumed_samples", consumed_train_samples=-1)
    refused(processor.post("call", skip, session=session), 400, "consumed_train_samples")


def test_another_sessions_or_tenants_object_is_a_404(processor: Processor, session: str) -> None:
    pid = dataset_pid(processor, session)
    length = call_body(pid, "__len__")
    for tenant, other in (("tenant-a", session + "x"), ("tenant-b", session)):
        answer = processor.post("call", length, tenant=tenant, session=other)
        refused(answer, 404, "processor_id")
        answer = processor.post("create", dataloader_body(pid), tenant=tenant, session=other)
        refused(answer, 404, "dataset")
    unknown = call_body("pid:" + "0" * 32, "__len__")
    refused(processor.post("call", unknown, session=session), 404, "processor_id")
    refused(processor.post("call", {"function": "__len__"}, session=session), 400, "processor_id")
    assert ok(processor.post("call", length, session=session)) == {"result": 8}


def test_more_objects_than_the_budget_is_a_413(processor: Processor, session: str) -> None:
    for _ in range(MAX_OBJECTS):
        dataset_pid(processor, session)
    body = dataset_body("self-cognition.jsonl")
    refused(processor.post("create", body, session=session), 413, "limit")
    dataset_pid(processor, session + "-other")  # another session's budget is its own


def test_after_every_refusal_the_session_still_runs_the_flow(
    processor: Processor, session: str
) -> None:
    tenant = "tenant-hostile"
    for hostile in (
        dataset_body("/etc/passwd"),
        dataset_body("ms://swift/self-cognition"),
        {"processor_type": "dataset", "class_type": "os"},
        dataloader_body("pid:" + "f" * 32),
    ):
        assert processor.post("create", hostile, session=session, tenant=tenant).status_code >= 400
    dataset = prepared(processor, session, range(8), tenant)
    for hostile in (call_body(dataset, "__class__"), map_body(dataset, "Plugin")):
        assert processor.post("call", hostile, session=session, tenant=tenant).status_code == 400
    loader = ok(processor.post("create", dataloader_body(dataset), session=session, tenant=tenant))
    batches = drain(processor, loader["processor_id"], session, tenant)
    assert [len(batch) for batch in batches] == [4, 4]
    check_row(batches[0][0])


def test_budgets_idle_expiry_and_sigterm(tmp_path: Path, tiny_model_35: Path) -> None:
    """A batch over 16 MiB of JSON is a 413; so is an object past the budget until the idle
    ones expire; SIGTERM stops the service, which removes its working directory."""
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "rows.jsonl", self_cognition_rows()[:4])
    write_jsonl(tmp_path / "data" / "wide.jsonl", [{"query": "q" * (1 << 20), "response": "r"}])
    short = start(tmp_path, tiny_model_35, "--ttl-s", "1", "--max-objects", "3")
    try:
        pid = ok(short.post("create", dataset_body("rows.jsonl")))["processor_id"]
        wide = ok(short.post("create", dataset_body("wide.jsonl", [0] * 17)))["processor_id"]
        loader = ok(short.post("create", dataloader_body(wide, 17)))["processor_id"]
        refused(short.post("create", dataset_body("rows.jsonl")), 413, "limit")
        refused(short.post("call", call_body(loader, "__next__")), 413, "__next__", "batch_size")
        refused(short.post("call", None, content=b"[" + b" " * (3 << 20) + b"]"), 413)

        def room() -> bool:  # the objects idle past the TTL swept (every second)
            return short.post("create", dataset_body("rows.jsonl")).status_code == 200

        wait_until(room, 20, "a slot freed by the sweep")
        refused(short.post("call", call_body(pid, "__len__")), 404, "processor_id")
    finally:
        assert stop(short.process) == 0
    log = short.log.read_text()
    workdir = log.split("removed ", 1)[1].split()[0]
    assert "twinkle-processor-" in workdir and not Path(workdir).exists()


def test_a_served_hub_model_comes_from_the_local_cache_only(
    processor: Processor, session: str
) -> None:
    dataset = prepared(processor, session, range(4), model=f"hf://{CACHED}")
    loader = ok(processor.post("create", dataloader_body(dataset), session=session))
    [batch] = drain(processor, loader["processor_id"], session)
    check_row(batch[0])
    body = set_template_body(dataset, UNCACHED) | {"template_func": "Qwen3_5Template"}
    refused(processor.post("call", body, session=session), 500, UNCACHED, "not on this server")


def test_shuffle_is_seeded_and_drop_last_drops(processor: Processor, session: str) -> None:
    """A shuffled loader gives the same order every time (twinkle's seed), so a resumed run
    skips the samples it saw; raw rows come out as they are in the file."""
    dataset = dataset_pid(processor, session)
    orders = []
    for _ in range(2):
        body = dataloader_body(dataset, 8) | {"shuffle": True}
        loader = ok(processor.post("create", body, session=session))["processor_id"]
        [batch] = drain(processor, loader, session)
        orders.append([row["query"] for row in batch])
    rows = self_cognition_rows()[:8]
    assert orders[0] == orders[1] != [row["query"] for row in rows]
    assert sorted(orders[0]) == sorted(row["query"] for row in rows)
    body = dataloader_body(dataset, 3) | {"drop_last": True}
    loader = ok(processor.post("create", body, session=session))["processor_id"]
    assert ok(processor.post("call", call_body(loader, "__len__"), session=session))["result"] == 2
    assert [len(batch) for batch in drain(processor, loader, session)] == [3, 3]


def _template(processor: Processor, **settings: Any) -> dict[str, Any]:
    return {"template_cls": "Template", "model_id": str(processor.model), **settings}


def test_a_samplers_template_encodes_a_trajectory_and_appends_a_sample(
    processor: Processor,
) -> None:
    """`/template` (the gateway's sampler routes): a trajectory's prompt as twinkle's own
    Template encodes it with the generation prompt, then a sample decoded and appended."""
    chat = {"messages": [{"role": "user", "content": "who are you?"}]}
    encoded = processor.post("template", {"template": _template(processor), "encode": [chat]})
    assert encoded.status_code == 200, encoded.text
    [row] = encoded.json()["result"]
    code = (
        "import json, sys\n"
        "from twinkle.template import Template\n"
        "t = Template(model_id=sys.argv[1])\n"
        "f = t.encode(json.loads(sys.argv[2]), add_generation_prompt=True)\n"
        "print(json.dumps([list(map(int, f['input_ids'])), t.decode([5, 6, 7])]))\n"
    )
    ran = subprocess.run(
        [str(SDK_PYTHON), "-c", code, str(processor.model), json.dumps(chat)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=120,
    )
    ids, decoded = json.loads(ran.stdout.strip().splitlines()[-1])
    assert row["prompt"] == ids == row["feature"]["input_ids"]
    finish = {
        "template": _template(processor),
        "features": [row["feature"]],
        "finish": [{"feature": 0, "tokens": [5, 6, 7]}, {"feature": 0, "tokens": []}],
    }
    done = processor.post("template", finish)
    assert done.status_code == 200, done.text
    first, empty = done.json()["result"]
    assert first["decoded"] == decoded
    assert first["new_input_feature"]["input_ids"] == ids + [5, 6, 7]
    assert empty["new_input_feature"]["input_ids"] == ids


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"template": {"template_cls": "os.system"}, "encode": [{}]}, ["template.template_cls"]),
        (
            {"template": {"template_cls": "Template", "model_id": "gpt2"}, "encode": [{}]},
            ["model_id"],
        ),
        ({"template": "Template", "encode": [{}]}, ["template"]),
        ({"template": None, "encode": []}, ["template"]),
        ({"encode": [], "finish": []}, ["encode or finish"]),
        ({"encode": [1]}, ["encode"]),
        ({"encode": [{}] * 65}, ["encode"]),
        ({"encode": [{"messages": "x"}]}, ["encode[0]"]),
        (
            {"features": [{"input_ids": [1]}], "finish": [{"feature": 1, "tokens": []}]},
            ["finish[0].feature"],
        ),
        (
            {"features": [{"input_ids": [1]}], "finish": [{"feature": 0, "tokens": ["x"]}]},
            ["finish[0].tokens"],
        ),
        (
            {"features": [{"input_ids": "x"}], "finish": [{"feature": 0, "tokens": []}]},
            ["features[0].input_ids"],
        ),
        ({"finish": [{"feature": 0, "tokens": []}]}, ["features"]),
        (
            {"features": [{"input_ids": [1]}], "finish": [{"feature": 0, "tokens": [1]}], "x": 1},
            ["x"],
        ),
    ],
)
def test_a_bad_template_call_is_a_400(
    processor: Processor, body: dict[str, Any], words: list[str]
) -> None:
    full = {"template": _template(processor), **body} if "template" not in body else body
    if isinstance(full.get("template"), dict) and "model_id" not in full["template"]:
        full["template"] = {**full["template"], "model_id": str(processor.model)}
    refused(processor.post("template", full), 400, *words)
    assert processor.post("template", full, secret="wrong").status_code == 401

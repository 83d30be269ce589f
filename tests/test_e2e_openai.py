"""The OpenAI-compatible API (`/v1`) with the `openai` package against the session's cluster:
models, completions, chat through the base model's chat template, streaming, n > 1, stops,
logprobs, a trained sampler checkpoint as the model, and bad input. Greedy answers are checked
against the Tinker SDK's samples of the same tokens."""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest
import tinker
from tinker import types
from transformers import AutoTokenizer

from tests.conftest import OTHER_TENANT_KEY, Cluster
from tests.sdk_helpers import toy_batch, train_steps

pytestmark = pytest.mark.e2e


def _client(cluster: Cluster, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{cluster.base_url}/v1", api_key=key or cluster.api_key, max_retries=0
    )


def _greedy(service: tinker.ServiceClient, tokens: list[int], n: int, **where: str) -> list[int]:
    sampler = service.create_sampling_client(**where).result()
    params = types.SamplingParams(max_tokens=n, temperature=0.0)
    got = sampler.sample(types.ModelInput.from_ints(tokens), 1, params).result()
    return list(got.sequences[0].tokens)


def test_completions_and_chat_answer_what_the_sampler_samples(
    cluster: Cluster, service: tinker.ServiceClient, tiny_model: Path
) -> None:
    client = _client(cluster)
    model = str(tiny_model)
    assert model in [m.id for m in client.models.list().data]
    tokenizer = AutoTokenizer.from_pretrained(model)

    prompt = "hello there, how are"
    done = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, n=2)
    assert len(done.choices) == 2 and done.choices[0].text == done.choices[1].text
    ids = tokenizer.encode(prompt)
    assert done.usage is not None and done.usage.prompt_tokens == len(ids)
    want = _greedy(service, ids, 6, base_model=model)
    assert done.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)

    chat = [{"role": "user", "content": "who are you?"}]
    answered = client.chat.completions.create(
        model=model, messages=chat, max_tokens=5, temperature=0
    )
    chat_ids = list(
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ]
    )
    assert answered.usage is not None and answered.usage.prompt_tokens == len(chat_ids)
    chat_want = _greedy(service, chat_ids, 5, base_model=model)
    assert answered.choices[0].message.content == tokenizer.decode(
        chat_want, skip_special_tokens=True
    )

    streamed = client.chat.completions.create(
        model=model,
        messages=chat,
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answered.choices[0].message.content
    assert (
        chunks[-1].usage is not None
        and chunks[-1].usage.completion_tokens == answered.usage.completion_tokens
    )

    scored = client.completions.create(
        model=model, prompt=prompt, max_tokens=3, temperature=0, logprobs=2
    )
    logprobs = scored.choices[0].logprobs
    assert logprobs is not None and logprobs.top_logprobs is not None
    assert all(len(row) <= 2 for row in logprobs.top_logprobs)
    assert len(logprobs.token_logprobs or []) == len(logprobs.tokens or []) >= 1

    # a stop string inside the greedy text ends it there, the stop itself left out
    full = done.choices[0].text
    if len(full) >= 4:
        stop = full[2:4]
        cut = client.completions.create(
            model=model, prompt=prompt, max_tokens=6, temperature=0, stop=[stop]
        )
        assert cut.choices[0].text == full[: full.find(stop)]
        assert cut.choices[0].finish_reason == "stop"


def test_a_trained_checkpoint_is_a_model_for_its_tenant_only(
    cluster: Cluster, service: tinker.ServiceClient, tiny_model: Path
) -> None:
    trainer = service.create_lora_training_client(
        base_model=str(tiny_model), rank=4, seed=9
    ).result()
    train_steps(trainer, toy_batch(seed=9), 3)
    path = trainer.save_weights_for_sampler("openai").result().path
    client = _client(cluster)
    assert path in [m.id for m in client.models.list().data]
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    done = client.completions.create(model=path, prompt="abc def", max_tokens=5, temperature=0)
    want = _greedy(service, tokenizer.encode("abc def"), 5, model_path=path)
    assert done.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)

    other = _client(cluster, OTHER_TENANT_KEY)
    with pytest.raises(openai.NotFoundError):
        other.completions.create(model=path, prompt="abc", max_tokens=2)
    assert path not in [m.id for m in other.models.list().data]


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"model": "no/such-model"}, openai.APIStatusError),
        ({"n": 0}, openai.BadRequestError),
        ({"n": 10_000}, openai.BadRequestError),
        ({"max_tokens": 10**9}, openai.BadRequestError),
        ({"temperature": -1}, openai.BadRequestError),
        ({"top_p": 0}, openai.BadRequestError),
        ({"prompt": ""}, openai.BadRequestError),
        ({"prompt": "x" * (2 << 20)}, openai.APIStatusError),
        ({"logprobs": 10**6}, openai.BadRequestError),
        ({"model": "tinker://sess-x:train:0/sampler_weights/nope"}, openai.NotFoundError),
        ({"model": "tinker://../../etc"}, openai.BadRequestError),
        ({"echo": True}, openai.BadRequestError),
    ],
)
def test_bad_input_is_a_clear_4xx(
    cluster: Cluster, tiny_model: Path, changes: dict[str, object], error: type[Exception]
) -> None:
    body: dict[str, object] = {"model": str(tiny_model), "prompt": "hi", "max_tokens": 2, **changes}
    with pytest.raises(error) as raised:
        _client(cluster).completions.create(**body)  # type: ignore[call-overload]
    status = getattr(raised.value, "status_code", 0)
    assert 400 <= status < 500, raised.value


@pytest.mark.parametrize(
    "changes",
    [
        {"messages": []},
        {"messages": [{"role": "root", "content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        {"messages": "hello"},
        {"max_tokens": -1},
        {"stop": ["x"] * 1000},
        {"seed": "x"},
        {"top_logprobs": 10**6, "logprobs": True},
        {"n": -3},
    ],
)
def test_bad_chat_input_is_a_clear_4xx(
    cluster: Cluster, tiny_model: Path, changes: dict[str, object]
) -> None:
    body: dict[str, object] = {
        "model": str(tiny_model),
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        **changes,
    }
    with pytest.raises(openai.BadRequestError) as raised:
        _client(cluster).chat.completions.create(**body)  # type: ignore[call-overload]
    # OpenAI's error shape, which its clients read: a message, a type and a code
    assert raised.value.type == "invalid_request_error" and raised.value.code
    assert isinstance(raised.value.body, dict) and raised.value.body["message"]


def test_a_missing_or_wrong_key_is_a_401(cluster: Cluster, tiny_model: Path) -> None:
    with pytest.raises(openai.AuthenticationError) as raised:
        _client(cluster, "tml-not-a-key").models.list()
    assert raised.value.type == "authentication_error"


def test_stream_sends_the_text_as_it_is_drawn(cluster: Cluster, tiny_model: Path) -> None:
    """`stream`: many chunks, spread over the generation, that join to the unstreamed text (a
    seeded sample draws the same tokens), each choice of n on its own; a stop string is never
    sent, not even its first characters."""
    client = _client(cluster)
    model = str(tiny_model)
    options: dict[str, object] = {
        "model": model,
        "prompt": "a long story:",
        "max_tokens": 160,
        "temperature": 1.0,
        "seed": 1,
        "n": 2,
    }
    whole = client.completions.create(**options)  # type: ignore[call-overload]
    assert all(len(c.text) > 40 for c in whole.choices), whole.choices
    texts = {0: "", 1: ""}
    arrivals: list[float] = []
    finished_at = 0.0
    finishes = {}
    for chunk in client.completions.create(stream=True, **options):  # type: ignore[call-overload]
        for choice in chunk.choices:
            if choice.text:
                texts[choice.index] += choice.text
                arrivals.append(time.monotonic())
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
                finished_at = time.monotonic()
    assert texts == {c.index: c.text for c in whole.choices}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert len(arrivals) >= 6  # sent as drawn, not once at the end
    assert finished_at - arrivals[0] > 0.1

    # a stop string: the streamed text stops where the whole one does, the stop left out
    stop = whole.choices[0].text[20:23]
    cut = client.completions.create(stop=[stop], **{**options, "n": 1})  # type: ignore[call-overload]
    pieces = [
        c.choices[0].text
        for c in client.completions.create(stop=[stop], stream=True, **{**options, "n": 1})  # type: ignore[call-overload]
        if c.choices
    ]
    assert "".join(pieces) == cut.choices[0].text
    assert stop not in "".join(pieces)

    # chat: the role first, then the content as drawn
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "tell me a story"}],
        max_tokens=80,
        temperature=1.0,
        seed=1,
        stream=True,
    )
    deltas = [c.choices[0].delta for c in chat if c.choices]
    assert deltas[0].role == "assistant"
    assert sum(1 for d in deltas if d.content) >= 3

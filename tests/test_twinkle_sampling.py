"""The Twinkle sampler calls as ours (`protocol.twinkle_sampling`): twinkle's sampling
parameters checked and mapped onto a Tinker `SampleRequest`, and a sampler's protobuf answer
read back as twinkle's `SampleResponseModel`."""

from __future__ import annotations

from typing import Any

import pytest

from protocol.errors import UserError
from protocol.sampling import SampledSequence, SampleOutput, SampleSpec, encode_sample_response
from protocol.twinkle_sampling import (
    feature,
    inputs_of,
    params,
    response_model,
    sample_request,
    sampler_template,
    trajectory,
)


def test_twinkles_parameters_map_onto_a_tinker_sample_request() -> None:
    given = params(
        {
            "max_new_tokens": 7,
            "temperature": 0.5,
            "top_k": 4,
            "top_p": 0.9,
            "seed": 3,
            "stop": ["\n"],
            "logprobs": 3,
            "prompt_logprobs": 2,
        },
        num_samples=5,
    )
    request = sample_request([1, 2, 3], given)
    assert request.sampling_params.max_tokens == 7 and request.sampling_params.top_k == 4
    assert request.sampling_params.stop == ["\n"] and request.sampling_params.seed == 3
    assert request.num_samples == 5  # the client's top-level count, sampling_params silent
    assert request.topk_sample_logprobs == 3
    assert request.prompt_logprobs and request.topk_prompt_logprobs == 2
    assert params({"num_samples": 2}, 5).num_samples == 2
    assert params({"stop": []}, None).tinker.stop is None  # twinkle's default: stop at EOS
    one = sample_request([1], params({"logprobs": 1}, None))
    assert one.topk_sample_logprobs == 0 and not one.prompt_logprobs
    only = params({"max_tokens": 0, "prompt_logprobs": 0}, None)
    assert only.logprobs_only and only.tinker.max_tokens == 1
    assert sample_request([1, 2], only).prompt_logprobs


@pytest.mark.parametrize(
    ("fields", "word"),
    [
        ({"n": 2}, "unknown"),
        ({"repetition_penalty": 1.1}, "repetition_penalty"),
        ({"temperature": True}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 2**70}, "max_tokens"),
        ({"seed": 1.5}, "seed"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": 5}, "stop"),
        ({"num_samples": "2"}, "num_samples"),
    ],
)
def test_a_bad_parameter_names_itself(fields: dict[str, Any], word: str) -> None:
    with pytest.raises(UserError, match=word):
        params(fields, None)


@pytest.mark.parametrize(
    ("value", "word"),
    [
        ([], "inputs"),
        ("x", "inputs"),
        ([1], r"inputs\[0\]"),
        ([{"input_ids": [1]}] * 65, "64"),
        ([{"input_ids": [1]}, {"messages": []}], "all"),
    ],
)
def test_inputs_are_one_kind_and_bounded(value: Any, word: str) -> None:
    with pytest.raises(UserError, match=word):
        inputs_of(value)


def test_features_and_trajectories_keep_only_what_is_sampled() -> None:
    assert inputs_of({"input_ids": [1]}) == [{"input_ids": [1]}]
    kept = feature({"input_ids": [1, 2], "labels": [-100, 2], "images": ["http://x"]}, 0)
    assert kept == {"input_ids": [1, 2], "labels": [-100, 2]}
    for bad, word in (
        ({"input_ids": [True]}, "32-bit"),
        ({"input_ids": [1], "labels": [1, 2]}, "labels"),
        ({"input_ids": "12"}, "input_ids"),
    ):
        with pytest.raises(UserError, match=word):
            feature(bad, 0)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert trajectory(chat, 0) == chat
    for bad_chat, word in (
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "text only"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "only role"),
        ({"messages": [], "tools": []}, "tools"),
        ({"messages": [{"role": "user", "content": "x" * (2 << 20)}]}, "characters"),
    ):
        with pytest.raises(UserError, match=word):
            trajectory(bad_chat, 0)


def test_a_template_is_a_served_class_with_typed_settings() -> None:
    template = sampler_template({"template_cls": "Template", "max_length": 64}, "base")
    assert template.settings == {"model_id": "base", "max_length": 64}
    for fields, word in (
        ({"template_cls": "Other"}, "template_cls"),
        ({"template_cls": "Template", "max_length": True}, "max_length"),
        ({"template_cls": "Template", "trust_remote_code": True}, "setting"),
    ):
        with pytest.raises(UserError, match=word):
            sampler_template(fields, "base")


def test_a_sample_answer_reads_back_in_twinkles_shapes() -> None:
    output = SampleOutput(
        sequences=[
            SampledSequence([7, 8], [-0.5, -1.5], "stop", [[(7, -0.5), (3, -0.9)], [(8, -1.5)]]),
        ],
        prompt_logprobs=[None, -2.0, -3.0],
        topk_prompt_logprobs=[[], [(4, -1.0)], [(5, -2.5)]],
    )
    spec = SampleSpec(prompt=(1, 2, 3), max_tokens=2, topk_sample_logprobs=2)
    payload = encode_sample_response(output, spec)
    top = response_model(payload, params({"logprobs": 2, "prompt_logprobs": 1}, None), 3)
    [seq] = top["sequences"]
    assert seq["tokens"] == [7, 8] and seq["stop_reason"] == "stop"
    assert seq["logprobs"] == [[(7, -0.5), (3, pytest.approx(-0.9))], [(8, -1.5)]]
    assert top["prompt_logprobs"] == [None, -2.0, -3.0]
    assert top["topk_prompt_logprobs"] == [None, [(4, -1.0)], [(5, -2.5)]]
    sampled = response_model(payload, params({"logprobs": 1}, None), 3)
    assert sampled["sequences"][0]["logprobs"] == [[(7, -0.5)], [(8, -1.5)]]
    assert sampled["topk_prompt_logprobs"] is None
    plain = response_model(payload, params({}, None), 3)
    assert plain["sequences"][0]["logprobs"] is None
    only = response_model(payload, params({"max_tokens": 0}, None), 3)
    assert only["sequences"][0]["tokens"] == [] and only["sequences"][0]["logprobs"] is None

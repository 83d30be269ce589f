"""`sample_spec` against hostile option values, and `encode_sample_response` read back by the
official SDK's own decoder (tinker.proto.response_conv) and cross-checks."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np
import pytest
from tinker.lib.public_interfaces.sampling_client import (
    _check_prompt_alt_tokens_returned,
    _check_prompt_logprobs_last_n_honored,
)
from tinker.proto.response_conv import deserialize_sample_response

from protocol import api
from protocol.errors import UserError
from protocol.sampling import (
    MAX_LOGPROBS_K,
    MAX_STOP_SEQUENCES,
    MAX_STOP_STRING_CHARS,
    SampledSequence,
    SampleOutput,
    SampleSpec,
    TargetIds,
    encode_sample_response,
    keep_last_n,
    sample_spec,
)

PROMPT = [5, 6, 7, 8, 9]
VOCAB = 512


def spec_of(**fields: Any) -> SampleSpec:
    body = {
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "sampling_params": {"max_tokens": 4},
        "type": "sample",
        **fields,
    }
    request = api.decode(msgspec.json.encode(body), api.SampleRequest)
    return sample_spec(request, max_context=64, vocab_size=VOCAB)


def dense(rows: list[list[int]], dtype: str = "int64") -> dict[str, Any]:
    shape = [len(rows), len(rows[0]) if rows else 0]
    return {"data": [v for row in rows for v in row], "dtype": dtype, "shape": shape}


def with_stop(value: Any) -> dict[str, Any]:
    return {"sampling_params": {"max_tokens": 4, "stop": value}}


HOSTILE: list[tuple[dict[str, Any], str]] = [
    ({"topk_sample_logprobs": -1}, "topk_sample_logprobs"),
    ({"topk_sample_logprobs": 10**9}, "topk_sample_logprobs"),
    ({"topk_prompt_logprobs": MAX_LOGPROBS_K + 1}, "topk_prompt_logprobs"),
    ({"prompt_alt_tokens_k": -3}, "prompt_alt_tokens_k"),
    ({"prompt_alt_tokens_k": 2**40}, "prompt_alt_tokens_k"),
    # stops are checked at every decode step: their number and length are bounded
    (with_stop(["ab"] * 300_000), "sampling_params.stop"),
    (with_stop(["a"] * (MAX_STOP_SEQUENCES + 1)), "sampling_params.stop"),
    (with_stop("x" * 2**20), "sampling_params.stop"),
    (with_stop(["x" * (MAX_STOP_STRING_CHARS + 1)]), "sampling_params.stop"),
    (with_stop(""), "sampling_params.stop"),
    (with_stop(["\n", ""]), "sampling_params.stop"),
    (with_stop(list(range(MAX_STOP_SEQUENCES + 1))), "sampling_params.stop"),
    (with_stop([2, VOCAB]), "sampling_params.stop"),
    (with_stop([-1]), "sampling_params.stop"),
    (with_stop(["a", 2]), "sampling_params.stop"),
    ({"prompt_logprobs_last_n": 2}, "prompt_logprobs_last_n"),  # without prompt_logprobs
    ({"prompt_logprobs": True, "prompt_logprobs_last_n": 0}, "prompt_logprobs_last_n"),
    ({"prompt_logprobs": True, "prompt_logprobs_last_n": 5}, "prompt_logprobs_last_n"),
    ({"prompt_logprobs": True, "prompt_logprobs_last_n": -7}, "prompt_logprobs_last_n"),
    ({"target_prompt_logprobs": dense([[1]] * 4, "float32")}, "target_prompt_logprobs"),
    ({"target_prompt_logprobs": dense([[1]] * 3)}, "target_prompt_logprobs"),  # rows
    ({"target_prompt_logprobs": dense([[1] * 21] * 4)}, "target_prompt_logprobs"),  # K
    ({"target_prompt_logprobs": dense([[VOCAB]] * 4)}, "target_prompt_logprobs"),
    ({"target_prompt_logprobs": dense([[-2]] * 4)}, "target_prompt_logprobs"),
    ({"target_prompt_logprobs": dense([[-1]] * 4)}, "target_prompt_logprobs"),  # no id
    ({"target_prompt_logprobs": {"data": [1, 2], "dtype": "int64", "shape": [4, 1]}}, "values"),
    ({"target_prompt_logprobs": {"data": [1], "dtype": "int64"}}, "target_prompt_logprobs"),
    (
        {"target_prompt_logprobs": {**dense([[1]] * 4), "data": [1.5, 1, 1, 1]}},
        "target_prompt_logprobs",
    ),
    (  # CSR: row pointers past the values
        {
            "target_prompt_logprobs": {
                "data": [3],
                "dtype": "int64",
                "shape": [4, 2],
                "sparse_crow_indices": [0, 1, 1, 1, 2],
                "sparse_col_indices": [0],
            }
        },
        "sparse_crow_indices",
    ),
    (  # CSR: a column outside the matrix, and repeated columns
        {
            "target_prompt_logprobs": {
                "data": [3, 4],
                "dtype": "int64",
                "shape": [4, 2],
                "sparse_crow_indices": [0, 2, 2, 2, 2],
                "sparse_col_indices": [1, 1],
            }
        },
        "sparse_col_indices",
    ),
    (
        {
            "target_prompt_logprobs": {
                "data": [3],
                "dtype": "int64",
                "shape": [4, 2],
                "sparse_crow_indices": [0, 1, 0, 1, 1],
                "sparse_col_indices": [5],
            }
        },
        "target_prompt_logprobs",
    ),
]


@pytest.mark.parametrize(("fields", "named"), HOSTILE)
def test_hostile_option_values_are_user_errors_naming_the_field(
    fields: dict[str, Any], named: str
) -> None:
    with pytest.raises(UserError) as raised:
        spec_of(**fields)
    assert named in str(raised.value)
    assert raised.value.category == "user"


def test_valid_options_become_the_spec() -> None:
    spec = spec_of(
        prompt_logprobs=True,
        topk_sample_logprobs=MAX_LOGPROBS_K,
        prompt_alt_tokens_k=3,
        prompt_logprobs_last_n=4,
        target_prompt_logprobs={
            "data": [3, 511],
            "dtype": "int64",
            "shape": [4, 2],
            "sparse_crow_indices": [0, 1, 1, 1, 2],
            "sparse_col_indices": [1, 0],
        },
    )
    assert spec.topk_sample_logprobs == MAX_LOGPROBS_K and spec.prompt_alt_tokens_k == 3
    assert spec.prompt_logprobs_last_n == 4 and spec.needs_prompt_rows
    target = spec.target_prompt_logprobs
    assert target is not None and target.cells() == ([0, 3], [3, 511])
    dense_target = spec_of(target_prompt_logprobs=dense([[1, -1], [2, 3], [-1, -1], [4, 4]]))
    assert dense_target.target_prompt_logprobs is not None
    assert dense_target.target_prompt_logprobs.cells()[0] == [0, 0, 1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize(
    ("stop", "strings", "token_ids"),
    [
        (None, (), ()),  # the SDK's default: stop at EOS
        ([], (), ()),  # never stop early
        (["\n\nUser:"], ("\n\nUser:",), ()),  # tinker-cookbook's RoleColon renderer
        ([2, 3, VOCAB - 1], (), (2, 3, VOCAB - 1)),  # three ids, as cookbook's GLM-5 renderer
        ("x" * MAX_STOP_STRING_CHARS, ("x" * MAX_STOP_STRING_CHARS,), ()),
        (["y" * MAX_STOP_STRING_CHARS] * MAX_STOP_SEQUENCES, ("y" * 256,) * 16, ()),
        (list(range(MAX_STOP_SEQUENCES)), (), tuple(range(16))),
    ],
)
def test_stops_within_the_bounds_become_the_spec(
    stop: Any, strings: tuple[str, ...], token_ids: tuple[int, ...]
) -> None:
    body = {
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "sampling_params": {"max_tokens": 4, "stop": stop},
        "type": "sample",
    }
    request = api.decode(msgspec.json.encode(body), api.SampleRequest)
    spec = sample_spec(request, max_context=64, vocab_size=VOCAB)
    assert (spec.stop_strings, spec.stop_token_ids) == (strings, token_ids)
    assert spec.stop_at_eos is (stop is None)


def test_a_temperature_below_the_greedy_threshold_is_greedy() -> None:
    for temperature, greedy in [(1e-300, True), (0.0, True), (1e-5, False), (0.7, False)]:
        params = {"max_tokens": 4, "temperature": temperature}
        assert spec_of(sampling_params=params).greedy is greedy
    assert not spec_of().greedy


def output_for(spec: SampleSpec) -> SampleOutput:
    lps = [-1.0, -2.0, -3.0]
    top = [[(4, -0.5), (9, -1.5)]] * 3
    return SampleOutput(
        sequences=[
            SampledSequence([1, 2, 3], lps, "length", top if spec.topk_sample_logprobs else None)
        ],
        prompt_logprobs=[None, -1.0, -2.0, -3.0, -4.0],
        topk_prompt_logprobs=[[], *[[(1, -0.125)]] * 4],
        target_prompt_logprobs=None
        if spec.target_prompt_logprobs is None
        else [
            -0.25 * (i + 1) if v >= 0 else 0.0
            for i, v in enumerate(spec.target_prompt_logprobs.values)
        ],
        prompt_alt_tokens=[[7, 8]] * 4 if spec.prompt_alt_tokens_k else None,
        prompt_alt_logprobs=[[-0.7, -0.8]] * 4 if spec.prompt_alt_tokens_k else None,
    )


def test_the_sdk_decodes_every_option() -> None:
    sparse = TargetIds(4, 2, (3, 511), (0, 1, 1, 1, 2), (1, 0))
    spec = SampleSpec(
        tuple(PROMPT),
        prompt_logprobs=True,
        topk_prompt_logprobs=1,
        topk_sample_logprobs=2,
        target_prompt_logprobs=sparse,
        prompt_alt_tokens_k=2,
        prompt_logprobs_last_n=2,
    )
    output = output_for(spec)
    keep_last_n(spec, output)
    response = deserialize_sample_response(encode_sample_response(output, spec))
    _check_prompt_alt_tokens_returned(response, 2)
    _check_prompt_logprobs_last_n_honored(response, 2)
    assert response.prompt_logprobs == [None, None, None, -3.0, -4.0]
    assert response.topk_prompt_logprobs == [None, None, None, [(1, -0.125)], [(1, -0.125)]]
    (seq,) = response.sequences
    assert seq.topk_logprobs == [[(4, -0.5), (9, -1.5)]] * 3
    target = response.target_prompt_logprobs
    assert target is not None and target.sparse_crow_indices == [0, 1, 1, 1, 2]
    np.testing.assert_allclose(target.to_numpy(), [[0, -0.25], [0, 0], [0, 0], [-0.5, 0]])
    alt = response.prompt_alt_tokens
    assert alt is not None and alt.tokens.to_numpy().tolist() == [[7, 8]] * 4
    assert alt.tokens.dtype == "int64" and alt.logprobs.dtype == "float32"
    np.testing.assert_allclose(alt.logprobs.to_numpy(), [[-0.7, -0.8]] * 4, rtol=1e-6)

    # Dense targets come back dense, 0.0 where the request had -1.
    dense_spec = SampleSpec(tuple(PROMPT), target_prompt_logprobs=TargetIds(4, 1, (2, -1, -1, 3)))
    back = deserialize_sample_response(encode_sample_response(output_for(dense_spec), dense_spec))
    assert back.target_prompt_logprobs is not None
    assert back.target_prompt_logprobs.sparse_crow_indices is None
    np.testing.assert_allclose(back.target_prompt_logprobs.to_numpy(), [[-0.25], [0], [0], [-1.0]])
    # Nothing asked, nothing sent: the SDK's cross-check catches a missing answer.
    plain = deserialize_sample_response(encode_sample_response(output_for(SampleSpec((1, 2)))))
    with pytest.raises(RuntimeError):
        _check_prompt_alt_tokens_returned(plain, 1)
    assert plain.sequences[0].topk_logprobs is None and not math.isnan(
        plain.sequences[0].logprobs[0]
    )


def test_a_sequence_over_the_samplers_plan_is_refused_naming_it() -> None:
    """`max_sequence` (the samplers' memory plan, from the workers' records): prompt +
    max_tokens over it is refused at the gateway, naming both; at it, accepted."""
    from protocol.sampling import check_sample_request

    def body(max_tokens: int) -> api.SampleRequest:
        fields = {
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
            "sampling_params": {"max_tokens": max_tokens},
            "type": "sample",
        }
        return api.decode(msgspec.json.encode(fields), api.SampleRequest)

    check_sample_request(body(5), max_context=64, vocab_size=VOCAB, max_sequence=10)
    with pytest.raises(UserError) as refused:
        check_sample_request(body(6), max_context=64, vocab_size=VOCAB, max_sequence=10)
    assert "5 tokens + max_tokens 6 exceed the 10 tokens of the longest sequence" in str(
        refused.value
    )

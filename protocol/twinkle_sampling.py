"""The Twinkle Client protocol's sampler calls (`vLLMSampler` of `twinkle_client`) as ours.

A `sample` body holds one or more inputs, each an `InputFeature` (its `input_ids`) or a
`Trajectory` (its `messages`, which the sampler's template encodes), and twinkle's
`SamplingParams` as a dict. Each input becomes one Tinker `SampleRequest` (`sample_request`);
each answer becomes twinkle's `SampleResponseModel` (`response_model`):

- `logprobs` (an int k): each sampled token's `[(token, logprob)]` (k <= 1) or its top k
  (k > 1), as twinkle's vLLM sampler gives them; the logprobs are the model's own
  distribution (Tinker's, before temperature), where twinkle's default is after it.
- `prompt_logprobs` (k): one logprob per prompt token (None for the first) and the top k.
- `max_tokens` 0: the prompt's logprobs only (one token is drawn and dropped, as twinkle does).
- `repetition_penalty` other than 1 is refused: Tinker's samplers have none.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np

from protocol import api
from protocol import tinker_wire_pb2 as pb
from protocol.errors import UserError
from protocol.sampling import TOPK_MASK_LOGPROB

MAX_INPUTS = 64  # one `sample` call's inputs (each a sample request of its own)
MAX_MESSAGES = 256  # a trajectory's
MAX_TEXT = 1 << 20  # characters of one trajectory's messages in all
ROLES = ("system", "user", "assistant", "tool")
TEMPLATES = ("Template", "Qwen3_5Template")
# twinkle's `SamplingParams` fields (`max_new_tokens` is read as `max_tokens`)
PARAMS = (
    "max_tokens",
    "max_new_tokens",
    "seed",
    "stop",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "logprobs",
    "prompt_logprobs",
    "num_samples",
)


class SampleBody(msgspec.Struct, frozen=True):
    """`/sample`: twinkle's `SampleRequest`, with the client's top-level `num_samples`."""

    inputs: Any
    sampling_params: dict[str, Any] | None = None
    adapter_name: str = ""
    adapter_uri: str | None = None
    num_samples: int | None = None


class AddSamplerAdapterBody(msgspec.Struct, frozen=True):
    adapter_name: str
    config: Any = None


class SamplerTemplate(msgspec.Struct, frozen=True):
    """`set_template`'s template: its class and settings, as the processor service takes them."""

    template_cls: str
    settings: dict[str, Any]


class TwinkleSamplerRecord(msgspec.Struct, frozen=True):
    """A session's sampler of one base model: its template and the adapter names it was given."""

    session_id: str
    tenant_id: str
    base_model: str
    template: SamplerTemplate | None = None
    adapters: list[str] = []
    created_at: float = 0.0


TEMPLATE_SETTINGS: dict[str, tuple[type, ...]] = {
    "model_id": (str,),
    "max_length": (int,),
    "truncation_strategy": (str,),
    "use_chat_template": (bool,),
    "enable_thinking": (bool,),
    "default_system": (str, type(None)),
}


def sampler_template(fields: dict[str, Any], base_model: str) -> SamplerTemplate:
    """`set_template(template_cls, **kwargs)`: the class must be one the processor service
    serves and the settings of its kinds (their values are checked there, where they are used);
    `model_id` defaults to the sampler's base model."""
    name = fields.get("template_cls")
    if name not in TEMPLATES:
        raise UserError(
            f"template_cls: {str(name)[:60]!r} is not served; allowed: {list(TEMPLATES)}"
        )
    settings: dict[str, Any] = {"model_id": base_model}
    for key, value in fields.items():
        if key in ("template_cls", "adapter_name"):
            continue
        kinds = TEMPLATE_SETTINGS.get(key)
        if kinds is None:
            raise UserError(
                f"{key[:60]}: not a template setting; allowed: {sorted(TEMPLATE_SETTINGS)}"
            )
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise UserError(f"{key}: {str(value)[:60]!r} is not a {kinds[0].__name__}")
        if isinstance(value, str) and len(value) > 4096:
            raise UserError(f"{key}: longer than 4096 characters")
        settings[key] = value
    return SamplerTemplate(template_cls=name, settings=settings)


def inputs_of(value: Any) -> list[dict[str, Any]]:
    """`inputs` as a list of 1..MAX_INPUTS objects (one object is a list of one)."""
    items = [value] if isinstance(value, dict) else value
    if not isinstance(items, list) or not items:
        raise UserError("inputs: an InputFeature or Trajectory object, or a non-empty list of them")
    if len(items) > MAX_INPUTS:
        raise UserError(f"inputs: {len(items)} inputs; at most {MAX_INPUTS} a call")
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise UserError(f"inputs[{index}]: not an object")
    kinds = {"input_ids" in item for item in items}
    if len(kinds) > 1:
        raise UserError("inputs: all InputFeatures (with input_ids) or all Trajectories")
    return items


def is_feature(item: dict[str, Any]) -> bool:
    return "input_ids" in item


def feature(item: dict[str, Any], index: int) -> dict[str, Any]:
    """An `InputFeature`'s `input_ids` (and `labels`, when as long), the only fields kept."""
    ids = _ints(item.get("input_ids"), f"inputs[{index}].input_ids")
    kept: dict[str, Any] = {"input_ids": ids}
    labels = item.get("labels")
    if labels is not None:
        labels = _ints(labels, f"inputs[{index}].labels")
        if len(labels) != len(ids):
            raise UserError(f"inputs[{index}].labels: {len(labels)} labels for {len(ids)} ids")
        kept["labels"] = labels
    return kept


def trajectory(item: dict[str, Any], index: int) -> dict[str, Any]:
    """A `Trajectory` of text messages only: `{"messages": [{"role", "content"}, ...]}`."""
    where = f"inputs[{index}]"
    extra = sorted(set(item) - {"messages"})
    if extra:
        raise UserError(f"{where}: {extra[:3]} not taken; a trajectory holds text messages only")
    messages = item.get("messages")
    if not isinstance(messages, list) or not 1 <= len(messages) <= MAX_MESSAGES:
        raise UserError(f"{where}.messages: a list of 1..{MAX_MESSAGES} messages")
    total = 0
    kept = []
    for number, message in enumerate(messages):
        at = f"{where}.messages[{number}]"
        if not isinstance(message, dict):
            raise UserError(f"{at}: not an object")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise UserError(f"{at}.role: {str(role)[:30]!r} is not one of {list(ROLES)}")
        if not isinstance(content, str):
            raise UserError(f"{at}.content: text only (images and tool calls are not taken)")
        if set(message) - {"role", "content"}:
            raise UserError(f"{at}: only role and content are taken")
        total += len(content)
        kept.append({"role": role, "content": content})
    if total > MAX_TEXT:
        raise UserError(f"{where}.messages: {total} characters, over {MAX_TEXT}")
    return {"messages": kept}


def _ints(value: Any, field: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise UserError(f"{field}: a non-empty list of token ids")
    if not all(
        isinstance(v, int) and not isinstance(v, bool) and -(2**31) <= v < 2**31 for v in value
    ):
        raise UserError(f"{field}: token ids must be 32-bit integers")
    return value


class Params(msgspec.Struct, frozen=True):
    """twinkle's sampling parameters, checked, as ours."""

    tinker: api.SamplingParams
    num_samples: int
    logprobs: int | None
    prompt_logprobs: int | None
    logprobs_only: bool  # max_tokens 0


def params(given: dict[str, Any] | None, num_samples: int | None) -> Params:
    fields = dict(given or {})
    unknown = sorted(set(fields) - set(PARAMS))
    if unknown:
        raise UserError(f"sampling_params: {unknown[:3]} unknown; allowed: {list(PARAMS)}")
    if "max_new_tokens" in fields and "max_tokens" not in fields:
        fields["max_tokens"] = fields.pop("max_new_tokens")
    fields.pop("max_new_tokens", None)
    max_tokens = _optional_int(fields, "max_tokens", 0)
    seed = _optional_int(fields, "seed", -(2**63))
    temperature = _number(fields, "temperature", 1.0)
    top_p = _number(fields, "top_p", 1.0)
    top_k = _optional_int(fields, "top_k", -1)
    penalty = _number(fields, "repetition_penalty", 1.0)
    if penalty != 1.0:
        raise UserError(
            f"sampling_params.repetition_penalty: {penalty} not supported; this server's samplers"
            " apply none (1.0)"
        )
    logprobs = _optional_int(fields, "logprobs", 0)
    prompt_logprobs = _optional_int(fields, "prompt_logprobs", 0)
    count = _optional_int(fields, "num_samples", 1)
    if count is None:
        count = 1 if num_samples is None else num_samples
    stop = fields.get("stop") or None  # twinkle's empty stop is its default: stop at EOS
    if stop is not None and not isinstance(stop, str | list):
        raise UserError("sampling_params.stop: a string, a list of strings or of token ids")
    only = max_tokens == 0
    tinker = api.SamplingParams(
        max_tokens=1 if only else max_tokens,
        seed=seed,
        stop=stop,
        temperature=temperature,
        top_k=-1 if top_k is None else top_k,
        top_p=top_p,
    )
    return Params(tinker, count, logprobs, prompt_logprobs, only)


def _optional_int(fields: dict[str, Any], name: str, low: int) -> int | None:
    value = fields.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 2**63:
        raise UserError(f"sampling_params.{name}: {str(value)[:30]!r} is not an integer >= {low}")
    return value


def _number(fields: dict[str, Any], name: str, default: float) -> float:
    value = fields.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise UserError(f"sampling_params.{name}: {str(value)[:30]!r} is not a finite number")
    return float(value)


def sample_request(prompt: list[int], p: Params) -> api.SampleRequest:
    """One input's Tinker `SampleRequest`."""
    k = p.logprobs or 0
    prompt_k = p.prompt_logprobs
    return api.SampleRequest(
        prompt=api.ModelInput(chunks=[api.EncodedTextChunk(tokens=prompt)]),
        sampling_params=p.tinker,
        num_samples=p.num_samples,
        prompt_logprobs=True
        if prompt_k is not None and (prompt_k > 0 or p.logprobs_only)
        else None,
        topk_prompt_logprobs=prompt_k or 0,
        topk_sample_logprobs=k if k > 1 else 0,
    )


def _topk(msg: Any, row: int) -> list[tuple[int, float]]:
    ids = np.frombuffer(msg.token_ids, dtype="<i4").reshape(msg.length, msg.k)
    lps = np.frombuffer(msg.logprobs, dtype="<f4").reshape(msg.length, msg.k)
    return [
        (int(t), float(lp))
        for t, lp in zip(ids[row], lps[row], strict=True)
        if lp > TOPK_MASK_LOGPROB
    ]


def response_model(payload: bytes, p: Params, prompt_len: int) -> dict[str, Any]:
    """A sample's protobuf `SampleResponse` as twinkle's `SampleResponseModel` (its sequences'
    `decoded` and `new_input_feature` are filled by the template, when the sampler has one)."""
    msg = pb.SampleResponse.FromString(payload)
    sequences = []
    for seq in msg.sequences:
        tokens = np.frombuffer(seq.tokens, dtype="<i4").tolist()
        logprobs: list[list[tuple[int, float]]] | None = None
        if p.logprobs is not None:
            values = np.frombuffer(seq.logprobs, dtype="<f4").tolist()
            if p.logprobs > 1 and seq.HasField("topk_sampled_logprobs"):
                logprobs = [_topk(seq.topk_sampled_logprobs, i) for i in range(len(tokens))]
            else:
                logprobs = [[(t, lp)] for t, lp in zip(tokens, values, strict=True)]
        stop = "stop" if seq.stop_reason == pb.STOP_REASON_STOP else "length"
        if p.logprobs_only:
            tokens, logprobs = [], None
        sequences.append(
            {
                "stop_reason": stop,
                "tokens": tokens,
                "logprobs": logprobs,
                "decoded": None,
                "new_input_feature": None,
            }
        )
    answer: dict[str, Any] = {
        "sequences": sequences,
        "prompt_logprobs": None,
        "topk_prompt_logprobs": None,
    }
    if msg.prompt_logprobs:
        values = np.frombuffer(msg.prompt_logprobs, dtype="<f4").tolist()
        answer["prompt_logprobs"] = [None if math.isnan(v) else v for v in values][:prompt_len]
    if p.prompt_logprobs and msg.HasField("topk_prompt_logprobs"):
        top = msg.topk_prompt_logprobs
        answer["topk_prompt_logprobs"] = [(_topk(top, i) or None) for i in range(top.length)][
            :prompt_len
        ]
    return answer

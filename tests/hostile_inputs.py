"""Hostile inputs for the fuzz tests, as hypothesis strategies: values for one JSON field by
what it holds, arbitrary JSON, and protobuf `ForwardBackwardRequest`s with hostile tensors.

Protobuf messages are the SDK's own (`tinker.proto.tinker_public_pb2`), and a valid body is what
the SDK's converter makes of `toy_batch`, so "valid plus one change" stays close to real traffic.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import zstandard
from hypothesis import strategies as st
from tinker import types
from tinker.proto import tinker_public_pb2 as public_pb
from tinker.proto.request_conv import forward_backward_request_to_proto

from tests.fuzz_harness import Raw, Target
from tests.sdk_helpers import toy_batch

# -- JSON values --------------------------------------------------------------------------------

HOSTILE_IDS = [
    "", " ", "a b", "*", ">", "a.*", "a.>", ".", "..", "../..", "x" * 300, "\U0001f984",
    "sess-\U0001f984", "a\x00b", "\n", "\t", "a/b", "%2F", "-", "$KV.tw_runs.x", "null",
    "tinker://x/weights/y", "req-00000000000000000000000000000000-sample",
]  # fmt: skip
HOSTILE_INTS: list[Any] = [
    -1, 0, 1, 2, 3, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30,
    -(2**63), -(2**63) - 1, 1.5, -0.0, 1e300, Raw("1e400"), Raw("-0"), "1", "", None, True,
    [], {},
]  # fmt: skip
HOSTILE_FLOATS: list[Any] = [
    1e38, -1, -1e-300, 0, -0.0, 5e-324, 1e308, 2.0, Raw("1e400"), Raw("-1e400"), Raw("NaN"),
    Raw("Infinity"), "inf", "nan", "NaN", "1e-3", None, True, [], {}, 10**30,
]  # fmt: skip
HOSTILE_NAMES = [
    "", " ", "a/b", "/", "/etc/passwd", ".", "..", "../x", "~", "~/x", "a\nb", "a\x00b",
    "\U0001f984" * 200, "x" * 129, "x" * 201, "x" * 5000, "-x", ".x", "a\\b", "con", "*", ">",
    "tinker://x", "%s%n", "fuzz-weights", "fuzz-sampler", "a b", "\ud800",
]  # fmt: skip
HOSTILE_STRINGS = ["", " ", "\x00", "\ud800", "\U0001f984" * 200, "x" * 10000, "null", "0"]


def json_junk() -> st.SearchStrategy[Any]:
    """Arbitrary JSON, including raw tokens and strings that are not valid UTF-8."""
    leaves = (
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats()
        | st.text(max_size=20)
        | st.sampled_from(HOSTILE_INTS + HOSTILE_FLOATS + HOSTILE_STRINGS)
    )
    return st.recursive(
        leaves,
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
        ),
        max_leaves=12,
    )


def tinker_paths(t: Target) -> list[str]:
    run, other = t.model, t.other_model
    return [
        t.checkpoint, t.sampler_checkpoint, f"tinker://{other}/weights/fuzz-weights",
        "tinker://", "tinker:///weights/x", f"tinker://{run}/weights/", f"tinker://{run}//x",
        f"tinker://{run}/weights/a/b", f"tinker://{run}/external_weights/x",
        f"tinker://{run}/weights/..", f"tinker://{run}/weights/a\x00b", "tinker://*/weights/>",
        "tinker://a b/weights/c", "tinker://../weights/x", "http://x/weights/y", "weights/x",
        f"tinker://{run}/weights/{'x' * 300}", f"tinker://{'x' * 300}/weights/y",
        f"tinker://{run}/sampler_weights/\U0001f984", "tinker:/" + t.checkpoint[8:],
    ]  # fmt: skip


def hostile(kind: str, t: Target) -> st.SearchStrategy[Any]:
    """Hostile values for one field: by what the field holds, plus any JSON at all."""
    ids = st.sampled_from(HOSTILE_IDS) | st.text(max_size=30)
    real = {
        "session": [t.session, t.finished_session, t.other_session, t.model],
        "model": [t.model, t.other_model, t.session, t.sampler, f"{t.model}x"],
        "sampler": [t.sampler, t.other_sampler, t.model, f"{t.session}:sample:99"],
        "request": [t.request, t.other_request, t.model, f"{t.request}x"],
    }
    by_kind: dict[str, st.SearchStrategy[Any]] = {
        "int": st.sampled_from(HOSTILE_INTS) | st.integers(),
        "float": st.sampled_from(HOSTILE_FLOATS) | st.floats(),
        "name": st.sampled_from(HOSTILE_NAMES) | st.text(max_size=40),
        "path": st.sampled_from(tinker_paths(t)) | st.text(max_size=40),
        "str": st.sampled_from(HOSTILE_STRINGS + HOSTILE_IDS) | st.text(max_size=40),
        "bool": st.sampled_from([0, 1, "true", None, [], 2]),
        "tokens": st.sampled_from(
            [[], [-1], [2**31], [2**63], [10**6], [1.5], ["a"], [None], list(range(5000))]
        )
        | st.lists(st.integers(), max_size=8),
        "stop": st.sampled_from([[], [""], ["a", 1], [-1], [2**40], "", "\x00", [[1]], 5]),
        "dict": st.dictionaries(st.text(max_size=8), json_junk(), max_size=3),
    }
    if kind in real:
        chosen = st.sampled_from(real[kind]) | ids
    else:
        chosen = by_kind.get(kind, st.nothing())
    return st.one_of(chosen, json_junk())


# -- forward_backward protobuf --------------------------------------------------------------

DIMS = st.sampled_from([0, 1, 2, 3, -1, 2**26, 2**31, 2**62, 2**63 - 1, -(2**63)]) | st.integers(
    0, 6
)
DTYPES = st.sampled_from([0, 1, 2, 3, 4, 5, 99, -1, 2**31 - 1])
INPUT_NAMES = st.sampled_from(
    ["target_tokens", "weights", "advantages", "logprobs", "clip_low_threshold", "", "x" * 300]
)
LOSS_FNS = st.sampled_from(
    ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "custom", "", "\x00"]
)


def _int64s(values: list[int]) -> bytes:
    return np.asarray(values, dtype="<i8").tobytes()


@st.composite
def tensors(draw: st.DrawFn) -> public_pb.Tensor:
    """A Tensor with any dtype number, any shape, and dense or CSR bytes that may not fit it."""
    tensor = public_pb.Tensor(dtype=draw(DTYPES), shape=draw(st.lists(DIMS, max_size=4)))
    if draw(st.booleans()):
        tensor.shape[:] = [1] * draw(st.sampled_from([33, 65, 100]))
    encoding = draw(st.sampled_from(["dense", "fitting", "sparse", "none"]))
    if encoding == "dense":
        tensor.dense = draw(st.binary(max_size=40))
    elif encoding == "fitting":
        cells = math.prod(tensor.shape) if 0 <= math.prod(tensor.shape) <= 64 else 1
        tensor.dense = bytes(cells * draw(st.sampled_from([1, 2, 4, 8])))
    elif encoding == "sparse":
        csr = tensor.sparse_csr
        csr.values = draw(st.binary(max_size=32))
        csr.crow_indices = draw(
            st.sampled_from([b"", _int64s([0]), _int64s([0, 0]), _int64s([0, 1]), b"\x00" * 3])
            | st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4).map(_int64s)
        )
        csr.col_indices = draw(
            st.sampled_from([b"", _int64s([0]), _int64s([-1]), _int64s([2**62])])
            | st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4).map(_int64s)
        )
    return tensor


@st.composite
def chunks(draw: st.DrawFn) -> public_pb.Chunk:
    kind = draw(st.sampled_from(["tokens", "raw", "image", "dmel", "empty"]))
    chunk = public_pb.Chunk()
    if kind == "tokens":
        tokens = draw(st.lists(st.integers(-(2**31), 2**31 - 1) | st.integers(0, 200), max_size=8))
        chunk.encoded_text.tokens = np.asarray(tokens, dtype="<i4").tobytes()
    elif kind == "raw":
        chunk.encoded_text.tokens = draw(st.binary(max_size=17))
    elif kind == "image":
        chunk.image.data = draw(st.binary(max_size=16))
        chunk.image.format = draw(st.sampled_from(["png", "jpeg", "", "gif"]))
    elif kind == "dmel":
        chunk.dmel.dmel = draw(st.binary(max_size=16))
    return chunk


@st.composite
def datums(draw: st.DrawFn) -> public_pb.Datum:
    datum = public_pb.Datum()
    datum.model_input.extend(draw(st.lists(chunks(), max_size=3)))
    for name in draw(st.lists(INPUT_NAMES, max_size=3, unique=True)):
        datum.loss_fn_inputs[name].CopyFrom(draw(tensors()))
    return datum


def model_ids(t: Target) -> st.SearchStrategy[str]:
    return st.sampled_from([t.model, t.model, t.other_model]) | st.sampled_from(HOSTILE_IDS)


@st.composite
def fwdbwd_requests(draw: st.DrawFn, t: Target) -> public_pb.ForwardBackwardRequest:
    msg = public_pb.ForwardBackwardRequest(
        model_id=draw(model_ids(t)),
        seq_id=draw(st.sampled_from([0, -1, 1, 3, 1000, 2**31 - 1, -(2**31)]) | st.integers(-9, 9)),
        loss_fn=draw(LOSS_FNS),
        forward_only=draw(st.booleans()),
    )
    for key, value in draw(st.dictionaries(st.text(max_size=12), st.floats(), max_size=2)).items():
        msg.loss_fn_config[key] = value
        msg.loss_fn_config_v2[key].number = value
    msg.data.extend(draw(st.lists(datums(), max_size=4)))
    if msg.data and draw(st.integers(0, 9)) == 0:
        first = public_pb.Datum()
        first.CopyFrom(msg.data[0])
        msg.data.extend([first] * draw(st.sampled_from([100, 1000])))
    return msg


def valid_fwdbwd(model_id: str, seq_id: int) -> public_pb.ForwardBackwardRequest:
    """What the SDK sends for two toy datums, built with the SDK's own converter."""
    data = types.ForwardBackwardInput(data=toy_batch(n=2), loss_fn="cross_entropy")
    request = types.ForwardBackwardRequest(
        model_id=model_id, seq_id=seq_id, forward_backward_input=data
    )
    message: public_pb.ForwardBackwardRequest = forward_backward_request_to_proto(request)
    return message


CHANGES = (
    "model_id", "seq_id", "loss_fn", "config", "shape", "dtype", "dense", "huge_sparse",
    "sparse_zero_rows", "tokens", "chunk", "many", "no_data", "drop_input", "extra_input", "tensor",
)  # fmt: skip
# Changes that keep the request addressed to its model, in its place, and small: what an
# end-to-end test can run.
CHANGES_IN_PLACE = tuple(c for c in CHANGES if c not in ("model_id", "seq_id", "many"))


def change_fwdbwd(
    draw: st.DrawFn,
    msg: public_pb.ForwardBackwardRequest,
    t: Target,
    changes: tuple[str, ...] = CHANGES,
) -> str:
    """Apply one hostile change to a valid request; return which."""
    what = draw(st.sampled_from(changes))
    first = msg.data[0]
    tensor = first.loss_fn_inputs[draw(st.sampled_from(["target_tokens", "weights"]))]
    if what == "model_id":
        msg.model_id = draw(model_ids(t))
    elif what == "seq_id":
        msg.seq_id = draw(st.sampled_from([0, -1, 1, 2, 3, 2**31 - 1, -(2**31)]))
    elif what == "loss_fn":
        msg.loss_fn = draw(LOSS_FNS | st.text(max_size=300))
    elif what == "config":
        key = draw(st.sampled_from(["clip_low_threshold", "beta", "loss_id", "", "\x00"]))
        value = draw(st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1.0]))
        msg.loss_fn_config[key] = value
        if draw(st.booleans()):
            msg.loss_fn_config_v2[key].text = draw(st.sampled_from(["", "\x00", "x" * 1000]))
    elif what == "shape":
        tensor.shape[:] = draw(st.lists(DIMS, max_size=4) | st.just([1] * 70))
    elif what == "dtype":
        tensor.dtype = draw(DTYPES)
    elif what == "dense":
        tensor.dense = tensor.dense[: draw(st.integers(0, len(tensor.dense)))] + draw(
            st.binary(max_size=9)
        )
    elif what in ("huge_sparse", "sparse_zero_rows"):
        shape = draw(st.sampled_from([[2**31, 2**31], [2**62, 1], [1, 2**40], [2**26, 1]]))
        if what == "sparse_zero_rows":
            shape = draw(st.sampled_from([[0, 2**63 - 1], [0, 2**62], [0, 2**40], [1, 0]]))
        tensor.ClearField("dense")
        tensor.shape[:] = shape
        tensor.sparse_csr.crow_indices = _int64s([0] * (min(shape[0], 4) + 1))
    elif what == "tokens":
        first.model_input[0].encoded_text.tokens = draw(
            st.binary(max_size=11)
            | st.sampled_from([_int64s([-1, 2**40]), np.asarray([-1, 2**31 - 1], "<i4").tobytes()])
        )
    elif what == "chunk":
        first.model_input.append(draw(chunks()))
    elif what == "many":
        msg.data.extend([first] * draw(st.sampled_from([200, 2000])))
    elif what == "no_data":
        del msg.data[:]
    elif what == "drop_input":
        del first.loss_fn_inputs[draw(st.sampled_from(["target_tokens", "weights"]))]
    elif what == "extra_input":
        first.loss_fn_inputs[draw(INPUT_NAMES)].CopyFrom(draw(tensors()))
    else:
        tensor.CopyFrom(draw(tensors()))
    return what


# -- compressed bodies --------------------------------------------------------------------------

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# 7 MiB of zeros compress to a few hundred bytes: more than the gateway's request limit.
ZSTD_BOMB = zstandard.ZstdCompressor().compress(bytes(7 * 1024 * 1024))

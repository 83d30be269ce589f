"""Server-side custom losses without a cluster: the validator refuses every graph that is not plain
allow-listed tensor math, and the graph rebuilt on the worker computes exactly what the user's
Python loss computes (value, metrics and gradient), traced by the official SDK."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import torch
import torch.nn.functional as F

from protocol import custom_loss as spec
from protocol.errors import UserError
from tests.custom_loss_helpers import (
    LossFn,
    check,
    on_meta,
    scalar_chain,
    unchecked,
    upload,
    upload_json,
)
from workers.engine import custom_loss as worker
from workers.engine.custom_loss import CustomLossError, ElementBudget, LossProgram

# -- losses a user writes ----------------------------------------------------------------------


def ppo_like(logprobs, advantages, old):  # type: ignore[no-untyped-def]
    ratio = torch.exp(logprobs - old)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    n = logprobs.shape[0]
    loss = -torch.min(ratio * advantages, clipped * advantages).sum() / n
    return loss, {"custom/ratio:mean": ratio.mean(), "custom/clipped:sum": (ratio != clipped).sum()}


def masked_tail(logprobs, weights):  # type: ignore[no-untyped-def]
    tail = logprobs[1:] * weights[1:]
    lead = torch.where(weights[:1] > 0, logprobs[:1], torch.zeros_like(logprobs[:1]))
    soft = F.logsigmoid(logprobs.double()).float().mean()
    running = torch.cumsum(tail, dim=0)[-1]
    return -(tail.sum() + lead.sum()) + 0.1 * soft + 0.01 * running, {}


def topk_distill(logprobs, target_probs):  # type: ignore[no-untyped-def]
    # logprobs [T, K] of K candidate tokens per position; a soft target over them.
    normalised = logprobs - torch.logsumexp(logprobs, dim=-1, keepdim=True)
    loss = -(target_probs * normalised).sum()
    return loss, {"custom/kl:sum": (target_probs * (torch.log(target_probs) - normalised)).sum()}


def scaled(logprobs, scale):  # type: ignore[no-untyped-def]
    return -((logprobs * scale).sum() ** 2) / (logprobs.ndim + 1.0), {"custom/scale:mean": scale}


CASES: list[tuple[LossFn, dict[str, Any], Callable[[torch.Generator], list[torch.Tensor]]]] = [
    (
        ppo_like,
        {"logprobs": 1, "advantages": 1, "old": 1},
        lambda g: [-torch.rand(7, generator=g) * 3, torch.randn(7, generator=g), -torch.rand(7, generator=g) * 3],
    ),
    (
        masked_tail,
        {"logprobs": 1, "weights": 1},
        lambda g: [-torch.rand(6, generator=g) * 2, torch.rand(6, generator=g) - 0.3],
    ),
    (
        topk_distill,
        {"logprobs": 2, "target_probs": 2},
        lambda g: [-torch.rand(5, 3, generator=g) * 4, torch.softmax(torch.randn(5, 3, generator=g), -1)],
    ),
    (scaled, {"logprobs": 1, "scale": 0}, lambda g: [-torch.rand(4, generator=g), torch.tensor(0.7)]),
]  # fmt: skip


@pytest.mark.parametrize(("fn", "ranks", "make"), CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_the_rebuilt_graph_equals_the_python_loss(
    fn: LossFn, ranks: dict[str, Any], make: Callable[[torch.Generator], list[torch.Tensor]]
) -> None:
    loss = upload(fn, ranks)
    program = LossProgram(loss)
    values = make(torch.Generator().manual_seed(3))
    mine = values[0].clone().requires_grad_(True)
    theirs = values[0].clone().requires_grad_(True)

    got, got_metrics = program.run([mine, *values[1:]], ElementBudget(1_000_000))
    want, want_metrics = fn(theirs, *values[1:])
    got.backward()
    want.backward()

    assert got.dtype == torch.float32 and got.ndim == 0
    torch.testing.assert_close(got, want.float(), rtol=0, atol=1e-6)
    assert mine.grad is not None and theirs.grad is not None
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=1e-6)
    assert set(got_metrics) == set(want_metrics) == set(loss.metrics)
    for key, value in want_metrics.items():
        torch.testing.assert_close(got_metrics[key].float(), value.float())


def test_the_worker_tables_are_exactly_the_allow_lists() -> None:
    assert set(worker.FUNCTIONS) == spec.FUNCTIONS
    assert set(worker.METHODS) == spec.METHODS
    for name, method in worker.METHODS.items():
        assert method is getattr(torch.Tensor, name)
    for forbidden in ("backward", "item", "tolist", "numpy", "add_", "copy_", "__reduce__"):
        assert forbidden not in spec.METHODS


# -- refusals ----------------------------------------------------------------------------------


def base_body() -> dict[str, Any]:
    return upload_json(ppo_like, {"logprobs": 1, "advantages": 1, "old": 1})


def with_node(node: dict[str, Any], at: int = 3) -> dict[str, Any]:
    body = base_body()
    body["graph"]["nodes"].insert(at, {"args": [], "kwargs": {}, **node})
    return body


def refused(body: dict[str, Any], *fragments: str) -> str:
    with pytest.raises(UserError) as err:
        check(body)
    for fragment in fragments:
        assert fragment in err.value.message, err.value.message
    assert err.value.status == 400
    return err.value.message


@pytest.mark.parametrize(
    "target",
    [
        "builtins.eval",
        "eval",
        "builtins.exec",
        "os.system",
        "subprocess.run",
        "torch.load",
        "torch.save",
        "torch.from_file",
        "torch.ops.aten.exp",
        "builtins.__import__",
        "torch.Tensor.backward",
        "operator.attrgetter",
        "operator.setitem",
        "operator.matmul",
        "torch.empty",
        "math.exp.__globals__",
    ],
)
def test_functions_off_the_allow_list_are_refused_naming_the_node(target: str) -> None:
    node = {"op": "call_function", "name": "evil", "target": target, "args": ["1+1"]}
    refused(with_node(node), "graph.nodes['evil']", repr(target), "not an allowed function")


@pytest.mark.parametrize(
    "method", ["backward", "item", "tolist", "numpy", "add_", "copy_", "__reduce__", "storage"]
)
def test_methods_off_the_allow_list_are_refused(method: str) -> None:
    node = {"op": "call_method", "name": "m", "target": method, "args": [{"ref": "logprobs"}]}
    refused(with_node(node), "graph.nodes['m']", repr(method), "not an allowed tensor method")


@pytest.mark.parametrize(
    "args",
    [
        [{"ref": "logprobs"}, "__class__"],
        [{"ref": "logprobs"}, "__dict__"],
        [{"ref": "logprobs"}, "grad_fn"],
        [{"ref": "logprobs"}, "data"],
        ["a string", "__class__"],
        [{"ref": "logprobs"}, "shape", None],
    ],
)
def test_getattr_reads_only_shape_dtype_and_ndim(args: list[Any]) -> None:
    node = {"op": "call_function", "name": "g", "target": "getattr", "args": args}
    refused(with_node(node), "graph.nodes['g']", "getattr may only read dtype, ndim, shape")


@pytest.mark.parametrize(
    ("node", "fragment"),
    [
        ({"op": "get_attr", "name": "w", "target": "weight"}, "only placeholder"),
        ({"op": "call_module", "name": "m", "target": "linear"}, "only placeholder"),
        ({"op": "exec", "name": "x", "target": "torch.exp"}, "only placeholder"),
        ({"op": "placeholder", "name": "extra", "target": "extra"}, "does not declare"),
        (
            {"op": "call_method", "name": "m", "target": "sum", "args": ["not a node"]},
            "receiver",
        ),
        (
            {"op": "call_function", "name": "f", "target": "torch.exp", "args": [{"ref": "mul"}]},
            "not an earlier node",
        ),
        (
            {"op": "call_function", "name": "f", "target": "torch.exp", "args": [{"pickle": "x"}]},
            "argument kind 'pickle'",
        ),
        (
            {"op": "call_function", "name": "f", "target": "torch.sum", "args": [list(range(300))]},
            "more than 256 constants",
        ),
        (
            {"op": "call_function", "name": "f", "target": "torch.mul", "args": [2**80, 1]},
            "outside ±2**53",
        ),
        (
            {"op": "call_function", "name": "f", "target": "torch.mul", "args": ["x" * 65]},
            "longer than 64",
        ),
        (
            {"op": "call_function", "name": "f", "target": "torch.exp", "args": [[[[[[[[1]]]]]]]]},
            "nest deeper",
        ),
        (
            {"op": "call_function", "name": "f", "target": "torch.exp", "args": [{"device": "cuda"}]},
            "argument kind 'device'",
        ),
        (
            {"op": "call_function", "name": "f", "target": "torch.exp", "args": [{"dtype": "qint8"}]},
            "malformed 'dtype'",
        ),
        (
            {"op": "call_method", "name": "m", "target": "to", "args": [{"ref": "logprobs"}, "cuda"]},
            "to() takes a dtype only",
        ),
        (
            {"op": "call_function", "name": "f", "target": "torch.exp", "kwargs": {"__x": 1}},
            "not a lowercase identifier",
        ),
        (
            {"op": "call_function", "name": "f", "target": "torch.exp", "kwargs": {"out": {"ref": "old"}}},
            "out= writes in place",
        ),
        ({"op": "call_function", "name": "sub", "target": "torch.exp"}, "used by an earlier node"),
        ({"op": "call_function", "name": "1bad", "target": "torch.exp"}, "not an identifier"),
    ],
)  # fmt: skip
def test_malformed_nodes_are_refused(node: dict[str, Any], fragment: str) -> None:
    refused(with_node(node), fragment)


def test_graph_level_refusals() -> None:
    body = base_body()
    body["graph"]["format"] = 2
    refused(body, "graph.format: 2")

    body = base_body()
    nodes = body["graph"]["nodes"]
    filler = [
        {"op": "call_function", "name": f"n{i}", "target": "torch.exp", "args": [{"ref": "old"}]}
        for i in range(spec.MAX_NODES)
    ]
    body["graph"]["nodes"] = nodes[:3] + filler + nodes[3:]
    refused(body, f"at most {spec.MAX_NODES}")

    body = base_body()
    body["graph"]["nodes"] = []
    refused(body, "graph.nodes: empty")

    body = base_body()
    body["graph"]["nodes"].pop()  # no output
    refused(body, "the last node must be the output node")

    body = base_body()
    body["graph"]["nodes"][-1]["args"] = [{"tuple": [{"ref": "mean"}]}]
    refused(body, "(loss, metrics)")

    body = base_body()
    body["graph"]["nodes"][-1]["args"][0]["tuple"][1]["dict"] = {"loss:sum": {"ref": "mean"}}
    refused(body, "custom/<name>:sum")

    body = base_body()
    body["inputs"][0]["name"] = "advantages"
    refused(body, "inputs: the first input must be logprobs")

    body = base_body()
    body["inputs"][1]["rank"] = 3
    refused(body, "inputs[1].rank: 3")

    body = base_body()
    body["graph"]["nodes"][1]["target"] = "old"  # placeholders in another order than declared
    refused(body, "placeholder of input 'advantages'")

    body = base_body()
    body["graph"]["nodes"] = "not a list"
    with pytest.raises(UserError, match="graph.nodes"):
        check(body)


def test_loss_ids_are_per_session_and_bounded() -> None:
    assert spec.loss_id_of("sess-1", 0) == "sess-1:loss:0"
    for bad in (-1, spec.MAX_LOSSES_PER_SESSION):
        with pytest.raises(UserError, match="custom_loss_seq_id"):
            spec.loss_id_of("sess-1", bad)


def test_a_validated_loss_travels_in_a_job() -> None:
    from protocol.jobs import ForwardBackwardJob, decode_job, encode_job

    loss = upload(ppo_like, {"logprobs": 1, "advantages": 1, "old": 1})
    job = ForwardBackwardJob(
        request_id="r", model_id="m", tenant_id="t", seq_id=1, custom_loss=loss
    )
    assert decode_job(encode_job(job)) == job
    assert msgspec.msgpack.decode(encode_job(job))["custom_loss"]["name"] == "ppo_like"


# -- what a valid graph may still not do at run time ------------------------------------------


def program_with(node: dict[str, Any], returns: str) -> LossProgram:
    body = base_body()
    body["graph"]["nodes"].insert(3, {"args": [], "kwargs": {}, **node})
    body["graph"]["nodes"][-1]["args"][0]["tuple"][0] = {"ref": returns}
    return LossProgram(check(body))


def run(program: LossProgram, budget: int = 1_000_000, n: int = 5) -> Any:
    values = [torch.zeros(n), torch.ones(n), torch.zeros(n)]
    return program.run(values, ElementBudget(budget))


def test_results_beyond_the_budget_fail_before_anything_is_allocated() -> None:
    node = {
        "op": "call_method",
        "name": "big",
        "target": "expand",
        "args": [{"ref": "logprobs"}, 2**40, 5],
    }
    program = program_with(node, "big")
    with pytest.raises(CustomLossError, match="node 'big'.*exceed 10000 tensor elements"):
        run(program, budget=10_000)


@pytest.mark.parametrize(
    ("node", "fragment"),
    [
        ({"target": "operator.pow", "args": [10, 10**9]}, "integer exponent"),
        ({"target": "operator.mul", "args": ["x", 10**9]}, "arithmetic on a str"),
        ({"target": "operator.add", "args": [[1], [2]]}, "arithmetic on a list"),
        ({"target": "torch.exp", "args": [{"ref": "logprobs"}, 1, 2, 3]}, "raised TypeError"),
    ],
)
def test_python_arithmetic_stays_bounded(node: dict[str, Any], fragment: str) -> None:
    program = program_with({"op": "call_function", "name": "x", **node}, "x")
    with pytest.raises(CustomLossError, match=fragment):
        run(program)


def test_the_loss_must_be_a_float_scalar() -> None:
    node = {"op": "call_function", "name": "x", "target": "torch.exp", "args": [{"ref": "old"}]}
    with pytest.raises(CustomLossError, match="floating-point scalar"):
        run(program_with(node, "x"))


def test_value_dependent_shapes_are_refused_clearly() -> None:
    def masked(logprobs, weights):  # type: ignore[no-untyped-def]
        return -logprobs[weights > 0].sum(), {}

    program = LossProgram(upload(masked, {"logprobs": 1, "weights": 1}))
    values = [torch.zeros(4), torch.tensor([1.0, 0.0, 1.0, 0.0])]
    with pytest.raises(CustomLossError, match="shape depends on tensor values"):
        program.run(values, ElementBudget(10_000))


# -- node counts, index ranges, placement -----------------------------------------------------


def test_every_node_evaluation_costs_at_least_min_node_cost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A chain of scalar ops costs its node count, charged on the meta run: the datum that
    would go past the budget is refused there, before its real run."""
    program = LossProgram(upload(scalar_chain, {"logprobs": 1, "weights": 1}))
    steps = len(program.steps)
    runs: list[str] = []
    evaluate = LossProgram._evaluate

    def spy(self: LossProgram, values: list[Any], budget: ElementBudget | None) -> Any:
        runs.append(values[0].device.type)
        return evaluate(self, values, budget)

    monkeypatch.setattr(LossProgram, "_evaluate", spy)
    budget = ElementBudget(2 * steps * worker.MIN_NODE_COST)
    values = [torch.zeros(3), torch.ones(3)]
    program.run(values, budget)
    assert budget.used == steps * worker.MIN_NODE_COST
    program.run(values, budget)
    with pytest.raises(CustomLossError, match=f"at least {worker.MIN_NODE_COST}"):
        program.run(values, budget)
    assert runs == ["meta", "cpu", "meta", "cpu", "meta"]


def gather_fn(logprobs, index):  # type: ignore[no-untyped-def]
    return -torch.gather(logprobs, 1, index).sum(), {}


def gather_method(logprobs, index):  # type: ignore[no-untyped-def]
    return -logprobs.gather(-1, index).sum(), {}


def tensor_index(logprobs, index):  # type: ignore[no-untyped-def]
    return -logprobs[index].sum(), {}


def column_index(logprobs, index):  # type: ignore[no-untyped-def]
    return -logprobs[..., index].sum(), {}


@pytest.mark.parametrize(
    ("fn", "ranks", "good", "bad", "fragment"),
    [
        (gather_fn, 2, [[0], [2]], [[0], [3]], "node 'gather' (torch.gather): index values span [0, 3], outside [0, 3) for dimension 1"),
        (gather_method, 2, [[1], [2]], [[-1], [2]], "node 'gather' (gather): index values span [-1, 2], outside [0, 3) for dimension 1"),
        (tensor_index, 1, [0, -2], [0, 2], "node 'getitem' (operator.getitem): index values span [0, 2], outside [-2, 2) for dimension 0"),
        (column_index, 1, [0, -3], [1, -4], "node 'getitem' (operator.getitem): index values span [-4, 1], outside [-3, 3) for dimension 1"),
    ],
    ids=["torch.gather", "Tensor.gather", "getitem", "getitem-tuple"],
)  # fmt: skip
def test_index_tensors_are_checked_against_their_dimension(
    fn: LossFn, ranks: int, good: list[Any], bad: list[Any], fragment: str
) -> None:
    """On CUDA an index out of range is a device-side assert that ends the worker's CUDA
    context for every tenant: the real run checks the range on the host first."""
    program = LossProgram(upload(fn, {"logprobs": 2, "index": ranks}))
    logprobs = -torch.arange(6.0).reshape(2, 3)
    got, _ = program.run([logprobs, torch.tensor(good)], ElementBudget(1_000_000))
    torch.testing.assert_close(got, fn(logprobs, torch.tensor(good))[0])
    with pytest.raises(CustomLossError) as err:
        program.run([logprobs, torch.tensor(bad)], ElementBudget(1_000_000))
    assert fragment in str(err.value), str(err.value)


def zeros_on_meta(logprobs, weights):  # type: ignore[no-untyped-def]
    return torch.zeros_like(logprobs, device="meta").sum() + (logprobs * weights).sum(), {}


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("device", "meta"),
        ("device", "cpu"),
        ("pin_memory", True),
        ("requires_grad", True),
        ("layout", "strided"),
        ("memory_format", "preserve_format"),
    ],
)
def test_placement_keywords_are_refused(key: str, value: Any) -> None:
    refused(
        upload_json(zeros_on_meta, {"logprobs": 1, "weights": 1}),
        "graph.nodes['zeros_like']",
        "device= is not allowed",
    )
    node = {
        "op": "call_function",
        "name": "z",
        "target": "torch.ones_like",
        "args": [{"ref": "old"}],
        "kwargs": {key: value},
    }
    refused(with_node(node), "graph.nodes['z']", f"{key}= is not allowed")


@pytest.mark.parametrize("where", ["loss", "metric"])
def test_a_loss_or_metric_off_the_inputs_device_fails_its_datum(where: str) -> None:
    loss = unchecked(on_meta, {"logprobs": 1, "weights": 1})
    if where == "metric":  # swap: the loss is the nll, the metric the tensor on meta
        returned = loss.nodes[-1].args[0]["tuple"]
        returned[0], returned[1]["dict"]["custom/nll:sum"] = {"ref": "neg"}, returned[0]
    program = LossProgram(loss)
    with pytest.raises(CustomLossError, match="on device meta, not beside"):
        program.run([torch.zeros(3), torch.ones(3)], ElementBudget(1_000_000))

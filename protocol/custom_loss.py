"""Server-side custom losses: the torch.fx graph a client uploads, checked as plain data.

Job: the wire shape of `create_custom_loss` (SDK `CreateCustomLossRequest`: `name`, `inputs`,
`graph`), and `check_custom_loss`, which turns a request into a validated `CustomLoss` or refuses
it with a `UserError` naming the node and its target. Nothing here runs the graph: the worker
(`workers.engine.custom_loss`) rebuilds it from its own table of the names allowed here.

Place in the flow: the gateway checks the upload once (`create_custom_loss`), stores the
`CustomLoss` per session, and a `forward_backward(loss_fn="custom")` carries it to the worker in
the job (`ForwardBackwardJob.custom_loss`).

Invariants (a hostile tenant controls every field):
- The graph is data. No name in it is ever imported, looked up or evaluated: every
  `call_function` target and `call_method` name must be on the explicit allow-lists below
  (elementwise math, reductions, comparisons, `where`, shape and indexing ops, casts, the
  `operator` module's arithmetic and `getitem`), and `getattr` may read only `shape`, `dtype`
  and `ndim`. `get_attr` and `call_module` nodes are refused.
- Placeholders come first and are exactly the declared inputs, `logprobs` first; the one
  `output` node is last and returns `(loss, {metric: node})`. Every reference names an earlier
  node. At most `MAX_NODES` nodes, `MAX_INPUTS` inputs, `MAX_METRICS` metrics.
- Constants are small: per node at most `MAX_ARG_LEAVES` leaves nested `MAX_ARG_DEPTH` deep,
  integers within ±2**53, strings of at most `MAX_STR_LEN` characters, and the only torch
  constant is a dtype from `DTYPES` (no devices).
- Where a tensor lives and how it is allocated is the server's business: the keywords in
  `PLACEMENT_KEYWORDS` (`device=`, `pin_memory=`, ...) are refused on every node, as is `out=`.
"""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec

from protocol.errors import UserError

FORMAT = 1
MAX_NODES = 2000
MAX_INPUTS = 16  # logprobs included, as in the SDK
MAX_METRICS = 64
MAX_ARG_LEAVES = 256
MAX_ARG_DEPTH = 6
MAX_STR_LEN = 64
MAX_INT = 2**53
MAX_LOSSES_PER_SESSION = 256  # custom_loss_seq_id is 0..MAX_LOSSES_PER_SESSION - 1
MAX_BODY_BYTES = 512 * 1024

_INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
_NODE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_LOSS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.<>-]{0,127}")
_METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
_KWARG_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")

# -- the allow-lists (the worker maps each name to a torch/operator function) -----------------

_TORCH_ELEMENTWISE = (
    "abs neg sign exp exp2 expm1 log log1p log2 log10 sqrt rsqrt square reciprocal sigmoid tanh"
    " relu sin cos floor ceil round trunc erf clamp clip clamp_min clamp_max minimum maximum"
    " pow add sub mul div true_divide where lerp logaddexp nan_to_num isfinite isnan isinf"
    " eq ne lt le gt ge logical_and logical_or logical_not logical_xor"
)
_TORCH_REDUCTIONS = "sum mean prod amax amin max min logsumexp cumsum std var all any count_nonzero"
_TORCH_SHAPES = (
    "stack cat unsqueeze squeeze flatten reshape transpose narrow select gather"
    " zeros_like ones_like full_like softmax log_softmax"
)
FUNCTIONS: frozenset[str] = frozenset(
    [f"torch.{n}" for n in f"{_TORCH_ELEMENTWISE} {_TORCH_REDUCTIONS} {_TORCH_SHAPES}".split()]
    + [
        f"torch.nn.functional.{n}"
        for n in ("relu", "softmax", "log_softmax", "softplus", "logsigmoid")
    ]
    + ["torch._C._nn.softplus", "torch._C._nn.log_sigmoid"]  # how fx names F.softplus/logsigmoid
    + [
        f"operator.{n}"
        for n in "add sub mul truediv floordiv mod pow neg pos abs getitem eq ne lt le gt ge"
        " and_ or_ invert".split()
    ]
    + ["getattr"]  # fx's name for builtins.getattr (attribute reads such as x.shape)
)
METHODS: frozenset[str] = frozenset(
    (
        f"{_TORCH_ELEMENTWISE} {_TORCH_REDUCTIONS}"
        " unsqueeze squeeze flatten reshape view transpose t narrow select gather expand"
        " expand_as masked_fill softmax log_softmax size dim numel detach clone contiguous"
        " float double half bfloat16 long int bool to type_as"
    ).split()
)
GETATTR_NAMES = frozenset({"shape", "dtype", "ndim"})
DTYPES = frozenset({"float32", "float64", "float16", "bfloat16", "int64", "int32", "bool"})
# Keywords that would put a result on another device (`zeros_like(x, device="meta")` escapes
# the worker's per-datum guard and fails the whole shared pass) or allocate it differently.
PLACEMENT_KEYWORDS = frozenset({"device", "pin_memory", "requires_grad", "layout", "memory_format"})
_ARG_KINDS = frozenset({"ref", "tuple", "dict", "slice", "ellipsis", "float", "dtype"})
_SPECIAL_FLOATS = frozenset({"inf", "-inf", "nan"})


# -- wire shape -----------------------------------------------------------------------------------


class LossInput(msgspec.Struct, frozen=True):
    """One input of a custom loss: `logprobs`, or a `loss_fn_inputs` key; rank 0, 1 or 2."""

    name: str
    rank: int


class LossNode(msgspec.Struct, frozen=True):
    """One torch.fx node as the SDK encodes it (`tinker.types.CustomLossNode`)."""

    op: str
    name: str
    target: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}


class LossGraph(msgspec.Struct, frozen=True):
    """The traced loss: its nodes in execution order (`tinker.types.CustomLossGraph`)."""

    nodes: list[LossNode]
    format: int = FORMAT


class CustomLoss(msgspec.Struct, frozen=True):
    """A validated custom loss, as stored per session and carried in a forward_backward job."""

    loss_id: str
    name: str
    inputs: list[LossInput]
    nodes: list[LossNode]
    metrics: list[str] = []  # the metric keys the output returns, in order

    @property
    def input_names(self) -> list[str]:
        """The `loss_fn_inputs` keys the loss reads, in parameter order (logprobs left out)."""
        return [loss_input.name for loss_input in self.inputs[1:]]


class CustomLossRecord(msgspec.Struct, frozen=True):
    """A stored custom loss (KV `tw_sessions`): its owner, its session and the upload's digest
    (a retried upload with the same digest is the same loss; another body is refused)."""

    tenant_id: str
    session_id: str
    digest: str
    created_at: float
    loss: CustomLoss


# -- the validator --------------------------------------------------------------------------------


def _refuse(node: LossNode, problem: str) -> UserError:
    return UserError(f"graph.nodes[{node.name!r}] ({node.op} {node.target!r}): {problem}")


def check_inputs(inputs: list[LossInput]) -> None:
    """`logprobs` first (rank 1 or 2), then distinct lowercase names, each of rank 0, 1 or 2."""
    if not inputs or inputs[0].name != "logprobs":
        raise UserError("inputs: the first input must be logprobs")
    if len(inputs) > MAX_INPUTS:
        raise UserError(f"inputs: {len(inputs)} inputs; at most {MAX_INPUTS}, logprobs included")
    if inputs[0].rank not in (1, 2):
        raise UserError(f"inputs[0]: logprobs has rank 1 or 2, got {inputs[0].rank}")
    seen: set[str] = set()
    for i, loss_input in enumerate(inputs):
        if not _INPUT_NAME.fullmatch(loss_input.name):
            raise UserError(
                f"inputs[{i}].name: {loss_input.name[:80]!r} is not a lowercase name of letters,"
                " digits and underscores"
            )
        if loss_input.name in seen:
            raise UserError(f"inputs[{i}].name: {loss_input.name!r} is declared twice")
        seen.add(loss_input.name)
        if loss_input.rank not in (0, 1, 2):
            raise UserError(f"inputs[{i}].rank: {loss_input.rank}; expected 0, 1 or 2")


def check_custom_loss(
    loss_id: str, name: str, inputs: list[LossInput], graph: LossGraph
) -> CustomLoss:
    """The validated loss, or a `UserError` naming the field, node and target at fault."""
    if not _LOSS_NAME.fullmatch(name):
        raise UserError(f"name: {name[:80]!r} is not a function name of at most 128 characters")
    check_inputs(inputs)
    if graph.format != FORMAT:
        raise UserError(f"graph.format: {graph.format}; this server reads format {FORMAT}")
    nodes = graph.nodes
    if not nodes:
        raise UserError("graph.nodes: empty")
    if len(nodes) > MAX_NODES:
        raise UserError(f"graph.nodes: {len(nodes)} nodes; at most {MAX_NODES}")
    defined: set[str] = set()
    for index, node in enumerate(nodes):
        if not _NODE_NAME.fullmatch(node.name):
            raise UserError(f"graph.nodes[{index}].name: {node.name[:80]!r} is not an identifier")
        if node.name in defined:
            raise _refuse(node, "the name is used by an earlier node")
        if index < len(inputs):
            _check_placeholder(node, inputs[index])
        elif index == len(nodes) - 1:
            metrics = _check_output(node, defined)
        else:
            _check_call(node, defined)
        defined.add(node.name)
    if len(nodes) <= len(inputs):
        raise UserError("graph.nodes: the graph has no output node after its inputs")
    return CustomLoss(loss_id=loss_id, name=name, inputs=inputs, nodes=nodes, metrics=metrics)


def _check_placeholder(node: LossNode, declared: LossInput) -> None:
    if node.op != "placeholder":
        raise _refuse(node, f"expected the placeholder of input {declared.name!r} here")
    if node.target != declared.name or node.args or node.kwargs:
        raise _refuse(node, f"expected the placeholder of input {declared.name!r} here")


def _check_call(node: LossNode, defined: set[str]) -> None:
    if node.op == "call_function":
        if node.target not in FUNCTIONS:
            raise _refuse(node, "not an allowed function (elementwise math, reductions, indexing)")
        if node.target == "getattr":
            _check_getattr(node, defined)
    elif node.op == "call_method":
        if node.target not in METHODS:
            raise _refuse(node, "not an allowed tensor method")
        if not node.args or not _is_ref(node.args[0]):
            raise _refuse(node, "a method call needs a node as its receiver")
        if node.target == "to":
            _check_to(node)
    elif node.op == "placeholder":
        raise _refuse(node, "an input the loss does not declare")
    elif node.op == "output":
        raise _refuse(node, "the output node must be the last node")
    else:
        # get_attr (a captured tensor), call_module (an nn.Module) and anything unknown.
        raise _refuse(node, "only placeholder, call_function, call_method and output nodes run")
    for key in node.kwargs:
        if not _KWARG_NAME.fullmatch(key):
            raise _refuse(node, f"keyword {key[:40]!r} is not a lowercase identifier")
        if key == "out":  # would write into an existing tensor (logprobs, say)
            raise _refuse(node, "out= writes in place; return a new tensor instead")
        if key in PLACEMENT_KEYWORDS:
            raise _refuse(
                node, f"{key}= is not allowed: the server places and allocates the loss's tensors"
            )
    leaves = [0]
    for arg in [*node.args, *node.kwargs.values()]:
        _check_arg(node, arg, defined, leaves, 0)


def _check_getattr(node: LossNode, defined: set[str]) -> None:
    ok = (
        len(node.args) == 2
        and not node.kwargs
        and _is_ref(node.args[0])
        and isinstance(node.args[1], str)
        and node.args[1] in GETATTR_NAMES
    )
    if not ok:
        allowed = ", ".join(sorted(GETATTR_NAMES))
        raise _refuse(node, f"getattr may only read {allowed} of a node")


def _check_to(node: LossNode) -> None:
    """`.to` converts dtypes only: moving a tensor (a device) is the server's business."""
    values = [*node.args[1:], *node.kwargs.values()]
    if set(node.kwargs) - {"dtype"} or not all(
        isinstance(v, dict) and set(v) == {"dtype"} for v in values
    ):
        raise _refuse(node, "to() takes a dtype only")


def _is_ref(arg: Any) -> bool:
    return isinstance(arg, dict) and set(arg) == {"ref"}


def _check_arg(node: LossNode, arg: Any, defined: set[str], leaves: list[int], depth: int) -> None:
    if depth > MAX_ARG_DEPTH:
        raise _refuse(node, f"arguments nest deeper than {MAX_ARG_DEPTH}")
    leaves[0] += 1
    if leaves[0] > MAX_ARG_LEAVES:
        raise _refuse(node, f"more than {MAX_ARG_LEAVES} constants in its arguments")
    if arg is None or isinstance(arg, bool):
        return
    if isinstance(arg, int):
        if abs(arg) > MAX_INT:
            raise _refuse(node, f"integer constant {arg} outside ±2**53")
        return
    if isinstance(arg, float):
        if not math.isfinite(arg):
            raise _refuse(node, "a non-finite float must be sent as {'float': 'inf'}")
        return
    if isinstance(arg, str):
        if len(arg) > MAX_STR_LEN:
            raise _refuse(node, f"string constant longer than {MAX_STR_LEN} characters")
        return
    if isinstance(arg, list):
        for item in arg:
            _check_arg(node, item, defined, leaves, depth + 1)
        return
    if not isinstance(arg, dict) or len(arg) != 1:
        raise _refuse(node, f"an argument of type {type(arg).__name__} is not understood")
    ((kind, value),) = arg.items()
    if kind not in _ARG_KINDS:
        raise _refuse(node, f"argument kind {str(kind)[:40]!r} is not allowed")
    if kind == "ref":
        if not isinstance(value, str) or value not in defined:
            raise _refuse(node, f"refers to {str(value)[:80]!r}, which is not an earlier node")
    elif kind == "tuple" and isinstance(value, list):
        for item in value:
            _check_arg(node, item, defined, leaves, depth + 1)
    elif kind == "dict" and isinstance(value, dict):
        for key, item in value.items():
            if len(key) > MAX_STR_LEN:
                raise _refuse(node, f"dict key longer than {MAX_STR_LEN} characters")
            _check_arg(node, item, defined, leaves, depth + 1)
    elif kind == "slice" and isinstance(value, list) and len(value) == 3:
        for item in value:
            if item is not None and not (isinstance(item, int) or _is_ref(item)):
                raise _refuse(node, "slice bounds must be integers, nodes or null")
            _check_arg(node, item, defined, leaves, depth + 1)
    elif kind == "ellipsis" and value is True:
        pass
    elif kind == "float" and value in _SPECIAL_FLOATS:
        pass
    elif kind == "dtype" and value in DTYPES:
        pass
    else:
        raise _refuse(node, f"malformed {kind!r} argument {str(value)[:80]!r}")


def _check_output(node: LossNode, defined: set[str]) -> list[str]:
    if node.op != "output":
        raise _refuse(node, "the last node must be the output node")
    ok = (
        len(node.args) == 1
        and not node.kwargs
        and isinstance(node.args[0], dict)
        and set(node.args[0]) == {"tuple"}
    )
    returned = node.args[0]["tuple"] if ok else None
    if not (isinstance(returned, list) and len(returned) == 2):
        raise _refuse(node, "the loss must return (loss, metrics)")
    loss, metrics = returned
    if not _is_ref(loss) or loss["ref"] not in defined:
        raise _refuse(node, "the loss must be a node computed by the graph")
    if not (isinstance(metrics, dict) and set(metrics) == {"dict"}):
        raise _refuse(node, "the metrics must be a dict")
    entries = metrics["dict"]
    if not isinstance(entries, dict) or len(entries) > MAX_METRICS:
        raise _refuse(node, f"the metrics must be a dict of at most {MAX_METRICS} entries")
    for key, value in entries.items():
        if not _METRIC_KEY.fullmatch(key):
            raise _refuse(
                node, f"metric {key[:80]!r} must be named custom/<name>:sum or custom/<name>:mean"
            )
        if not _is_ref(value) or value["ref"] not in defined:
            raise _refuse(node, f"metric {key!r} must be a node computed by the graph")
    return list(entries)


def loss_id_of(session_id: str, custom_loss_seq_id: int) -> str:
    """The id of a session's n-th custom loss: a retried upload gets the same one."""
    if not 0 <= custom_loss_seq_id < MAX_LOSSES_PER_SESSION:
        raise UserError(
            f"custom_loss_seq_id: {custom_loss_seq_id} is out of range"
            f" 0..{MAX_LOSSES_PER_SESSION - 1} (a session creates at most"
            f" {MAX_LOSSES_PER_SESSION} custom losses)"
        )
    return f"{session_id}:loss:{custom_loss_seq_id}"

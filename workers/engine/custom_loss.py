"""Custom losses on the worker: a validated graph rebuilt with torch and run once per datum.

Job: `check_request` (a `custom` request's datums carry every input its loss declares, at its
rank), and `LossProgram`, the graph of a `protocol.custom_loss.CustomLoss` as a list of steps
whose functions come from this module's tables, never from a name looked up in the graph.
`workers.engine.passes` runs a program on each datum's learner log-probs inside the shared pass.

Invariants:
- Only names on `protocol.custom_loss`'s allow-lists run, each through `FUNCTIONS` or
  `METHODS` here (a test checks the tables equal the lists); a method's receiver is a tensor.
- A datum's graph first runs on meta tensors (shapes only, nothing allocated): each result is
  counted against the request's `ElementBudget`, at least `MIN_NODE_COST` per node, and one
  over it fails the request before any real tensor is made. The minimum bounds node runs, whose
  fixed cost (~0.1 ms on a scalar) is what a long chain of tiny ops spends; `check_request`
  refuses a request whose datums × nodes cannot fit before any of it runs. Python arithmetic
  outside tensors stays on bounded numbers.
- Index tensors (`gather`, `getitem`) are checked against the indexed dimension on the host
  before the op runs: on CUDA an index out of range is a device-side assert that would take
  down the worker's CUDA context for every tenant.
- The loss and metrics are tensors on the device of the learner log-probs.
- Anything the graph does wrong is a `UserError` of its own request naming the node; the shared
  pass and the other tenants never see it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np
import torch
import torch.nn.functional as F

from protocol import custom_loss as spec
from protocol.errors import UserError
from protocol.sampling import MAX_LOGPROBS_K
from protocol.tensors import TARGET_TOKENS, FwdBwdRequest

# A request's graphs together may produce this many times its declared element budget: what a
# few dozen elementwise steps over every input cost, and a bound on what a hostile graph holds.
BUDGET_FACTOR = 8
# What one node evaluation costs the budget at least (its meta run and its real run together):
# at the default 4 Mi element budget a request runs at most 32 Ki nodes (datums × nodes, ~4 s
# on a CPU at worst), which still fits the SDK's largest chunk, 1024 datums, of a 32-node loss.
MIN_NODE_COST = 1024
_MAX_PY_INT = 2**63
_MAX_PY_EXPONENT = 64

_TORCH_FUNCTIONS: tuple[Callable[..., Any], ...] = (
    # elementwise
    torch.abs, torch.neg, torch.sign, torch.exp, torch.exp2, torch.expm1, torch.log,
    torch.log1p, torch.log2, torch.log10, torch.sqrt, torch.rsqrt, torch.square,
    torch.reciprocal, torch.sigmoid, torch.tanh, torch.relu, torch.sin, torch.cos, torch.floor,
    torch.ceil, torch.round, torch.trunc, torch.erf, torch.clamp, torch.clip, torch.clamp_min,
    torch.clamp_max, torch.minimum, torch.maximum, torch.pow, torch.add, torch.sub, torch.mul,
    torch.div, torch.true_divide, torch.where, torch.lerp, torch.logaddexp, torch.nan_to_num,
    torch.isfinite, torch.isnan, torch.isinf, torch.eq, torch.ne, torch.lt, torch.le, torch.gt,
    torch.ge, torch.logical_and, torch.logical_or, torch.logical_not, torch.logical_xor,
    # reductions
    torch.sum, torch.mean, torch.prod, torch.amax, torch.amin, torch.max, torch.min,
    torch.logsumexp, torch.cumsum, torch.std, torch.var, torch.all, torch.any,
    torch.count_nonzero,
    # shapes, indexing, softmax
    torch.stack, torch.cat, torch.unsqueeze, torch.squeeze, torch.flatten, torch.reshape,
    torch.transpose, torch.narrow, torch.select, torch.gather, torch.zeros_like,
    torch.ones_like, torch.full_like, torch.softmax, torch.log_softmax,
)  # fmt: skip
_OPERATORS: tuple[Callable[..., Any], ...] = (
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod,
    operator.pow, operator.neg, operator.pos, operator.abs, operator.getitem, operator.eq,
    operator.ne, operator.lt, operator.le, operator.gt, operator.ge, operator.and_,
    operator.or_, operator.invert,
)  # fmt: skip

FUNCTIONS: dict[str, Callable[..., Any]] = {
    **{f"torch.{fn.__name__}": fn for fn in _TORCH_FUNCTIONS},
    **{f"operator.{fn.__name__}": fn for fn in _OPERATORS},
    "torch.nn.functional.relu": F.relu,
    "torch.nn.functional.softmax": F.softmax,
    "torch.nn.functional.log_softmax": F.log_softmax,
    "torch.nn.functional.softplus": F.softplus,
    "torch.nn.functional.logsigmoid": F.logsigmoid,
    "torch._C._nn.softplus": F.softplus,
    "torch._C._nn.log_sigmoid": F.logsigmoid,
    "getattr": getattr,  # guarded: a tensor receiver and a name from GETATTR_NAMES
}
# Unbound `torch.Tensor` methods, looked up once here from the protocol's own list.
METHODS: dict[str, Callable[..., Any]] = {
    name: getattr(torch.Tensor, name) for name in sorted(spec.METHODS)
}
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}
_SCALAR_TYPES = (bool, int, float)
_OPERATOR_TARGETS = frozenset(f"operator.{fn.__name__}" for fn in _OPERATORS) - {"operator.getitem"}


class CustomLossError(Exception):
    """What a graph did wrong on one datum; becomes its request's `UserError`."""


class ElementBudget:
    """The elements a request's graphs may still produce (counted on the meta run, at least
    `MIN_NODE_COST` per node)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def spend(self, count: int) -> None:
        self.used += count
        if self.used > self.limit:
            raise CustomLossError(
                f"its results exceed {self.limit} tensor elements ({BUDGET_FACTOR}x the request's"
                f" element budget; each node evaluation counts at least {MIN_NODE_COST})"
            )


@dataclass(frozen=True)
class _Step:
    name: str
    target: str
    call: Callable[..., Any]
    is_method: bool
    args: list[Any]
    kwargs: dict[str, Any]


class LossProgram:
    """A validated `CustomLoss`, ready to run on one datum's tensors."""

    def __init__(self, loss: spec.CustomLoss) -> None:
        self.loss = loss
        self.n_inputs = len(loss.inputs)
        steps = []
        for node in loss.nodes[self.n_inputs : -1]:
            is_method = node.op == "call_method"
            table = METHODS if is_method else FUNCTIONS
            steps.append(
                _Step(node.name, node.target, table[node.target], is_method, node.args, node.kwargs)
            )
        self.steps = steps
        self.output = loss.nodes[-1].args[0]

    def inputs_of(self, logprobs: torch.Tensor, arrays: dict[str, torch.Tensor]) -> list[Any]:
        """The graph's arguments: learner logprobs, then each declared input at its rank."""
        values = [logprobs]
        for declared in self.loss.inputs[1:]:
            value = arrays[declared.name]
            values.append(value.reshape(()) if declared.rank == 0 else value)
        return values

    def run(
        self, values: Sequence[torch.Tensor], budget: ElementBudget
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss as a float32 scalar, metrics) of one datum; `CustomLossError` if it fails.

        Runs on meta tensors first, so a graph that would allocate beyond `budget` (or fail on
        shapes) stops before it touches memory; that run charges every node for both runs.
        """
        meta = [torch.empty(v.shape, dtype=v.dtype, device="meta") for v in values]
        self._evaluate(meta, budget)
        loss, metrics = self._evaluate(list(values), None)
        return loss.float(), metrics

    def _evaluate(
        self, values: list[Any], budget: ElementBudget | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        env: dict[str, Any] = {
            node.name: value for node, value in zip(self.loss.nodes, values, strict=False)
        }
        for step in self.steps:
            try:
                args = [_decode(a, env) for a in step.args]
                kwargs = {k: _decode(v, env) for k, v in step.kwargs.items()}
                result = _call(step, args, kwargs)
                if budget is not None:
                    budget.spend(max(_elements(result), MIN_NODE_COST))
            except CustomLossError as err:
                raise CustomLossError(f"node {step.name!r} ({step.target}): {err}") from None
            except torch.OutOfMemoryError:
                raise
            except NotImplementedError:
                if budget is None:
                    raise
                # On meta tensors: a shape that depends on values cannot be bounded beforehand.
                raise CustomLossError(
                    f"node {step.name!r} ({step.target}): its result's shape depends on tensor"
                    " values (boolean-mask indexing, say); multiply by the mask or use torch.where"
                ) from None
            except Exception as exc:  # noqa: BLE001 - any failure of the graph is the tenant's
                raise CustomLossError(
                    f"node {step.name!r} ({step.target}) raised {type(exc).__name__}:"
                    f" {_first_line(exc)}"
                ) from None
            env[step.name] = result
        loss, metrics = _decode(self.output, env)
        device = values[0].device  # the learner log-probs': the pass's device (or meta)
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.is_floating_point():
            raise CustomLossError(
                f"the loss must be a floating-point scalar tensor, got {_kind(loss)}"
            )
        if loss.device != device:
            raise CustomLossError(f"the loss is on device {loss.device}, not beside its inputs")
        for key, value in metrics.items():
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise CustomLossError(
                    f"metric {key!r} must be a one-element tensor, got {_kind(value)}"
                )
            if value.device != device:
                raise CustomLossError(
                    f"metric {key!r} is on device {value.device}, not beside the inputs"
                )
        return loss, metrics


def _call(step: _Step, args: list[Any], kwargs: dict[str, Any]) -> Any:
    if step.is_method:
        if not isinstance(args[0], torch.Tensor):
            raise CustomLossError(f"method receiver is {_kind(args[0])}, not a tensor")
        if step.target == "gather":
            _check_gather(args, kwargs)
        return step.call(*args, **kwargs)
    if step.target == "getattr":
        receiver, name = args
        if not isinstance(receiver, torch.Tensor) or name not in spec.GETATTR_NAMES:
            raise CustomLossError("getattr reads shape, dtype or ndim of a tensor only")
        return getattr(receiver, name)
    if step.target == "torch.gather":
        _check_gather(args, kwargs)
    elif step.target == "operator.getitem" and isinstance(args[0], torch.Tensor):
        _check_getitem(*args)
    if step.target in _OPERATOR_TARGETS and not any(isinstance(a, torch.Tensor) for a in args):
        return _scalar_operator(step, args)
    return step.call(*args, **kwargs)


# -- index ranges: checked on the host, since on CUDA torch checks them in the kernel (an assert
# that ends the process's CUDA context). Meta tensors have no values: the real run checks. ----


def _check_gather(args: list[Any], kwargs: dict[str, Any]) -> None:
    """`gather(input, dim, index)` (function or method): index values within [0, size)."""
    named = dict(zip(("input", "dim", "index"), args, strict=False))
    named.update({key: kwargs[key] for key in ("input", "dim", "index") if key in kwargs})
    source, dim, index = named.get("input"), named.get("dim"), named.get("index")
    if not (isinstance(source, torch.Tensor) and _integer_index(index)):
        return  # torch refuses it on the host, or there is nothing to check
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise CustomLossError(f"gather's dim must be an integer, got {_kind(dim)}")
    ndim = max(source.ndim, 1)
    if not -ndim <= dim < ndim:
        return  # torch refuses the dim on the host
    _check_range(index, 0, source.shape[dim] if source.ndim else 1, dim % ndim)


def _check_getitem(source: torch.Tensor, index: Any) -> None:
    """`source[index]`: each integer tensor or list in the index within [-size, size) of the
    dimension it indexes (Python ints and slices torch checks on the host itself)."""
    items = index if _is_index_tuple(index) else (index,)
    taken = [_dims_taken(item) for item in items]
    rest = source.ndim - sum(n for item, n in zip(items, taken, strict=True) if item is not ...)
    dim = 0
    for item, n in zip(items, taken, strict=True):
        if item is ...:
            dim += max(rest, 0)
            continue
        values = torch.as_tensor(item) if isinstance(item, (list, tuple)) else item
        if _integer_index(values) and dim < source.ndim:
            _check_range(values, -source.shape[dim], source.shape[dim], dim)
        dim += n


def _is_index_tuple(index: Any) -> bool:
    """Whether torch reads `index` as one index per dimension (its `treatSequenceAsTuple`)."""
    if isinstance(index, tuple):
        return True
    if not isinstance(index, list) or len(index) >= 32:
        return False
    return any(
        isinstance(item, (torch.Tensor, list, tuple, slice)) or item is None or item is ...
        for item in index
    )


def _dims_taken(item: Any) -> int:
    """How many dimensions of the indexed tensor one index item consumes."""
    if item is None or isinstance(item, bool):
        return 0
    if isinstance(item, (list, tuple)):
        if _has_tensor(item):
            # torch would copy the tensors into a new index tensor: ask for one tensor instead
            raise CustomLossError("an index list holding tensors; stack them into one tensor")
        item = torch.as_tensor(item)
    if isinstance(item, torch.Tensor) and item.dtype in (torch.bool, torch.uint8):
        return item.ndim  # a mask: one dimension per mask dimension
    return 1


def _has_tensor(items: list[Any] | tuple[Any, ...]) -> bool:
    return any(
        isinstance(item, torch.Tensor) or (isinstance(item, (list, tuple)) and _has_tensor(item))
        for item in items
    )


def _integer_index(index: Any) -> TypeGuard[torch.Tensor]:
    """An index tensor with values to check: integers (not a mask), real, not empty."""
    return (
        isinstance(index, torch.Tensor)
        and index.device.type != "meta"
        and not index.is_floating_point()
        and not index.is_complex()
        and index.dtype not in (torch.bool, torch.uint8)
        and index.numel() > 0
    )


def _check_range(index: torch.Tensor, low: int, size: int, dim: int) -> None:
    smallest, largest = torch.stack(torch.aminmax(index)).tolist()  # one device sync
    if smallest < low or largest >= size:
        raise CustomLossError(
            f"index values span [{smallest}, {largest}], outside [{low}, {size}) for dimension"
            f" {dim} (size {size}) of the indexed tensor"
        )


def _scalar_operator(step: _Step, args: list[Any]) -> Any:
    """Python arithmetic between plain numbers (shape arithmetic), kept to bounded values."""
    if not all(isinstance(a, _SCALAR_TYPES) for a in args):
        raise CustomLossError(f"arithmetic on {', '.join(_kind(a) for a in args)}")
    if step.target == "operator.pow" and isinstance(args[1], int) and abs(args[0]) > 1:
        if abs(args[1]) > _MAX_PY_EXPONENT:
            raise CustomLossError(f"integer exponent {args[1]} above {_MAX_PY_EXPONENT}")
    result = step.call(*args)
    if isinstance(result, int) and abs(result) > _MAX_PY_INT:
        raise CustomLossError("integer result beyond 64 bits")
    return result


def _decode(arg: Any, env: dict[str, Any]) -> Any:
    """An encoded argument (see `protocol.custom_loss`) as a Python value."""
    if isinstance(arg, list):
        return [_decode(item, env) for item in arg]
    if not isinstance(arg, dict):
        return arg
    ((kind, value),) = arg.items()
    if kind == "ref":
        return env[value]
    if kind == "tuple":
        return tuple(_decode(item, env) for item in value)
    if kind == "dict":
        return {key: _decode(item, env) for key, item in value.items()}
    if kind == "slice":
        return slice(*(_decode(item, env) for item in value))
    if kind == "ellipsis":
        return Ellipsis
    if kind == "float":
        return float(value)
    if kind == "dtype":
        return _DTYPES[value]
    raise CustomLossError(f"argument kind {kind!r}")  # the validator lets none other through


def _elements(result: Any) -> int:
    if isinstance(result, torch.Tensor):
        return int(result.numel())
    if isinstance(result, tuple):  # torch.max(x, dim) and friends return named tuples
        return sum(_elements(item) for item in result)
    return 1


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return f"a {type(value).__name__}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else "")[:300]


def failed(loss: spec.CustomLoss, index: int, err: CustomLossError) -> UserError:
    """The `UserError` of a request whose custom loss failed on datum `index`."""
    return UserError(f"loss_fn custom ({loss.name}): datums[{index}]: {err}")


# -- the request check --------------------------------------------------------------------------


def check_request(req: FwdBwdRequest, vocab_size: int) -> spec.CustomLoss:
    """The request's custom loss, once its datums carry what the loss reads; else `UserError`."""
    loss = req.custom_loss
    if loss is None:
        raise UserError(
            "loss_fn_config.loss_id: loss_fn custom needs the loss_id of a loss created with"
            " ServiceClient.create_custom_loss"
        )
    if set(req.loss_fn_config) != {"loss_id"} or req.loss_fn_config["loss_id"] != loss.loss_id:
        raise UserError(
            f"loss_fn_config: loss_fn custom takes only loss_id, got {sorted(req.loss_fn_config)}"
        )
    logprobs_rank = loss.inputs[0].rank
    for index, datum in enumerate(req.datums):
        prefix = f"datums[{index}].loss_fn_inputs"
        targets = datum.inputs.get(TARGET_TOKENS)
        if targets is None:
            raise UserError(
                f"{prefix}.{TARGET_TOKENS}: missing; the custom loss reads its logprobs"
            )
        _check_targets(f"{prefix}.{TARGET_TOKENS}", targets, int(datum.tokens.shape[0]), vocab_size)
        if targets.ndim != logprobs_rank:
            raise UserError(
                f"{prefix}.{TARGET_TOKENS}: rank {targets.ndim}, but loss {loss.name!r} declared"
                f" logprobs with rank {logprobs_rank}"
            )
        for declared in loss.inputs[1:]:
            array = datum.inputs.get(declared.name)
            where = f"{prefix}.{declared.name}"
            if array is None:
                raise UserError(f"{where}: missing; loss {loss.name!r} takes it")
            # The wire has no rank 0: a scalar arrives as one value of rank 1.
            ok = (
                array.size == 1 and array.ndim == 1
                if declared.rank == 0
                else array.ndim == declared.rank
            )
            if not ok:
                raise UserError(
                    f"{where}: shape {array.shape}, but loss {loss.name!r} declared rank"
                    f" {declared.rank}"
                )
    steps = len(loss.nodes) - len(loss.inputs) - 1
    node_runs = steps * len(req.datums)
    limit = req.max_elements * BUDGET_FACTOR
    if node_runs * MIN_NODE_COST > limit:
        raise UserError(
            f"loss_fn custom ({loss.name}): {len(req.datums)} datums × {steps} nodes cost at"
            f" least {node_runs * MIN_NODE_COST} of the request's custom-loss budget of {limit}"
            f" tensor elements ({BUDGET_FACTOR}x its element budget; each node evaluation counts"
            f" at least {MIN_NODE_COST}): send fewer datums per request or a smaller graph"
        )
    return loss


def _check_targets(where: str, targets: np.ndarray, n_tokens: int, vocab_size: int) -> None:
    if targets.dtype.kind not in "iu":
        raise UserError(f"{where}: dtype {targets.dtype}, expected integer token ids (int64)")
    if targets.ndim not in (1, 2) or targets.shape[0] != n_tokens:
        raise UserError(f"{where}: shape {targets.shape}, expected [{n_tokens}] or [{n_tokens}, K]")
    if targets.ndim == 2 and not 1 <= targets.shape[1] <= MAX_LOGPROBS_K:
        # as `workers.engine.losses` checks it: a pass pads every datum to the widest K it holds
        raise UserError(f"{where}: shape {targets.shape}; K must be in 1..{MAX_LOGPROBS_K}")
    if targets.size and (int(targets.min()) < 0 or int(targets.max()) >= vocab_size):
        raise UserError(f"{where}: an id outside the vocabulary [0, {vocab_size})")


def metric_values(sums: dict[str, float], n_datums: int) -> dict[str, float]:
    """Summed metrics as the SDK reduces them: a `:mean` metric is divided by the datum count."""
    return {
        key: value / n_datums if key.endswith(":mean") else value for key, value in sums.items()
    }

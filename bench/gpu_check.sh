#!/usr/bin/env bash
# GPU check of the trainer's compute paths, in under 8 minutes, offline: reports the machine and
# what is installed, then runs bench/gpu_bench.py (random Qwen3-4B, small Qwen3.5 and Qwen3-30B-A3B
# MoE layer shapes (6 layers),
# LoRA kinds loop / gather / grouped, N = 1, 4, 16 tenants) and prints its table; then, as a step
# with its own time limit, bench/gpu_bench.py --models deepseek_v3: one DeepSeek-V3 decoder layer
# at full size (multi-head latent attention, 256 experts top-8, one shared expert; 27 GB of bf16
# weights), the experts' products grouped and per expert; on a machine with two GPUs or more,
# bench/group_step.py then runs a worker group over two of them.
#
# Run from anywhere on a machine with the project checked out and a Python with a CUDA build
# of torch:   bash bench/gpu_check.sh [gpu_bench.py options]
#
# Python packages the benchmark needs: torch (CUDA build, >= 2.8 for the grouped GEMM kind) and
# transformers >= 5 (Qwen3 and Qwen3.5 models). That is all: it imports `workers.engine.lora`,
# `workers.engine.lora_kernels` and `workers.engine.kernels` from this checkout (PYTHONPATH), which need only
# torch. `pip install -e .[worker]` gives the whole worker; optional, for Qwen3.5's fused linear
# attention: `flash-linear-attention` and `causal-conv1d`. Nothing is installed unless
# GPU_CHECK_PIP=1 (the machine may not reach PyPI): missing packages are reported instead.
#
# Environment: PYTHON (default python3, then python), GPU_BENCH_TIMEOUT_S (default 280),
# GPU_DEEPSEEK_TIMEOUT_S (default 150; 0 skips the DeepSeek-V3 layer).
set -u -o pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# A checkout's .venv is a CPU environment: never pick it up here.
PY=${PYTHON:-$(command -v python3 || command -v python)}
TIMEOUT_S=${GPU_BENCH_TIMEOUT_S:-280}
DEEPSEEK_TIMEOUT_S=${GPU_DEEPSEEK_TIMEOUT_S:-150}
# `--tiny` runs the same script on the CPU (how it is checked without a GPU).
GPU_CHECK_NEEDS_CUDA=1
for arg in "$@"; do [ "$arg" = "--tiny" ] && GPU_CHECK_NEEDS_CUDA=0; done
export GPU_CHECK_NEEDS_CUDA

echo "== machine"
date -u +"%Y-%m-%dT%H:%M:%SZ"
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader \
    2>/dev/null || echo "nvidia-smi: not available"
echo "python: $PY ($("$PY" --version 2>&1))"

if [ "${GPU_CHECK_PIP:-0}" = "1" ]; then
    echo "== pip install (GPU_CHECK_PIP=1)"
    "$PY" -m pip install -q -e ".[worker]" || echo "pip install -e .[worker] failed"
    "$PY" -m pip install -q flash-linear-attention causal-conv1d \
        || echo "flash-linear-attention / causal-conv1d: not installed"
fi

echo "== packages"
"$PY" - <<'EOF'
import importlib.metadata as md
import importlib.util

required = {"torch": "torch", "transformers": "transformers"}
optional = {
    "fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d", "kernels": "kernels",
    "flash_attn": "flash-attn", "triton": "triton",
}
missing = []
for table, label in ((required, "required"), (optional, "optional")):
    for module, dist in table.items():
        if importlib.util.find_spec(module) is None:
            print(f"{label:9} {dist:24} MISSING")
            if label == "required":
                missing.append(dist)
            continue
        try:
            version = md.version(dist)
        except md.PackageNotFoundError:
            version = "?"
        print(f"{label:9} {dist:24} {version}")
if missing:
    raise SystemExit(f"cannot run the benchmark without: {', '.join(missing)}")
import os

import torch

print(f"torch.cuda.is_available() = {torch.cuda.is_available()}, CUDA {torch.version.cuda}")
if not torch.cuda.is_available() and os.environ["GPU_CHECK_NEEDS_CUDA"] == "1":
    raise SystemExit("no usable CUDA device for this torch build")
EOF
status=$?
if [ $status -ne 0 ]; then
    echo "gpu_check: environment not usable (exit $status)"
    exit $status
fi

echo "== bench/gpu_bench.py (timeout ${TIMEOUT_S}s)"
timeout --signal=INT --kill-after=15 "$TIMEOUT_S" "$PY" bench/gpu_bench.py "$@"
status=$?
if [ $status -eq 124 ] || [ $status -eq 130 ]; then
    echo "gpu_check: the benchmark ran past ${TIMEOUT_S}s; the rows above are what finished"
fi
# A DeepSeek-V3-shaped layer in a process of its own: the table above keeps its time budget, and
# this model (the largest here) has the whole GPU. The `--models` after "$@" wins over one given
# to the script; `--tiny` still makes it the CPU dry run. Its rows stop 30 s before the timeout.
if [ "$DEEPSEEK_TIMEOUT_S" -gt 0 ]; then
    echo "== bench/gpu_bench.py --models deepseek_v3 (timeout ${DEEPSEEK_TIMEOUT_S}s)"
    DEEPSEEK_BUDGET_S=$((DEEPSEEK_TIMEOUT_S > 60 ? DEEPSEEK_TIMEOUT_S - 30 : DEEPSEEK_TIMEOUT_S))
    timeout --signal=INT --kill-after=15 "$DEEPSEEK_TIMEOUT_S" \
        "$PY" bench/gpu_bench.py "$@" --models deepseek_v3 --budget-s "$DEEPSEEK_BUDGET_S"
    deepseek_status=$?
    if [ $deepseek_status -eq 124 ] || [ $deepseek_status -eq 130 ]; then
        echo "gpu_check: the DeepSeek-V3 layer ran past ${DEEPSEEK_TIMEOUT_S}s; the rows above" \
            "are what finished"
    fi
    [ $status -eq 0 ] && status=$deepseek_status
else
    echo "== DeepSeek-V3 layer: skipped (GPU_DEEPSEEK_TIMEOUT_S=0)"
fi
# A worker group over two GPUs (expert parallelism for the MoE model, gathered frozen linears
# for the dense one): tokens/s against one GPU and the collectives' share of a step.
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${GPUS:-0}" -ge 2 ] && [ "$GPU_CHECK_NEEDS_CUDA" = "1" ]; then
    echo "== bench/group_step.py --device cuda --devices 1 2 (timeout ${TIMEOUT_S}s)"
    timeout --signal=INT --kill-after=15 "$TIMEOUT_S" \
        "$PY" bench/group_step.py --device cuda --devices 1 2
    group_status=$?
    [ $status -eq 0 ] && status=$group_status
else
    echo "== worker group: needs two GPUs (found ${GPUS:-0}); its figures wait for such a machine"
fi
echo "gpu_check: exit $status"
exit $status

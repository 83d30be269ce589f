# The trainer worker image: torch + transformers + peft. CPU by default; for GPUs build with
#   --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 \
#   --build-arg EXTRA="vllm flash-linear-attention"
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRA=""
WORKDIR /app
RUN pip install --no-cache-dir torch==2.13.0 --index-url ${TORCH_INDEX}
COPY requirements-worker.txt /app/
RUN pip install --no-cache-dir -r requirements-worker.txt ${EXTRA}
COPY pyproject.toml README.md /app/
COPY protocol /app/protocol
COPY twinkle_async /app/twinkle_async
COPY workers /app/workers
RUN pip install --no-cache-dir --no-deps /app
VOLUME ["/data"]
CMD ["twinkle-async", "worker"]

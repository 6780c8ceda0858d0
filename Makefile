# The two set-up commands (README): `make run` and `make test`.
# Both create a local virtual environment in .venv on first use.

PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(VENV)/bin/pip
ARGS   ?=

.PHONY: help run test test-fast test-workers lint format fault-long binary dist wheelhouse image image-base bench completions clean
.DEFAULT_GOAL := help

# The compiled speed-ups (setup.py) are rebuilt when their sources change.
SPEEDUPS_SRC = setup.py store/_speedups.pyx broker/_speedups.pyx broker/_fsyncer.pyx core/_busypoll.pyx
# So are the RocketMQ front end's protobuf modules (setup.py, grpcio-tools).
PROTO_SRC = broker/rocketmq/pb/definition.proto broker/rocketmq/pb/service.proto

# With the rocketmq extra, so `make run ARGS="--rocketmq-port 8081"` serves RocketMQ's gRPC service.
$(VENV)/.installed: pyproject.toml $(SPEEDUPS_SRC) $(PROTO_SRC)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[rocketmq]'
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml $(SPEEDUPS_SRC) $(PROTO_SRC)
	$(PIP) install -q -e '.[test,spark,report,rocketmq]'
	touch $@

# `make binary` builds in an environment of its own, with only the broker's dependencies (the rocketmq extra)
# and the two build tools, at the test extra's pins (read from pyproject.toml): not the test and spark extras.
BINARY_VENV ?= .venv-binary
BINARY_TOOLS = $(shell $(PYTHON) -c 'import shlex, tomllib; t = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["test"]; \
	print(" ".join(shlex.quote(r) for r in t if r.startswith(("pyinstaller", "shiv"))))')
$(BINARY_VENV)/.installed: pyproject.toml $(SPEEDUPS_SRC) $(PROTO_SRC)
	$(PYTHON) -m venv $(BINARY_VENV)
	$(BINARY_VENV)/bin/pip install -q --upgrade pip
	$(BINARY_VENV)/bin/pip install -q -e '.[rocketmq]' $(BINARY_TOOLS)
	touch $@

# `make dist` needs only PyPA's build (the test extra has it too, with the same pin).
$(VENV)/.installed-dist: $(VENV)/.installed
	$(PIP) install -q 'build>=1.2'
	touch $@

## help: list these targets
help:
	@awk '/^## /{ l = substr($$0, 4); i = index(l, ": "); printf "  %-12s %s\n", substr(l, 1, i - 1), substr(l, i + 2) }' $(MAKEFILE_LIST)

## run: install into .venv (with the rocketmq extra) and run the broker on the default data directory (~/.local/share/txmq)
run: $(VENV)/.installed
	$(VENV)/bin/txmq broker start $(ARGS)

# TEST_WORKERS=N runs the suite on N pytest-xdist workers, each test file on one worker (most of the suite's time is
# spent waiting on brokers, JVMs and builds; the builds take turns, tests/conftest.py). The default, 0, runs it in this
# process, one test after another: what CI runs.
TEST_WORKERS ?= 0
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

## test: install (with the test, spark, report and rocketmq extras), lint (ruff check) and run the whole suite
test: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q $(XDIST) $(ARGS)

## test-fast: lint and run the suite without the Spark, slow and real-RocketMQ tests
test-fast: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q $(XDIST) -m "not spark and not slow and not rocketmq_peer" $(ARGS)

## test-workers: the RocketMQ 5 and 4 suites again, their ports served by WORKERS front-end worker processes (default 2)
WORKERS ?= 2
ROCKETMQ5_SUITES = tests/test_rocketmq_frontend.py tests/test_rocketmq_receive.py tests/test_rocketmq_refusals.py \
	tests/test_rocketmq_topics.py tests/test_rocketmq_fifo.py tests/test_rocketmq_long_poll_bounds.py \
	tests/test_rocketmq_sdk_python.py tests/test_rocketmq_sdk_fifo.py tests/test_rocketmq_sdk_long_polls.py \
	tests/test_rocketmq_sdk_node.py tests/test_rocketmq_mixed.py tests/test_rocketmq_connection_limits.py tests/test_frontend_workers.py
ROCKETMQ4_SUITES = tests/test_remoting_wire.py tests/test_remoting_admin.py tests/test_remoting_stored_like_rocketmq.py \
	tests/test_remoting_sdk_python.py tests/test_remoting_sdk_node.py tests/test_remoting_java_quickstart.py tests/test_mqadmin_txmq.py \
	tests/test_differential_rocketmq.py tests/test_differential_cpp_client.py tests/test_rocketmq_article_examples.py \
	tests/test_badinput_nested_bodies.py tests/test_refusals_logged.py tests/test_lone_client.py tests/test_frontend_workers_remoting.py
test-workers: $(VENV)/.installed-test
	TXMQ_TEST_FRONTEND_PROCESSES=$(WORKERS) $(PY) -m pytest -q $(XDIST) $(ROCKETMQ5_SUITES) $(ROCKETMQ4_SUITES) $(ARGS)

## lint: ruff check (rules in pyproject.toml); `make lint ARGS=--fix` applies the safe fixes
lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check . $(ARGS)

## format: ruff format FILES=... (the formatter for new files; the existing code is not reformatted in one sweep)
format: $(VENV)/.installed-test
	@test -n "$(FILES)" || { echo "make format FILES='path/new_module.py ...': name the files to format" >&2; exit 2; }
	$(VENV)/bin/ruff format $(FILES)

## fault-long: the long fault-injection run (many kill/restart cycles)
fault-long: $(VENV)/.installed-test
	TXMQ_FAULT_LONG=1 TXMQ_FAULT_REPORT=$(or $(TXMQ_FAULT_REPORT),fault-report.jsonl) $(PY) -m pytest -q -s -m fault $(ARGS)

## binary: dist/txmq-linux-<arch>, one executable that needs no Python (docs/binary.md), and dist/txmq.pyz, a zipapp for this Python minor
binary: $(BINARY_VENV)/.installed
	rm -rf build/shiv && mkdir -p dist
	$(BINARY_VENV)/bin/shiv --compressed -c txmq --preamble scripts/zipapp_preamble.py -o dist/txmq.pyz --reproducible '.[rocketmq]' -q
	@echo "built dist/txmq.pyz"
	$(BINARY_VENV)/bin/python scripts/binary/build.py

## dist: an sdist and a wheel in dist/ to install elsewhere: pip install 'dist/txmq-<version>-<tag>.whl[rocketmq]' (README "Install")
# The sdist is built first and the wheel from it (PyPA's build, in isolated environments that fetch
# setuptools, Cython and grpcio-tools), so a file missing from MANIFEST.in fails here, not on a user's machine.
# The wheel holds the compiled speed-ups: it is for this OS, CPU architecture and Python minor version.
dist: $(VENV)/.installed-dist
	rm -f dist/txmq-*.whl dist/txmq-*.tar.gz
	$(PY) -m build -q --outdir dist .
	@for w in dist/txmq-*.whl; do echo "built $$w: pip install '$$w[rocketmq]' (or [spark])"; done

## wheelhouse: dist/wheelhouse, txmq's wheel and its dependencies' (with the rocketmq extra), for the container image
wheelhouse: dist
	rm -rf dist/wheelhouse
	$(PIP) wheel -q --wheel-dir dist/wheelhouse "$$(ls dist/txmq-*.whl)[rocketmq]"

## image: the container image (Dockerfile, docs/container.md) from the wheelhouse: make image [BASE=debian:bookworm-slim] [IMAGE=txmq:latest]
# The base is checked first (here, or pulled), so a missing one stops the build before the wheels are built.
BASE  ?= debian:bookworm-slim
IMAGE ?= txmq:latest
IMAGE_BASE ?= txmq-base
image:
	@docker info >/dev/null 2>&1 || { echo "make image: no Docker daemon answers \`docker info\`: start it (systemctl start docker, or dockerd &) and run make image again" >&2; exit 1; }
	@docker image inspect $(BASE) >/dev/null 2>&1 || err=$$(docker pull -q $(BASE) 2>&1 >/dev/null) || { \
		echo "make image: the base image $(BASE) is not here and cannot be pulled ($$(echo "$$err" | tail -n 1)): without a registry, build a Debian base with \`make image-base\` (debootstrap, as root, 1-2 min), then run \`make image BASE=$(IMAGE_BASE)\`" >&2; exit 1; }
	$(MAKE) --no-print-directory wheelhouse
	docker build --build-arg BASE=$(BASE) -t $(IMAGE) .
	@echo "built $(IMAGE) (base $(BASE)): $$(docker image inspect --format '{{.Size}}' $(IMAGE) | awk '{ printf "%.0f MB", $$1 / 1e6 }')"

## image-base: a Debian bookworm base with Python 3.11 for `make image BASE=txmq-base`, built with debootstrap, no registry needed (as root): make image-base [IMAGE_BASE=txmq-base]
image-base:
	scripts/image-base.sh $(IMAGE_BASE)

## bench: the side-by-side comparison (machine limits, txmq, RabbitMQ if installed) into docs/benchmarks.md
bench: $(VENV)/.installed-test
	$(PY) benchmarks/compare.py --write docs/benchmarks.md

## completions: regenerate the shell completion scripts in completions/
completions: $(VENV)/.installed
	PYTHON=$(PY) sh scripts/gen-completions.sh

## clean: remove build output, compiled speed-ups and the install stamps (keeps .venv and .venv-binary)
clean:
	rm -rf build dist *.egg-info .pytest_cache store/_speedups.c broker/_speedups.c store/_speedups.*.so broker/_speedups.*.so \
		broker/rocketmq/pb/*_pb2.py broker/rocketmq/pb/*_pb2_grpc.py \
		$(VENV)/.installed $(VENV)/.installed-test $(VENV)/.installed-dist $(BINARY_VENV)/.installed

# Set-up and everyday commands. Everything installs into .venv from pyproject.toml.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP_RUN := $(VENV)/.installed-run
STAMP_TEST := $(VENV)/.installed-test
S3RVER := tests/s3rver/node_modules/.installed

.PHONY: demo test lint typecheck unit bench horovod clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# The TensorFlow kernel (yogastore/train/tf_ops.py) is compiled against the installed TensorFlow.
$(STAMP_RUN): pyproject.toml yogastore/_gather.c yogastore/_tfops.cc | $(PY)
	$(PIP) install -q -e '.[tf,s3]'
	$(PY) -m yogastore.train.tf_ops
	touch $@

# The tests run the benchmark on a tiny size, its peers (Grain, ArrayRecord) included.
$(STAMP_TEST): pyproject.toml $(STAMP_RUN)
	$(PIP) install -q -e '.[tf,s3,test,bench]'
	touch $@

demo: $(STAMP_RUN)
	$(PY) examples/demo.py

horovod: $(STAMP_RUN)
	bash scripts/build_horovod.sh

lint: $(STAMP_TEST)
	$(VENV)/bin/ruff check yogastore storage_backends tests benchmarks examples
	$(VENV)/bin/ruff format --check yogastore storage_backends tests benchmarks examples

typecheck: $(STAMP_TEST)
	$(VENV)/bin/mypy

# s3rver: a second S3 implementation the S3 tests also run against (skipped without npm).
$(S3RVER): tests/s3rver/package.json tests/s3rver/package-lock.json
	if command -v npm >/dev/null; then \
		cd tests/s3rver && npm ci --no-audit --no-fund --loglevel=error && touch node_modules/.installed; \
	else echo "npm not found: the s3rver tests will be skipped"; fi

unit: $(STAMP_TEST) $(S3RVER)
	$(PY) -m pytest $(PYTEST_ARGS)

test: $(STAMP_TEST) horovod lint typecheck unit

bench: $(STAMP_TEST)
	$(PY) -m benchmarks.read_throughput $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

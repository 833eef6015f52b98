# Set-up and checks. `make demo` and `make test` build their virtual environments on first use.
PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
# The oldest transformers release ssmshard supports (hf_compat.OLDEST_SUPPORTED): the
# compatibility subset of the tests (`-m compat`) runs against it in its own environment.
OLDEST_TRANSFORMERS := 5.17.0
VENV_OLDEST := .venv-transformers-$(OLDEST_TRANSFORMERS)
# torch is pinned exactly and installed first: the pin selects the local CPU wheel, and an
# already-satisfied torch keeps `pip install -e .` from pulling a CUDA build.
TORCH  := torch==2.13.0
PIP_QUIET := --quiet --disable-pip-version-check
# Test processes (pytest-xdist). Multi-rank tests start their own processes on top, so more
# workers than cores only adds contention; the slowest tests are listed at the end of a run.
JOBS   ?= 2
PYTEST_OPTS := -n $(JOBS) --dist worksteal --durations=25
# Intra-op threads per test process (and per rank it starts): the cores shared out over the
# workers, at least one. torch's default, a thread per core in every process, oversubscribes
# the cores (on 2 cores a set of the heaviest tests took 10% longer). OMP_NUM_THREADS wins if set.
TEST_THREADS ?= $(or $(OMP_NUM_THREADS),$(shell n=$$(( $$(nproc 2>/dev/null || echo 1) / $(JOBS) )); echo $$(( n > 0 ? n : 1 ))))

.PHONY: venv demo test test-all test-newest test-oldest clean

venv: $(VENV)/.stamp

$(VENV)/.stamp: pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install $(PIP_QUIET) $(TORCH)
	$(VPY) -m pip install $(PIP_QUIET) -e '.[test]'
	touch $@

$(VENV_OLDEST)/.stamp: pyproject.toml
	test -x $(VENV_OLDEST)/bin/python || $(PYTHON) -m venv $(VENV_OLDEST)
	$(VENV_OLDEST)/bin/python -m pip install $(PIP_QUIET) $(TORCH)
	$(VENV_OLDEST)/bin/python -m pip install $(PIP_QUIET) -e '.[test]' 'transformers==$(OLDEST_TRANSFORMERS)'
	touch $@

demo: venv
	@$(VENV)/bin/ssmshard demo

# The suite on the newest transformers, then the compatibility subset on the oldest. Tests
# marked slow (the tp = 3 and 4 repeats of the heaviest multi-process tests) run in test-all.
# The oldest environment is built while the newest suite runs (pip mostly waits on downloads,
# a few minutes a fresh machine would otherwise spend idle); its log is shown if that fails.
MARKS ?= not slow
OLDEST_LOG := $(VENV_OLDEST).build.log
test: venv
	@$(MAKE) --no-print-directory $(VENV_OLDEST)/.stamp > $(OLDEST_LOG) 2>&1 & builder=$$!; \
	status=0; $(MAKE) --no-print-directory test-newest || status=$$?; \
	if ! wait $$builder; then cat $(OLDEST_LOG); echo "make: building $(VENV_OLDEST) failed" >&2; exit 1; fi; \
	if [ $$status -ne 0 ]; then exit $$status; fi; \
	$(MAKE) --no-print-directory test-oldest

test-all:
	$(MAKE) test MARKS=

test-newest: venv
	OMP_NUM_THREADS=$(TEST_THREADS) $(VPY) -m pytest tests $(PYTEST_OPTS) $(if $(MARKS),-m "$(MARKS)")

test-oldest: $(VENV_OLDEST)/.stamp
	OMP_NUM_THREADS=$(TEST_THREADS) $(VENV_OLDEST)/bin/python -m pytest tests -m "compat$(if $(MARKS), and ($(MARKS)))" $(PYTEST_OPTS)

clean:
	rm -rf $(VENV) $(VENV_OLDEST) $(OLDEST_LOG) *.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

# Set-up and checks. `make demo` and `make test` build .venv on first use.
PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
# torch is pinned exactly and installed first: the pin selects the local CPU wheel, and an
# already-satisfied torch keeps `pip install -e .` from pulling a CUDA build.
TORCH  := torch==2.13.0

.PHONY: venv demo test clean

venv: $(VENV)/.stamp

$(VENV)/.stamp: pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install $(TORCH)
	$(VPY) -m pip install -e '.[test]'
	touch $@

demo: venv
	$(VENV)/bin/ssmshard demo

test: venv
	$(VPY) -m pytest tests

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

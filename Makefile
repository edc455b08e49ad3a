# The two commands in the README: `make demo` and `make test`.
# Both build the virtual environment they need from a fresh checkout.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := DS_BUILD_OPS=0 $(PY) -m pip install -q --disable-pip-version-check

.PHONY: demo test system-deps clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# setuptools leaves src/corral.egg-info behind (the editable install does not
# use it: its metadata is in the venv): removed, so that a second user can
# install from the same checkout (root's copy stopped their `pip install -e .`).
$(VENV)/.demo-installed: $(VENV)/bin/python pyproject.toml requirements-demo.txt
	$(PIP) -r requirements-demo.txt -e .
	rm -rf src/corral.egg-info
	touch $@

$(VENV)/.test-installed: $(VENV)/bin/python pyproject.toml requirements-test.txt
	$(PIP) -r requirements-test.txt -e .
	rm -rf src/corral.egg-info
	touch $@ $(VENV)/.demo-installed

## demo: install corral and train examples/train_ddp.py on this machine (2 processes, or one per GPU)
demo: $(VENV)/.demo-installed
	$(VENV)/bin/corral run examples/train_ddp.py

## test: install what the tests drive (sshd, rsync, iproute2, torch...) and run the whole suite
test: system-deps $(VENV)/.test-installed
	$(PY) -m pytest $(PYTEST_ARGS)

system-deps:
	bash scripts/system-deps.sh

clean:
	rm -rf $(VENV) runs .pytest_cache src/corral.egg-info build

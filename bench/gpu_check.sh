#!/usr/bin/env bash
# The GPU verifier's check, on a lent GPU in at most 9½ minutes:
#
#   bash bench/gpu_check.sh            full sizes; results in $OUT/gpu_results.txt (or ./gpu_results.txt)
#   bash bench/gpu_check.sh --short    the same steps at small sizes, on CPU in < 4 min on 2 cores
#                                      (tests/test_gpu_check.py runs it in the vLLM suite, so it cannot rot)
#
# 1. the Python: $PYTHON, else $VENV_GPU (default .venv-gpu) or .venv-vllm if it imports vllm, else
#    python3; with WHEELS=/folder and no vLLM anywhere, .venv-gpu is built from that folder
#    (pip --no-index: a lent machine reaches nothing outside);
# 2. the acceptance maths per pass (bench/accept_maths.py): per-session numpy, the batched torch call
#    on each device, and the softmax floor;
# 3. many edges: hybrid against cloud-only at 64 and 256 edges on lte, synthetic edges (netsim load
#    --synthetic: the synthetic verifier, drafting emulated per edge);
# 4. what a round costs vLLM, from its own counters (bench/fleet_vllm_counters.py), every setting and path;
# 5. vLLM speculating for itself beside plain decoding (bench/vllm_self_spec.py: n-gram and a draft
#    model, the same prompts, one engine each): the second baseline of the per-GPU comparison
#    (docs/operators.md), measured; --short: plain and n-gram at tiny sizes (a vLLM that refuses
#    speculative decoding on CPU is reported as refused, not failed); the requests are eval-draft's
#    prompts (edge_client/prompts/eval.jsonl) as token ids, and each proposer's acceptance per draft
#    position comes from vLLM's own counters (on a GPU also n-gram and a draft model at γ 8);
# 5a. (before 5) the acceptance curve of our device draft on the same prompts (edge-client eval-draft, llama.cpp:
#    `chain`), beside vLLM's n-gram rule as netsim emulates it (`ngram`): the curves netsim/fleet uses,
#    next to what the real proposer measured in step 5;
# 6. on a GPU: step 3 again with a vLLM verifier (SmolLM2 dequantized, started here) and
#    prompt-lookup edges (--drafter lookup, drafting emulated).
# Every step is time-boxed by what is left of the budget (560 s; --short 480 s: the short run starts vLLM four times on a CPU); a step that fails
# or runs out of time is reported and the script goes on. Exit status: the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
SHORT=0
for arg in "$@"; do
  case "$arg" in
    --short) SHORT=1 ;;
    *) echo "usage: bash bench/gpu_check.sh [--short]  (unknown argument: $arg)" >&2; exit 2 ;;
  esac
done
RESULTS=${OUT:-.}/gpu_results.txt
BUDGET=$([ $SHORT = 1 ] && echo 480 || echo 560)
START=$(date +%s)
FAILED=0
mkdir -p "$(dirname "$RESULTS")"
: > "$RESULTS"
say() { echo "$*" | tee -a "$RESULTS"; }
elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( BUDGET - $(elapsed) )); }
# step NAME SECONDS CMD...: run CMD time-boxed by min(SECONDS, what is left); its output filtered into the results.
step() {
  local name=$1 box=$2; shift 2
  local t=$(( $(left) < box ? $(left) : box ))
  say "## $name (elapsed $(elapsed) s, box ${t} s)"
  if [ "$t" -lt 10 ]; then say "skipped: out of time"; FAILED=$((FAILED + 1)); return; fi
  timeout "$t" "$@" 2>&1 | grep -v " INFO \|WARNING\|^INFO\|it/s\]" | tail -40 | tee -a "$RESULTS"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" != 0 ]; then say "FAILED: $name (exit $rc$([ "$rc" = 124 ] && echo ': out of time'))"; FAILED=$((FAILED + 1)); fi
}

say "# gpu_check $([ $SHORT = 1 ] && echo --short) $(date -u +%FT%TZ) on $(hostname)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /' | tee -a "$RESULTS"

# --- 1. the Python --------------------------------------------------------------------------------
PY=${PYTHON:-}
spec() { "$1" -c "import importlib.util as u, sys; sys.exit(u.find_spec('$2') is None)" 2>/dev/null; }
if [ -z "$PY" ]; then
  for v in "${VENV_GPU:-.venv-gpu}" .venv-vllm; do
    if spec "$v/bin/python" vllm; then PY=$v/bin/python; break; fi
  done
fi
if [ -z "$PY" ] && [ -n "${WHEELS:-}" ]; then
  python3 -m venv .venv-gpu && timeout "$(left)" .venv-gpu/bin/pip install -q --no-index --find-links "$WHEELS" \
    "${VLLM_PACKAGE:-vllm}" -e ".[dev]" 2>&1 | tail -3 | tee -a "$RESULTS"
  spec .venv-gpu/bin/python vllm && PY=.venv-gpu/bin/python
fi
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PROMPTS=edge_client/prompts/eval.jsonl   # eval-draft's prompts: vLLM's proposers and our draft on the same ones
# vLLM on CPU: a small KV cache, and no core reserved for its bookkeeping (scripts/test_vllm.sh).
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
# Found, not imported (importing vLLM takes a while): a broken install fails its step.
has() { spec "$PY" "$1"; }
CUDA=$(has torch && "$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
say "python: $PY; vllm $(has vllm && echo found || echo missing), torch $(has torch && echo found || echo missing), cuda $CUDA"

# --- 2. the acceptance maths per pass ---------------------------------------------------------------
if has torch; then
  if [ $SHORT = 1 ]; then
    step "acceptance maths per pass" 35 "$PY" bench/accept_maths.py --sessions 1 4 --vocabs 49152 --reps 1 \
      --out "$(dirname "$RESULTS")/accept_maths_short.md"
  else
    # numpy and torch-on-CPU cells only up to 0.35 GiB of logits: the time box, not the GPU, limits them.
    step "acceptance maths per pass" 120 "$PY" bench/accept_maths.py --reps 2 --cpu-max-gib 0.35 \
      --out "$(dirname "$RESULTS")/accept_maths_gpu.md"
  fi
else
  say "## acceptance maths per pass: skipped (torch is not importable by $PY)"; FAILED=$((FAILED + 1))
fi

# --- 3. many edges: hybrid against cloud-only on lte ------------------------------------------------
if [ $SHORT = 1 ]; then
  step "many edges, synthetic (lte)" 50 "$PY" -m netsim load --synthetic --edges 4,16 --profile lte \
    --mode hybrid,cloud-only --duration 2 --warmup 1 --out "$(dirname "$RESULTS")/load_short"
else
  step "many edges, synthetic (lte)" 90 "$PY" -m netsim load --synthetic --edges 64,256 --profile lte \
    --mode hybrid,cloud-only --duration 8 --warmup 2 --out "$(dirname "$RESULTS")/load_synthetic_lte"
fi

# --- 4. vLLM's counters per round -------------------------------------------------------------------
if has vllm; then
  if [ $SHORT = 1 ]; then
    step "vLLM counters per round" 120 "$PY" bench/fleet_vllm_counters.py --gammas 2 --rounds 2 --context 40 --settings greedy,top-k \
      --out "$(dirname "$RESULTS")/vllm_counters_short.json"
  else
    step "vLLM counters per round" 120 "$PY" bench/fleet_vllm_counters.py --gammas 4 \
      --vllm-arg gpu_memory_utilization=0.3 --vllm-arg enforce_eager=true \
      --out "$(dirname "$RESULTS")/vllm_counters_gpu.json"
  fi
else
  say "## vLLM counters per round: skipped (vllm is not importable by $PY)"; FAILED=$((FAILED + 1))
fi

# --- 5a. our device draft's acceptance curve on the same prompts (llama.cpp; no vLLM, no GPU) --------
DRAFT=${HYBRIDSPEC_MODELS:-models}/smollm2-draft.gguf
ACC=$(dirname "$RESULTS")/device_acceptance$([ $SHORT = 1 ] && echo _short || echo _gpu).json
if [ ! -f "$DRAFT" ]; then
  step "the device draft (made from the bundled target)" 120 "$PY" -m edge_client make-draft --method requant --type Q4_0 --out "$DRAFT"
fi
if [ $SHORT = 1 ]; then
  step "device draft acceptance, same prompts" 90 bash -c '"$0" -m edge_client eval-draft --target smollm2 --draft "$1" \
    --prompts "$2" --per-category 1 --tokens 8 --temperatures 0 --fom-temperature 0 --no-speed --json > "$3"' "$PY" "$DRAFT" "$PROMPTS" "$ACC"
else
  step "device draft acceptance, same prompts" 100 bash -c '"$0" -m edge_client eval-draft --target smollm2 --draft "$1" \
    --prompts "$2" --tokens 48 --temperatures 0 --fom-temperature 0 --no-speed --json > "$3"' "$PY" "$DRAFT" "$PROMPTS" "$ACC"
fi
if [ -s "$ACC" ]; then
  "$PY" -c "import json, sys; r = json.load(open(sys.argv[1]))
print('device draft (llama.cpp), tokens per step by γ:', r['chain']['0']['tokens_per_step'])
print('n-gram as netsim emulates it, tokens per step by γ:', r['ngram']['tokens_per_step'])" "$ACC" | tee -a "$RESULTS"
fi

# --- 5. vLLM speculating for itself, beside plain decoding ------------------------------------------
if has vllm; then
  if [ $SHORT = 1 ]; then
    step "vLLM speculating for itself" 370 "$PY" bench/vllm_self_spec.py --prompts-file "$PROMPTS" --per-category 1 \
      --max-tokens 8 --methods none,ngram --vllm-arg dtype=float32 --out "$(dirname "$RESULTS")/vllm_self_spec_short.json"
  else
    step "vLLM speculating for itself" 150 "$PY" bench/vllm_self_spec.py --prompts 64 --max-tokens 128 \
      --vllm-arg gpu_memory_utilization=0.3 --vllm-arg enforce_eager=true \
      --out "$(dirname "$RESULTS")/vllm_self_spec_gpu.json"
    step "vLLM's acceptance per position (eval prompts, γ 8)" 110 "$PY" bench/vllm_self_spec.py --prompts-file "$PROMPTS" \
      --max-tokens 48 --gamma 8 --methods ngram,draft_model --vllm-arg gpu_memory_utilization=0.3 \
      --vllm-arg enforce_eager=true --out "$(dirname "$RESULTS")/vllm_acceptance_gpu.json"
  fi
else
  say "## vLLM speculating for itself: skipped (vllm is not importable by $PY)"; FAILED=$((FAILED + 1))
fi

# --- 6. many edges with the vLLM verifier (a GPU only: its start and 2 x 2 runs do not fit --short) ---
# The verifier runs here, in its own process group, and netsim load talks to it (--server): vLLM's
# shutdown can outlast netsim's wait for a verifier it started. VLLM_LOAD=1 runs this step without
# CUDA too (VLLM_LOAD_EDGES=2: a CPU check of the step itself).
if [ $SHORT = 0 ] && { [ "$CUDA" = 1 ] || [ "${VLLM_LOAD:-0}" = 1 ]; } && has vllm; then
  FOLDER=$("$PY" -c "from hybridspec.testing.vllm_model import smollm2_folder; print(smollm2_folder())" 2>/dev/null | tail -1)
  free_port() { "$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
  PORT=$(free_port); MPORT=$(free_port)
  EXTRA=(); [ "$CUDA" = 1 ] && EXTRA=(--vllm-arg gpu_memory_utilization=0.5)
  setsid "$PY" -m cloud_verifier serve --backend vllm --model "$FOLDER" --port "$PORT" --metrics-port "$MPORT" \
    --n-ctx 512 --max-sessions 256 "${EXTRA[@]}" > "$(dirname "$RESULTS")/vllm_verifier.log" 2>&1 &
  VPID=$!
  ready() { "$PY" -c "import socket; socket.create_connection(('127.0.0.1', $PORT), 1)" 2>/dev/null; }
  while ! ready && kill -0 "$VPID" 2>/dev/null && [ "$(left)" -gt 30 ]; do sleep 2; done
  if ready; then
    say "vLLM verifier ready on port $PORT (elapsed $(elapsed) s)"
    step "many edges, vLLM verifier (lte)" 200 "$PY" -m netsim load --server "127.0.0.1:$PORT" \
      --metrics-url "http://127.0.0.1:$MPORT/metrics" --drafter lookup --edges "${VLLM_LOAD_EDGES:-64,256}" \
      --profile lte --mode hybrid,cloud-only --duration 8 --warmup 2 --out "$(dirname "$RESULTS")/load_vllm_lte"
  else
    say "FAILED: the vLLM verifier did not start (elapsed $(elapsed) s):"; tail -5 "$(dirname "$RESULTS")/vllm_verifier.log" | tee -a "$RESULTS"
    FAILED=$((FAILED + 1))
  fi
  kill -TERM -- "-$VPID" 2>/dev/null
  for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$VPID" 2>/dev/null || break; sleep 2; done
  kill -KILL -- "-$VPID" 2>/dev/null
fi
say "done in $(elapsed) s, $FAILED step(s) failed"
exit "$FAILED"

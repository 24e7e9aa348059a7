"""Cost of one verification round against context length, llama.cpp vs vLLM (a benchmark, not a test).

For each backend, context length L and draft length gamma: open a session on L prompt tokens
(the first round pays the prefill and is not counted), then run steady-state rounds: each round
verifies gamma draft tokens after the committed sequence and commits what the backend returns,
as the verifier does, so llama.cpp rolls its KV cache back and vLLM hits its prefix cache.
Drafts are point masses on arbitrary tokens at T = 1 (rejected at once, so the committed length
grows by one a round and every round does the full gamma + 1 rows of work). Prints medians and
writes a Markdown table.

  .venv-vllm/bin/python bench/verify_cost.py                      # both, SmolLM2, 512/2k/8k
  .venv-vllm/bin/python bench/verify_cost.py --backends llama.cpp --contexts 512,2048

The vLLM model is the bundled SmolLM2 GGUF dequantized to an HF folder (hybridspec/testing/vllm_model.py,
cached), or --vllm-model FOLDER. --prompt-logprobs also times the rejected alternative: one
request with prompt_logprobs over context + drafts (no prefix cache).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from hybridspec.machine import announce, summary as machine_summary

ROOT = Path(__file__).resolve().parent.parent

TEXT = ("Speculative decoding lets a small draft model propose several tokens that a large target "
        "model checks in one forward pass. The output has exactly the target's distribution. ")


def prompt_ids(tokenize, n: int) -> list[int]:
    base = tokenize(TEXT)
    ids = []
    while len(ids) < n:
        ids.extend(base)
    return ids[:n]


def run_rounds(backend, prompt: list[int], gamma: int, rounds: int, vocab: int, seed: int = 0) -> dict:
    from spec_core.verify import commit_round
    from spec_core.warping import SamplingSettings
    rng = np.random.default_rng(seed)
    settings = SamplingSettings(temperature=1.0)
    state = backend.new_state()
    committed = list(prompt)
    times, forwarded = [], []
    try:
        for r in range(rounds + 1):
            drafts = [int(t) for t in rng.integers(3, vocab, gamma)]
            f0 = backend.forward_tokens() if hasattr(backend, "_forwarded") else 0
            t0 = time.perf_counter()
            result = backend.verify(state, committed, drafts, None, settings, rng).result
            dt = time.perf_counter() - t0
            done = commit_round(drafts, result, frozenset(), remaining=10**9, context_left=10**9)
            committed.extend(done.tokens)
            if r == 0:
                first = dt  # prefill of the whole prompt
                continue
            times.append(dt)
            if hasattr(backend, "_forwarded"):
                forwarded.append(backend.forward_tokens() - f0)
    finally:
        backend.release(state)
    return {"first_s": first, "median_s": statistics.median(times), "min_s": min(times),
            "prefill_tokens": statistics.median(forwarded) if forwarded else None}


def prompt_logprobs_cost(backend, prompt: list[int], gamma: int, reps: int = 2) -> float:
    """One request with prompt_logprobs=1 over prompt + drafts: vLLM re-prefills everything."""
    from vllm import SamplingParams
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, detokenize=False, flat_logprobs=True)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        backend._run(backend._batch([(prompt + prompt[:gamma], params)], kind="full"))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fmt(x) -> str:
    return "" if x is None else f"{x:.0f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="llama.cpp,vllm")
    ap.add_argument("--contexts", default="512,2048,8000", help="context lengths in tokens (SmolLM2 trains on 8192)")
    ap.add_argument("--gammas", default="4,8")
    ap.add_argument("--rounds", type=int, default=8, help="steady-state rounds per cell")
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: all cores, max 8)")
    ap.add_argument("--gguf", default=None, help="GGUF for llama.cpp (default: bundled SmolLM2 Q4_1)")
    ap.add_argument("--vllm-model", default=None, help="HF folder for vLLM (default: SmolLM2 dequantized)")
    ap.add_argument("--vllm-arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--prompt-logprobs", action="store_true", help="also time the prompt_logprobs alternative")
    ap.add_argument("--out", default=str(ROOT / "results" / "verify_cost.md"))
    args = ap.parse_args()
    machine = announce()
    contexts = [int(x) for x in args.contexts.split(",")]
    gammas = [int(x) for x in args.gammas.split(",")]
    n_ctx = max(contexts) + max(gammas) + args.rounds * (max(gammas) + 1) + 8

    from llama_runtime import GGUFModel, bundled_model_path
    gguf = args.gguf or str(bundled_model_path())
    tok = GGUFModel(gguf, vocab_only=True)
    rows = []  # (backend, L, gamma, result)
    notes = []
    for name in args.backends.split(","):
        t0 = time.perf_counter()
        if name == "llama.cpp":
            from cloud_verifier.backends.llama_cpp import LlamaCppBackend
            backend = LlamaCppBackend(gguf, n_ctx=n_ctx, n_threads=args.threads)
            model_desc = f"{Path(gguf).name} (llama.cpp, {backend.model.n_threads} threads)"
        elif name == "vllm":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
            from cloud_verifier.backends.vllm import VllmBackend
            from hybridspec.testing.vllm_model import smollm2_folder
            folder = args.vllm_model or str(smollm2_folder())
            engine_args = dict(kv.split("=", 1) for kv in args.vllm_arg)
            backend = VllmBackend(folder, n_ctx=n_ctx, engine_args=engine_args)
            same = backend.info.fingerprint == tok.fingerprint
            model_desc = (f"{Path(folder).name} (vLLM {__import__('vllm').__version__}, "
                          f"{ {k: v for k, v in backend.engine_args.items() if k != 'model'} })")
            notes.append(f"vLLM tokenizer fingerprint {'equals' if same else 'DIFFERS from'} the GGUF's")
        else:
            raise SystemExit(f"unknown backend {name!r}")
        start_s = time.perf_counter() - t0
        notes.append(f"{name}: {model_desc}; start {start_s:.1f} s")
        print(f"# {name}: start {start_s:.1f} s", flush=True)
        try:
            for L in contexts:
                prompt = prompt_ids(tok.tokenize, L)
                for gamma in gammas:
                    res = run_rounds(backend, prompt, gamma, args.rounds, backend.info.n_vocab)
                    if name == "vllm" and args.prompt_logprobs:
                        res["prompt_logprobs_s"] = prompt_logprobs_cost(backend, prompt, gamma)
                    rows.append((name, L, gamma, res))
                    print(f"{name:9s} L={L:5d} gamma={gamma}: round median {res['median_s'] * 1e3:8.1f} ms "
                          f"(min {res['min_s'] * 1e3:.1f}), first round {res['first_s']:.2f} s"
                          + (f", prefill/round {res['prefill_tokens']:.0f} tok" if res["prefill_tokens"] else "")
                          + (f", prompt_logprobs alt {res['prompt_logprobs_s'] * 1e3:.0f} ms"
                             if "prompt_logprobs_s" in res else ""), flush=True)
        finally:
            backend.close()

    lines = ["# Cost of one verification round against context length", "",
             f"Machine: {machine_summary(machine)}; "
             f"{args.rounds} steady-state rounds per cell (median; the first round's prefill is separate).", "",
             *[f"- {n}" for n in notes], "",
             "| backend | context | γ | round median (ms) | min (ms) | first round (s) | tokens prefilled / round |"
             + (" prompt_logprobs alternative (ms) |" if args.prompt_logprobs else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if args.prompt_logprobs else "")]
    for name, L, gamma, r in rows:
        lines.append(f"| {name} | {L} | {gamma} | {r['median_s'] * 1e3:.1f} | {r['min_s'] * 1e3:.1f} | "
                     f"{r['first_s']:.2f} | {_fmt(r['prefill_tokens'])} |"
                     + (f" {_fmt(r.get('prompt_logprobs_s', None) and r['prompt_logprobs_s'] * 1e3)} |"
                        if args.prompt_logprobs else ""))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What session affinity saves: a round on the replica that holds the session's KV cache against
the first round after a replica change, where the new replica has no cache and re-prefills the
prompt and every committed token (the edge's replay: NOT_FOUND, then `open` with the committed
tokens; no token is lost, only time).

Runs the llama.cpp backend on the bundled SmolLM2-135M-Instruct Q4_1, exactly as the verifier
calls it (`LlamaCppBackend.verify` from a worker thread, one KV cache per session):

- warm: the state already holds the committed tokens (the previous round's drafts are rolled
  back), so the round decodes the last committed token and the gamma drafts;
- after a replica change: a new state (the new replica's `new_state()`, timed too) and the same
  verify, which decodes committed + drafts from scratch.

    .venv/bin/python bench/affinity.py                # 256, 1024, 2048 committed tokens, gamma 5
    .venv/bin/python bench/affinity.py --lengths 512 --gamma 8 --repeats 5 --out -

Prints medians and writes results/affinity.md (use --out - to skip the file).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from cloud_verifier.backends.llama_cpp import LlamaCppBackend
from hybridspec.machine import announce, summary as machine_summary
from llama_runtime import bundled_model_path, default_threads
from spec_core.warping import SamplingSettings

TEXT = ("Speculative decoding lets a small draft model propose several tokens that a large target "
        "model checks in a single forward pass; the output keeps the target's distribution. ")


def committed_tokens(backend: LlamaCppBackend, length: int) -> list[int]:
    """`length` real tokens of English text (the cost of a prefill does not depend on which)."""
    ids = backend.model.tokenize(TEXT, add_special=False)
    reps = -(-length // len(ids))
    return [backend.model.bos_id] + (ids * reps)[: length - 1]


def time_round(backend: LlamaCppBackend, state, committed: list[int], drafts: list[int],
               settings: SamplingSettings) -> float:
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    backend.verify(state, committed, drafts, None, settings, rng)
    return time.perf_counter() - t0


def measure(backend: LlamaCppBackend, length: int, gamma: int, repeats: int, warm_repeats: int) -> dict:
    committed = committed_tokens(backend, length)
    drafts = committed[1: gamma + 1]  # any in-vocabulary ids; greedy so the verdict is cheap and fixed
    greedy = SamplingSettings(temperature=0.0)

    # Warm and fresh rounds are interleaved so that both see the same background load.
    warm_state = backend.new_state()
    warm, fresh, new_state_s = [], [], []
    try:
        time_round(backend, warm_state, committed, drafts, greedy)  # the session's history: cache filled
        per_fresh = max(1, warm_repeats // repeats)
        for _ in range(repeats):
            warm += [time_round(backend, warm_state, committed, drafts, greedy) for _ in range(per_fresh)]
            t0 = time.perf_counter()
            state = backend.new_state()  # the new replica's
            t1 = time.perf_counter()
            try:
                fresh.append(t1 - t0 + time_round(backend, state, committed, drafts, greedy))
                new_state_s.append(t1 - t0)
            finally:
                backend.release(state)
    finally:
        backend.release(warm_state)
    w, f = statistics.median(warm), statistics.median(fresh)
    return {"committed": length, "gamma": gamma, "warm_ms": w * 1e3, "fresh_ms": f * 1e3,
            "new_state_ms": statistics.median(new_state_s) * 1e3, "extra_ms": (f - w) * 1e3,
            "ratio": f / w, "warm_n": len(warm), "fresh_n": len(fresh)}


def markdown(rows: list[dict], args, backend: LlamaCppBackend) -> str:
    lines = [
        "# Session affinity: a warm round vs the first round after a replica change",
        "",
        f"Command: `.venv/bin/python bench/affinity.py --gamma {args.gamma} --repeats {args.repeats} "
        f"--warm-repeats {args.warm_repeats} --threads {backend.model.n_threads}`",
        "",
        f"Target: {backend.info.model} (llama.cpp, CPU), {backend.model.n_threads} threads, "
        f"n_ctx {backend.n_ctx}, n_batch {backend.n_batch}; machine: {machine_summary()}, "
        f"Python {platform.python_version()}; load average (1 min) "
        f"{args.load_before:.1f} before, {os.getloadavg()[0]:.1f} after (other jobs shared the cores).",
        "",
        "warm = `backend.verify` on the session's own KV cache (decodes the last committed token and the "
        "drafts); after change = a new replica's `new_state()` + the same `verify` (re-prefills prompt + "
        "committed + drafts). Medians; warm and fresh rounds interleaved.",
        "",
        "| committed tokens | gamma | warm round ms | after replica change ms | of which new_state ms "
        "| extra ms | ratio | runs (warm / fresh) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['committed']} | {r['gamma']} | {r['warm_ms']:.1f} | {r['fresh_ms']:.1f} | "
                     f"{r['new_state_ms']:.1f} | {r['extra_ms']:.1f} | {r['ratio']:.1f}x | "
                     f"{r['warm_n']} / {r['fresh_n']} |")
    lines += [
        "",
        "Reading: each replica change costs one re-prefill, paid once by the round that follows it; "
        "`extra ms / warm round ms` is how many ordinary rounds that one round is worth. Affinity "
        "(one long-lived HTTP/2 connection per edge, ClientIP affinity for reconnects) avoids it; "
        "correctness never depends on it (the edge replays its committed tokens). On a GPU the prefill "
        "is far cheaper per token than here, but it still grows with the committed length, and it "
        "competes with other sessions' rounds for the same forward passes.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="target GGUF (default: the bundled SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048], help="committed tokens")
    p.add_argument("--gamma", type=int, default=5, help="draft tokens per round")
    p.add_argument("--repeats", type=int, default=5, help="rounds after a replica change, per length")
    p.add_argument("--warm-repeats", type=int, default=20, help="warm rounds, per length")
    p.add_argument("--threads", type=int, default=default_threads(), help="llama.cpp threads")
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "affinity.md"), help="markdown file, or - for none")
    args = p.parse_args(argv)
    announce()

    args.load_before = os.getloadavg()[0]
    n_ctx = max(args.lengths) + args.gamma + 64
    backend = LlamaCppBackend(args.model or str(bundled_model_path()), n_ctx=n_ctx, n_threads=args.threads)
    rows = []
    try:
        print(f"{'committed':>9} {'gamma':>5} {'warm ms':>9} {'after change ms':>15} {'new_state ms':>12} "
              f"{'extra ms':>9} {'ratio':>6}")
        for length in args.lengths:
            r = measure(backend, length, args.gamma, args.repeats, args.warm_repeats)
            rows.append(r)
            print(f"{r['committed']:>9} {r['gamma']:>5} {r['warm_ms']:>9.1f} {r['fresh_ms']:>15.1f} "
                  f"{r['new_state_ms']:>12.1f} {r['extra_ms']:>9.1f} {r['ratio']:>5.1f}x", flush=True)
        if args.out != "-":
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(markdown(rows, args, backend))
            print(f"wrote {args.out}", file=sys.stderr)
    finally:
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

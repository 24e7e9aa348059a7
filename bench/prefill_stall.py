"""How long another session's rounds wait while one session prefills a long prompt, on every
verifier path (serial, batched fair, batched slack, kv-park), with prefills chunked (the default
--prefill-chunk) and not (a chunk longer than the prompt: the schedules before issue 24), side by
side in one run on the machine at hand.

    PYTHONPATH=. .venv/bin/python bench/prefill_stall.py                    # synthetic target
    PYTHONPATH=. .venv/bin/python bench/prefill_stall.py --model smollm2    # SmolLM2 on llama.cpp
    PYTHONPATH=. .venv/bin/python bench/prefill_stall.py --model smollm2 --gamma 16 --threads 2

The backends are driven directly (no gRPC, no edge): one thread prefills `--prompt` tokens; a
second sends chain rounds of `--gamma` drafts back to back on a session of its own until the
prefill is done. Printed per path: the rounds sent meanwhile, their latency (p50 and max), the
most target passes (serial: turns of the model) one round saw begin, and the prefill's own time.
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np

from hybridspec.machine import summary

PATHS = {
    "serial": dict(batching=False),
    "batched fair": dict(batching=True, schedule="fair"),
    "batched slack": dict(batching=True, schedule="slack"),
    "batched kv-park": dict(batching=True, kv_park=True),
}
NO_CHUNKS = 1 << 20


def make_backend(args, chunk: int | None, kw: dict):
    if args.model is None:
        from cloud_verifier.backends.synthetic import SyntheticBackend
        extra = dict(kv_tokens=4 * 4096) if kw.get("kv_park") else {}
        return SyntheticBackend(vocab=64, step_ms=args.step_ms, per_token_ms=args.per_token_ms,
                                batch_tokens=32, prefill_chunk=chunk, **kw, **extra)
    from cloud_verifier.backends.llama_cpp import LlamaCppBackend
    from llama_runtime.model import resolve_model
    extra = dict(kv_tokens=4 * 2048) if kw.get("batching") else {}
    return LlamaCppBackend(str(resolve_model(args.model)), n_ctx=2048, n_threads=args.threads,
                           prefill_chunk=chunk, **kw, **extra)


def passes(backend) -> int:
    return backend.batcher.passes if backend.batcher is not None else backend.turns.turns


def run(args, chunk: int | None, kw: dict) -> dict:
    backend = make_backend(args, chunk, kw)
    rng = np.random.default_rng(0)
    vocab = backend.info.n_vocab
    try:
        small, big = backend.new_state(), backend.new_state()
        committed = [int(t) for t in rng.integers(3, vocab, size=16)]
        backend.target_logits(small, committed, 1)
        prompt = [int(t) for t in rng.integers(3, vocab, size=args.prompt)]
        done: dict[str, float] = {}

        def prefill():
            t0 = time.perf_counter()
            backend.target_logits(big, prompt, 1)
            done["prefill_s"] = time.perf_counter() - t0
        thread = threading.Thread(target=prefill)
        thread.start()
        walls, waited = [], []
        while thread.is_alive():
            drafts = [int(t) for t in rng.integers(3, vocab, size=args.gamma)]
            p0, t0 = passes(backend), time.perf_counter()
            backend.target_logits(small, committed + drafts, args.gamma + 1)
            walls.append(time.perf_counter() - t0)
            waited.append(passes(backend) - p0)
            committed.append(drafts[0])
        thread.join()
        return dict(rounds=len(walls), p50_ms=1e3 * statistics.median(walls) if walls else float("nan"),
                    max_ms=1e3 * max(walls, default=float("nan")), max_passes=max(waited, default=0),
                    prefill_s=done["prefill_s"])
    finally:
        backend.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="a GGUF file or a bundled model's name (smollm2, gemma); default: the synthetic target")
    p.add_argument("--prompt", type=int, default=1561, help="the long prompt's tokens")
    p.add_argument("--gamma", type=int, default=4, help="drafts per round of the other session")
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads")
    p.add_argument("--step-ms", type=float, default=2.0, help="(synthetic) cost of a pass")
    p.add_argument("--per-token-ms", type=float, default=0.2, help="(synthetic) cost per token of a pass")
    p.add_argument("--paths", default=",".join(PATHS), help="comma-separated: " + ", ".join(PATHS))
    args = p.parse_args()
    print(f"# prefill of {args.prompt} tokens vs rounds of gamma {args.gamma}; target: "
          f"{args.model or f'synthetic ({args.step_ms} ms + {args.per_token_ms} ms/token a pass)'}")
    print(f"# {summary()}")
    print(f"{'path':16} {'prefill':9} {'rounds':>6} {'p50 ms':>8} {'max ms':>8} {'max passes':>10} {'prefill s':>9}")
    for name in args.paths.split(","):
        for label, chunk in (("whole", NO_CHUNKS), ("chunked", None)):
            r = run(args, chunk, PATHS[name])
            print(f"{name:16} {label:9} {r['rounds']:6d} {r['p50_ms']:8.1f} {r['max_ms']:8.1f} {r['max_passes']:10d} "
                  f"{r['prefill_s']:9.2f}", flush=True)


if __name__ == "__main__":
    main()

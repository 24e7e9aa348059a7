"""Concurrent requests to `edge-client serve`: do their round trips overlap?

Each request has its own verifier session and draft KV cache; drafting is serialised in one
worker thread, the Verify round trips overlap on the event loop. On a link where the round trip
dominates, N requests at once should take little longer than one. The verifier sits behind a
netsim proxy (a real link profile: delay, jitter, bandwidth) so the round trips are real ones.

It runs the same N greedy requests (different prompts) one at a time and then all at once, in one
run, and prints wall time and aggregate tokens/s side by side.

    python bench/serve_concurrency.py --synthetic --profile lte     # model time ~0: the link is the cost
    python bench/serve_concurrency.py --profile lte                 # bundled SmolLM2 + models/smollm2-draft.gguf
"""
from __future__ import annotations

import argparse
import http.client
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge_client.drafters import DEFAULT_DRAFT  # noqa: E402
from hybridspec.launch import spawn_edge_server, spawn_verifier  # noqa: E402
from hybridspec.machine import announce
from llama_runtime import bundled_model_path  # noqa: E402
from netsim.profiles import get_profile  # noqa: E402
from netsim.proxy import LinkProxy  # noqa: E402

TEXT_PROMPTS = ["Write a Python function that reverses a list.", "Name three rivers in Europe.",
                "Explain what a hash table is.", "Write a haiku about rain.", "What is 12 times 7?",
                "List the planets of the solar system.", "Translate 'good morning' into French.",
                "Give a JSON object with a name and an age."]


def request(host: str, port: int, prompt: str, max_tokens: int) -> tuple[float, int, int]:
    """One non-streamed completion: (wall seconds, completion tokens, rounds)."""
    body = json.dumps({"model": "any", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True})
    conn = http.client.HTTPConnection(host, port, timeout=300)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    resp = conn.getresponse()
    out = json.loads(resp.read())
    wall = time.perf_counter() - t0
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {out}")
    return wall, out["usage"]["completion_tokens"], out["hybridspec"]["rounds"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="lte", help="netsim link profile between edge and verifier")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--gamma", default="4")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--synthetic", action="store_true", help="the synthetic pair instead of GGUF models")
    ap.add_argument("--synthetic-step-ms", type=float, default=5.0, help="verifier cost per forward pass (synthetic)")
    args = ap.parse_args()
    announce()
    n = args.concurrency

    if args.synthetic:
        prompts = [" ".join(str((i * 7 + k) % 60 + 2) for k in range(12)) for i in range(n)]
        verifier, address = spawn_verifier(["--backend", "synthetic", "--n-ctx", "1024", "--max-sessions", str(2 * n),
                                            "--synthetic-step-ms", str(args.synthetic_step_ms)])
        drafter_args = ["--drafter", "synthetic"]
    else:
        prompts = [TEXT_PROMPTS[i % len(TEXT_PROMPTS)] for i in range(n)]
        verifier, address = spawn_verifier(["--model", str(bundled_model_path()), "--n-ctx", "1024",
                                            "--threads", str(args.threads), "--max-sessions", str(2 * n)])
        drafter_args = ["--draft", str(DEFAULT_DRAFT)]
    vhost, vport = address.rsplit(":", 1)
    proxy = LinkProxy(upstream=(vhost, int(vport)), profile=get_profile(args.profile), seed=0).start_in_thread()
    edge, url, _ = spawn_edge_server(["--server", f"127.0.0.1:{proxy.port}", *drafter_args, "--threads",
                                      str(args.threads), "--gamma", args.gamma, "--plan", "off", "--max-concurrent", str(n)])
    try:
        host, port = url.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
        request(host, int(port), prompts[0], 4)  # warm-up: connection to the verifier, first draft context

        t0 = time.perf_counter()
        alone = [request(host, int(port), p, args.max_tokens) for p in prompts]
        alone_wall = time.perf_counter() - t0
        with ThreadPoolExecutor(n) as pool:
            t0 = time.perf_counter()
            together = list(pool.map(lambda p: request(host, int(port), p, args.max_tokens), prompts))
            together_wall = time.perf_counter() - t0
    finally:
        edge.terminate()
        edge.wait(30)
        proxy.stop()
        verifier.terminate()
        verifier.wait(30)

    tokens = sum(t for _, t, _ in alone)
    rounds_alone, rounds_together = sum(r for _, _, r in alone), sum(r for _, _, r in together)
    print(f"{'synthetic pair' if args.synthetic else 'SmolLM2 target + Q4_0 draft'}, link {args.profile}, "
          f"{n} requests x {args.max_tokens} tokens greedy, gamma {args.gamma}")
    print(f"{'':12} {'wall s':>8} {'tokens/s':>9} {'rounds':>7} {'mean request s':>15}")
    print(f"{'one by one':12} {alone_wall:8.2f} {tokens / alone_wall:9.1f} {rounds_alone:7d} "
          f"{sum(w for w, _, _ in alone) / n:15.2f}")
    print(f"{'all at once':12} {together_wall:8.2f} {tokens / together_wall:9.1f} {rounds_together:7d} "
          f"{sum(w for w, _, _ in together) / n:15.2f}")
    print(f"speed-up of the batch: {alone_wall / together_wall:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

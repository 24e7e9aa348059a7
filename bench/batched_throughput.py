"""Server throughput with N concurrent edges on loopback: batched vs serial verifier, hybrid vs
cloud-only, side by side in one run.

For each verifier mode (`--batching on` / `off`, each its own `cloud-verifier serve` process,
rows alternating between them) and each N, N edges run `--reps` generations of `--tokens` tokens each, concurrently:
  hybrid      EdgeClient rounds (gamma 4, greedy) with a prompt-lookup drafter (no model on
              the edge, so the edges do not compete with the verifier for these 2 cores)
  cloud-only  the target's own Generate stream
Printed per row: committed tokens/s across all edges (server throughput), time per output token
TPOT = (wall - TTFT) / (tokens - 1) per generation, p50 / p95 over generations, and from the
verifier's Prometheus metrics the mean tokens, sessions and seconds per target pass.

    python bench/batched_throughput.py [--edges 1 4 16] [--tokens 32] [--reps 2]
    python bench/batched_throughput.py --target synthetic   # synthetic pair, 20 ms per pass
    python bench/batched_throughput.py --target vllm        # SmolLM2 on vLLM (GPU): always batched

The llama.cpp prefill is batch-invariant (ubatches of 32 tokens), which the per-pass figures show.
"""
from __future__ import annotations

import argparse
import asyncio
import re
import socket
import sys
import time
import urllib.request

import grpc
import numpy as np

from edge_client import EdgeClient
from edge_client.client import stream_cloud_only
from edge_client.options import EdgeOptions, Speculation, Transport
from hybridspec.launch import spawn_verifier
from hybridspec.machine import announce
from spec_core.proto import verifier_pb2_grpc as pb_grpc
from spec_core.warping import SamplingSettings

TOPICS = ["the planets of the solar system", "the rules of chess", "how bread is made", "the history of Rome",
          "the water cycle", "how a bicycle works", "the life of bees", "the causes of rain",
          "how computers store numbers", "the parts of a flower", "the seasons of the year", "how tides work",
          "volcanoes", "the human heart", "the moon landing", "how a compass works"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pass_stats(metrics_port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    vals = {}
    for name in ("tokens", "sessions", "seconds"):
        s = re.search(rf"^hybridspec_batch_{name}_sum (\S+)$", text, re.M)
        c = re.search(rf"^hybridspec_batch_{name}_count (\S+)$", text, re.M)
        # The vLLM backend has no per-pass figures of its own (vLLM's scheduler makes the passes).
        vals[name] = (float(s.group(1)), float(c.group(1))) if s and c else (0.0, 0.0)
    return vals


def delta_means(before, after) -> tuple[float, float, float, int]:
    out = []
    for name in ("tokens", "sessions", "seconds"):
        ds, dc = after[name][0] - before[name][0], after[name][1] - before[name][1]
        out.append(ds / dc if dc else float("nan"))
    return out[0], out[1], out[2], int(after["tokens"][1] - before["tokens"][1])


async def run_edges(addr, mode, n_edges, args, tokenizer, make_drafter) -> tuple[float, list[float], int]:
    settings = SamplingSettings(temperature=0.0, max_new_tokens=args.tokens, ignore_eos=True)
    tpots, total = [], 0

    def prompt(k, r):
        if args.target == "synthetic":
            return [0, 2 + (k * 7 + r) % 60]
        return tokenizer.tokenize(f"Write a short list of facts about {TOPICS[(k + r) % len(TOPICS)]}.\n1.")

    def tpot(wall, ttft, n):
        return (wall - ttft) / (n - 1) if n > 1 else float("nan")

    async def edge(k):
        nonlocal total
        if mode == "hybrid":
            options = EdgeOptions(Transport(addr), Speculation(plan="off", gamma=args.gamma, qmode="none"))
            async with EdgeClient(options, make_drafter(), tokenizer) as c:
                for r in range(args.reps):
                    gen = c.generate(prompt(k, r), settings)
                    await gen.text()
                    st = gen.stats
                    tpots.append(tpot(st.wall_s, st.ttft_s, st.tokens))
                    total += st.tokens
        else:
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = pb_grpc.VerifierStub(ch)
                for r in range(args.reps):
                    st = await stream_cloud_only(stub, prompt(k, r), settings)
                    tpots.append(tpot(st.wall_s, st.ttft_s, st.tokens))
                    total += st.tokens

    t0 = time.perf_counter()
    await asyncio.gather(*[edge(k) for k in range(n_edges)])
    return time.perf_counter() - t0, tpots, total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--edges", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--tokens", type=int, default=32, help="tokens per generation")
    ap.add_argument("--reps", type=int, default=2, help="generations per edge, one after another")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1,
                    help="verifier threads (1: on a shared, oversubscribed machine ggml's spinning thread "
                         "barriers cost more than a second thread gains)")
    ap.add_argument("--target", choices=["bundled", "synthetic", "vllm"], default="bundled")
    ap.add_argument("--vllm-model", default=None, help="HF folder (default: the bundled SmolLM2 dequantized)")
    ap.add_argument("--vllm-arg", action="append", default=["gpu_memory_utilization=0.3"], metavar="KEY=VALUE")
    ap.add_argument("--synthetic-step-ms", type=float, default=20.0)
    ap.add_argument("--synthetic-per-token-ms", type=float, default=0.5)
    ap.add_argument("--modes", nargs="+", default=["hybrid", "cloud-only"])
    args = ap.parse_args(argv)
    announce()

    if args.target == "synthetic":
        from edge_client.drafters import SyntheticDrafter
        from edge_client.text import SyntheticTokenizer
        tokenizer = SyntheticTokenizer(64)
        make_drafter = lambda: SyntheticDrafter(64)  # noqa: E731
        target_args = ["--backend", "synthetic", "--synthetic-step-ms", str(args.synthetic_step_ms),
                       "--synthetic-per-token-ms", str(args.synthetic_per_token_ms)]
    elif args.target == "vllm":
        from edge_client.drafters import PromptLookupDrafter
        from llama_runtime import GGUFModel, bundled_model_path
        from hybridspec.testing.vllm_model import smollm2_folder
        tokenizer = GGUFModel(bundled_model_path(), vocab_only=True)
        make_drafter = lambda: PromptLookupDrafter(fingerprint=tokenizer.fingerprint)  # noqa: E731
        target_args = ["--backend", "vllm", "--model", args.vllm_model or str(smollm2_folder())]
        for kv in args.vllm_arg:
            target_args += ["--vllm-arg", kv]
    else:
        from edge_client.drafters import PromptLookupDrafter
        from llama_runtime import GGUFModel, bundled_model_path
        tokenizer = GGUFModel(bundled_model_path(), vocab_only=True)
        make_drafter = lambda: PromptLookupDrafter(fingerprint=tokenizer.fingerprint)  # noqa: E731
        target_args = ["--threads", str(args.threads)]
    n_max = max(args.edges)
    ctx = 256
    print(f"target {args.target}, {args.tokens} tokens x {args.reps} generations per edge, gamma {args.gamma}, "
          f"greedy; verifier --n-ctx {ctx}")
    header = (f"{'verifier':8s} {'mode':10s} {'N':>3s} {'tok/s':>7s} {'TPOT p50':>9s} {'TPOT p95':>9s} "
              f"{'passes':>6s} {'tok/pass':>8s} {'sess/pass':>9s} {'ms/pass':>8s}")
    print(header)
    rows = {}
    # Both verifiers run side by side (an idle one costs nothing) and the rows alternate between
    # them, so that the load of a shared machine drifts over both alike.
    verifiers = ("vllm",) if args.target == "vllm" else ("off", "on")
    procs = {}
    try:
        for v in verifiers:
            metrics_port = free_port()
            proc, addr = spawn_verifier([*target_args, "--n-ctx", str(ctx), "--batching", "off" if v == "off" else "on",
                                         "--kv-tokens", str(ctx * (2 * n_max + 2)), "--max-sessions",
                                         str(2 * n_max + 2), "--metrics-port", str(metrics_port)])
            procs[v] = (proc, addr, metrics_port)
        for mode in args.modes:
            for n in args.edges:
                for v in verifiers:
                    _, addr, metrics_port = procs[v]
                    before = pass_stats(metrics_port)
                    wall, tpots, total = asyncio.run(run_edges(addr, mode, n, args, tokenizer, make_drafter))
                    tok_pass, sess_pass, s_pass, passes = delta_means(before, pass_stats(metrics_port))
                    tp = np.array([t for t in tpots if np.isfinite(t)])
                    rows[v, mode, n] = (total / wall, np.percentile(tp, 95))
                    per_pass = (f"{passes:6d} {tok_pass:8.1f} {sess_pass:9.2f} {s_pass * 1e3:8.1f}" if passes
                                else f"{'–':>6s} {'–':>8s} {'–':>9s} {'–':>8s}")   # vLLM: its scheduler's passes
                    print(f"{v:8s} {mode:10s} {n:3d} {total / wall:7.1f} {np.percentile(tp, 50) * 1e3:7.1f}ms "
                          f"{np.percentile(tp, 95) * 1e3:7.1f}ms {per_pass}", flush=True)
    finally:
        for proc, _, _ in procs.values():
            proc.terminate()
            proc.wait(timeout=30)
    print()
    for mode in args.modes:
        n = n_max
        if ("on", mode, n) in rows and ("off", mode, n) in rows and ("on", mode, 1) in rows:
            speedup = rows["on", mode, n][0] / rows["off", mode, n][0]
            tpot_ratio = rows["on", mode, n][1] / rows["on", mode, 1][1]
            print(f"{mode}: batched / serial throughput at N={n}: {speedup:.2f}x (goal >= 1.5x); "
                  f"batched p95 TPOT N={n} / N=1: {tpot_ratio:.2f}x (goal <= 2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Live rounds and first tokens under load: N live edges generate while new sessions with long
prompts arrive, against one or two in-process verifier replicas; side by side in one run, the live
edges' time between commits without arrivals and with them, and the arrivals' time to first token.

    PYTHONPATH=$PWD python bench/first_tokens.py --backend synthetic --edges 16,64 --replicas 1,2
    PYTHONPATH=$PWD python bench/first_tokens.py --backend llamacpp --edges 16 --replicas 1   # bundled target, 1 thread

Backends: `synthetic`, the flat GPU-like target (20 ms + 0.05 ms a token a pass), synthetic drafts;
`llamacpp`, the bundled SmolLM2 target on llama.cpp, one thread, prompt-lookup drafts (no model on
the edge). Every verifier batches (the default) with the live-rounds-first prefill budget and honest
admission (a new session predicted to wait past its TTFT target is refused at once with a retry hint;
an edge given two replicas then tries the other one).

Per (edges, replicas): phase "without" runs the live edges alone for as long as phase "with" runs its
arrivals (`--arrivals` sessions of `--prompt` tokens, one every `--every` seconds, 4 tokens each).
Printed and written to bench/results/first-tokens-<backend>.json: the live edges' gaps between
commits (median, p95, max) per phase, and for the arrivals: first tokens (median, max), how many
were refused at least once (and so moved or waited), and the verifier's predicted first token over
the one measured (median), for the opens it admitted.

Long prompts served at once (`--parts idle,cpu,synthetic,edges,fleet`, one result file
bench/results/long-prompts.json; bench/long_prompts.py holds these parts):

    PYTHONPATH=$PWD python bench/first_tokens.py --parts idle,cpu,synthetic,edges,fleet --repeats 3
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cloud_verifier.admission import ServerPolicy  # noqa: E402
from cloud_verifier.engine import Limits  # noqa: E402
from cloud_verifier.server import VerifierServer  # noqa: E402
from edge_client import EdgeClient  # noqa: E402
from edge_client.options import EdgeOptions, Speculation, Transport  # noqa: E402
from edge_client.transport import replica_targets  # noqa: E402
from hybridspec.figures import Table, write_result  # noqa: E402
from hybridspec.machine import summary  # noqa: E402
from spec_core.warping import SamplingSettings  # noqa: E402

VOCAB = 64   # synthetic


@dataclass
class Phase:
    gaps: list[float] = field(default_factory=list)       # live edges' seconds between commits, in the window
    ttft: list[float] = field(default_factory=list)       # arrivals' first tokens (those that got one)
    refused: int = 0                                      # arrivals refused at least once
    failed: int = 0                                       # arrivals that gave up (hint waits ran out)
    predicted_over_took: list[float] = field(default_factory=list)


class Target:
    """Builds one replica's backend, and an edge's drafter and tokenizer, for a backend kind."""

    def __init__(self, kind: str, sessions: int, fixed: bool):
        self.kind, self.sessions = kind, sessions
        # fixed: the schedule without the rule (a fixed chunk of a quarter pass, the rest of each pass
        # filled with prompt) and without admission by first token: the comparison in the same run.
        self.fixed = fixed
        self.chunk = dict(prefill_chunk=(8 if kind == "llamacpp" else 128)) if fixed else {}
        if kind == "llamacpp":
            from llama_runtime import GGUFModel, bundled_model_path
            self.model_path = str(bundled_model_path())
            self.tokenizer = GGUFModel(self.model_path, vocab_only=True)
            self.vocab = self.tokenizer.n_vocab
        else:
            from edge_client.text import SyntheticTokenizer
            self.tokenizer, self.vocab = SyntheticTokenizer(VOCAB), VOCAB

    def backend(self):
        if self.kind == "llamacpp":
            from cloud_verifier.backends.llama_cpp import LlamaCppBackend
            return LlamaCppBackend(self.model_path, n_ctx=2048, n_threads=1, batching=True,
                                   kv_tokens=self.sessions * 2048, **self.chunk)
        from cloud_verifier.backends.synthetic import SyntheticBackend
        return SyntheticBackend(vocab=VOCAB, batching=True, step_ms=20.0, per_token_ms=0.05, **self.chunk)

    def drafter(self):
        if self.kind == "llamacpp":
            from edge_client.drafters import PromptLookupDrafter
            return PromptLookupDrafter(fingerprint=self.tokenizer.fingerprint)
        from edge_client.drafters import SyntheticDrafter
        return SyntheticDrafter(VOCAB, 0, 1.0)

    def prompt(self, rng: np.random.Generator, n: int) -> list[int]:
        low = 3 if self.kind == "synthetic" else 200
        return [int(t) for t in rng.integers(low, min(self.vocab, 20_000), size=n)]


def _window(times: list[float], t0: float, t1: float) -> list[float]:
    return [b - a for a, b in zip(times, times[1:]) if t0 <= a and b <= t1]


async def run_phase(target: Target, args, edges: int, replicas: int, arrivals: bool,
                    window_s: float | None) -> tuple[Phase, float]:
    policy = ServerPolicy(evict_idle_after_s=5.0, admit_ttft_s=0.0 if target.fixed else ServerPolicy.admit_ttft_s)
    limits = Limits(max_sessions=target.sessions, default_max_new_tokens=256)
    servers = [await VerifierServer(target.backend(), "127.0.0.1", 0, limits, grace_s=0.5, policy=policy).start()
               for _ in range(replicas)]
    addresses = ",".join(f"127.0.0.1:{s.port}" for s in servers)
    lists = replica_targets(addresses)
    phase, stop = Phase(), asyncio.Event()
    commits: list[list[float]] = [[] for _ in range(edges)]
    rng = np.random.default_rng(1)

    def client(k: int, on_round=None, ttft_ms: float = 0.0, **transport) -> EdgeClient:
        opts = EdgeOptions(Transport(lists[k % len(lists)], deadline_s=120, **transport),
                           Speculation(gamma=4, slo_ttft_ms=ttft_ms))
        return EdgeClient(opts, target.drafter(), target.tokenizer, on_round=on_round)

    async def live(k: int) -> None:
        async with client(k, on_round=lambda _ev, k=k: commits[k].append(time.perf_counter())) as c:
            n = 0
            while not stop.is_set():
                gen = c.generate(target.prompt(np.random.default_rng([k, n]), 16),
                                 SamplingSettings(temperature=0.0, max_new_tokens=args.live_tokens, ignore_eos=True))
                await gen.text()
                n += 1

    async def arrival(j: int) -> None:
        await asyncio.sleep(j * args.every)
        async with client(edges + j, ttft_ms=args.arrival_ttft_ms, max_wait_s=args.arrival_wait) as c:
            gen = c.generate(target.prompt(rng, args.prompt),
                             SamplingSettings(temperature=0.0, max_new_tokens=4, ignore_eos=True))
            try:
                await gen.text()
                phase.ttft.append(gen.stats.ttft_s)
            except Exception:  # noqa: BLE001 - refused past its patience: counted
                phase.failed += 1
            phase.refused += gen.stats.backoffs > 0 or gen.stats.retries > 0

    tasks = [asyncio.ensure_future(live(k)) for k in range(edges)]
    try:
        while sum(1 for c in commits if c) < edges:   # every live edge has committed once
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)
        t0 = time.perf_counter()
        if arrivals:
            try:
                async with asyncio.timeout(args.phase_cap):
                    await asyncio.gather(*[arrival(j) for j in range(args.arrivals)])
            except asyncio.TimeoutError:   # arrivals still waiting for a first token count as given up
                phase.failed = args.arrivals - len(phase.ttft)
        else:
            await asyncio.sleep(window_s)
        t1 = time.perf_counter()
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in servers:
            for p in s.servicer.first_tokens.history:
                if not p.replay and p.tokens >= args.prompt and p.predicted_s and p.took_s:
                    phase.predicted_over_took.append(p.predicted_s / p.took_s)
            await s.stop()
            s.engine.backend.close()
    for c in commits:
        phase.gaps += _window(c, t0, t1)
    return phase, t1 - t0


def _q(xs: list[float], q: float) -> float | None:
    return float(np.quantile(xs, q)) * 1e3 if xs else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="arrivals",
                   help="comma list: arrivals (the run above, default), or the long-prompt parts idle, cpu, "
                        "synthetic, edges, fleet (bench/long_prompts.py)")
    p.add_argument("--repeats", type=int, default=3, help="(long-prompt parts) repeats, modes interleaved")
    p.add_argument("--threads", type=int, default=1, help="(long-prompt parts) llama.cpp threads of the verifier "
                                                          "and of plain llama.cpp")
    p.add_argument("--prompts", default="200,800,1500", help="(cpu, synthetic) new sessions' prompt tokens")
    p.add_argument("--idle-prompt", type=int, default=1400, help="(idle, edges) the long prompt's tokens")
    p.add_argument("--window", type=float, default=4.0,
                   help="(cpu, synthetic) seconds the live edges' gaps are measured without an arrival")
    p.add_argument("--backend", choices=["synthetic", "llamacpp"], default="synthetic")
    p.add_argument("--edges", default="16", help="comma list of live edge counts")
    p.add_argument("--replicas", default="1", help="comma list of replica counts")
    p.add_argument("--arrivals", type=int, default=6, help="new sessions with long prompts, per run")
    p.add_argument("--every", type=float, default=2.0, help="seconds between two arrivals")
    p.add_argument("--prompt", type=int, default=1500, help="an arrival's prompt tokens")
    p.add_argument("--live-tokens", type=int, default=64, help="tokens of each live generation (then a new one)")
    p.add_argument("--arrival-wait", type=float, default=60.0,
                   help="seconds an arrival waits out refusals before it gives up")
    p.add_argument("--arrival-ttft-ms", type=float, default=0.0,
                   help="the arrivals' own TTFT target (0: none, the verifier's default of 10 s applies)")
    p.add_argument("--phase-cap", type=float, default=240.0,
                   help="seconds the arrivals of one phase may take in all; those without a first token by then "
                        "count as given up")
    p.add_argument("--name", default=None, help="result name (default first-tokens-BACKEND)")
    p.add_argument("--note", default="shared 2-core VM, five jobs at once")
    args = p.parse_args()
    load_start = [round(x, 2) for x in os.getloadavg()]
    print(f"# {summary()}\n# load {load_start}")
    parts = [x for x in args.parts.split(",") if x]
    if parts != ["arrivals"]:
        import long_prompts
        long_prompts.run(args, parts, load_start)
        return
    rows = []
    for edges in [int(x) for x in args.edges.split(",")]:
        for replicas in [int(x) for x in args.replicas.split(",")]:
            for fixed in (False, True):
                target = Target(args.backend, sessions=edges + args.arrivals + 4, fixed=fixed)
                rule = "fixed chunk" if fixed else "live first"
                with_, span = asyncio.run(run_phase(target, args, edges, replicas, True, None))
                without, _ = asyncio.run(run_phase(target, args, edges, replicas, False, span))
                for label, ph in (("without", without), ("with", with_)):
                    row = [edges, replicas, rule, label, len(ph.gaps), _q(ph.gaps, 0.5), _q(ph.gaps, 0.95),
                           max(ph.gaps) * 1e3 if ph.gaps else None]
                    if label == "with":
                        row += [len(ph.ttft), statistics.median(ph.ttft) if ph.ttft else None,
                                max(ph.ttft) if ph.ttft else None, ph.refused, ph.failed,
                                statistics.median(ph.predicted_over_took) if ph.predicted_over_took else None]
                    else:
                        row += [None] * 6
                    rows.append(row)
                    print(row, flush=True)
                _write(args, rows, load_start)   # after every pair of phases: a run cut short keeps its rows
    print(_write(args, rows, load_start).render())


def _write(args, rows: list, load_start: list[float]) -> Table:
    columns = ["edges", "replicas", "schedule", "arrivals", "gaps", "p50 ms", "p95 ms", "max ms", "first tokens",
               "TTFT p50 s", "TTFT max s", "refused", "gave up", "predicted / took"]
    table = Table(columns, rows, {"p50 ms": "{:.0f}", "p95 ms": "{:.0f}", "max ms": "{:.0f}",
                                  "TTFT p50 s": "{:.1f}", "TTFT max s": "{:.1f}", "predicted / took": "{:.2f}"})
    write_result(args.name or f"first-tokens-{args.backend}", tables={"live-and-arrivals": table},
                 load_start=load_start, note=args.note)
    return table


if __name__ == "__main__":
    main()

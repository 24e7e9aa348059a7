"""How soon a busy verifier says so: the time from a new session's request to its refusal with a
retry hint, while live edges generate and another session's long prompt is being prefilled.

    PYTHONPATH=$PWD python bench/hint_latency.py --backend llamacpp    # bundled target, 1 thread
    PYTHONPATH=$PWD python bench/hint_latency.py --backend synthetic   # the flat GPU-like target

One in-process verifier (batching, live rounds first, admission as one replica of a fleet:
`--admission refuse`, so that a session past its target is refused rather than queued) serves
`--edges` live edges;
one session with a `--long`-token prompt arrives (no TTFT target of its own: the verifier's default
applies, so it is admitted and prefilled); then `--probes` new sessions, one every `--every` seconds,
each with a `--prompt`-token prompt and a TTFT target of `--slo-ms`, on an edge that does not wait
out refusals (`Transport.max_wait_s` 0). Each probe is either admitted (its first token's time is
counted) or refused: the time from its request to the refusal, the status and the retry hint are
counted. Printed and written to bench/results/first-tokens-hint-<backend>.json.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cloud_verifier.admission import ServerPolicy  # noqa: E402
from cloud_verifier.engine import Limits  # noqa: E402
from cloud_verifier.server import VerifierServer  # noqa: E402
from edge_client import EdgeClient  # noqa: E402
from edge_client.options import EdgeOptions, Speculation, Transport  # noqa: E402
from edge_client.transport import EdgeError  # noqa: E402
from first_tokens import Target  # noqa: E402
from hybridspec.figures import Figure, write_result  # noqa: E402
from hybridspec.machine import summary  # noqa: E402
from spec_core.warping import SamplingSettings  # noqa: E402


async def run(args) -> dict:
    target = Target(args.backend, sessions=args.edges + args.probes + 4, fixed=False)
    limits = Limits(max_sessions=target.sessions, default_max_new_tokens=256)
    server = await VerifierServer(target.backend(), "127.0.0.1", 0, limits, grace_s=0.5,
                                  policy=ServerPolicy(evict_idle_after_s=5.0, admission="refuse")).start()
    address = f"127.0.0.1:{server.port}"
    stop, commits = asyncio.Event(), [0] * args.edges
    refusals: list[tuple[float, str, float | None]] = []   # (seconds to the refusal, status, hint s)
    admitted: list[float] = []                              # probes admitted: their first token (s)

    def client(slo_ms: float = 0.0, **transport) -> EdgeClient:
        opts = EdgeOptions(Transport(address, deadline_s=120, **transport), Speculation(gamma=4, slo_ttft_ms=slo_ms))
        return EdgeClient(opts, target.drafter(), target.tokenizer)

    async def live(k: int) -> None:
        async with client() as c:
            n = 0
            while not stop.is_set():
                gen = c.generate(target.prompt(np.random.default_rng([k, n]), 16),
                                 SamplingSettings(temperature=0.0, max_new_tokens=32, ignore_eos=True))
                await gen.text()
                commits[k] += 1
                n += 1

    async def long_prompt() -> None:
        async with client() as c:
            gen = c.generate(target.prompt(np.random.default_rng(99), args.long),
                             SamplingSettings(temperature=0.0, max_new_tokens=4, ignore_eos=True))
            await gen.text()

    async def probe(j: int) -> None:
        async with client(args.slo_ms, max_wait_s=0.0) as c:
            t0 = time.perf_counter()
            gen = c.generate(target.prompt(np.random.default_rng([7, j]), args.prompt),
                             SamplingSettings(temperature=0.0, max_new_tokens=2, ignore_eos=True))
            try:
                await gen.text()
                admitted.append(gen.stats.ttft_s)
            except EdgeError as e:
                refusals.append((time.perf_counter() - t0, e.code.name, e.retry_after_s))

    tasks = [asyncio.ensure_future(live(k)) for k in range(args.edges)]
    try:
        while not all(commits):
            await asyncio.sleep(0.1)
        busy = asyncio.ensure_future(long_prompt())
        await asyncio.sleep(args.every)
        for j in range(args.probes):
            await probe(j)
            await asyncio.sleep(args.every)
        long_done = busy.done()
        busy.cancel()
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.stop()
        server.engine.backend.close()
    return {"refusals": refusals, "admitted": admitted, "long_done": long_done}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["synthetic", "llamacpp"], default="llamacpp")
    p.add_argument("--edges", type=int, default=8, help="live edges")
    p.add_argument("--long", type=int, default=1500, help="the long prompt that keeps the verifier busy (tokens)")
    p.add_argument("--probes", type=int, default=10)
    p.add_argument("--every", type=float, default=0.5, help="seconds between two probes")
    p.add_argument("--prompt", type=int, default=400, help="a probe's prompt (tokens)")
    p.add_argument("--slo-ms", type=float, default=300.0, help="a probe's TTFT target")
    p.add_argument("--note", default="shared 2-core VM")
    args = p.parse_args()
    load_start = [round(x, 2) for x in os.getloadavg()]
    print(f"# {summary()}\n# load {load_start}")
    got = asyncio.run(run(args))
    times = [t for t, _, _ in got["refusals"]]
    hints = [h for _, _, h in got["refusals"] if h is not None]
    print({"refused": len(times), "statuses": sorted({s for _, s, _ in got["refusals"]}),
           "refusal ms p50/max": [round(statistics.median(times) * 1e3, 1), round(max(times) * 1e3, 1)] if times else None,
           "hints s": [round(h, 2) for h in hints], "admitted": len(got["admitted"]),
           "long prompt still prefilling at the end": not got["long_done"]})
    setup = (f"bench/hint_latency.py --backend {args.backend}: {args.edges} live edges, a {args.long}-token prompt "
             f"prefilling, probes of {args.prompt} tokens with a TTFT target of {args.slo_ms:g} ms")
    figures = {"probes-refused": Figure(len(times), f"probes refused with a retry hint, of {args.probes}", setup, "",
                                        "{:d}"),
               "probes-admitted": Figure(len(got["admitted"]), f"probes admitted, of {args.probes}", setup, "", "{:d}")}
    if times:
        figures["refusal-p50-ms"] = Figure(round(statistics.median(times) * 1e3, 1),
                                           "time from a probe's request to its refusal, median", setup, "ms", "{:.0f} ms")
        figures["refusal-max-ms"] = Figure(round(max(times) * 1e3, 1),
                                           "time from a probe's request to its refusal, the longest", setup, "ms",
                                           "{:.0f} ms")
    print(write_result(f"first-tokens-hint-{args.backend}", figures=figures, load_start=load_start, note=args.note))


if __name__ == "__main__":
    main()

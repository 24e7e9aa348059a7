"""Long prompts served at once: both sides of each trade-off, side by side in one run (the parts of
bench/first_tokens.py's `--parts`; one result file, bench/results/long-prompts.json).

    PYTHONPATH=$PWD python bench/first_tokens.py --parts idle,cpu,synthetic,edges,fleet --repeats 3

- idle: one user on an idle verifier (the bundled target on llama.cpp, `--threads`, batching as
  `cloud-verifier serve` runs it): the first token of a `--idle-prompt`-token prompt, an edge with
  no draft model (prompt lookup), against plain llama.cpp's prefill of the same ids on the same
  threads (a context with llama.cpp's default batch sizes) and against the batch-invariant
  prefill the verifier runs (decodes below 64 tokens, flash attention on), each repeat in a new
  order; refusals (there must be none) and whether the open was queued.
- cpu / synthetic: one live edge on the CPU target (its drafts from the bundled draft model, so its
  rounds leave the verifier idle while it drafts) / 16 live edges on the synthetic batching target
  (20 ms + 0.05 ms a token a pass, synthetic drafts). The live edges run in a process of their own
  and generate for `--window` s with no arrival (their gaps between commits: "alone"), then a new
  session (an edge in this process, beside the verifier) with a prompt of each of
  `--prompts` tokens arrives (its first token, and the live edges' gaps until then: "beside").
  Its time alone comes from a fresh verifier with nobody live. Ratios: first token beside / alone,
  and the live edges' p95 gap beside / alone.
- edges: the issue's case with real drafting on both edges: one edge generating (bundled draft),
  another with a `--idle-prompt`-token prompt arriving 2 s later; its first token beside / alone,
  refusals.
- fleet: two synthetic replicas with 8 live edges each; sixteen new sessions with 1,500-token
  prompts and a first-token target of 600 ms arrive 0.01 s apart on edges that list both replicas
  (each its own first). Per refused session: refusals in a row (at most two), and for those that waited out
  a hint (place held), the first token predicted at the refusal against the time it came.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from cloud_verifier.admission import ServerPolicy
from cloud_verifier.engine import Limits
from cloud_verifier.server import VerifierServer
from edge_client import EdgeClient
from edge_client.options import EdgeOptions, Speculation, Transport
from edge_client.transport import replica_targets
from hybridspec.figures import Figure, Table, write_result
from spec_core.warping import SamplingSettings

RESULT = "long-prompts"
SYNTHETIC_LIVE, FLEET_LIVE, FLEET_ARRIVALS, FLEET_EVERY_S, FLEET_TTFT_MS, FLEET_PROMPT = 16, 8, 16, 0.01, 600.0, 1500


def _q(xs: list[float], q: float) -> float | None:
    return float(np.quantile(xs, q)) if xs else None


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _client(target, server: str, drafter: str = "lookup", on_round=None, ttft_ms: float = 0.0) -> EdgeClient:
    opts = EdgeOptions(Transport(server, deadline_s=120, max_wait_s=120), Speculation(gamma=4, slo_ttft_ms=ttft_ms))
    if drafter == "gguf":
        from edge_client.drafters import DEFAULT_DRAFT, GGUFDrafter
        d = GGUFDrafter(str(DEFAULT_DRAFT), n_threads=1)
        return EdgeClient(opts, d, d.model, on_round=on_round)
    return EdgeClient(opts, target.drafter(), target.tokenizer, on_round=on_round)


def _live_main(kind: str, lists: list[str], n: int, drafter: str, tokens: int, pipe) -> None:
    """The live edges' process: `n` edges generate until "stop" comes down `pipe`; "warm" goes up
    once each has committed twice, then their commit times (time.perf_counter: CLOCK_MONOTONIC,
    the same clock as the parent's)."""
    from first_tokens import Target
    target = Target(kind, sessions=1, fixed=False)
    commits: dict[int, list[float]] = {k: [] for k in range(n)}

    async def live(k: int) -> None:
        on_round = lambda _ev: commits[k].append(time.perf_counter())   # noqa: E731
        async with _client(target, lists[k % len(lists)], drafter, on_round) as c:
            j = 0
            while not stop.is_set():
                gen = c.generate(target.prompt(np.random.default_rng([k, j]), 16),
                                 SamplingSettings(temperature=0.0, max_new_tokens=tokens, ignore_eos=True))
                try:
                    await gen.text()
                except Exception as e:  # noqa: BLE001 - a live edge that failed starts a new generation
                    print(f"live edge {k}: {e!r}", file=sys.stderr, flush=True)
                    await asyncio.sleep(0.5)
                j += 1

    stop = asyncio.Event()

    async def main() -> None:
        tasks = [asyncio.ensure_future(live(k)) for k in range(n)]
        t0 = time.monotonic()
        # Warm: every edge has committed twice, or after 30 s all but an eighth (one stuck edge, seen
        # on a loaded machine, must not hold the run up: its gaps are simply missing).
        while (ready := sum(1 for c in commits.values() if len(c) >= 2)) < n:
            if any(t.done() for t in tasks) or time.monotonic() - t0 > 600:
                pipe.send(f"not warm: {[len(c) for c in commits.values()]} commits, "
                          f"{[repr(t.exception()) for t in tasks if t.done()][:2]}")
                return
            if time.monotonic() - t0 > 30 and ready >= n - n // 8:
                print(f"live edges warm but {n - ready}: commits {[len(c) for c in commits.values()]}",
                      file=sys.stderr, flush=True)
                break
            await asyncio.sleep(0.05)
        pipe.send("warm")
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, pipe.recv)
        # Stop between generations (a cancelled one waits for its session's Close up to its deadline);
        # the commit times go up as soon as they are in, and whatever has not ended by then is left.
        stop.set()
        await asyncio.wait(tasks, timeout=30)
        pipe.send(commits)
        os._exit(0)
    asyncio.run(main())


class Bed:
    """Verifier replicas of one kind ("llamacpp": the bundled target, `threads`; "synthetic"), in
    this process, and the edges that talk to them."""

    def __init__(self, kind: str, threads: int = 1, replicas: int = 1, sessions: int = 24,
                 policy: ServerPolicy = ServerPolicy()):
        from first_tokens import Target
        self.kind, self.threads, self.replicas, self.policy = kind, threads, replicas, policy
        self.target = Target(kind, sessions=sessions, fixed=False)
        self.servers: list[VerifierServer] = []
        self.commits: dict[int, list[float]] = {}
        self._live = None   # (process, pipe) of the live edges

    def backend(self):
        if self.kind == "llamacpp":
            from cloud_verifier.backends.llama_cpp import LlamaCppBackend
            return LlamaCppBackend(self.target.model_path, n_ctx=2048, n_threads=self.threads, batching=True)
        return self.target.backend()

    async def __aenter__(self) -> "Bed":
        limits = Limits(max_sessions=self.target.sessions, default_max_new_tokens=1024)
        for _ in range(self.replicas):
            self.servers.append(await VerifierServer(self.backend(), "127.0.0.1", 0, limits, grace_s=0.5,
                                                     policy=self.policy).start())
        self.lists = replica_targets(",".join(f"127.0.0.1:{s.port}" for s in self.servers))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop_live()
        for s in self.servers:
            await s.stop()
            s.engine.backend.close()

    def client(self, k: int, drafter: str = "lookup", on_round=None, ttft_ms: float = 0.0) -> EdgeClient:
        return _client(self.target, self.lists[k % len(self.lists)], drafter, on_round, ttft_ms)

    def prompt(self, seed, n: int) -> list[int]:
        return self.target.prompt(np.random.default_rng(seed), n)

    async def start_live(self, n: int, drafter: str = "lookup", tokens: int = 64) -> None:
        """`n` edges generating `tokens` at a time, again and again, in a process of their own (so
        that their rounds do not queue in this process's event loop beside the verifier's and the
        arrival's), until `stop_live`; returns once each has committed twice."""
        ctx = multiprocessing.get_context("spawn")
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_live_main, args=(self.kind, self.lists, n, drafter, tokens, there), daemon=True)
        proc.start()
        there.close()   # the child's end: a child that dies ends this side's recv (EOFError)
        self._live = (proc, here)
        said = await asyncio.get_running_loop().run_in_executor(None, here.recv)
        if said != "warm":
            raise RuntimeError(f"the live edges did not start: {said}")

    async def stop_live(self) -> None:
        if self._live is None:
            return
        proc, pipe = self._live
        self._live = None
        try:
            pipe.send("stop")
            self.commits = await asyncio.get_running_loop().run_in_executor(None, pipe.recv)
        except (OSError, EOFError):   # the process ended already (its edges did not start)
            pass
        proc.join(30)
        if proc.is_alive():
            proc.kill()

    def gaps(self, t0: float, t1: float) -> list[float]:
        """The live edges' seconds between commits within [t0, t1] (after stop_live)."""
        return [b - a for c in self.commits.values() for a, b in zip(c, c[1:]) if t0 <= a and b <= t1]

    async def arrival(self, ids: list[int], k: int = 1000, drafter: str = "lookup", ttft_ms: float = 0.0) -> dict:
        """A new session with prompt `ids` (4 tokens): its first token, refusals, queued prediction."""
        async with self.client(k, drafter, ttft_ms=ttft_ms) as c:
            gen = c.generate(ids, SamplingSettings(temperature=0.0, max_new_tokens=4, ignore_eos=True))
            await gen.text()
        st = gen.stats
        return {"ttft": st.ttft_s, "refused": st.backoffs, "queued": st.queued_s or None}

    async def warm(self) -> None:
        """One short session, closed (so it is not live): the passes' cost is measured."""
        await self.arrival(self.prompt([99], 16), k=999)


# --- idle: one user on an idle verifier --------------------------------------------------------------

def plain_prefill_s(model, ids: list[int], threads: int) -> float:
    """Plain llama.cpp: a context with its default batch sizes (one decode per n_batch, ubatches of
    n_ubatch), the same threads; the last position's logits."""
    import llama_cpp
    from llama_runtime.lowlevel import fill_batch
    from spec_core.batchplan import PassItem
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = len(ids) + 16
    params.n_threads = params.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model.handle, params)
    n_batch = int(params.n_batch)
    batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
    try:
        t0 = time.perf_counter()
        for start in range(0, len(ids), n_batch):
            part = ids[start:start + n_batch]
            fill_batch(batch, [PassItem(0, start + i, t, start + i == len(ids) - 1) for i, t in enumerate(part)])
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
        llama_cpp.llama_get_logits_ith(ctx, -1)
        return time.perf_counter() - t0
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)


def invariant_prefill_s(model, ids: list[int]) -> float:
    """The verifier's batch-invariant evaluation of the same ids (KVContext, invariant): decodes of
    the model's probed cut (below 64 tokens), flash attention on."""
    ctx = model.new_context(len(ids) + 16, 512, invariant=True)
    try:
        t0 = time.perf_counter()
        ctx.logits(ids, 1)
        return time.perf_counter() - t0
    finally:
        ctx.close()


async def served_first_token(args, ids: list[int]) -> dict:
    async with Bed("llamacpp", args.threads) as bed:
        await bed.warm()
        out = await bed.arrival(ids)
        out["refused"] += bed.servers[0].servicer.first_tokens.refused
        return out


def part_idle(args) -> tuple[Table, dict]:
    from llama_runtime import GGUFModel
    bed_target = Bed("llamacpp").target
    model = GGUFModel(bed_target.model_path, n_threads=args.threads)
    rows, ratios = [], []
    for rep in range(args.repeats):
        ids = bed_target.prompt(np.random.default_rng([7, rep]), args.idle_prompt)
        modes = ["plain", "invariant", "served"]
        modes = modes[rep % 3:] + modes[:rep % 3]
        got = {}
        for mode in modes:
            if mode == "plain":
                got[mode] = plain_prefill_s(model, ids, args.threads)
            elif mode == "invariant":
                got[mode] = invariant_prefill_s(model, ids)
            else:
                got[mode] = asyncio.run(served_first_token(args, ids))
        served = got["served"]
        row = [rep + 1, got["plain"], got["invariant"], served["ttft"], served["ttft"] / got["plain"],
               got["invariant"] / got["plain"], served["refused"], served["queued"]]
        ratios.append(row[4])
        rows.append(row)
        print("idle", row, flush=True)
    model.close()
    table = Table(["repeat", "plain llama.cpp s", "invariant s", "first token s", "first token / plain",
                   "invariant / plain", "refused", "queued s"], rows,
                  {"plain llama.cpp s": "{:.2f}", "invariant s": "{:.2f}", "first token s": "{:.2f}",
                   "first token / plain": "{:.2f}", "invariant / plain": "{:.2f}", "queued s": "{:.1f}"})
    setup = f"bundled SmolLM2 target, {args.idle_prompt}-token prompt, {args.threads} thread(s), idle verifier"
    figs = {"idle-first-token-over-plain": Figure(_median(ratios), "first token over plain llama.cpp's prefill, median",
                                                  setup, "x", "{:.2f}×"),
            "idle-refused": Figure(sum(r[6] for r in rows), "refusals of a lone user", setup, "", "{}")}
    return table, figs


# --- cpu / synthetic: a new session beside live sessions --------------------------------------------

@dataclass
class Beside:
    alone: list[float] = field(default_factory=list)
    beside: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    gaps_alone: list[float] = field(default_factory=list)
    gaps_beside: list[float] = field(default_factory=list)
    refused: int = 0
    queued: int = 0


async def _alone(kind: str, args, ids: list[int], drafter: str = "lookup") -> dict:
    async with Bed(kind, args.threads) as bed:
        await bed.warm()
        return await bed.arrival(ids, drafter=drafter)


async def _beside(kind: str, args, ids: list[int], live: int, live_drafter: str, arrival_drafter: str = "lookup",
                  window_s: float | None = None) -> tuple[dict, list[float], list[float]]:
    async with Bed(kind, args.threads, sessions=live + 8) as bed:
        await bed.start_live(live, live_drafter, tokens=600 if arrival_drafter == "gguf" else 64)
        t0 = time.perf_counter()
        await asyncio.sleep(args.window if window_s is None else window_s)
        t1 = time.perf_counter()
        out = await bed.arrival(ids, drafter=arrival_drafter)
        t2 = time.perf_counter()
        out["refused"] += bed.servers[0].servicer.first_tokens.refused
        await bed.stop_live()
        return out, bed.gaps(t0, t1), bed.gaps(t1, t2)


def part_beside(args, kind: str) -> tuple[Table, dict]:
    live, live_drafter = (1, "gguf") if kind == "llamacpp" else (SYNTHETIC_LIVE, "lookup")
    prompts = [int(x) for x in args.prompts.split(",")]
    got = {p: Beside() for p in prompts}
    for rep in range(args.repeats):
        for j, p in enumerate(prompts[rep % len(prompts):] + prompts[:rep % len(prompts)]):
            ids = Bed(kind).prompt([11, rep, p], p)
            order = ("alone", "beside") if (rep + j) % 2 == 0 else ("beside", "alone")
            for which in order:
                if which == "alone":
                    alone = asyncio.run(_alone(kind, args, ids))
                else:
                    beside, g0, g1 = asyncio.run(_beside(kind, args, ids, live, live_drafter))
            b = got[p]
            b.alone.append(alone["ttft"])
            b.beside.append(beside["ttft"])
            b.ratios.append(beside["ttft"] / alone["ttft"])
            b.gaps_alone += g0
            b.gaps_beside += g1
            b.refused += alone["refused"] + beside["refused"]
            b.queued += bool(beside["queued"])
            print(kind, p, rep, round(alone["ttft"], 3), round(beside["ttft"], 3), len(g0), len(g1), flush=True)
    rows = []
    for p in prompts:
        b = got[p]
        p95_0, p95_1 = _q(b.gaps_alone, 0.95), _q(b.gaps_beside, 0.95)
        rows.append([p, _median(b.alone), _median(b.beside), _median(b.ratios), len(b.gaps_alone),
                     p95_0 and p95_0 * 1e3, len(b.gaps_beside), p95_1 and p95_1 * 1e3, _ratio(p95_1, p95_0), b.refused,
                     b.queued])
    table = Table(["prompt tokens", "first token alone s", "beside s", "beside / alone", "gaps alone",
                   "live p95 alone ms", "gaps beside", "live p95 beside ms", "p95 beside / alone", "refused",
                   "queued"], rows,
                  {"first token alone s": "{:.2f}", "beside s": "{:.2f}", "beside / alone": "{:.2f}",
                   "live p95 alone ms": "{:.0f}", "live p95 beside ms": "{:.0f}", "p95 beside / alone": "{:.2f}"})
    name = "cpu" if kind == "llamacpp" else "synthetic"
    setup = ("bundled SmolLM2 target, 1 live edge drafting with the bundled draft" if kind == "llamacpp"
             else f"synthetic batching target (20 ms + 0.05 ms a token), {SYNTHETIC_LIVE} live edges")
    figs = {f"{name}-worst-first-token-ratio": Figure(max((r[3] for r in rows if r[3] is not None), default=None),
                                                      "a new session's first token beside live sessions over alone, "
                                                      "worst prompt size", setup, "x", "{:.2f}×"),
            f"{name}-worst-live-p95-ratio": Figure(max((r[8] for r in rows if r[8] is not None), default=None),
                                                   "live sessions' p95 gap between commits beside a prefill over "
                                                   "without, worst prompt size", setup, "x", "{:.2f}×")}
    return table, figs


# --- edges: the 1,400-token edge beside a generating edge --------------------------------------------

def part_edges(args) -> tuple[Table, dict]:
    rows, ratios, refused = [], [], 0
    for rep in range(args.repeats):
        ids = Bed("llamacpp").prompt([13, rep], args.idle_prompt)
        order = ("alone", "beside") if rep % 2 == 0 else ("beside", "alone")
        for which in order:
            if which == "alone":
                alone = asyncio.run(_alone("llamacpp", args, ids, drafter="gguf"))
            else:
                beside, _, _ = asyncio.run(_beside("llamacpp", args, ids, 1, "gguf", arrival_drafter="gguf",
                                                   window_s=2.0))
        ratio = beside["ttft"] / alone["ttft"]
        ratios.append(ratio)
        refused += alone["refused"] + beside["refused"]
        rows.append([rep + 1, alone["ttft"], beside["ttft"], ratio, beside["refused"], beside["queued"]])
        print("edges", rows[-1], flush=True)
    table = Table(["repeat", "first token alone s", "beside a generating edge s", "beside / alone", "refused",
                   "queued s"], rows, {"first token alone s": "{:.2f}", "beside a generating edge s": "{:.2f}",
                                        "beside / alone": "{:.2f}", "queued s": "{:.1f}"})
    setup = f"bundled pair, {args.idle_prompt}-token prompt, both edges drafting with the bundled draft, 1 thread each"
    return table, {"edges-first-token-ratio": Figure(_median(ratios), "the long-prompt edge's first token beside a "
                                                     "generating edge over alone, median", setup, "x", "{:.2f}×"),
                   "edges-refused": Figure(refused, "refusals of the long-prompt edge", setup, "", "{}")}


# --- fleet: hints and refusals in a row --------------------------------------------------------------

async def _fleet(args, rep: int) -> list[list]:
    policy = ServerPolicy(evict_idle_after_s=5.0)
    async with Bed("synthetic", replicas=2, sessions=FLEET_LIVE * 2 + FLEET_ARRIVALS + 4, policy=policy) as bed:
        await bed.start_live(2 * FLEET_LIVE)
        await asyncio.sleep(1.0)

        async def one(j: int) -> dict:
            await asyncio.sleep(FLEET_EVERY_S * j)
            return await bed.arrival(bed.prompt([17, rep, j], FLEET_PROMPT), k=j, ttft_ms=FLEET_TTFT_MS)
        await asyncio.gather(*[one(j) for j in range(FLEET_ARRIVALS)])
        refusals, served = {}, {}
        for s in bed.servers:
            for h in s.servicer.first_tokens.refusals:
                refusals.setdefault(h.key, []).append(h)
            for p in s.servicer.first_tokens.history:
                if p.key:
                    served[p.key] = p
    rows = []
    for key, hs in refusals.items():
        hs.sort(key=lambda h: h.t_refused)
        last, p = hs[-1], served.get(key)
        waited = None if p is None else p.t_admit - last.t_refused
        came = None if p is None or p.t_done is None else p.t_done - last.t_refused
        waited_hint = waited is not None and waited >= 0.5 * last.hint_s
        rows.append([rep + 1, len(hs), last.hint_s, last.predicted_s, waited, came,
                     _ratio(came, last.predicted_s) if waited_hint else None])
    return rows


def part_fleet(args) -> tuple[Table, dict]:
    rows = []
    for rep in range(args.repeats):
        got = asyncio.run(_fleet(args, rep))
        rows += got
        print("fleet", got, flush=True)
    waited = [r[6] for r in rows if r[6] is not None]
    table = Table(["repeat", "refusals in a row", "last hint s", "predicted first token s", "came back after s",
                   "first token after s", "first token / predicted"], rows,
                  {"last hint s": "{:.2f}", "predicted first token s": "{:.2f}", "came back after s": "{:.2f}",
                   "first token after s": "{:.2f}", "first token / predicted": "{:.2f}"})
    setup = (f"2 synthetic replicas, {FLEET_LIVE} live edges each, {FLEET_ARRIVALS} arrivals of {FLEET_PROMPT} "
             f"tokens {FLEET_EVERY_S:g} s apart, target {FLEET_TTFT_MS:.0f} ms")
    return table, {
        "fleet-max-refusals-in-a-row": Figure(max((r[1] for r in rows), default=0), "most refusals in a row of one "
                                              "session", setup, "", "{}"),
        "fleet-within-20pc": Figure(sum(abs(x - 1) <= 0.2 for x in waited) / len(waited) if waited else None,
                                    "share of sessions that waited out a hint whose first token came within 20 % of "
                                    "the prediction", setup, "", "{:.0%}")}


PARTS = {"idle": part_idle, "cpu": lambda a: part_beside(a, "llamacpp"),
         "synthetic": lambda a: part_beside(a, "synthetic"), "edges": part_edges, "fleet": part_fleet}


def run(args, parts: list[str], load_start: list[float]) -> None:
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise SystemExit(f"unknown parts {unknown}; known: {', '.join(PARTS)}")
    tables, figures = {}, {}
    for part in parts:
        table, figs = PARTS[part](args)
        tables[part] = table
        figures.update({k: f for k, f in figs.items() if f.value is not None})   # a figure is a number
        # after every part: a run cut short keeps what it measured
        write_result(RESULT, tables=tables, figures=figures, load_start=load_start, note=args.note)
        print(table.render(), flush=True)

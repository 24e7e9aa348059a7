"""`netsim calibrate`: measure a pair's and a verifier's costs on this machine and write the cost table
the virtual clock reads (netsim.virtual.costs).

What it measures, each as the experiment runs it (one llama.cpp thread each side by default):

  drafting        the pair's drafter (the CrossVocabDrafter for a draft of another tokenizer) after a
                  committed sequence that grows two tokens a call, γ in 1..8: a line over rows; and
                  the experiment's tree (16 nodes, depth 4): its time a row past the call's base.
  the pass        the target behind the shipped batcher (llama.cpp, batching on): rounds of k drafts
                  (k + 1 tokens, k + 1 rows read), kept as the round curve, and prompts of P tokens
                  (one row read), whose tokens past the first give the prefill cost a token; each point
                  a median. A plane base + per_token·tokens + per_row·rows over both is kept beside.
  the maths       the backend's acceptance over k + 1 rows at T 0.7, top-p 0.95, with the draft's q.
  the host path   one synthetic round per token (no model time) through a verifier process and
                  netsim's proxy on an empty link, as the wall-clock experiment runs it: the edge's
                  share is the round trip less the server's own time, the verifier's its own time;
                  and the cloud-only stream's time per token.

Quiet gate: the 1-minute load per core must be at most 0.5 at the start and at the end, else the
command refuses (exit 3), unless --busy-ok, which writes the table marked busy (never publish one).
"""
from __future__ import annotations

import asyncio
import datetime as _dt
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from netsim.virtual.costs import CostTable, EdgeCosts, VerifierCosts

QUIET_LOAD_PER_CORE = 0.5
GAMMAS = (1, 2, 4, 8)
ROUND_DRAFTS = (0, 1, 2, 4, 8, 12, 16)
PROMPTS = (32, 64, 128, 256)
REPEATS = 7


class NotQuiet(RuntimeError):
    pass


def load_per_core() -> float:
    return os.getloadavg()[0] / (os.cpu_count() or 1)


def _line(xs, ys) -> tuple[float, float]:
    """Least squares y = a + b·x, both >= 0 (a negative intercept is noise: through the origin)."""
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    b, a = np.polyfit(x, y, 1)
    if a < 0:
        return 0.0, float((x @ y) / (x @ x))
    return float(a), max(float(b), 0.0)


def _timed(fn, repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_drafting(drafter, prompt_ids: list[int], say) -> dict:
    """Median seconds of a propose(γ) call after two more committed tokens, per γ; the line."""
    from spec_core.drafting import QMode
    from spec_core.warping import SamplingSettings
    settings, qmode = SamplingSettings(temperature=0.7, top_p=0.95, seed=1), QMode("fixed", 16, 16)
    rng = np.random.default_rng(1)
    seq = list(prompt_ids)
    drafter.propose(seq, 4, settings, qmode, rng)   # warm: the prompt into the draft's cache
    points = []
    for gamma in GAMMAS:
        say(f"drafting: γ {gamma}")
        times = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            d = drafter.propose(seq, gamma, settings, qmode, rng)
            times.append(time.perf_counter() - t0)
            seq += (d.tokens + [d.tokens[-1] if d.tokens else 1])[:2]   # two committed, as an accepted round
        points.append((gamma, statistics.median(times)))
    base, per_row = _line([g for g, _ in points], [t for _, t in points])
    out = {"draft_base_s": base, "draft_row_s": per_row, "points": points}
    if getattr(drafter, "supports_trees", False):
        from spec_core.tree import TreeShape
        say("drafting: the experiment's tree (16 nodes, depth 4, 2 children, 2 expanded a level)")
        times, rows = [], []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            d = drafter.propose_tree(seq, TreeShape(16, 4, 2, 2), settings, qmode, rng)
            times.append(time.perf_counter() - t0)
            rows.append(d.rows)
            seq += (d.tokens[:2] if d.tokens else [1, 1])
        out["tree_points"] = list(zip(rows, times))
        out["draft_tree_row_s"] = max(0.0, (statistics.median(times) - base) / max(statistics.median(rows), 1))
    return out


def measure_pass(backend, prompt_ids: list[int], drafts: list[int], say) -> dict:
    """The batcher's passes timed where they run (its packer's decode), over rounds and prompts."""
    batcher = backend.batcher
    packer, seen = batcher.packer, []

    class Timed:
        def __getattr__(self, name):
            return getattr(packer, name)

        def decode(self, items):
            t0 = time.perf_counter()
            out = packer.decode(items)
            seen.append((len(items), sum(1 for it in items if it.want_logits), time.perf_counter() - t0))
            return out
    batcher.packer = Timed()
    points = []
    try:
        state = backend.new_state()
        base = list(prompt_ids[:64])
        backend.target_logits(state, base, 1)
        for k in ROUND_DRAFTS:
            say(f"the pass: a round of {k} drafts")
            got = []
            for _ in range(REPEATS):
                seen.clear()
                backend.target_logits(state, base + drafts[:k], k + 1)
                got.append(sum(s for _, _, s in seen))
            points.append((k + 1, k + 1, statistics.median(got)))
        backend.release(state)
        for n in PROMPTS:
            say(f"the pass: a prompt of {n} tokens")
            got = []
            for _ in range(3):
                state = backend.new_state()
                seen.clear()
                backend.target_logits(state, (prompt_ids * (n // max(len(prompt_ids), 1) + 1))[:n], 1)
                got.append(sum(s for _, _, s in seen))
                backend.release(state)
            points.append((n, 1, statistics.median(got)))
    finally:
        batcher.packer = packer
    a = np.array([[1.0, t, r] for t, r, _ in points])
    y = np.array([s for _, _, s in points])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    base_s, per_token_s, per_row_s = (max(float(c), 0.0) for c in coef)
    # The rounds as measured (a CPU's round cost bends: batching rows is cheaper per row as they grow),
    # and the prompts' tokens past the one row read, by least squares through the round of one row.
    curve = sorted((t, s) for t, r, s in points if t == r)
    curve = [(t, max(s for _, s in curve[: k + 1])) for k, (t, _) in enumerate(curve)]   # more rows never cost less
    one = curve[0][1]
    prompts = [(t - 1, s - one) for t, r, s in points if r == 1 and t > 1]
    prefill_s = max(0.0, sum(x * y for x, y in prompts) / sum(x * x for x, _ in prompts)) if prompts else per_token_s
    return {"base_s": base_s, "per_token_s": per_token_s, "per_row_s": per_row_s, "round_curve": curve,
            "prefill_token_s": prefill_s, "points": [list(p) for p in points]}


def measure_maths(backend, drafter, prompt_ids: list[int], say) -> dict:
    """The backend's acceptance (warping, accept/reject) over k + 1 rows with the draft's q."""
    from spec_core.drafting import QMode
    from spec_core.tree import DraftTree
    from spec_core.warping import SamplingSettings
    settings = SamplingSettings(temperature=0.7, top_p=0.95, seed=1)
    rng = np.random.default_rng(2)
    state = backend.new_state()
    points = []
    try:
        for k in (1, 4, 8, 16):
            say(f"the maths: {k + 1} rows")
            d = drafter.propose(list(prompt_ids), k, settings, QMode("fixed", 16, 16), rng)
            logits, _, _ = backend.target_logits(state, list(prompt_ids) + d.tokens, len(d.tokens) + 1)
            tree = DraftTree.chain(d.tokens)
            points.append((len(d.tokens) + 1, _timed(lambda: backend.accept(logits, tree, d.qs, settings, rng))))
    finally:
        backend.release(state)
    base, per_row = _line([r for r, _ in points], [s for _, s in points])
    return {"host_round_s": base, "host_row_s": per_row, "points": points}


async def _host_path(tokens: int = 64) -> dict:
    """Rounds and a stream without model time, through a verifier process and the proxy."""
    from edge_client.client import EdgeClient, stream_cloud_only
    from edge_client.drafters import SyntheticDrafter
    from edge_client.options import EdgeOptions, Speculation, Transport
    from edge_client.text import SyntheticTokenizer
    from hybridspec.launch import spawn_verifier
    from netsim.link import Link
    from netsim.profiles import Profile
    from netsim.proxy import LinkProxy
    from spec_core.proto import verifier_pb2_grpc as pb_grpc
    from spec_core.warping import SamplingSettings
    import grpc
    proc, address = spawn_verifier(["--backend", "synthetic", "--synthetic-vocab", "64", "--admit-ttft-ms", "0"])
    port = int(address.rsplit(":", 1)[-1])
    empty = Profile("empty", Link(()), Link(()), description="no effects", source="calibrate")
    thread = LinkProxy(upstream=("127.0.0.1", port), profile=empty, seed=0).start_in_thread()
    try:
        settings = SamplingSettings(temperature=0.7, top_p=0.95, max_new_tokens=tokens, seed=1, ignore_eos=True)
        events = []
        target = f"127.0.0.1:{thread.port}"
        async with grpc.aio.insecure_channel(target) as channel:
            options = EdgeOptions(Transport(target), Speculation(plan="off", gamma=1))
            for _ in range(3):
                events.clear()
                async with EdgeClient(options, SyntheticDrafter(64, 0, 1.0), SyntheticTokenizer(64), channel=channel,
                                      on_round=events.append) as client:
                    await client.generate([0, 5, 9, 11], settings).text()
            edge = statistics.median(e.rpc_s - e.server_s for e in events[1:])
            server = statistics.median(e.server_s for e in events[1:])
            streams = []
            for _ in range(3):
                st = await stream_cloud_only(pb_grpc.VerifierStub(channel), [0, 5, 9, 11], settings)
                streams.append((st.wall_s - st.ttft_s) / max(st.tokens - 1, 1))
        return {"edge_host_round_s": edge, "verifier_host_round_s": server, "stream_token_s": min(streams),
                "rounds": len(events)}
    finally:
        thread.stop()
        proc.terminate()
        proc.wait(30)


def calibrate(pair: str, target: str, draft: str, out: Path, threads: int = 1, busy_ok: bool = False,
              say=lambda what: None) -> CostTable:
    """Measure the pair and write its table to `out` (module docstring)."""
    from cloud_verifier.backends.llama_cpp import LlamaCppBackend
    from edge_client.drafters import GGUFDrafter
    from edge_client.text import render_chat
    from hybridspec.machine import describe
    from llama_runtime import GGUFModel

    start = load_per_core()
    if start > QUIET_LOAD_PER_CORE and not busy_ok:
        raise NotQuiet(f"the machine is busy ({start:.2f} runnable per core over the last minute, the limit is "
                       f"{QUIET_LOAD_PER_CORE}): stop what runs, or pass --busy-ok for a table marked busy")
    say("loading the models")
    target_vocab = GGUFModel(target, vocab_only=True)
    prompt = render_chat(target_vocab, "Write a Python function that reverses a list, and explain it step by step.")
    raw = GGUFDrafter(draft, n_threads=threads, max_tree_nodes=64)   # as the experiment's edge (trees on)
    drafter, draft_prompt = raw, prompt
    cross = target_vocab.fingerprint != raw.model.fingerprint
    if cross:
        from edge_client import crossvocab
        drafter = crossvocab.wrap(raw, raw.model, target_vocab.vocabulary)
        draft_prompt = render_chat(raw.model, "Write a Python function that reverses a list, and explain it step "
                                              "by step.")
        drafter.anchor_prompt(prompt, draft_prompt)
    drafting = measure_drafting(drafter, prompt, say)
    backend = LlamaCppBackend(target, n_threads=threads, batching=True)
    try:
        drafts = [int(t) for t in np.random.default_rng(3).integers(100, 1000, size=16)]
        pass_ = measure_pass(backend, prompt, drafts, say)
        maths = measure_maths(backend, drafter, prompt, say)
    finally:
        backend.close()
        raw.close()
    say("the host path: rounds and a stream through a verifier process and the proxy")
    host = asyncio.run(_host_path())
    end = load_per_core()
    busy = max(start, end) > QUIET_LOAD_PER_CORE
    if busy and not busy_ok:
        raise NotQuiet(f"the machine became busy ({end:.2f} runnable per core at the end): run again quiet, or pass "
                       "--busy-ok for a table marked busy")
    table = CostTable(
        name=f"{pair}" + ("-busy" if busy else ""), pair=pair, measured=True, busy=busy,
        verifier=VerifierCosts(base_s=pass_["base_s"], per_token_s=pass_["prefill_token_s"], per_row_s=pass_["per_row_s"],
                               host_round_s=host["verifier_host_round_s"] + maths["host_round_s"],
                               host_row_s=maths["host_row_s"], stream_token_s=host["stream_token_s"],
                               round_curve=pass_["round_curve"]),
        edge=EdgeCosts(draft_base_s=drafting["draft_base_s"], draft_row_s=drafting["draft_row_s"],
                       host_round_s=host["edge_host_round_s"], draft_tree_row_s=drafting.get("draft_tree_row_s", 0.0)),
        description=f"{Path(target).name} verifier ({threads} llama.cpp thread, batching on) and "
                    f"{Path(draft).name} draft ({threads} thread{'; across vocabularies' if cross else ''}) on this "
                    "machine; the host path through a verifier process and netsim's proxy, as the wall-clock "
                    "experiment runs",
        source="measured by netsim calibrate" + (" on a BUSY machine: not for publication" if busy else ""),
        machine=describe(), date=_dt.datetime.now(_dt.timezone.utc).date().isoformat(),
        command=" ".join(["netsim", "calibrate", *sys.argv[2:]]) if sys.argv[1:2] == ["calibrate"] else "",
        load={"start_per_core": start, "end_per_core": end},
        fits={"drafting": drafting, "pass": pass_, "maths": maths, "host": host})
    out.parent.mkdir(parents=True, exist_ok=True)
    table.save(out)
    return table

"""What drafter-invariant verification costs: `--coupling gumbel` against rejection sampling on the
real pairs, side by side, with the acceptance computed from p and q over the same positions.

    # acceptance and counts (no timing: publishable from any machine); one result per pair
    PYTHONPATH=. python bench/coupling.py --pairs synthetic --name coupling_acceptance_synthetic       # ~4 min
    PYTHONPATH=. python bench/coupling.py --pairs smollm2 --prompts 8 --max-tokens 80 --name coupling_acceptance_smollm2
    PYTHONPATH=. python bench/coupling.py --pairs gemma-smollm2 --prompts 8 --max-tokens 80 --name coupling_acceptance_gemma
    # the default edge (planner on) run twice per setting with one seed: distinct texts per coupling
    PYTHONPATH=. python bench/coupling.py --part repeat --pairs smollm2 --settings T1.0-p0.9 --max-tokens 32 --name coupling_repeat_smollm2
    PYTHONPATH=. python bench/coupling.py --part repeat --pairs gemma-smollm2 --settings T1.0-p0.9 --max-tokens 32 --name coupling_repeat_gemma
    # the noise's cost per row beside warping (wall clock: a quiet machine), ~1 min
    PYTHONPATH=. python bench/coupling.py --part noise --repeats 9 --name coupling_noise
    # tokens/s (wall clock: run it on a quiet machine), ~20 min
    PYTHONPATH=. python bench/coupling.py --part speed --prompts 6 --max-tokens 64 --repeats 3 --name coupling_speed

Acceptance part: an in-process verifier (llama.cpp) and edge over gRPC, a chain of --gamma drafts a
round (--plan off), chat prompts, per pair (smollm2: SmolLM2 target and its Q4_0 draft;
gemma-smollm2: Gemma 3 270M target, SmolLM2 draft across vocabularies; synthetic: the synthetic
pair, exact rows and ~10^4 positions, the implementation's check at a small standard error) × sampling setting
(T 0.7 / 1.0, top-p 0.9) × coupling. At every position the verifier tested it records p (the
target's processed row) and the q the draft drew that token from (the edge's, also when it is not
shipped), and prints beside the measured acceptance (accepted ÷ tested):
  - computed: the exact rate of the coupling at those p and q, averaged over the positions
    (gumbel: sum_k 1 / sum_j max(p_j/p_k, q_j/q_k); rejection: 1 - TV);
  - the bound (1 - TV)/(1 + TV) (Daliri, Musco, Suresh 2024) and rejection's 1 - TV.
Acceptance at a tested position given the past is exactly the computed rate, so measured and
computed differ only by sampling noise (a standard error is printed). Also: tokens per round and,
for gumbel, whether each prompt's ids equal the verifier's own cloud-only stream at the same seed,
and at how many positions the verification pass's target row differed in its bits from the
cloud-only step's row, and how often that changed the Gumbel-max token (a flip).

Repeat part: the default edge (planner on), per pair × sampling (T 0.7 top-k 40, T 1.0 top-p 0.9)
× q (fixed, float) × work in flight (the planner's, or --pipeline), one seed, two runs per coupling:
how many distinct texts, and (gumbel) whether they are cloud-only's.

Speed part: a verifier process (one thread) and this edge (one draft thread), per pair and setting
the two couplings interleaved per prompt, --repeats times; median tokens/s per coupling with its
spread (min-max), and gumbel ÷ rejection.

The few-bits scheme (Daliri et al.: a few bits per token sent from the draft so the verifier can
close most of the gap to 1 - TV) is not tried here: docs/exactness.md says why.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = ["Write a Python function that reverses a list.", "Explain why the sky is blue in three sentences.",
           "List the first ten prime numbers, separated by commas.", "Write a short poem about the sea.",
           "What is the capital of France? Answer in one sentence.", "Give three tips for writing clear emails.",
           "Describe a cat to someone who has never seen one.", "Write a haiku about autumn.",
           "Explain recursion with a simple example.", "Summarise the plot of a heist film in four sentences."]
SETTINGS = {"T0.7-p0.9": dict(temperature=0.7, top_p=0.9), "T1.0-p0.9": dict(temperature=1.0, top_p=0.9)}
PAIR_NAMES = ("synthetic", "smollm2", "gemma-smollm2")
SYNTHETIC_V, SYNTHETIC_TOKENS = 256, 256
   # the synthetic pair (spec_core.synthetic): vocabulary, tokens per prompt


def _one_edge():
    """One edge at a time: no admission control (it would refuse a session on a busy machine
    instead of measuring it)."""
    from cloud_verifier.admission import ServerPolicy
    return ServerPolicy(admit_ttft_s=0)


def _digest(row: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(row).tobytes(), digest_size=8).digest()


def recording_backend(base, *a, **kw):
    """A backend (`base`: a LogitsBackend class, built with *a, **kw) that records, per round, the
    rows its rule read (as processed p for the positions tested, and the Gumbel-max token with the
    row's digest), and per cloud-only step the same for the stream."""
    from spec_core.gumbel import target_token
    from spec_core.warping import processed_probs

    class Recording(base):
        def __init__(self):
            super().__init__(*a, **kw)
            self.qsource: dict[tuple[int, int], object] = {}   # RecordingDrafter.qs: (position, token) -> q
            self.tested: list[tuple[np.ndarray, object, int, bool]] = []   # (p, q, draft token, accepted)
            self.round_rows: dict[int, tuple[int, bytes]] = {}   # gumbel: position -> (y, row digest)
            self.stream_rows: dict[int, tuple[int, bytes]] = {}
            self._last = None

        def target_logits(self, state, tokens, rows):
            out = super().target_logits(state, tokens, rows)
            self._last = out[0]
            return out

        def accept(self, logits, tree, draft_probs, settings, rng, position=None):
            out = super().accept(logits, tree, draft_probs, settings, rng, position)
            assert tree.is_chain
            p = lambda i: processed_probs(logits[i], settings.temperature, settings.top_k, settings.top_p)  # noqa: E731
            for j in range(min(len(out.path) + 1, len(tree))):   # the drafts the rule tested
                tok = tree.tokens[j]
                self.tested.append((p(j), self.qsource.get((position + j, tok)), tok, j < len(out.path)))
            if settings.gumbel:
                for j in range(len(out.path) + 1):
                    self.round_rows[position + j] = (target_token(p(j), settings.seed, position + j),
                                                     _digest(logits[j]))
            return out

        def sample_next(self, state, tokens, settings, rng):
            out = super().sample_next(state, tokens, settings, rng)
            if settings.gumbel:
                self.stream_rows[len(tokens)] = (out.token, _digest(self._last[0]))
            return out
    return Recording()


class RecordingDrafter:
    """Wraps the pairing's drafter: the q each draft token was drawn from, by (position, token)."""

    def __init__(self, inner):
        self.inner = inner
        self.qs: dict[tuple[int, int], object] = {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, committed, gamma, settings, qmode, rng):
        d = self.inner.propose(committed, gamma, settings, qmode, rng)
        for j, tok in enumerate(d.tokens):
            self.qs[(len(committed) + j, tok)] = None if d.qs is None else d.qs[j]
        return d


async def acceptance(pair: str, args) -> list[dict]:
    from cloud_verifier.server import VerifierServer
    from edge_client import EdgeClient, crossvocab
    from edge_client.drafters import GGUFDrafter
    from edge_client.options import EdgeOptions, Speculation, Transport
    from edge_client.stats import GenerationStats
    from netsim.pairs import resolve
    from spec_core.gumbel import coupling_rate, daliri_bound, rejection_rate
    from spec_core.warping import COUPLINGS, SamplingSettings

    if pair == "synthetic":   # exact rows, many positions: the implementation's check at small error
        from cloud_verifier.backends.synthetic import SyntheticBackend
        from edge_client.drafters import SyntheticDrafter
        from edge_client.text import SyntheticTokenizer
        backend = recording_backend(SyntheticBackend, vocab=SYNTHETIC_V, seed=0)
        drafter, tokenizer = SyntheticDrafter(SYNTHETIC_V, seed=0, noise=1.0), SyntheticTokenizer(SYNTHETIC_V)
        prompts = [[0, 2 + i] for i in range(args.synthetic_prompts)]
        max_tokens = SYNTHETIC_TOKENS
    else:
        from cloud_verifier.backends.llama_cpp import LlamaCppBackend
        paths = resolve(pair, None, None)
        backend = recording_backend(LlamaCppBackend, paths.target, n_ctx=1024, n_threads=args.threads)
        drafter = GGUFDrafter(paths.draft, n_threads=1, n_ctx=1024)
        tokenizer = drafter.model
        prompts = [crossvocab.Chat.of(p) for p in PROMPTS[: args.prompts]]
        max_tokens = args.max_tokens
    rows = []
    async with VerifierServer(backend, "127.0.0.1", 0, policy=_one_edge()) as server:
        options = EdgeOptions(Transport(f"127.0.0.1:{server.port}", deadline_s=300),
                              Speculation(plan="off", gamma=args.gamma, qmode=args.q))
        async with EdgeClient(options, drafter, tokenizer) as client:
            for name, kw in SETTINGS.items():
                for coupling in COUPLINGS:
                    backend.tested.clear()
                    tokens = rounds = 0
                    same, flips, differing_rows, compared = 0, 0, 0, 0
                    for i, prompt in enumerate(prompts):
                        s = SamplingSettings(max_new_tokens=max_tokens, seed=100 + i, ignore_eos=True,
                                             coupling=coupling, **kw)
                        await client.speculation_for(GenerationStats())   # asks ServerInfo: the pairing needs it
                        pairing = await client.pairing_for(GenerationStats())
                        if not isinstance(pairing.drafter, RecordingDrafter):
                            recorder = RecordingDrafter(pairing.drafter)
                            recorder.qs = backend.qsource
                            client._pairing = dataclasses.replace(pairing, drafter=recorder)
                            client.drafter = recorder
                        backend.round_rows.clear()
                        gen = client.generate(prompt, s)
                        await gen.text()
                        tokens, rounds = tokens + gen.stats.tokens, rounds + gen.stats.rounds
                        if coupling == "gumbel":
                            backend.stream_rows.clear()
                            ref = client.generate_cloud_only(prompt, s)
                            await ref.text()
                            same += ref.stats.token_ids == gen.stats.token_ids
                            for pos, (y, dig) in backend.round_rows.items():
                                if pos in backend.stream_rows:
                                    y2, dig2 = backend.stream_rows[pos]
                                    compared += 1
                                    differing_rows += dig != dig2
                                    flips += y != y2
                    n_vocab = backend.info.n_vocab
                    computed, bound, rej, hits = [], [], [], 0
                    for p, q_enc, tok, accepted in backend.tested:
                        q = np.zeros(n_vocab) if q_enc is None else q_enc.dense(n_vocab).astype(np.float64)
                        if q_enc is None:
                            q[tok] = 1.0
                        q /= q.sum()
                        computed.append(coupling_rate(p, q) if coupling == "gumbel" else rejection_rate(p, q))
                        bound.append(daliri_bound(p, q))
                        rej.append(rejection_rate(p, q))
                        hits += accepted
                    n = len(backend.tested)
                    measured = hits / max(n, 1)
                    mean_computed = statistics.mean(computed) if computed else 0.0
                    se = float(np.sqrt(np.sum(np.array(computed) * (1 - np.array(computed))))) / max(n, 1)
                    row = dict(pair=pair, setting=name, coupling=coupling, tested=n, measured=measured,
                               computed=mean_computed, se=se, bound=statistics.mean(bound) if bound else None,
                               rejection_rate=statistics.mean(rej) if rej else None,
                               tokens_per_round=tokens / max(rounds, 1), tokens=tokens, rounds=rounds)
                    if coupling == "gumbel":
                        row.update(same_as_cloud_only=f"{same}/{len(prompts)}",
                                   positions_compared=compared, rows_differing=differing_rows, flips=flips)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    drafter.close()
    backend.close()
    return rows


REPEAT_SETTINGS = {"T0.7-k40": dict(temperature=0.7, top_k=40), "T1.0-p0.9": dict(temperature=1.0, top_p=0.9)}


async def repeat(pair: str, args) -> list[dict]:
    """The default edge (the planner on: shapes follow measured times) run twice with one seed per
    setting, q and work in flight: how many distinct texts each coupling gives, and whether gumbel's
    equal cloud-only's. Counts whose rejection column depends on the machine's timing, by design."""
    from cloud_verifier.backends.llama_cpp import LlamaCppBackend
    from cloud_verifier.server import VerifierServer
    from edge_client import EdgeClient, crossvocab
    from edge_client.drafters import GGUFDrafter
    from edge_client.options import EdgeOptions, Speculation, Transport
    from netsim.pairs import resolve
    from spec_core.warping import COUPLINGS, SamplingSettings

    paths = resolve(pair, None, None)
    backend = LlamaCppBackend(paths.target, n_ctx=1024, n_threads=args.threads)
    rows = []
    async with VerifierServer(backend, "127.0.0.1", 0, policy=_one_edge()) as server:
        for q in ("fixed:16:16", "float:16"):
            for work in ("plain", "pipeline"):
                drafter = GGUFDrafter(paths.draft, n_threads=1, n_ctx=1024, max_tree_nodes=64)
                spec = Speculation(qmode=q, **({"pipeline": True} if work == "pipeline" else {}))
                options = EdgeOptions(Transport(f"127.0.0.1:{server.port}", deadline_s=300), spec)
                async with EdgeClient(options, drafter, drafter.model) as client:
                    for name, kw in REPEAT_SETTINGS.items():
                        if args.settings and name not in args.settings.split(","):
                            continue
                        for coupling in COUPLINGS:
                            s = SamplingSettings(max_new_tokens=args.max_tokens, seed=11, ignore_eos=True,
                                                 coupling=coupling, **kw)
                            texts = []
                            for _ in range(2):
                                gen = client.generate(crossvocab.Chat.of(PROMPTS[0]), s)
                                await gen.text()
                                texts.append(tuple(gen.stats.token_ids))
                            row = dict(pair=pair, setting=name, q=q, work=work, coupling=coupling,
                                       distinct=len(set(texts)), shapes=len(gen.stats.shapes))
                            if coupling == "gumbel":
                                ref = client.generate_cloud_only(crossvocab.Chat.of(PROMPTS[0]), s)
                                await ref.text()
                                row["equal_cloud_only"] = all(t == tuple(ref.stats.token_ids) for t in texts)
                            print(json.dumps(row), flush=True)
                            rows.append(row)
                drafter.close()
    backend.close()
    return rows


def noise_cost(args) -> list[dict]:
    """The gumbel coupling's per-row cost on the verifier, beside the warping every round pays: on
    random N(0, 2^2) rows of Gemma's and SmolLM2's vocabulary sizes, per setting, the median time of
    processed_probs (warping), of target_token on its result (noise and argmax, pruned), and of the
    plain argmax over the whole support (noise on every kept token)."""
    from spec_core.gumbel import PositionNoise, target_token
    from spec_core.warping import processed_probs

    def median_s(fn, reps: int) -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    rows = []
    rng = np.random.default_rng(0)
    for vocab in (262144, 49152):
        logits = (rng.standard_normal((8, vocab)) * 2).astype(np.float32)
        for name, kw in {"T0.7": dict(temperature=0.7), "T1.0": dict(temperature=1.0),
                         "T1.0-p0.9": dict(temperature=1.0, top_p=0.9)}.items():
            warp = median_s(lambda: [processed_probs(r, **kw) for r in logits], args.repeats)
            probs = [processed_probs(r, **kw) for r in logits]
            pruned = median_s(lambda: [target_token(p, 7, i) for i, p in enumerate(probs)], args.repeats)

            def plain():
                for i, p in enumerate(probs):
                    ids = np.flatnonzero(p)
                    np.argmax(np.log(p[ids]) + PositionNoise(7, i)(ids))
            full = median_s(plain, args.repeats)
            row = dict(vocab=vocab, setting=name, warp_ms=warp / 8 * 1e3, noise_ms=pruned / 8 * 1e3,
                       plain_noise_ms=full / 8 * 1e3, noise_over_warp=pruned / warp)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


async def speed(pair: str, args) -> list[dict]:
    from edge_client import EdgeClient, crossvocab
    from edge_client.drafters import GGUFDrafter
    from edge_client.options import EdgeOptions, Speculation, Transport
    from hybridspec.launch import spawn_verifier
    from netsim.pairs import resolve
    from spec_core.warping import COUPLINGS, SamplingSettings

    paths = resolve(pair, None, None)
    proc, address = spawn_verifier(["--model", paths.target, "--threads", "1", "--n-ctx", "1024",
                                    "--admit-ttft-ms", "0"])
    drafter = GGUFDrafter(paths.draft, n_threads=1, n_ctx=1024)
    rows = []
    try:
        options = EdgeOptions(Transport(address, deadline_s=300), Speculation(plan="off", gamma=args.gamma,
                                                                              qmode=args.q))
        async with EdgeClient(options, drafter, drafter.model) as client:
            warm = client.generate(crossvocab.Chat.of("Hello"), SamplingSettings(max_new_tokens=8))
            await warm.text()
            for name, kw in SETTINGS.items():
                rates: dict[str, list[float]] = {c: [] for c in COUPLINGS}
                for rep in range(args.repeats):
                    for i, prompt in enumerate(PROMPTS[: args.prompts]):
                        order = COUPLINGS if (rep + i) % 2 == 0 else COUPLINGS[::-1]   # interleaved, ABBA
                        for coupling in order:
                            s = SamplingSettings(max_new_tokens=args.max_tokens, seed=100 + i, ignore_eos=True,
                                                 coupling=coupling, **kw)
                            gen = client.generate(crossvocab.Chat.of(prompt), s)
                            await gen.text()
                            rates[coupling].append(gen.stats.tokens_per_s)
                med = {c: statistics.median(v) for c, v in rates.items()}
                for c in COUPLINGS:
                    row = dict(pair=pair, setting=name, coupling=c, runs=len(rates[c]), tokens_per_s=med[c],
                               low=min(rates[c]), high=max(rates[c]), vs_rejection=med[c] / med["rejection"])
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    finally:
        drafter.close()
        proc.terminate()
        proc.wait(30)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("acceptance", "repeat", "speed", "noise"), default="acceptance")
    p.add_argument("--pairs", help="netsim pair names (netsim/pairs.py); the acceptance part also takes 'synthetic' "
                                   "(default: synthetic and both real pairs; the other parts: the real pairs)")
    p.add_argument("--prompts", type=int, default=len(PROMPTS))
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--q", default="fixed:16:16", help="the q the draft draws from (and ships, for rejection)")
    p.add_argument("--threads", type=int, default=1, help="verifier threads (acceptance part)")
    p.add_argument("--synthetic-prompts", type=int, default=40, help="prompts of the synthetic pair (acceptance part)")
    p.add_argument("--repeats", type=int, default=3, help="speed part: runs of each prompt per coupling")
    p.add_argument("--settings", help="repeat part: a subset of " + ",".join(REPEAT_SETTINGS))
    p.add_argument("--name", help="also write bench/results/NAME.json (hybridspec.figures)")
    args = p.parse_args()
    load_start = list(os.getloadavg())
    os.environ.setdefault("HYBRIDSPEC_CACHE", tempfile.mkdtemp())
    from hybridspec.machine import summary
    print(json.dumps({"machine": summary(), "load": load_start}), flush=True)
    run = {"acceptance": acceptance, "repeat": repeat, "speed": speed}.get(args.part)
    t0 = time.perf_counter()
    rows = []
    pairs = args.pairs or ",".join(PAIR_NAMES if args.part == "acceptance" else PAIR_NAMES[1:])
    if run is None:
        rows = noise_cost(args)
    else:
        for pair in pairs.split(","):
            rows += asyncio.run(run(pair, args))
    print(json.dumps({"seconds": round(time.perf_counter() - t0, 1)}))
    if args.name:
        from hybridspec.figures import Table, write_result
        if args.part == "acceptance":
            cols = ["pair", "setting", "coupling", "positions tested", "accepted ÷ tested", "computed from p, q",
                    "± s.e.", "bound (1−TV)/(1+TV)", "1 − TV", "tokens/round", "ids = cloud-only",
                    "row bits differ", "token flips"]
            table = Table(cols, [[r["pair"], r["setting"], r["coupling"], r["tested"], r["measured"], r["computed"],
                                  r["se"], r["bound"], r["rejection_rate"], r["tokens_per_round"],
                                  r.get("same_as_cloud_only"),
                                  (f"{r['rows_differing']}/{r['positions_compared']}" if "flips" in r else None),
                                  r.get("flips")] for r in rows],
                          {"accepted ÷ tested": "{:.3f}", "computed from p, q": "{:.3f}", "± s.e.": "{:.3f}",
                           "bound (1−TV)/(1+TV)": "{:.3f}", "1 − TV": "{:.3f}", "tokens/round": "{:.2f}"})
            note = (f"counts, not times: γ {args.gamma} chains, q {args.q}, {args.prompts} chat prompts × "
                    f"{args.max_tokens} tokens, seeds 100+i")
        elif args.part == "noise":
            cols = ["vocabulary", "setting", "warping ms/row", "noise + argmax ms/row", "plain noise ms/row",
                    "noise ÷ warping"]
            table = Table(cols, [[r["vocab"], r["setting"], r["warp_ms"], r["noise_ms"], r["plain_noise_ms"],
                                  r["noise_over_warp"]] for r in rows],
                          {"warping ms/row": "{:.2f}", "noise + argmax ms/row": "{:.2f}",
                           "plain noise ms/row": "{:.2f}", "noise ÷ warping": "{:.2f}"})
            note = f"wall clock, one thread: random N(0, 4) rows, 8 per setting, median of {args.repeats} repeats"
        elif args.part == "repeat":
            cols = ["pair", "setting", "q", "work in flight", "coupling", "distinct texts in 2 runs",
                    "ids = cloud-only"]
            table = Table(cols, [[r["pair"], r["setting"], r["q"], r["work"], r["coupling"], r["distinct"],
                                  r.get("equal_cloud_only")] for r in rows])
            note = (f"counts: the default edge (planner on), seed 11, {args.max_tokens} tokens of one chat prompt, "
                    "each setting run twice; rejection's count depends on the run's timing by design")
        else:
            cols = ["pair", "setting", "coupling", "runs", "median tok/s", "min", "max", "÷ rejection"]
            table = Table(cols, [[r["pair"], r["setting"], r["coupling"], r["runs"], r["tokens_per_s"], r["low"],
                                  r["high"], r["vs_rejection"]] for r in rows],
                          {"median tok/s": "{:.1f}", "min": "{:.1f}", "max": "{:.1f}", "÷ rejection": "{:.2f}"})
            note = (f"wall clock: verifier 1 thread + edge 1 draft thread on one machine, loopback, γ {args.gamma}, "
                    f"{args.prompts} prompts × {args.max_tokens} tokens × {args.repeats} repeats, couplings "
                    "interleaved per prompt")
        print(f"wrote {write_result(args.name, tables={'by-pair': table}, load_start=load_start, note=note)}")


if __name__ == "__main__":
    main()

"""The option matrix of issue 24 on a synthetic pair, in process: one `Combo` per combination of
vocabulary × shape × work during the round trip × q × sampling × verifier batching, run against a
verifier on 127.0.0.1:0 (tests/test_option_matrix.py draws from it; its slow test runs it all).

Same vocabulary: a 16-token synthetic target (order 1, seed 0) and its blurred draft.
Across vocabularies: tests/xvocab_pair.py (target `<s> <eos> a b c é abc bb \\xc3`, draft
`<d> a b c é ab ca bb`); the edge negotiates the mode by itself (the fingerprints differ) and opens
with the text prompt.
Both targets are bigram models (order 1), so a sampled run is checked token transition by token
transition against the target's processed distribution (`transition_p`).
The verifier batches, runs serially, or batches with KV parking on ("kv-park"; whether a session is
parked depends on the pressure on its places: the matrix checks that the option combines).
The llama.cpp backend (tests/tiny_gguf.py's target and its blurred draft, one tokenizer): same
vocabulary only; greedy runs
are compared with the cloud-only stream, sampled ones only for the same seed twice (there is no
exact distribution to test against).
The vLLM backend (tests/vllm_model.py's tiny llama as an HF folder, its GGUF draft; sessions on, the
one engine of the vLLM suite passed in as `backend`): same vocabulary, the verifier's own batching;
checked as llama.cpp's rows are (tests/test_vllm_combos.py).
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from cloud_verifier.backends.synthetic import SyntheticBackend
from edge_client import EdgeClient
from edge_client.client import stream_cloud_only
from edge_client.drafters import Draft, Drafter, SyntheticDrafter
from edge_client.text import SyntheticTokenizer
from helpers import edge_options, running_server, stub_for
from hybridspec.testing import exactness
from hybridspec.testing.exactness import PassLog, transition_counts, transition_fit
from spec_core.qcodec import EncodedQ
from spec_core.synthetic import SyntheticLM
from spec_core.warping import SamplingSettings, processed_probs
from xvocab_pair import DRAFT, TARGET, DraftTokenizer, longest_match_tokenizer

SAME_V = 16
PINNED_INPUTS = "rtt_ms=40,draft_ms=1,verify_ms=2,node_ms=0.1,alpha=0.7"   # a window of rounds pays at these
TREE = "budget=6,depth=3,branching=2,width=2"

VOCABS = ("same", "cross")
SHAPES = ("chain", "tree", "auto")
WORKS = ("none", "proactive", "pipeline", "continuations", "window", "fused", "auto")
QS = ("none", "fixed", "float")
SAMPLINGS = ("greedy", "top-k", "top-p")
BATCHINGS = ("batched", "serial", "kv-park")   # kv-park: batching with KV parking on


@dataclass(frozen=True)
class Combo:
    vocab: str = "same"        # VOCABS
    shape: str = "chain"       # SHAPES: chain (tree off), a fixed tree, or auto (adaptive γ, the cost model picks)
    work: str = "none"         # WORKS: what the edge does while a round is in flight (auto: the planner's choice)
    q: str = "float"           # QS: q on the wire (sparse supports: narrower than the vocabulary)
    sampling: str = "greedy"   # SAMPLINGS
    batching: str = "serial"   # BATCHINGS: the verifier's batcher on or off, or on with KV parking
    backend: str = "synthetic"  # synthetic | llama.cpp (tiny GGUF models) | vllm (its batching: "batched")

    def __str__(self) -> str:
        return "/".join(dataclasses.astuple(self))

    @property
    def greedy(self) -> bool:
        return self.sampling == "greedy"

    def edge_fields(self) -> dict:
        """Edge option fields (tests/helpers.edge_options) for this combination."""
        out: dict = {"qmode": {"none": "none", "fixed": "fixed:6:12", "float": "float:6"}[self.q]}
        planner = self.work in ("auto", "auto-pinned")
        out["plan"] = "auto" if planner else "off"   # every other work pins the round's shape
        if not (planner and self.shape == "auto"):   # auto/auto: the default edge, every shape the planner's
            out["gamma"] = "adaptive" if self.shape == "auto" else 3
            out["tree"] = {"chain": "off", "tree": TREE, "auto": "auto"}[self.shape]
        if self.shape == "auto":
            out["max_tree_nodes"] = 8
        out.update({"none": {}, "proactive": {"proactive": True, "max_continuations": 1},
                    "pipeline": {"pipeline": True, "max_continuations": 1},
                    "continuations": {"pipeline": True, "max_continuations": 8},
                    "window": {"window": 3, "max_continuations": 8},
                    "fused": {"fuse": True, "max_continuations": 8},
                    "auto": {"plan": "auto"},
                    # not in WORKS: the planner with its inputs pinned (a seed then pins the output)
                    "auto-pinned": {"plan": "auto", "plan_inputs": PINNED_INPUTS}}[self.work])
        return out

    def settings(self, max_new_tokens: int, seed: int | None = None) -> SamplingSettings:
        kw = {"greedy": dict(temperature=0.0), "top-k": dict(temperature=0.8, top_k=5),
              "top-p": dict(temperature=1.0, top_p=0.8)}[self.sampling]
        return SamplingSettings(max_new_tokens=max_new_tokens, ignore_eos=True, seed=seed, **kw)


def all_combos():
    """The synthetic matrix (1134 combinations)."""
    return [Combo(*c) for c in itertools.product(VOCABS, SHAPES, WORKS, QS, SAMPLINGS, BATCHINGS)]


def llama_combos():
    """The llama.cpp matrix (567 combinations: one vocabulary, three verifier modes)."""
    return [Combo("same", *c, backend="llama.cpp")
            for c in itertools.product(SHAPES, WORKS, QS, SAMPLINGS, BATCHINGS)]


def vllm_combos():
    """The vLLM matrix (189 combinations: one vocabulary; vLLM batches by itself, its KV is its own)."""
    return [Combo("same", *c, "batched", backend="vllm") for c in itertools.product(SHAPES, WORKS, QS, SAMPLINGS)]


# --- the pair ----------------------------------------------------------------------------------------

def target_lm(vocab: str) -> SyntheticLM:
    """The target the backend of `vocab` serves (SyntheticBackend's own model)."""
    return SyntheticLM(SAME_V, 0) if vocab == "same" else SyntheticLM(TARGET.n_vocab, 5)


def backend_for(combo: Combo, models: dict | None = None, step_ms: float = 2.0):
    if combo.backend == "llama.cpp":
        from cloud_verifier.backends.llama_cpp import LlamaCppBackend
        return LlamaCppBackend(str(models["target"]), n_ctx=512, n_threads=1, max_tree_leaves=16,
                               batching=combo.batching != "serial", kv_park=combo.batching == "kv-park")
    # A few ms per pass, so that drafting during the round trip has a round trip to work in.
    kw = dict(step_ms=step_ms, batching=combo.batching != "serial", kv_park=combo.batching == "kv-park")
    if combo.vocab == "same":
        return SyntheticBackend(vocab=SAME_V, seed=0, **kw)
    return SyntheticBackend(vocab=TARGET.n_vocab, seed=5, vocabulary=TARGET, tokenize=longest_match_tokenizer(TARGET),
                            eos_token_ids=(1,), **kw)


def drafter_for(combo: Combo, models: dict | None = None) -> tuple[Drafter, object]:
    if combo.backend in ("llama.cpp", "vllm"):
        from edge_client.drafters import GGUFDrafter
        d = GGUFDrafter(str(models["draft"]), n_threads=1, n_ctx=512, max_tree_nodes=16)
        return d, d.model
    if combo.vocab == "same":
        return SyntheticDrafter(SAME_V, seed=0, noise=1.0), SyntheticTokenizer(SAME_V)
    d = SyntheticDrafter(vocab=DRAFT.n_vocab, seed=2, noise=0.5)
    return d, DraftTokenizer(d.fingerprint)


def prompt_for(combo: Combo):
    if combo.backend in ("llama.cpp", "vllm"):
        return "Hello world"
    return [0, 5, 6] if combo.vocab == "same" else "ab"


class WrongQ(Drafter):
    """Negative control: ships, for each drafted token, a uniform q over the support it was drawn
    from instead of the q it was drawn from (the verifier's min(1, p/q) then uses the wrong q)."""

    def __init__(self, inner: Drafter):
        self.inner = inner
        self.name, self.fingerprint = inner.name, inner.fingerprint
        self.supports_trees, self.supports_cross_vocab = False, inner.supports_cross_vocab

    def propose(self, committed, gamma, settings, qmode, rng) -> Draft:
        d = self.inner.propose(committed, gamma, settings, qmode, rng)
        if d.qs is not None:
            d.qs = [EncodedQ(q.token_ids, _uniform(q.weights), q.fixed) for q in d.qs]
        return d

    def next_logits(self, seq):
        return self.inner.next_logits(seq)


def _uniform(weights: np.ndarray) -> np.ndarray:
    on = weights > 0
    if weights.dtype.kind == "i":
        return on.astype(weights.dtype)
    return (on / np.count_nonzero(on)).astype(weights.dtype)


# --- running --------------------------------------------------------------------------------------------

class Run(NamedTuple):
    ids: list[int]            # the generated target ids
    prompt_ids: list[int]     # the target's prompt ids (from the verifier for a text prompt)
    stats: object             # edge_client.client.GenerationStats


async def generate(combo: Combo, server_port: int, settings: SamplingSettings, wrap: Callable | None = None,
                   runs: int = 1, models: dict | None = None) -> list[Run]:
    """`runs` generations of `combo` (one EdgeClient, one drafter) against the verifier at `server_port`."""
    drafter, tokenizer = drafter_for(combo, models)
    if wrap is not None:
        drafter = wrap(drafter)
    out = []
    try:
        async with EdgeClient(edge_options(f"127.0.0.1:{server_port}", deadline_s=60, **combo.edge_fields()),
                              drafter, tokenizer) as c:
            for _ in range(runs):
                gen = c.generate(prompt_for(combo), settings)
                await gen.text()
                out.append(Run(list(gen.stats.token_ids), list(gen.prompt_ids), gen.stats))
    finally:
        drafter.close()
    return out


async def cloud_only(server, prompt_ids: list[int], settings: SamplingSettings) -> list[int]:
    async with stub_for(server) as stub:
        return (await stream_cloud_only(stub, prompt_ids, settings, timeout_s=120)).token_ids


# --- the statistics --------------------------------------------------------------------------------------

def transition_p(combo: Combo, sequences: list[list[int]]) -> tuple[float, int]:
    """Chi-square p of the token transitions in `sequences` (each starting with its last prompt
    token) against the target's processed bigram distribution, row by row with sparse cells pooled
    (hybridspec.testing.exactness.transition_fit). Returns (p, transitions counted)."""
    lm = target_lm(combo.vocab)
    s = combo.settings(1)
    probs = np.stack([processed_probs(lm.logits([a]), s.temperature, s.top_k, s.top_p) for a in range(lm.vocab)])
    fit = transition_fit(transition_counts(sequences, lm.vocab), probs)
    exactness.note_config(combo=str(combo))
    return exactness.noted_p(fit.p), fit.transitions


def seeded_ids_by_work(combo: Combo, works: tuple[str, ...], tokens: int, seed: int) -> dict[str, list[int]]:
    """The ids of `combo` with each of `works` (no work during the round trip, proactive, pipeline, ...),
    each on a fresh verifier, all with the same seed."""
    async def run_all():
        out = {}
        for work in works:
            c = dataclasses.replace(combo, work=work)
            backend = backend_for(c)
            try:
                async with running_server(backend, max_sessions=16) as server:
                    (r,) = await generate(c, server.port, c.settings(tokens, seed=seed))
            finally:
                backend.close()
            out[work] = r.ids
        return out
    return asyncio.run(run_all())


def run_combo(combo: Combo, tokens: int, seed: int = 7, check_seed: bool = True, wrap: Callable | None = None,
              runs: int = 1, models: dict | None = None, backend=None) -> dict:
    """Run one combination on a fresh verifier and check it: greedy equals the cloud-only stream;
    sampled: the same seed gives the same ids twice, and (unseeded, synthetic only) `tokens` tokens
    for the chi-square. `models`: tests/conftest.py's tiny_models (llama.cpp) or tiny_vllm (vLLM:
    the drafter's GGUF). `backend`: the verifier's backend, served by a fresh server and left open
    (the vLLM suite's one engine); None: one built for the combination and closed.
    Returns what was measured (the caller asserts)."""
    return asyncio.run(_run_combo(combo, tokens, seed, check_seed, wrap, runs, models, backend))


async def _run_combo(combo: Combo, tokens: int, seed: int, check_seed: bool, wrap, runs: int, models,
                     given=None) -> dict:
    backend = given if given is not None else backend_for(combo, models)
    if getattr(backend, "batcher", None) is not None:
        PassLog(backend.batcher)   # each pass's composition, into the test's replay record
    exactness.note_seed("run_combo", {"combo": str(combo), "seed": seed, "tokens": tokens})
    out: dict = {"combo": str(combo)}
    try:
        async with running_server(backend, max_sessions=16) as server:
            if combo.greedy:
                n = min(tokens, 40)
                (run,) = await generate(combo, server.port, combo.settings(n), models=models)
                out["ids"], out["reference"] = run.ids, await cloud_only(server, run.prompt_ids, combo.settings(n))
                out["prompt_ids"], out["stats"] = run.prompt_ids, run.stats
                return out
            if check_seed:
                a, b = await generate(combo, server.port, combo.settings(24, seed=seed), runs=2, models=models)
                out["seeded"] = (a.ids, b.ids)
            if combo.backend != "synthetic":
                return out
            done = await generate(combo, server.port, combo.settings(tokens), wrap=wrap, runs=runs)
            out["stats"] = done[0].stats
            out["chi2"] = transition_p(combo, [r.prompt_ids[-1:] + r.ids for r in done])
            return out
    finally:
        if given is None:
            backend.close()

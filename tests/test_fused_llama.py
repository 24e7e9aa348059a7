"""Fused continuations on the llama.cpp backend (tests/tiny_gguf.py's target): the fused tree's rows
are the ones round r and round r + 1 would read unfused, and the cache afterwards serves the next
round. Greedy, so the committed tokens are the target's own greedy continuation (computed with
`sample_next`, one token a pass), in the serial verifier and with batching."""
from __future__ import annotations

import numpy as np
import pytest

from cloud_verifier.backends.base import FusedContinuation
from cloud_verifier.backends.llama_cpp import LlamaCppBackend
from spec_core.tree import DraftTree
from spec_core.warping import SamplingSettings

PROMPT = [1, 17, 42, 99, 7, 23]
GREEDY = SamplingSettings(temperature=0.0)


@pytest.fixture(scope="module", params=[False, True], ids=["serial", "batching"])
def backend(tiny_models, request):
    b = LlamaCppBackend(str(tiny_models["target"]), n_ctx=256, n_threads=1, batching=request.param,
                        kv_tokens=4 * 256)
    yield b
    b.close()


def greedy(backend, n: int) -> list[int]:
    state, seq = backend.new_state(), list(PROMPT)
    try:
        for _ in range(n):
            seq.append(backend.sample_next(state, seq, GREEDY, np.random.default_rng(0)).token)
    finally:
        backend.release(state)
    return seq[len(PROMPT):]


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_a_fused_round_commits_the_targets_greedy_text(backend, shape):
    g = greedy(backend, 12)
    wrong = [(t + 1) % backend.info.n_vocab for t in g]
    if shape == "chain":   # round r: g0 g1 (all kept, bonus g2)
        tree = DraftTree.chain(g[0:2])
    else:                  # round r: g0 -> g1, and a wrong sibling at the root
        tree = DraftTree((wrong[0], g[0], g[1]), (-1, -1, 1))
    conts = [FusedContinuation((wrong[0] + 1,), DraftTree.chain([5]), None),                # no outcome taken
             FusedContinuation((g[0], wrong[1]), DraftTree.chain([5, 6]), None),            # a rejection at 1
             FusedContinuation(tuple(g[0:3]), DraftTree((g[3], wrong[3], g[4]), (-1, -1, 0)), None),  # the hit
             FusedContinuation((g[0], g[1], wrong[2]), DraftTree.chain(g[3:5]), None)]
    state = backend.new_state()
    try:
        out = backend.verify_round(state, PROMPT, tree, None, GREEDY, np.random.default_rng(1), conts,
                                   lambda n: np.random.default_rng(n))
        kept = [tree.tokens[i] for i in out.result.path] + [out.result.next_token]
        assert kept == g[0:3]
        assert out.following is not None and out.following.index == 2
        c, nxt = conts[2], out.following.result
        assert [c.tree.tokens[i] for i in nxt.path] + [nxt.next_token] == g[3:6]
        # The next round, on the cache the fused round left.
        committed = PROMPT + g[0:6]
        after = backend.verify_round(state, committed, DraftTree.chain(g[6:9]), None, GREEDY,
                                     np.random.default_rng(2))
        assert after.result.path == [0, 1, 2] and after.result.next_token == g[9]
    finally:
        backend.release(state)


# --- one real-model check (slow): the bundled SmolLM2 pair, greedy, --fuse ----------------------

@pytest.mark.slow
async def test_fused_greedy_hybrid_equals_target_greedy_on_smollm2():
    from edge_client import EdgeClient
    from edge_client.drafters import GGUFDrafter
    from edge_client.text import render_chat
    from helpers import edge_options, running_server
    from llama_runtime import GGUFModel, bundled_model_path
    from test_e2e_grpc import check_same_or_near_tie, target_greedy

    try:
        target_path = str(bundled_model_path())
    except FileNotFoundError as e:
        pytest.fail(f"{e} (scripts/setup.sh installs it)")
    from edge_client.drafters import DEFAULT_DRAFT
    if not DEFAULT_DRAFT.exists():
        pytest.fail(f"no draft at {DEFAULT_DRAFT} (scripts/setup.sh makes it)")
    draft_path = str(DEFAULT_DRAFT)
    tok = GGUFModel(target_path, vocab_only=True)
    ids = render_chat(tok, "List the first ten prime numbers, separated by commas.")
    n = 48
    async with running_server(LlamaCppBackend(target_path, n_ctx=1024, n_threads=2)) as server:
        drafter = GGUFDrafter(draft_path, n_threads=1, n_ctx=1024)
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=4, qmode="none", fuse=True),
                              drafter, tok) as c:
            gen = c.generate(ids, SamplingSettings(temperature=0.0, max_new_tokens=n, ignore_eos=True))
            await gen.text()
        reference = await target_greedy(server, ids, n)
    st = gen.stats
    print(f"fused {st.fused_rounds} of {st.rounds - st.fused_hits} rounds sent, {st.fused_hits} hits")
    assert st.fused_rounds > 0 and st.fused_hits > 0, st
    check_same_or_near_tie(target_path, ids, st.token_ids, reference)

"""llama.cpp trees: one decode for the whole tree, and a KV cache that afterwards holds exactly the
kept path (next-round logits equal to having decoded the kept path as a chain).

The chain reference runs in a context with the same settings (n_seq_max > 1: flash attention
off, see KVContext). Tolerance: logits within LOGIT_ATOL = 1e-4 of the chain's, ten times under
NEAR_TIE of tests/test_e2e_grpc.py; measured differences are ~2e-6 (batched vs single-token
kernels), while flash attention's cell-order-dependent F16 accumulation gave ~1e-3.
"""
from __future__ import annotations

import numpy as np
import pytest

from llama_runtime import GGUFModel

LOGIT_ATOL = 1e-4
PROMPT = [1, 17, 42, 99, 7, 23]
# root -> 5 -> 6 -> 7 ; root -> 5 -> 8 ; root -> 9 -> 10 ; root -> 11
TOKENS = [5, 6, 7, 8, 9, 10, 11]
PARENTS = [-1, 0, 1, 0, -1, 4, -1]


@pytest.fixture(scope="module")
def target(tiny_models):
    m = GGUFModel(str(tiny_models["target"]), n_threads=1)
    yield m
    m.close()


def chain_rows(model, tokens, rows):
    ctx = model.new_context(256, n_seq_max=2)
    try:
        return ctx.logits(tokens, rows)
    finally:
        ctx.close()


def path_tokens(node):
    out = []
    while node != -1:
        out.append(TOKENS[node])
        node = PARENTS[node]
    return out[::-1]


def test_tree_rows_equal_chain_rows(target):
    ctx = target.new_context(256, n_seq_max=8)
    rows = ctx.tree_logits(PROMPT, TOKENS, PARENTS)
    assert rows.shape == (len(TOKENS) + 1, target.n_vocab)
    np.testing.assert_allclose(rows[0], chain_rows(target, PROMPT, 1)[0], atol=LOGIT_ATOL)
    for node in range(len(TOKENS)):
        ref = chain_rows(target, PROMPT + path_tokens(node), 1)[0]
        np.testing.assert_allclose(rows[node + 1], ref, atol=LOGIT_ATOL, err_msg=f"node {node}")
    ctx.close()


@pytest.mark.parametrize("path", [[0, 1, 2], [0, 3], [4, 5], [6], []], ids=lambda p: "path" + "-".join(map(str, p)))
def test_kv_after_a_tree_round_is_the_kept_path(target, path):
    ctx = target.new_context(256, n_seq_max=8)
    ctx.tree_logits(PROMPT, TOKENS, PARENTS)
    kept = [TOKENS[i] for i in path]
    ctx.keep_tree_path(path, kept)
    assert ctx.tokens == PROMPT + kept
    before = ctx.tokens_decoded
    nxt = PROMPT + kept + [3, 4]  # next round: the bonus/corrected token and one more draft
    got = ctx.logits(nxt, 2)
    assert ctx.tokens_decoded - before == 2, "the kept path must be reused from the cache, not decoded again"
    np.testing.assert_allclose(got, chain_rows(target, nxt, 2), atol=LOGIT_ATOL)
    # A second tree round on the same cache (scratch ids reused) is still right.
    rows = ctx.tree_logits(nxt, TOKENS, PARENTS)
    np.testing.assert_allclose(rows[3], chain_rows(target, nxt + path_tokens(2), 1)[0], atol=LOGIT_ATOL)
    ctx.keep_tree_path([4], [TOKENS[4]])
    np.testing.assert_allclose(ctx.logits(nxt + [TOKENS[4], 2], 1), chain_rows(target, nxt + [TOKENS[4], 2], 1),
                               atol=LOGIT_ATOL)
    ctx.close()


def test_tree_that_needs_more_sequences_is_refused(target):
    ctx = target.new_context(64, n_seq_max=2)
    with pytest.raises(ValueError, match="n_seq_max"):
        ctx.tree_logits(PROMPT, TOKENS, PARENTS)
    ctx.close()

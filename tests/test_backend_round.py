"""LogitsBackend.verify_round: the one round entry (a chain is a tree with one path), one driver
(spec_core.tree.verify_tree_on_logits) behind it, the chain's rows read without tree bookkeeping."""
from __future__ import annotations

import numpy as np
import pytest

from cloud_verifier.backends.base import BackendRound
from cloud_verifier.backends.synthetic import SyntheticBackend
from spec_core.tree import DraftTree, TreeResult, verify_tree
from spec_core.warping import SamplingSettings, processed_probs

T1 = SamplingSettings(temperature=1.0)
COMMITTED = [0, 5, 7]


def reference(backend: SyntheticBackend, tree: DraftTree, seed: int) -> TreeResult:
    """The rule on every row warped up front, the target's rows written out by hand."""
    ctxs = [COMMITTED] + [COMMITTED + [tree.tokens[j] for j in tree.path_to(i)] for i in range(len(tree))]
    p = processed_probs(np.stack([backend.lm.logits(c) for c in ctxs]), T1.temperature)
    return verify_tree(p, tree, None, np.random.default_rng(seed))


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("tree", [DraftTree.chain([3, 9, 4]), DraftTree((3, 9, 4), (-1, -1, 0)), DraftTree.chain([])],
                         ids=["chain", "tree", "empty"])
def test_a_round_answers_as_a_tree_with_the_rules_draws(seed, tree):
    backend = SyntheticBackend(vocab=16)
    out = backend.verify_round(backend.new_state(), COMMITTED, tree, None, T1, np.random.default_rng(seed))
    assert isinstance(out, BackendRound) and isinstance(out.result, TreeResult)
    assert out.result == reference(backend, tree, seed)


def test_a_chain_reads_its_rows_and_a_tree_its_tree_pass_and_both_take_the_one_rule():
    class Counting(SyntheticBackend):
        chains = trees = rules = 0

        def target_logits(self, *args):
            self.chains += 1
            return super().target_logits(*args)

        def tree_logits(self, *args):
            self.trees += 1
            return super().tree_logits(*args)

        def accept(self, *args):
            self.rules += 1
            return super().accept(*args)

    backend = Counting(vocab=16)
    rng = np.random.default_rng(0)
    backend.verify_round(backend.new_state(), COMMITTED, DraftTree.chain([3, 4]), None, T1, rng)
    backend.verify_round(backend.new_state(), COMMITTED, DraftTree.chain([]), None, T1, rng)
    backend.verify_round(backend.new_state(), COMMITTED, DraftTree((3, 9), (-1, -1)), None, T1, rng)
    assert (backend.chains, backend.trees, backend.rules) == (2, 1, 3)

"""Backend.verify_round: the one round entry (a chain is a tree with one path), the chain kernel inside it."""
from __future__ import annotations

import numpy as np
import pytest

from cloud_verifier.backends.base import BackendRound
from cloud_verifier.backends.synthetic import SyntheticBackend
from spec_core.tree import DraftTree, TreeResult
from spec_core.warping import SamplingSettings

T1 = SamplingSettings(temperature=1.0)
COMMITTED = [0, 5, 7]


@pytest.mark.parametrize("seed", range(20))
def test_a_chain_takes_the_chain_kernel_and_answers_as_a_tree(seed):
    backend = SyntheticBackend(vocab=16)
    drafts = [3, 9, 4]
    out = backend.verify_round(backend.new_state(), COMMITTED, DraftTree.chain(drafts), None, T1,
                               np.random.default_rng(seed))
    ref = backend.verify(backend.new_state(), COMMITTED, drafts, None, T1, np.random.default_rng(seed))
    assert isinstance(out, BackendRound) and isinstance(out.result, TreeResult)
    # The same draws as the chain kernel: the kept path is the accepted prefix.
    assert out.result.path == list(range(ref.result.num_accepted)) and out.result.next_token == ref.result.next_token


@pytest.mark.parametrize("seed", range(20))
def test_a_tree_takes_the_tree_kernel(seed):
    backend = SyntheticBackend(vocab=16)
    tree = DraftTree((3, 9, 4), (-1, -1, 0))
    out = backend.verify_round(backend.new_state(), COMMITTED, tree, None, T1, np.random.default_rng(seed))
    ref = backend.verify_tree(backend.new_state(), COMMITTED, tree, None, T1, np.random.default_rng(seed))
    assert out.result == ref.result


def test_the_kernels_a_backend_overrides_are_the_ones_used():
    class Counting(SyntheticBackend):
        chains = trees = 0

        def verify(self, *args):
            self.chains += 1
            return super().verify(*args)

        def verify_tree(self, *args):
            self.trees += 1
            return super().verify_tree(*args)

    backend = Counting(vocab=16)
    rng = np.random.default_rng(0)
    backend.verify_round(backend.new_state(), COMMITTED, DraftTree.chain([3, 4]), None, T1, rng)
    backend.verify_round(backend.new_state(), COMMITTED, DraftTree.chain([]), None, T1, rng)
    backend.verify_round(backend.new_state(), COMMITTED, DraftTree((3, 9), (-1, -1)), None, T1, rng)
    assert (backend.chains, backend.trees) == (2, 1)

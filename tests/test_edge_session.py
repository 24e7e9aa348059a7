"""The edge's session loop on its own (no server): one prepared-draft type for chains and trees,
and one α for ranking a round's outcomes and planning rounds."""
from __future__ import annotations

import asyncio
import types

import numpy as np
import pytest

from edge_client.drafters import SyntheticDrafter
from edge_client.options import Speculation, Transport
from edge_client.pairing import Pairing
from edge_client.loop import RoundLoop
from edge_client.planner import RoundPlan
from edge_client.rounds import Prepared
from edge_client.stats import GenerationStats
from edge_client.text import SyntheticTokenizer
from spec_core.estimates import Acceptance
from spec_core.tree import DraftTree, TreeShape
from spec_core.warping import SamplingSettings
from plan_feed import chain_round

V = 64
CHAIN = RoundPlan("chain", 4)
TREE = RoundPlan("tree8", 3, TreeShape(budget=8, depth=3))


def loop(gamma) -> RoundLoop:
    drafter, tokenizer = SyntheticDrafter(V, 0, 1.0), SyntheticTokenizer(V)
    client = types.SimpleNamespace(verifier=None, on_round=None, transport=Transport(""))
    return RoundLoop(client, Speculation(gamma=gamma, plan="off"), [0, 5], SamplingSettings(temperature=1.0, seed=1),
                     GenerationStats(), Pairing(drafter, tokenizer, tokenizer.eog_ids))


def chain(base, tokens) -> Prepared:
    return Prepared(list(base), CHAIN, DraftTree.chain(tokens), None, 0.001, len(tokens))


def test_one_alpha_ranks_outcomes_and_plans_rounds():
    """40 chain rounds of γ = 4 with random acceptances (seeded). The one estimate of α (the
    session's Estimates, read by the drafting that ranks outcomes and by the planner) follows
    spec_core.estimates.Acceptance, the verifier's rule, fed the same rounds. Control: the
    whole-session estimate a fixed γ once used, (accepted + 1) / (accepted + rejections + 2),
    differs from it after these rounds."""
    s, reference = loop(4), Acceptance()
    assert s.drafts.est is s.est
    rng = np.random.default_rng(3)
    accepted_all = rejections = 0
    for _ in range(40):
        n = int(rng.integers(0, 5))
        chain_round(s.est, 4, n, 0.02)
        reference.observe(4, n, rejected=n < 4)
        accepted_all, rejections = accepted_all + n, rejections + (n < 4)
    assert s.est.alpha == pytest.approx(reference.alpha)
    assert abs(s.est.alpha - (accepted_all + 1) / (accepted_all + rejections + 2)) > 1e-3


def test_a_chain_is_a_tree_with_one_path_and_stays_a_chain_on_the_wire():
    s = loop(4)
    prep = s.drafts.prepare(list(s.committed), CHAIN)
    assert prep.tree.is_chain and len(prep.tree) == 4 and prep.likely_nodes() == [0, 1, 2, 3]
    req = s.remote.request(prep, 1)
    assert list(req.draft_token_ids) == list(prep.tree.tokens) and not req.draft_parents
    # A tree that came out as one path goes on the wire as the chain it is.
    path = Prepared([0, 5], TREE, DraftTree((3, 4), (-1, 0)), None, 0.001, 2, [0.5, 0.25])
    assert not s.remote.request(path, 1).draft_parents and path.kept_path(2, ()) == [0, 1]
    tree = s.drafts.prepare([0, 5], TREE)
    assert not tree.tree.is_chain and list(s.remote.request(tree, 1).draft_parents) == list(tree.tree.parents)


def test_the_kept_path_is_checked_against_the_tree():
    #            0:3   1:4          two children of the root; node 2 under node 0
    tree = Prepared([0, 5], TREE, DraftTree((3, 4, 6), (-1, -1, 0)), None, 0.001, 3, [0.6, 0.3, 0.4])
    assert tree.likely_path() == [3, 6]
    assert tree.kept_path(2, [0, 2]) == [0, 2]
    for bad in ([1, 2], [2], [0, 7]):
        assert tree.kept_path(len(bad), bad) is None
    assert chain([0, 5], [7, 8]).kept_path(3, ()) is None   # more accepted than drafted


def test_a_round_that_ends_at_a_shallow_leaf_is_a_bonus_not_a_rejection():
    """Tree (depth 2 on one branch, 1 on the other) planned at depth 3: keeping the shallow leaf
    and drawing the bonus after it is no rejection; stopping above drafts still on offer is."""
    tree = Prepared([0, 5], TREE, DraftTree((3, 4, 6), (-1, -1, 0)), None, 0.001, 3, [0.6, 0.3, 0.4])
    assert not tree.rejected([1], drew=True)
    assert tree.rejected([0], drew=True)        # node 0 kept, its child 2 rejected
    assert tree.rejected([], drew=True) and not tree.rejected([0, 2], drew=True)
    assert not tree.rejected([0], drew=False)   # the generation ended there: nothing drawn
    assert max(tree.tree.depths()) == 2


async def test_the_pairing_is_decided_once_per_client_before_the_first_round(monkeypatch, tmp_path):
    """Three generations started together, then one more, on one client whose draft has another
    tokenizer: one pairing (one vocabulary set-up), made before any Verify round; each open
    announces the draft's tokenizer."""
    import edge_client.client as client_module
    from edge_client import EdgeClient, crossvocab
    from helpers import edge_options, running_server
    from test_crossvocab_grpc import drafter_pair, target_backend

    monkeypatch.setenv("HYBRIDSPEC_CACHE", str(tmp_path))
    crossvocab._VOCABS.clear()
    pairings, opens = [], []
    real_pair = client_module.pair

    async def counted_pair(*args, **kw):
        pairings.append(len(opens))   # Verify rounds sent before this pairing
        return await real_pair(*args, **kw)
    monkeypatch.setattr(client_module, "pair", counted_pair)
    drafter, tok = drafter_pair()
    settings = SamplingSettings(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    async with running_server(target_backend()) as server:
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=3), drafter, tok) as c:
            real_verify = c.verifier.verify

            async def verify(req, st, retries=None):
                if req.HasField("open"):
                    opens.append(req.open.draft_tokenizer_fingerprint)
                return await real_verify(req, st, retries)
            c.verifier.verify = verify
            gens = [c.generate(p, settings) for p in ("abc", "ab", "ba")]
            await asyncio.gather(*(g.text() for g in gens))
            await c.generate("cab", settings).text()
    assert pairings == [0] and len(opens) == 4 and set(opens) == {drafter.fingerprint}
    assert all(g.stats.tokens == 6 for g in gens)

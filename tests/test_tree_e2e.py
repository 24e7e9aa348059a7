"""Trees end to end through real gRPC (tiny GGUF target on llama.cpp, tiny GGUF draft building trees
on its KV cache), and the chain-or-tree policy."""
from __future__ import annotations

import pytest

from cloud_verifier.backends.llama_cpp import LlamaCppBackend
from cloud_verifier.backends.synthetic import SyntheticBackend
from edge_client import EdgeClient
from edge_client.drafters import GGUFDrafter, SyntheticDrafter
from edge_client.estimates import Estimates
from edge_client.options import Speculation
from edge_client.planner import Budget, arm_rate, candidate_arms
from edge_client.text import SyntheticTokenizer
from helpers import edge_options, running_server
from spec_core.tree import TreeShape
from spec_core.warping import SamplingSettings
from plan_feed import plan, teach
from test_e2e_grpc import PROMPTS, check_same_or_near_tie, target_greedy


@pytest.fixture(scope="module")
def target_backend(tiny_models):
    return LlamaCppBackend(str(tiny_models["target"]), n_ctx=512, n_threads=1, max_tree_leaves=16)


@pytest.fixture(scope="module")
def tree_drafter(tiny_models):
    d = GGUFDrafter(str(tiny_models["draft"]), n_threads=1, n_ctx=512, max_tree_nodes=16)
    yield d
    d.close()


@pytest.mark.parametrize("tree", ["budget=8,depth=4,branching=2,width=2", "auto"])
@pytest.mark.parametrize("qmode", ["none", "fixed:8"])
@pytest.mark.parametrize("prompt", PROMPTS)
async def test_greedy_hybrid_with_trees_equals_target_greedy(target_backend, tree_drafter, tiny_models, tree, qmode,
                                                             prompt):
    n = 40
    async with running_server(target_backend) as server:
        options = edge_options(f"127.0.0.1:{server.port}", gamma=4, qmode=qmode, tree=tree, max_tree_nodes=16)
        async with EdgeClient(options, tree_drafter, tree_drafter.model) as c:
            gen = c.generate(prompt, SamplingSettings(temperature=0.0, max_new_tokens=n, ignore_eos=True))
            await gen.text()
        ids = tree_drafter.model.tokenize(prompt)
        reference = await target_greedy(server, ids, n)
    st = gen.stats
    assert st.tokens == n and st.finish_reason == "length"
    assert st.tree_rounds > 0 and st.nodes_per_round > 1
    check_same_or_near_tie(str(tiny_models["target"]), ids, st.token_ids, reference)


async def test_sampled_tree_run_reports_consistent_stats(target_backend, tree_drafter):
    async with running_server(target_backend) as server:
        options = edge_options(f"127.0.0.1:{server.port}", gamma=4, tree="budget=8,depth=3,branching=2,width=2")
        async with EdgeClient(options, tree_drafter, tree_drafter.model) as c:
            gen = c.generate("the list", SamplingSettings(temperature=0.8, top_p=0.95, max_new_tokens=30,
                                                           ignore_eos=True, seed=5))
            await gen.text()
    st = gen.stats
    # every round is a tree, but a last one with room for no draft (one token left: a chain of 0)
    assert st.tokens == 30 and st.rounds - 1 <= st.tree_rounds <= st.rounds
    assert st.tokens == st.rounds + st.accepted
    assert st.nodes_per_round <= 8 and st.reused_drafts == 0 and st.discarded_rounds == 0


async def test_synthetic_pair_with_trees_commits_the_kept_paths():
    backend = SyntheticBackend(vocab=64, seed=0)
    drafter = SyntheticDrafter(vocab=64, seed=0, noise=1.0)
    async with running_server(backend) as server:
        options = edge_options(f"127.0.0.1:{server.port}", gamma=4, tree="budget=12,depth=4,branching=3,width=2")
        async with EdgeClient(options, drafter, SyntheticTokenizer(64)) as c:
            gen = c.generate([0, 5], SamplingSettings(temperature=1.0, max_new_tokens=60, ignore_eos=True, seed=1))
            await gen.text()
    assert gen.stats.tokens == 60 and gen.stats.tokens_per_round > 1


AUTO4 = Speculation(gamma=4, tree="auto", plan="off")   # γ 4, chain or tree each round


def feed(rounds: int, per_node_s: float, tree_tokens: float, chain_tokens: float,
         tree_extra_s: float = 0.0) -> tuple[Estimates, dict[str, int]]:
    """Plan each round with plan_round and teach the estimates what a modelled verifier did: base
    10 ms + per_node_s per node, RTT 50 ms, draft 5 ms per row; chains and trees commit the given
    tokens per round, and a tree's drafting takes tree_extra_s more than its rows (work the cost
    model does not see). Returns the estimates and the rounds each arm got."""
    est, chosen = Estimates(), {}
    for _ in range(rounds):
        p = plan(est, AUTO4, remaining=1000)
        chosen[p.arm] = chosen.get(p.arm, 0) + 1
        model_s = 0.010 + per_node_s * p.nodes
        tokens, extra = (chain_tokens, 0.0) if p.shape is None else (tree_tokens, tree_extra_s)
        teach(est, p, tokens=round(tokens), rtt_s=0.050, model_s=model_s, draft_s=0.005 * p.rows + extra)
    return est, chosen


def tree_rounds(chosen: dict[str, int]) -> int:
    return sum(v for k, v in chosen.items() if k.startswith("tree"))


def test_policy_finds_that_trees_do_not_pay_on_a_slow_verifier():
    """CPU-like: 30 ms per node. Trees commit 4 tokens, chains 3, but 16 nodes cost too much."""
    est, chosen = feed(60, per_node_s=0.030, tree_tokens=4, chain_tokens=3)
    assert chosen.get("chain", 0) > 40, chosen
    chain, *trees = candidate_arms(est, AUTO4, Budget(1000))
    tree4x = next(t for t in trees if t.arm == "tree4x")
    assert arm_rate(est, chain) > arm_rate(est, tree4x)


def test_policy_takes_trees_on_a_flat_verifier():
    """GPU-like: 0.1 ms per node; the same tokens per round make the tree the better plan."""
    est, chosen = feed(60, per_node_s=0.0001, tree_tokens=4, chain_tokens=3)
    assert tree_rounds(chosen) > 40, chosen


def test_fixed_tree_shape_is_cut_to_the_tokens_left():
    spec = Speculation(gamma=4, tree=TreeShape(budget=8, depth=4, branching=2, width=2), plan="off")
    assert plan(Estimates(), spec, remaining=3).shape.depth == 2
    assert plan(Estimates(), spec, remaining=1).shape is None


def test_a_tree_that_costs_more_than_the_model_says_is_left_for_the_chain():
    """Flat verifier, trees commit 4 tokens to the chain's 3 (test_policy_takes_trees_on_a_flat_verifier
    takes them: the control), but each tree round's drafting takes 60 ms the model does not predict:
    measured per arm, that excess makes the chain the faster plan (3 / 0.09 s > 4 / 0.15 s)."""
    est, chosen = feed(60, per_node_s=0.0001, tree_tokens=4, chain_tokens=3, tree_extra_s=0.060)
    assert tree_rounds(chosen) < 15, chosen

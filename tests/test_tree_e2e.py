"""Trees end to end through real gRPC (tiny GGUF target on llama.cpp, tiny GGUF draft building trees
on its KV cache), and the chain-or-tree policy."""
from __future__ import annotations

import pytest

from cloud_verifier.backends.llama_cpp import LlamaCppBackend
from cloud_verifier.backends.synthetic import SyntheticBackend
from edge_client import EdgeClient
from edge_client.drafters import GGUFDrafter, SyntheticDrafter
from edge_client.gamma import FixedGamma, RoundPlan, TreePolicy
from edge_client.text import SyntheticTokenizer
from helpers import edge_options, running_server
from spec_core.tree import TreeShape
from spec_core.warping import SamplingSettings
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


def feed(policy: TreePolicy, rounds: int, per_node_s: float, tree_tokens: float, chain_tokens: float,
         tree_extra_s: float = 0.0):
    """Drive the policy with a modelled verifier: base 10 ms + per_node_s per node, RTT 50 ms,
    draft 5 ms per row; chains and trees commit the given tokens per round, and a tree's drafting
    takes tree_extra_s more than its rows (work the cost model does not see)."""
    for _ in range(rounds):
        plan = policy.plan(remaining=1000)
        nodes = plan.gamma if plan.shape is None else plan.shape.budget
        rows = plan.gamma if plan.shape is None else 1 + (plan.shape.depth - 1) * plan.shape.width
        model_s = 0.010 + per_node_s * nodes
        tokens, extra = (chain_tokens, 0.0) if plan.shape is None else (tree_tokens, tree_extra_s)
        policy.observe(plan, nodes=nodes, rows=rows, tokens=round(tokens), draft_s=0.005 * rows + extra,
                       round_s=0.050 + model_s, server_s=model_s, model_s=model_s)
    return policy


def tree_rounds(policy: TreePolicy) -> int:
    return sum(v for k, v in policy.chosen.items() if k.startswith("tree"))


def test_policy_finds_that_trees_do_not_pay_on_a_slow_verifier():
    """CPU-like: 30 ms per node. Trees commit 4 tokens, chains 3, but 16 nodes cost too much."""
    p = feed(TreePolicy(FixedGamma(4), "auto"), 60, per_node_s=0.030, tree_tokens=4, chain_tokens=3)
    assert p.chosen.get("chain", 0) > 40, p.chosen
    assert p.predicted_rate(RoundPlan("chain", 4)) > p.predicted_rate(RoundPlan("tree4x", 4, p._shapes(4)["tree4x"]))


def test_policy_takes_trees_on_a_flat_verifier():
    """GPU-like: 0.1 ms per node; the same tokens per round make the tree the better plan."""
    p = feed(TreePolicy(FixedGamma(4), "auto"), 60, per_node_s=0.0001, tree_tokens=4, chain_tokens=3)
    assert tree_rounds(p) > 40, p.chosen


def test_fixed_tree_shape_is_cut_to_the_tokens_left():
    p = TreePolicy(FixedGamma(4), TreeShape(budget=8, depth=4, branching=2, width=2))
    assert p.plan(remaining=3).shape.depth == 2
    assert p.plan(remaining=1).shape is None


def test_a_tree_that_costs_more_than_the_model_says_is_left_for_the_chain():
    """Flat verifier, trees commit 4 tokens to the chain's 3 (test_policy_takes_trees_on_a_flat_verifier
    takes them: the control), but each tree round's drafting takes 60 ms the model does not predict:
    measured per arm, that excess makes the chain the faster plan (3 / 0.09 s > 4 / 0.15 s)."""
    p = feed(TreePolicy(FixedGamma(4), "auto"), 60, per_node_s=0.0001, tree_tokens=4, chain_tokens=3,
             tree_extra_s=0.060)
    assert tree_rounds(p) < 15, p.chosen

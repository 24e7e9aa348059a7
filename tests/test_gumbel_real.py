"""`--coupling gumbel` on the real pairs (llama.cpp): the hybrid's ids equal the verifier's own
cloud-only stream at the same seed, token for token, sampled (T 0.8, top-p 0.9).

- the bundled pair (SmolLM2 target, its Q4_0 draft): a chain, a tree, the default edge (planner on),
  and 8 sessions batched together (the batching verifier), each against its own cloud-only stream;
- the two-family pair (Gemma 3 270M target, SmolLM2 drafting across vocabularies): chain and tree.

Equality needs the verification pass's rows to be the cloud-only step's bit for bit (the llama.cpp
backend's invariant contexts make them so; bench/coupling.py counts rows that differ and tokens
that flip on longer runs). Slow (real models); Gemma is skipped, with the reason, when not installed.
"""
from __future__ import annotations

import asyncio

import pytest

from cloud_verifier.backends.llama_cpp import LlamaCppBackend
from edge_client import EdgeClient, crossvocab
from edge_client.drafters import DEFAULT_DRAFT, GGUFDrafter
from helpers import edge_options, running_server
from llama_runtime import bundled_model_path
from spec_core.warping import GUMBEL, SamplingSettings
from test_crossvocab_real import gemma, smollm2, vocab_cache  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow
N_NEW = 32


def settings(seed: int) -> SamplingSettings:
    return SamplingSettings(temperature=0.8, top_p=0.9, max_new_tokens=N_NEW, seed=seed, ignore_eos=True,
                            coupling=GUMBEL)


async def hybrid_and_cloud_only(target: str, draft: str, prompts, spec: dict, batching: bool = False):
    """[(hybrid ids, cloud-only ids)] per prompt, generations run together."""
    backend = LlamaCppBackend(target, n_ctx=1024, n_threads=2, batching=batching)
    drafter = GGUFDrafter(draft, n_threads=1, n_ctx=1024,
                          max_tree_nodes=edge_options("", **spec).speculation.draft_tree_nodes)
    try:
        async with running_server(backend) as server:
            async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", deadline_s=300, **spec), drafter,
                                  drafter.model) as c:
                gens = [c.generate(p, settings(40 + i)) for i, p in enumerate(prompts)]
                if batching:
                    await asyncio.gather(*(g.text() for g in gens))
                else:
                    for g in gens:
                        await g.text()
                refs = [c.generate_cloud_only(p, g.settings) for p, g in zip(prompts, gens)]
                for r in refs:
                    await r.text()
    finally:
        drafter.close()
        backend.close()
    return [(g.stats.token_ids, r.stats.token_ids) for g, r in zip(gens, refs)]


@pytest.mark.parametrize("spec", [dict(gamma=4), dict(tree="budget=8,depth=3"), dict(plan="auto")],
                         ids=["chain", "tree", "planner"])
async def test_bundled_pair_equals_cloud_only(spec):
    draft = str(DEFAULT_DRAFT) if DEFAULT_DRAFT.is_file() else str(bundled_model_path())
    for hybrid, reference in await hybrid_and_cloud_only(str(bundled_model_path()), draft,
                                                         [crossvocab.Chat.of("Write a haiku about rain.")], spec):
        assert hybrid == reference and len(hybrid) == N_NEW


async def test_eight_batched_sessions_on_the_bundled_pair():
    draft = str(DEFAULT_DRAFT) if DEFAULT_DRAFT.is_file() else str(bundled_model_path())
    prompts = [crossvocab.Chat.of(f"Tell me one fact about the number {n}.") for n in range(8)]
    pairs = await hybrid_and_cloud_only(str(bundled_model_path()), draft, prompts, dict(gamma=4), batching=True)
    assert [h for h, _ in pairs] == [r for _, r in pairs]


@pytest.mark.parametrize("spec", [dict(gamma=4), dict(tree="budget=8,depth=3")], ids=["chain", "tree"])
async def test_two_family_pair_equals_cloud_only(gemma, smollm2, spec):  # noqa: F811
    for hybrid, reference in await hybrid_and_cloud_only(gemma, smollm2, [crossvocab.Chat.of("Name three rivers.")],
                                                         spec):
        assert hybrid == reference and len(hybrid) == N_NEW

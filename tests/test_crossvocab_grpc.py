"""Drafting across tokenizers over gRPC, in process, on the synthetic vocabulary pair
(tests/xvocab_pair.py): the edge negotiates the mode by itself (fingerprints differ), fetches and
caches the target's vocabulary, opens with text, drafts with TLI; the output follows the target.

Chi-square: N = 2000 generations of L = 2 target tokens (81 sequences; cells with expected count
< 5 pooled) from the text prompt "a" (target ids [0, 2]) at T = 1, γ = 3, compared with the exact
target probabilities at p < 1e-4. Negative control (must fail, p < 1e-4): the edge ships a
uniform q over the drawn support instead of the q it drew from (more controls in
test_crossvocab.py).
"""
from __future__ import annotations

import itertools

import grpc
import numpy as np
import pytest

from cloud_verifier.backends.synthetic import SyntheticBackend
from edge_client import EdgeClient
from edge_client import crossvocab
from edge_client.client import EdgeError
from edge_client.drafters import CrossVocabDrafter, SyntheticDrafter
from helpers import edge_options, running_server, stub_for
from spec_core.proto import verifier_pb2 as pb
from spec_core.warping import SamplingSettings, processed_probs
from test_exactness_stats import chi_square_p
from xvocab_pair import DRAFT, TARGET, DraftTokenizer, longest_match_tokenizer

N, L = 2000, 2
P_MIN = 1e-4


def target_backend(**kw) -> SyntheticBackend:
    return SyntheticBackend(vocab=TARGET.n_vocab, seed=5, vocabulary=TARGET, tokenize=longest_match_tokenizer(TARGET),
                            eos_token_ids=(1,), **kw)


@pytest.fixture(autouse=True)
def vocab_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDSPEC_CACHE", str(tmp_path))
    crossvocab._VOCABS.clear()
    return tmp_path / "vocab"


def drafter_pair():
    d = SyntheticDrafter(vocab=DRAFT.n_vocab, seed=2, noise=0.5)
    return d, DraftTokenizer(d.fingerprint)


async def test_vocabulary_rpc_round_trip_and_cache(vocab_cache):
    async with running_server(target_backend()) as server, stub_for(server) as stub:
        info = await stub.GetServerInfo(pb.ServerInfoRequest())
        assert info.text_prompts and info.chat_prompts
        msg = await stub.GetVocabulary(pb.VocabularyRequest(fingerprint=info.tokenizer_fingerprint))
        v = crossvocab.vocabulary_from_proto(msg)
        assert v.token_bytes == TARGET.token_bytes and v.eog_ids == {1} and v.byte_ids == {8}
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.GetVocabulary(pb.VocabularyRequest(fingerprint="0" * 64))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.GetVocabulary(pb.VocabularyRequest(fingerprint="../../etc/passwd"))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert crossvocab.store_vocabulary(msg) == vocab_cache / f"{TARGET.fingerprint}.pb"
    assert crossvocab.cached_vocabulary(TARGET.fingerprint).token_bytes == TARGET.token_bytes
    assert crossvocab.cached_vocabulary("../" * 20) is None


async def test_edge_negotiates_cross_vocabulary_and_caches_the_vocabulary(vocab_cache):
    drafter, tok = drafter_pair()
    async with running_server(target_backend()) as server:
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=3), drafter, tok) as c:
            gen = c.generate("abc", SamplingSettings(temperature=0.0, max_new_tokens=6, ignore_eos=True))
            text = await gen.text()
            assert isinstance(c.drafter, CrossVocabDrafter)
        assert gen.prompt_ids == [0, 6] and gen.stats.tokens == 6   # the verifier's tokenization of "abc"
        assert text.encode() == TARGET.text_bytes(gen.stats.token_ids)   # decoded with the target's bytes
        assert (vocab_cache / f"{TARGET.fingerprint}.pb").is_file()
        # The target's own greedy continuation of the same text prompt (its Generate stream).
        async with stub_for(server) as stub:
            ref, first = [], None
            async for chunk in stub.Generate(pb.GenerateRequest(prompt_text="abc", sampling=pb.SamplingParams(
                    temperature=0, max_new_tokens=6, ignore_eos=True))):
                first = first or list(chunk.prompt_token_ids)
                ref.extend(chunk.token_ids)
        assert first == [0, 6] and gen.stats.token_ids == ref


async def test_strict_tokenizer_refuses():
    drafter, tok = drafter_pair()
    async with running_server(target_backend()) as server:
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", strict_tokenizer=True), drafter, tok) as c:
            with pytest.raises(EdgeError) as e:
                await c.generate("abc", SamplingSettings(temperature=0.0, max_new_tokens=4)).text()
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "tokenizer mismatch" in str(e.value)


@pytest.mark.parametrize("spec", [dict(gamma=3), dict(gamma=3, pipeline=True), dict(tree="budget=6,depth=3"),
                                  dict(gamma=2, qmode="none")], ids=["chain", "pipeline", "tree", "point-mass"])
async def test_replay_after_the_verifier_loses_the_session(spec):
    """A session lost after its text open is replayed with the target ids the first reply gave."""
    drafter, tok = drafter_pair()
    settings = SamplingSettings(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    async with running_server(target_backend()) as server:
        lost = []

        def lose_once(ev):
            if not lost:
                lost.append(server.engine.sessions.clear() or True)
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", **spec), drafter, tok, on_round=lose_once) as c:
            gen = c.generate(crossvocab.Chat.of("ab"), settings)
            await gen.text()
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", **spec), drafter, tok) as c:
            clean = c.generate(crossvocab.Chat.of("ab"), settings)
            await clean.text()
    assert gen.stats.replays == 1 and gen.stats.token_ids == clean.stats.token_ids and gen.stats.tokens == 12


def _uniform_q(q, token_map):
    """Control: ship a uniform q over the drawn support instead of the q the token was drawn from."""
    from spec_core.crossvocab import to_target_q
    t = to_target_q(q, token_map)
    return type(t)(t.token_ids, np.full_like(t.weights, 1.0 / len(t.weights)), t.fixed)


@pytest.mark.parametrize("control", [False, True], ids=["tli", "control-wrong-q"])
async def test_sequences_over_grpc_follow_the_target(control, monkeypatch):
    if control:
        monkeypatch.setattr("edge_client.drafters.to_target_q", _uniform_q)
    drafter, tok = drafter_pair()
    backend = target_backend()
    s = SamplingSettings(temperature=1.0, max_new_tokens=L, ignore_eos=True)
    counts: dict[tuple, int] = {}
    async with running_server(backend, max_sessions=64) as server:
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=3, qmode="float:0"), drafter, tok) as c:
            for i in range(N):
                gen = c.generate("a", SamplingSettings(temperature=1.0, max_new_tokens=L, ignore_eos=True, seed=i))
                await gen.text()
                seq = tuple(gen.stats.token_ids)
                counts[seq] = counts.get(seq, 0) + 1
    exact = {}
    for seq in itertools.product(range(TARGET.n_vocab), repeat=L):
        ctx, prob = [0, 2], 1.0
        for t in seq:
            prob *= processed_probs(backend.lm.logits(ctx), s.temperature)[t]
            ctx.append(t)
        exact[seq] = prob
    p = chi_square_p(counts, exact, N)
    if control:
        assert p < P_MIN, f"the control was not caught: chi-square p = {p:.2e}"
    else:
        assert p > P_MIN, f"chi-square p = {p:.2e}"


async def test_target_vocabulary_from_a_local_file(tmp_path, vocab_cache):
    """--target-vocab: no GetVocabulary call (the server's is made to fail), nothing cached."""
    path = tmp_path / "target.pb"
    path.write_bytes(crossvocab.vocabulary_to_proto(TARGET).SerializeToString())
    drafter, tok = drafter_pair()
    backend = target_backend()
    async with running_server(backend) as server:
        async def no_vocabulary(req):
            raise AssertionError("GetVocabulary was called")
        server.engine.vocabulary = no_vocabulary
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=3, target_vocab=str(path)), drafter,
                              tok) as c:
            gen = c.generate("abc", SamplingSettings(temperature=0.0, max_new_tokens=4, ignore_eos=True))
            await gen.text()
    assert gen.stats.tokens == 4 and not vocab_cache.exists()


async def test_generations_started_together_set_up_once():
    import asyncio
    drafter, tok = drafter_pair()
    async with running_server(target_backend()) as server:
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=3), drafter, tok) as c:
            gens = [c.generate("ab", SamplingSettings(temperature=0.0, max_new_tokens=5, ignore_eos=True))
                    for _ in range(3)]
            await asyncio.gather(*(g.text() for g in gens))
            assert isinstance(c.drafter, CrossVocabDrafter) and c.drafter.inner is drafter
    assert [g.stats.token_ids for g in gens[1:]] == [gens[0].stats.token_ids] * 2

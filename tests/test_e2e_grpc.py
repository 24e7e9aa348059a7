"""End to end through real gRPC on 127.0.0.1: tiny GGUF target on llama.cpp, tiny GGUF draft."""
from __future__ import annotations

import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cloud_verifier.backends.llama_cpp import LlamaCppBackend
from edge_client import EdgeClient, EdgeError
from edge_client.drafters import GGUFDrafter, PromptLookupDrafter
from edge_client.text import render_chat
from helpers import edge_options, running_server, stub_for
from llama_runtime import GGUFModel
from spec_core.proto import verifier_pb2 as pb
from spec_core.warping import SamplingSettings

PROMPTS = ["hello world, the list", "def return the list of a"]
NEAR_TIE = 1e-3  # top-2 logit margin under which batched vs single-token numerics may flip the argmax


@pytest.fixture(scope="module")
def target_backend(tiny_models):
    return LlamaCppBackend(str(tiny_models["target"]), n_ctx=512, n_threads=1)


@pytest.fixture(scope="module")
def drafter(tiny_models):
    d = GGUFDrafter(str(tiny_models["draft"]), n_threads=1, n_ctx=512)
    yield d
    d.close()


async def target_greedy(server, prompt_ids, n) -> list[int]:
    """The target's own greedy output, one token per forward pass (the Generate stream)."""
    async with stub_for(server) as stub:
        out = []
        req = pb.GenerateRequest(prompt_token_ids=prompt_ids,
                                 sampling=pb.SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True))
        async for chunk in stub.Generate(req, timeout=60):
            out.extend(chunk.token_ids)
        return out


def check_same_or_near_tie(model_path, prompt_ids, hybrid, reference):
    """Equal token for token; a difference is only tolerated (and reported) at a near-tie."""
    if hybrid == reference:
        return
    i = next(k for k, (a, b) in enumerate(zip(hybrid, reference)) if a != b)
    m = GGUFModel(model_path, n_threads=1)
    row = m.new_context(512).logits(list(prompt_ids) + reference[:i], 1)[0]
    top2 = np.sort(row)[-2:]
    margin = float(top2[1] - top2[0])
    assert margin < NEAR_TIE, (f"hybrid and target differ at generated position {i} "
                               f"(hybrid {hybrid[i]}, target {reference[i]}) with a clear margin {margin:.3g}")
    pytest.xfail(f"near-tie flip at position {i}: top-2 logit margin {margin:.2e} < {NEAR_TIE} "
                 "(batched verification numerics differ from single-token decoding)")


@pytest.mark.parametrize("gamma", [1, 4])
@pytest.mark.parametrize("qmode", ["none", "fixed:8", "float:0"])
@pytest.mark.parametrize("prompt", PROMPTS)
async def test_greedy_hybrid_equals_target_greedy(target_backend, drafter, tiny_models, gamma, qmode, prompt):
    n = 40
    async with running_server(target_backend) as server:
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=gamma, qmode=qmode), drafter,
                              drafter.model) as c:
            gen = c.generate(prompt, SamplingSettings(temperature=0.0, max_new_tokens=n, ignore_eos=True))
            await gen.text()
        ids = drafter.model.tokenize(prompt)
        reference = await target_greedy(server, ids, n)
    st = gen.stats
    assert len(reference) == n and st.tokens == n and st.finish_reason == "length"
    assert 0 < st.accepted <= st.drafted, "the blurred draft should agree with the target sometimes"
    check_same_or_near_tie(str(tiny_models["target"]), ids, st.token_ids, reference)


async def test_sampling_run_reports_consistent_stats(target_backend, drafter):
    async with running_server(target_backend) as server:
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=4), drafter, drafter.model) as c:
            gen = c.generate("the list", SamplingSettings(temperature=0.8, top_p=0.95, max_new_tokens=30,
                                                           ignore_eos=True, seed=5))
            pieces = [p async for p in gen]
    st = gen.stats
    assert st.tokens == 30 == len(st.token_ids)
    assert st.rounds * 1 <= st.tokens <= st.rounds * 5
    assert st.tokens == st.rounds + st.accepted  # every round adds accepted + 1 (no cut mid-round here)
    assert st.tokens_per_round == pytest.approx(1 + st.accepted / st.rounds)
    assert st.bytes_up > 0 and st.bytes_down > 0 and st.wall_s > 0
    assert "".join(pieces) == st.text


async def test_same_seed_same_output(target_backend, drafter):
    outs = []
    async with running_server(target_backend) as server:
        for _ in range(2):
            async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=3), drafter, drafter.model) as c:
                gen = c.generate("hello", SamplingSettings(temperature=1.0, max_new_tokens=20, ignore_eos=True, seed=9))
                await gen.text()
                outs.append(gen.stats.token_ids)
    assert outs[0] == outs[1]


async def test_prompt_lookup_drafter_runs_exact_greedy(target_backend, tiny_models):
    model = GGUFModel(str(tiny_models["target"]), vocab_only=True)
    d = PromptLookupDrafter(fingerprint=model.fingerprint)
    prompt = "the list the list the list the list"
    async with running_server(target_backend) as server:
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=4, qmode="none"), d, model) as c:
            gen = c.generate(prompt, SamplingSettings(temperature=0.0, max_new_tokens=24, ignore_eos=True))
            await gen.text()
        reference = await target_greedy(server, model.tokenize(prompt), 24)
    check_same_or_near_tie(str(tiny_models["target"]), model.tokenize(prompt), gen.stats.token_ids, reference)


async def test_stop_token_ends_generation(target_backend, drafter):
    # Make a frequent token a stop token: generation must end right after it is committed.
    async with running_server(target_backend) as server:
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=4), drafter, drafter.model) as c:
            free = c.generate("hello", SamplingSettings(temperature=0.0, max_new_tokens=30, ignore_eos=True))
            await free.text()
            stop = free.stats.token_ids[5]
            gen = c.generate("hello", SamplingSettings(temperature=0.0, max_new_tokens=30, ignore_eos=True,
                                                       stop_token_ids=(stop,)))
            await gen.text()
    first = free.stats.token_ids.index(stop)
    assert gen.stats.token_ids == free.stats.token_ids[: first + 1]
    assert gen.stats.finish_reason == "stop"


async def test_chat_template_from_gguf(tiny_models):
    m = GGUFModel(str(tiny_models["target"]), vocab_only=True)
    ids = render_chat(m, "hello")
    assert ids[0] == m.bos_id
    assert m.detokenize(ids).endswith("<|assistant|>")


async def test_health_reports_serving(target_backend):
    async with running_server(target_backend) as server:
        import grpc
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            reply = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="hybridspec.v1.Verifier"), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_server_info(target_backend, tiny_models):
    async with running_server(target_backend, max_gamma=7) as server:
        async with stub_for(server) as stub:
            info = await stub.GetServerInfo(pb.ServerInfoRequest(), timeout=5)
    assert (info.backend, info.n_vocab, info.max_gamma, info.n_ctx) == ("llama.cpp", 299, 7, 512)
    assert info.tokenizer_fingerprint == GGUFModel(str(tiny_models["target"]), vocab_only=True).fingerprint
    assert list(info.eos_token_ids) == [2]


async def test_mismatched_tokenizer_is_refused(target_backend, tiny_models):
    d = GGUFDrafter(str(tiny_models["other_vocab"]), n_threads=1, n_ctx=512)
    try:
        async with running_server(target_backend) as server:
            # --strict-tokenizer: refuse instead of drafting across vocabularies (test_crossvocab_*.py).
            async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=2, strict_tokenizer=True), d,
                                  d.model) as c:
                with pytest.raises(EdgeError, match="tokenizer mismatch") as e:
                    await c.generate("hello", SamplingSettings(temperature=0.0, max_new_tokens=5)).text()
    finally:
        d.close()
    assert e.value.code.name == "FAILED_PRECONDITION"

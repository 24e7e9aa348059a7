"""`--coupling gumbel` end to end: the hybrid's token ids equal the verifier's own cloud-only stream
(Generate with the same seed and coupling), token for token, whatever the edge did.

Checked through real gRPC in process (synthetic pair: its logits are exact, so the tolerance is
none; the llama.cpp tiny models through the CLI):
- a sample of the option matrix (tests/option_matrix.py: vocabulary × shape × work in flight × q ×
  sampling × verifier batching), with explicit rows for trees across vocabularies, windows, fused
  rounds and KV parking; the whole matrix behind HYBRIDSPEC_MATRIX=all;
- lost replies, every session evicted mid-generation, a verifier restart (tests/test_faults.py's
  patterns), 8 sessions batched together;
- the default edge (the planner on, shapes following measured times) repeats a seeded run exactly;
- negative control: a verifier whose noise is keyed by the round (the position within the round)
  instead of the absolute position commits other ids than cloud-only;
- refusals before the first round: a verifier that does not list the coupling (one from before
  the field, or a backend without it), and the verifier's own checks of SamplingParams.coupling;
  and before a replay opens on another replica that does not list it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys

import grpc
import pytest
from hypothesis import HealthCheck, Phase, example, given, note, settings
from hypothesis import strategies as st

from cloud_verifier.backends.synthetic import SyntheticBackend
from edge_client import EdgeClient, EdgeError
from edge_client.drafters import SyntheticDrafter
from edge_client.text import SyntheticTokenizer
from helpers import edge_options, running_server, stub_for
from option_matrix import (BATCHINGS, QS, SAMPLINGS, SHAPES, VOCABS, WORKS, Combo, all_combos, backend_for,
                           cloud_only, generate)
from spec_core.proto import verifier_pb2 as pb
from spec_core.warping import GUMBEL, REJECTION, SamplingSettings
from test_faults import LosingReplies, generate_across_a_restart

WHOLE = os.environ.get("HYBRIDSPEC_MATRIX") == "all"
N_TOKENS = 40


@pytest.fixture(autouse=True)
def vocab_cache(tmp_path, monkeypatch):
    from edge_client import crossvocab
    monkeypatch.setenv("HYBRIDSPEC_CACHE", str(tmp_path))
    crossvocab._VOCABS.clear()


def gumbel(combo: Combo, seed: int, tokens: int = N_TOKENS) -> SamplingSettings:
    return dataclasses.replace(combo.settings(tokens, seed=seed), coupling=GUMBEL)


async def hybrid_and_reference(combo: Combo, seed: int, backend=None, tokens: int = N_TOKENS):
    """One hybrid generation of `combo` and the cloud-only stream for its prompt ids, same seed."""
    backend = backend or backend_for(combo)
    try:
        async with running_server(backend, max_sessions=16) as server:
            s = gumbel(combo, seed, tokens)
            (run,) = await generate(combo, server.port, s)
            return run, await cloud_only(server, run.prompt_ids, s)
    finally:
        backend.close()


def check_equal(combo: Combo, seed: int = 5) -> None:
    run, reference = asyncio.run(hybrid_and_reference(combo, seed))
    note(f"{combo}: {run.ids} vs {reference}")
    assert len(run.ids) == N_TOKENS
    assert run.ids == reference, f"{combo}: the hybrid's ids differ from cloud-only's at seed {seed}"
    assert run.stats.coupling == GUMBEL and run.stats.seed == seed


COMBOS = st.builds(Combo, st.sampled_from(VOCABS), st.sampled_from(SHAPES), st.sampled_from(WORKS),
                   st.sampled_from(QS), st.sampled_from(SAMPLINGS), st.sampled_from(BATCHINGS))


@settings(max_examples=8, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(combo=COMBOS)
@example(combo=Combo("cross", "tree", "continuations", "fixed", "top-k", "batched"))
@example(combo=Combo("same", "tree", "window", "float", "top-p", "kv-park"))
@example(combo=Combo("same", "chain", "fused", "fixed", "top-p", "batched"))
@example(combo=Combo("cross", "auto", "auto", "none", "top-k", "serial"))
def test_a_sample_of_the_matrix_equals_cloud_only(combo):
    check_equal(combo)


@pytest.mark.skipif(not WHOLE, reason="the whole matrix: HYBRIDSPEC_MATRIX=all (about 15 min on 2 cores)")
def test_the_whole_matrix_equals_cloud_only():
    failed = []
    for combo in all_combos():
        if combo.greedy:   # greedy is argmax in both couplings: test_option_matrix covers it
            continue
        run, reference = asyncio.run(hybrid_and_reference(combo, 5))
        if run.ids != reference:
            failed.append(str(combo))
    assert not failed, failed


# --- faults, batching, the planner ------------------------------------------------------------------

VOCAB = 48
TOP_P = dict(temperature=1.0, top_p=0.9)


async def reference_ids(prompt, settings: SamplingSettings) -> list[int]:
    backend = SyntheticBackend(vocab=VOCAB)
    try:
        async with running_server(backend) as server, stub_for(server) as stub:
            ids = []
            async for chunk in stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=_wire(settings))):
                ids.extend(chunk.token_ids)
            return ids
    finally:
        backend.close()


def _wire(settings):
    from edge_client.client import sampling_proto
    return sampling_proto(settings)


@pytest.mark.parametrize("plan", ["off", "auto"])
async def test_lost_replies_change_nothing(plan):
    s = SamplingSettings(max_new_tokens=60, ignore_eos=True, seed=3, coupling=GUMBEL, **TOP_P)
    backend = SyntheticBackend(vocab=VOCAB)
    try:
        async with running_server(backend) as server:
            async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", stream=False,
                                               **({"gamma": 4} if plan == "off" else {"plan": "auto"})),
                                  SyntheticDrafter(VOCAB, noise=1.0), SyntheticTokenizer(VOCAB)) as c:
                c._stub = LosingReplies(c._stub)
                gen = c.generate("5 6 7", s)
                await gen.text()
    finally:
        backend.close()
    assert c._stub.lost >= 3 and gen.stats.retries == c._stub.lost
    assert gen.stats.token_ids == await reference_ids([0, 5, 6, 7], s)


async def test_evicted_sessions_replay_to_the_same_ids():
    s = SamplingSettings(max_new_tokens=60, ignore_eos=True, seed=8, coupling=GUMBEL, **TOP_P)
    backend = SyntheticBackend(vocab=VOCAB, step_ms=5)
    try:
        async with running_server(backend) as server:
            async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=3, qmode="fixed:8:12"),
                                  SyntheticDrafter(VOCAB, noise=1.0), SyntheticTokenizer(VOCAB)) as c:
                gen = c.generate([0, 5, 6, 7], s)
                it = gen.__aiter__()
                evictions = 0
                async for _ in it:
                    if evictions < 2 and gen.stats.rounds in (3, 8):
                        server.engine.drop_sessions()   # every session evicted: the edge replays
                        evictions += 1
    finally:
        backend.close()
    assert gen.stats.replays >= 2
    assert gen.stats.token_ids == await reference_ids([0, 5, 6, 7], s)


async def test_a_verifier_restart_replays_to_the_same_ids():
    s = SamplingSettings(max_new_tokens=60, ignore_eos=True, seed=4, coupling=GUMBEL, **TOP_P)
    st_ = await generate_across_a_restart(
        lambda port: EdgeClient(edge_options(f"127.0.0.1:{port}", deadline_s=10, gamma=3),
                                SyntheticDrafter(VOCAB, noise=1.0), SyntheticTokenizer(VOCAB)), s)
    assert st_.replays >= 1
    assert st_.token_ids == await reference_ids([0, 5, 6, 7], s)


async def test_eight_batched_sessions_each_equal_their_cloud_only_stream():
    backend = SyntheticBackend(vocab=VOCAB, step_ms=3, batching=True)
    seeds = range(20, 28)
    try:
        async with running_server(backend, max_sessions=16) as server:
            async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", plan="auto"),
                                  SyntheticDrafter(VOCAB, noise=1.0), SyntheticTokenizer(VOCAB)) as c:
                gens = [c.generate([0, 5], SamplingSettings(max_new_tokens=40, ignore_eos=True, seed=seed,
                                                            coupling=GUMBEL, temperature=0.7, top_k=8))
                        for seed in seeds]
                await asyncio.gather(*(g.text() for g in gens))
                refs = [c.generate_cloud_only([0, 5], g.settings) for g in gens]
                await asyncio.gather(*(r.text() for r in refs))
    finally:
        backend.close()
    for g, r in zip(gens, refs):
        assert g.stats.token_ids == r.stats.token_ids and len(g.stats.token_ids) == 40
    assert len({tuple(g.stats.token_ids) for g in gens}) == len(gens)   # different seeds, different texts


@pytest.mark.parametrize("combo", [Combo("same", "auto", "auto", "fixed", "top-p", "batched"),
                                   Combo("cross", "auto", "auto", "float", "top-k", "serial")], ids=str)
def test_the_default_edge_repeats_a_seeded_run_exactly(combo):
    """The planner on (every shape following measured times, nothing pinned): the same seed gives the
    same ids every time, and they are cloud-only's."""
    async def twice():
        backend = backend_for(combo)
        try:
            async with running_server(backend, max_sessions=16) as server:
                s = gumbel(combo, 11)
                a, b = await generate(combo, server.port, s, runs=2)
                return a.ids, b.ids, await cloud_only(server, a.prompt_ids, s)
        finally:
            backend.close()
    a, b, reference = asyncio.run(twice())
    assert a == b == reference and len(a) == N_TOKENS


def test_a_generation_without_a_seed_draws_one_and_reports_it():
    combo = Combo("same", "chain", "none", "fixed", "top-p", "serial")

    async def run():
        backend = backend_for(combo)
        try:
            async with running_server(backend) as server:
                s = dataclasses.replace(combo.settings(N_TOKENS), coupling=GUMBEL)   # no seed
                (r,) = await generate(combo, server.port, s)
                return r, await cloud_only(server, r.prompt_ids, dataclasses.replace(s, seed=r.stats.seed))
        finally:
            backend.close()
    run_, reference = asyncio.run(run())
    assert run_.stats.seed is not None and run_.ids == reference


# --- negative control ----------------------------------------------------------------------------

class RoundKeyed(SyntheticBackend):
    """Negative control: the verifier's noise keyed by the round (positions counted from the round's
    start) instead of the absolute position."""

    def accept(self, logits, tree, draft_probs, settings, rng, position=None):
        return super().accept(logits, tree, draft_probs, settings, rng, 0)


def test_noise_keyed_by_round_breaks_equality():
    combo = Combo("same", "chain", "none", "fixed", "top-p", "serial")
    differ = 0
    for seed in (5, 6, 7):
        run, reference = asyncio.run(hybrid_and_reference(combo, seed, backend=RoundKeyed(vocab=16, seed=0)))
        differ += run.ids != reference
    assert differ == 3
    run, reference = asyncio.run(hybrid_and_reference(combo, 5))   # the same with absolute positions
    assert run.ids == reference


# --- refusals -------------------------------------------------------------------------------------

async def _refused(backend, patch_info=None) -> EdgeError:
    try:
        async with running_server(backend) as server:
            if patch_info is not None:
                original = server.engine.server_info
                server.engine.server_info = lambda: patch_info(original())
            async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=3),
                                  SyntheticDrafter(VOCAB), SyntheticTokenizer(VOCAB)) as c:
                for gen in (c.generate([0, 5], SamplingSettings(seed=1, coupling=GUMBEL)),
                            c.generate_cloud_only([0, 5], SamplingSettings(seed=1, coupling=GUMBEL))):
                    with pytest.raises(EdgeError) as e:
                        await gen.text()
                    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
                assert not server.engine.held_sessions()   # refused before the first round
                return e.value
    finally:
        backend.close()


async def test_an_old_verifier_is_refused_before_the_first_round():
    def old(info):
        del info.couplings[:]
        return info
    e = await _refused(SyntheticBackend(vocab=VOCAB), old)
    assert "--coupling gumbel is not offered by the synthetic verifier" in str(e)
    assert "use --coupling rejection" in str(e)


async def test_a_backend_without_the_coupling_is_refused_by_both_ends():
    backend = SyntheticBackend(vocab=VOCAB)
    backend.caps = dataclasses.replace(backend.caps, couplings=(REJECTION,))
    e = await _refused(backend)
    assert "ServerInfo.couplings: rejection" in str(e)
    # An edge that does not ask: the verifier refuses the open itself, and a value it does not know.
    backend = SyntheticBackend(vocab=VOCAB)
    backend.caps = dataclasses.replace(backend.caps, couplings=(REJECTION,))
    try:
        async with running_server(backend) as server, stub_for(server) as stub:
            for coupling, code, text in ((pb.COUPLING_GUMBEL, grpc.StatusCode.FAILED_PRECONDITION,
                                          "coupling gumbel is not available with the synthetic backend"),
                                         (7, grpc.StatusCode.INVALID_ARGUMENT, "sampling.coupling = 7")):
                req = pb.GenerateRequest(prompt_token_ids=[0, 5], sampling=pb.SamplingParams(
                    temperature=1.0, max_new_tokens=4, coupling=coupling))
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in stub.Generate(req):
                        pass
                assert e.value.code() == code and text in e.value.details(), e.value.details()
            info = await stub.GetServerInfo(pb.ServerInfoRequest())
            assert list(info.couplings) == [pb.COUPLING_REJECTION]
    finally:
        backend.close()


@pytest.mark.parametrize("second_offers", [False, True], ids=["old-second-replica", "control"])
async def test_a_replay_on_a_replica_that_does_not_offer_the_coupling_is_refused(second_offers):
    """Two replicas; the first drains mid-generation and hands the session back ("moved"), so the edge
    replays on the second. One that does not list gumbel in ServerInfo.couplings (a verifier from
    before the field: it would check by rejection sampling without a word) is refused before the
    replay opens, naming the coupling and the replica; the control (it lists it) finishes with
    cloud-only's ids."""
    from cloud_verifier.server import VerifierServer
    from cloud_verifier.engine import Limits
    s = SamplingSettings(max_new_tokens=40, ignore_eos=True, seed=6, coupling=GUMBEL, **TOP_P)
    servers = [VerifierServer(SyntheticBackend(vocab=VOCAB, step_ms=2), "127.0.0.1", 0, Limits(), grace_s=2.0)
               for _ in range(2)]
    for server in servers:
        await server.start()
    if not second_offers:
        original = servers[1].engine.server_info

        def old():
            info = original()
            del info.couplings[:]
            return info
        servers[1].engine.server_info = old
    second = f"127.0.0.1:{servers[1].port}"
    try:
        async with EdgeClient(edge_options(",".join(f"127.0.0.1:{x.port}" for x in servers), gamma=3),
                              SyntheticDrafter(VOCAB, noise=1.0), SyntheticTokenizer(VOCAB)) as c:
            gen = c.generate([0, 5, 6, 7], s)

            async def run():
                async for _ in gen:
                    if gen.stats.rounds == 3 and not servers[0].servicer.draining:
                        servers[0].servicer.drain()
            if second_offers:
                await run()
            else:
                with pytest.raises(EdgeError) as e:
                    await run()
    finally:
        for server in servers:
            await server.stop()
            server.engine.backend.close()
    assert gen.stats.replays == 1
    if second_offers:
        assert gen.stats.token_ids == await reference_ids([0, 5, 6, 7], s)
        return
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"the verifier at {second} cannot open" in str(e.value) and "--coupling gumbel" in str(e.value)
    assert len(gen.stats.token_ids) < 40


# --- the real programs (tiny GGUF models, llama.cpp) -----------------------------------------------

def test_the_cli_hybrid_equals_its_cloud_only_run(tiny_models):
    """`edge-client generate --coupling gumbel --seed S` and the same with `--cloud-only`: the same ids."""
    pytest.importorskip("llama_cpp")
    from cloud_verifier.process import spawn_verifier
    proc, address = spawn_verifier(["--model", str(tiny_models["target"]), "--n-ctx", "512", "--threads", "1"])
    try:
        out = []
        for extra in (["--gamma", "4", "--tree", "budget=6,depth=3"], ["--cloud-only"]):
            r = subprocess.run([sys.executable, "-m", "edge_client", "generate", "--server", address,
                                "--draft", str(tiny_models["draft"]), "--prompt", "hello world", "--max-tokens", "24",
                                "--temperature", "0.8", "--top-p", "0.95", "--coupling", "gumbel", "--seed", "9",
                                "--json", *extra], capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stderr
            out.append(json.loads(r.stdout.rstrip("\n").split("\n")[-1]))
            assert out[-1]["seed"] == 9 and out[-1]["coupling"] == "gumbel"
    finally:
        proc.terminate()
        proc.wait(20)
    tree, reference = out
    assert tree["token_ids"] == reference["token_ids"] and len(reference["token_ids"]) == 24
    assert reference["rounds"] == 0 and tree["rounds"] > 0 and tree["coupling"] == "gumbel"


# --- netsim experiment: the same-text check --------------------------------------------------------

def test_the_experiment_report_says_whether_every_mode_committed_the_same_ids():
    from netsim.experiment import ids_digest, same_text
    from netsim.report import _same_text_lines
    rows = [dict(profile="3g", workload="chat", prompt_index=0, mode=m, ids_digest=ids_digest(ids))
            for m, ids in (("cloud-only", [5, 6, 7]), ("hybrid-g4", [5, 6, 7]), ("auto", [5, 6, 7]),
                           ("edge-only", [9, 9]))]
    assert same_text(rows) == {"compared": 2, "differ": []}
    result = {"config": {"coupling": "gumbel"}, "rows": rows}
    assert "every mode committed the cloud-only ids" in _same_text_lines(result)[0]
    rows[1]["ids_digest"] = ids_digest([5, 6, 8])   # control: one mode's ids differ
    assert same_text(rows)["differ"] == ["3g/chat#0: hybrid-g4"]
    assert "NOT every mode" in _same_text_lines(result)[0]
    assert _same_text_lines({"config": {"coupling": "rejection"}, "rows": rows}) == []

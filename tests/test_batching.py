"""Batched verification: many sessions share target passes, and nothing about a session's output
depends on who else was in its passes (llama.cpp on the tiny GGUF models; the synthetic target
for the statistical test)."""
from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import grpc
import numpy as np
import pytest

from cloud_verifier.backends.llama_cpp import LlamaCppBackend
from cloud_verifier.backends.synthetic import SyntheticBackend
from edge_client import EdgeClient
from edge_client.drafters import GGUFDrafter, SyntheticDrafter
from edge_client.text import SyntheticTokenizer
from helpers import HeldPasses, edge_options, generate_many, running_server, stub_for
from hybridspec.testing import exactness
from hybridspec.testing.exactness import PassLog
from test_exactness_stats import chi_square_p, exact_sequence_probs
from llama_runtime import GGUFModel, SharedKV
from spec_core.batchplan import PassItem
from spec_core.proto import verifier_pb2 as pb
from spec_core.synthetic import synthetic_fingerprint, synthetic_pair
from spec_core.tree import TreeResult
from spec_core.warping import SamplingSettings, processed_probs

PROMPTS = ["hello world, the list", "def return the list of a", "the the the", "a list of hello",
           "world", "return a", "of the world def", "list list hello world the a"]


def batched_backend(tiny_models, **kw):
    kw.setdefault("kv_tokens", 16 * 512)
    kw.setdefault("batching", True)
    return LlamaCppBackend(str(tiny_models["target"]), n_ctx=512, n_threads=1, **kw)


# --- the runtime: rows do not depend on the batch ----------------------------------------------

def _in_threads(fn, n: int, timeout_s: float) -> None:
    """fn(0) .. fn(n - 1), each in a thread of its own, all at once."""
    threads = [threading.Thread(target=fn, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)


def _random_rounds(model, k: int, n_rounds: int = 12):
    """Rounds of sequence k: drafts of 0-5 random tokens, a random accepted prefix, a new token."""
    rng = np.random.default_rng(k)
    seq = model.tokenize(PROMPTS[k % len(PROMPTS)])
    for _ in range(n_rounds):
        drafts = [int(t) for t in rng.integers(3, model.n_vocab, size=int(rng.integers(0, 6)))]
        yield seq + drafts, len(drafts) + 1
        seq = seq + drafts[:int(rng.integers(0, len(drafts) + 1))] + [int(rng.integers(3, model.n_vocab))]


def _rows_alone(model, k: int, n_rounds: int = 12) -> np.ndarray:
    ctx = model.new_context(512, invariant=True)
    alone = np.concatenate([ctx.logits(toks, rows) for toks, rows in _random_rounds(model, k, n_rounds)])
    ctx.close()
    return alone


def test_shared_cache_rows_match_private_context_rows(tiny_models):
    """8 sequences with different prompts, driven by 8 threads through one batcher, random rounds
    with rollbacks, against the same calls on a private context each: every row bit-identical
    (so no sequence sees another's tokens, and rollbacks in the shared cache never leave a
    sequence's cells out of position order)."""
    # A fixed prefill chunk (a quarter of the 32-token pass, the batcher's base chunk): with the
    # live-rounds-first budget the chunk follows the measured pass cost, so on a busy machine a
    # prompt may take a pass of its own and the eight would not all share one; what this test
    # checks is the shared cache's rows, not the prefill schedule (tests/test_first_tokens.py).
    backend = batched_backend(tiny_models, prefill_chunk=8)
    model = GGUFModel(str(tiny_models["target"]), n_threads=1)
    results: dict[int, list[np.ndarray]] = {}
    states = [backend.new_state() for _ in PROMPTS]   # before the gate: acquire waits between passes
    running, lock = [len(PROMPTS)], threading.Lock()
    held = HeldPasses(backend.batcher, lambda _: running[0])   # every running thread's round in each pass

    def run_batched(k: int):
        try:
            results[k] = [backend.target_logits(states[k], toks, rows)[0] for toks, rows in _random_rounds(model, k)]
        finally:
            with lock:
                running[0] -= 1
            backend.release(states[k])

    _in_threads(run_batched, len(PROMPTS), timeout_s=120)
    backend.close()
    assert held.timed_out == 0 and max(held.sessions_per_pass) == len(PROMPTS), held.sessions_per_pass
    for k in range(len(PROMPTS)):
        np.testing.assert_array_equal(_rows_alone(model, k), np.concatenate(results[k]))


def test_compaction_moves_cells_without_changing_a_row(tiny_models):
    """A shared cache with almost no spare cells, so retired cells (rollbacks, releases, padding)
    fill it again and again and it compacts many times mid-request: 16 sequences, 4 at a time,
    each row bit-identical to a private context's; a released sequence's successor starts clean."""
    from cloud_verifier.backends.batcher import Batcher
    model = GGUFModel(str(tiny_models["target"]), n_threads=1)
    kv = SharedKV(model, 4, 140, slack=33)
    batcher = Batcher(kv)
    results: dict[int, np.ndarray] = {}
    lock = threading.Lock()

    def run(k: int):
        with lock:
            seq = batcher.acquire(kv.acquire)
        results[k] = np.concatenate([batcher.submit(seq, toks, rows)[0]
                                     for toks, rows in _random_rounds(model, k, n_rounds=20)])
        batcher.release(seq)

    sem = threading.Semaphore(4)

    def bounded(k: int):
        with sem:
            run(k)

    _in_threads(bounded, 16, timeout_s=120)
    batcher.close()
    print(f"{kv.compactions} compactions in {batcher.passes} passes, {kv.compaction_seconds * 1e3:.1f} ms in all")
    assert kv.compactions >= 2, kv.compactions
    assert len(results) == 16
    for k in range(16):
        np.testing.assert_array_equal(_rows_alone(model, k, n_rounds=20), results[k])
    kv.close()


def _random_tree(rng, n_vocab: int, max_nodes: int, max_leaves: int) -> tuple[list[int], list[int]]:
    """Random token tree: parents before children, at most max_leaves leaves."""
    tokens, parents = [], []
    for i in range(int(rng.integers(1, max_nodes + 1))):
        leaves = set(range(i)) - set(parents)
        p = int(rng.integers(-1, i)) if i else -1
        if len(leaves) >= max_leaves and p not in leaves:   # a new leaf only by extending one
            p = int(rng.choice(sorted(leaves)))
        tokens.append(int(rng.integers(3, n_vocab)))
        parents.append(p)
    return tokens, parents


def test_tree_rows_in_shared_passes_equal_chain_rows(tiny_models):
    """Tree rounds through the batcher: 4 sessions at once mix chain rounds and trees of up to 40
    nodes (so a tree spans passes) sharing a pool of 16 tree ids (so trees wait for ids), in a
    cache with almost no spare cells (so it compacts under trees in flight). Every tree row is
    bit-identical to the row a private context gives for the chain through that node; afterwards
    every tree id is back in the pool."""
    from cloud_verifier.backends.batcher import Batcher
    model = GGUFModel(str(tiny_models["target"]), n_threads=1)
    kv = SharedKV(model, 4, 160, slack=33, tree_ids=16)
    batcher = Batcher(kv)
    failures: list[str] = []
    n_trees = [0]

    def run(k: int):
        rng = np.random.default_rng(100 + k)
        seq = batcher.acquire(kv.acquire)
        ctx = model.new_context(512, invariant=True)
        committed = model.tokenize(PROMPTS[k])
        for r in range(20):
            if len(committed) > 110:
                break
            if r % 2:
                drafts = [int(t) for t in rng.integers(3, model.n_vocab, size=int(rng.integers(0, 5)))]
                got = batcher.submit(seq, committed + drafts, len(drafts) + 1)[0]
                want = ctx.logits(committed + drafts, len(drafts) + 1)
                if not np.array_equal(got, want):
                    failures.append(f"session {k} chain round {r}")
                committed = committed + drafts[:int(rng.integers(0, len(drafts) + 1))]
            else:
                tokens, parents = _random_tree(rng, model.n_vocab, 40, 12)
                got = batcher.submit_tree(seq, committed, tokens, parents)[0]
                n_trees[0] += 1
                want = [ctx.logits(committed, 1)[0]]
                for i in range(len(tokens)):
                    path, node = [], i
                    while node != -1:
                        path.insert(0, tokens[node])
                        node = parents[node]
                    want.append(ctx.logits(committed + path, 1)[0])
                if not np.array_equal(got, np.stack(want)):
                    bad = [i for i in range(len(want)) if not np.array_equal(got[i], want[i])]
                    failures.append(f"session {k} tree round {r}: rows {bad} of {len(want)} differ")
                node = int(rng.integers(-1, len(tokens)))
                path = []
                while node != -1:
                    path.insert(0, tokens[node])
                    node = parents[node]
                committed = committed + path
            committed = committed + [int(rng.integers(3, model.n_vocab))]
        ctx.close()
        batcher.release(seq)

    _in_threads(run, 4, timeout_s=300)
    batcher.close()
    print(f"{n_trees[0]} trees, {kv.compactions} compactions in {batcher.passes} passes")
    assert not failures, failures
    assert n_trees[0] >= 16 and kv.compactions >= 1
    assert sorted(kv._tree_free) == list(range(kv.retired + 1, kv.retired + 17))
    kv.close()


def test_replayed_cache_equals_the_cache_built_in_rounds(tiny_models):
    """The same rows after the cache was built token by token, in rounds of 5, or in one replay."""
    model = GGUFModel(str(tiny_models["target"]), n_threads=1)
    tokens = model.tokenize("hello world, the list of the world " * 12)[:150]
    ref_ctx = model.new_context(512, invariant=True)
    ref = [ref_ctx.logits(tokens[:n], 1)[0] for n in range(100, 150)]  # one token at a time
    kv = SharedKV(model, 2, 512)
    seq = kv.acquire()
    rounds = []
    for n in range(100, 150, 5):
        rows = kv.decode(kv.prepare(seq, tokens[:n + 5], 5)) if n > 100 else []
        rounds.extend(rows)
        if n == 100:
            items = kv.prepare(seq, tokens[:105], 6)  # 100 prompt tokens in chunks of 32, then rows
            got = []
            for i in range(0, len(items), kv.n_ubatch):
                got += kv.decode(items[i:i + kv.n_ubatch])
            rounds.extend(got[1:])
    replay_seq = kv.acquire()
    items = kv.prepare(replay_seq, tokens[:150], 50)
    replay = []
    for i in range(0, len(items), kv.n_ubatch):
        replay += kv.decode(items[i:i + kv.n_ubatch])
    kv.close()
    ref_ctx.close()
    np.testing.assert_array_equal(np.stack(ref[1:]), np.stack(rounds[:49]))
    np.testing.assert_array_equal(np.stack(ref[1:]), np.stack(replay[:49]))


# --- end to end: same seed, same text ---------------------------------------------------------

async def _generate(port, drafter, prompt, seed, n=24, gamma=4, **client_kw):
    async with EdgeClient(edge_options(f"127.0.0.1:{port}", gamma=gamma, **client_kw), drafter, drafter.model) as c:
        gen = c.generate(prompt, SamplingSettings(temperature=0.9, top_p=0.95, max_new_tokens=n, ignore_eos=True,
                                                  seed=seed))
        await gen.text()
    return gen.stats


async def _while_evicting(server, every_s: float, runs) -> list:
    """Run the generations while the server evicts an idle session every `every_s`."""
    async def evict_often(stop: asyncio.Event):
        while not stop.is_set():
            server.engine.sessions.evict_idle()
            await asyncio.sleep(every_s)

    stop = asyncio.Event()
    evictor = asyncio.create_task(evict_often(stop))
    try:
        return await asyncio.gather(*runs)
    finally:
        stop.set()
        await evictor


async def test_eight_concurrent_sessions_equal_their_single_session_runs(tiny_models, drafters):
    """Seeded sampling with q: each of 8 sessions (different prompts) gives the same tokens alone
    on the serial verifier, alone on the batched one, and inside a batch of 8."""
    serial = LlamaCppBackend(str(tiny_models["target"]), n_ctx=512, n_threads=1, batching=False)
    async with running_server(serial) as server:
        alone_serial = [(await _generate(server.port, d, p, seed=k)).token_ids
                        for k, (d, p) in enumerate(zip(drafters, PROMPTS))]
    serial.close()
    backend = batched_backend(tiny_models)
    async with running_server(backend) as server:
        alone = [(await _generate(server.port, d, p, seed=k)).token_ids
                 for k, (d, p) in enumerate(zip(drafters, PROMPTS))]
        together = await asyncio.gather(*[_generate(server.port, d, p, seed=k)
                                          for k, (d, p) in enumerate(zip(drafters, PROMPTS))])
    backend.close()
    assert alone == alone_serial
    assert [s.token_ids for s in together] == alone
    assert len({tuple(t) for t in alone}) == len(PROMPTS), "different prompts should give different texts"


async def test_tree_rounds_in_a_batch_equal_their_single_session_runs(tiny_models):
    """Token trees with batching: 8 seeded sessions drafting trees (q shipped) give the same
    tokens alone and all 8 at once, their trees sharing passes and the pool of tree ids."""
    ds = [GGUFDrafter(str(tiny_models["draft"]), n_threads=1, n_ctx=512, max_tree_nodes=16) for _ in PROMPTS]
    backend = batched_backend(tiny_models, max_tree_leaves=16)
    tree = "budget=10,depth=4,branching=2,width=3"
    try:
        async with running_server(backend) as server:
            alone = [await _generate(server.port, d, p, seed=k, n=30, tree=tree, max_tree_nodes=16)
                     for k, (d, p) in enumerate(zip(ds, PROMPTS))]
            passes = backend.batcher.passes
            running = [len(PROMPTS)]   # each pass waits for every running session's round
            held = HeldPasses(backend.batcher, lambda _: running[0], max_wait_s=10.0)

            async def counted(k, d, p):
                try:
                    return await _generate(server.port, d, p, seed=k, n=30, tree=tree, max_tree_nodes=16)
                finally:
                    running[0] -= 1
            together = await asyncio.gather(*[counted(k, d, p) for k, (d, p) in enumerate(zip(ds, PROMPTS))])
            passes_together = backend.batcher.passes - passes
    finally:
        backend.close()
        for d in ds:
            d.close()
    assert all(st.tree_rounds > 0 and st.nodes_per_round > 1 for st in alone)
    assert [st.token_ids for st in together] == [st.token_ids for st in alone]
    assert held.timed_out == 0 and max(held.sessions_per_pass) > 1
    assert passes_together < passes, (passes_together, passes)


async def test_same_text_across_replays(tiny_models, drafters):
    """4 concurrent sessions while idle sessions are evicted every few milliseconds: each is
    replayed (its KV cache rebuilt in other shapes, among other sessions) and still gives the
    tokens of its undisturbed run."""
    backend = batched_backend(tiny_models)
    async with running_server(backend) as server:
        alone = [(await _generate(server.port, d, p, seed=k, n=40)).token_ids
                 for k, (d, p) in enumerate(zip(drafters[:4], PROMPTS))]

        runs = await _while_evicting(server, 0.005, [_generate(server.port, d, p, seed=k, n=40, max_replays=1000)
                                                     for k, (d, p) in enumerate(zip(drafters[:4], PROMPTS))])
    backend.close()
    assert sum(s.replays for s in runs) >= 4, "the test needs replays"
    assert [s.token_ids for s in runs] == alone


@pytest.mark.slow
async def test_same_seed_same_text_on_the_bundled_target():
    """The bundled target (where cell order once moved logits by 1.4): 8 seeded generations of
    48 tokens, with the bundled self-draft (or the target as its own drafter without it), give
    the same tokens alone on the serial verifier, alone on the batched one, all 8 in one batch,
    and with every session evicted and replayed mid-generation."""
    from llama_runtime import bundled_model_path
    from edge_client.drafters import DEFAULT_DRAFT
    draft = DEFAULT_DRAFT if DEFAULT_DRAFT.is_file() else bundled_model_path()
    topics = ["chess", "bread", "Rome", "rain", "bees", "tides", "volcanoes", "the moon"]
    prompts = [f"Write a short list of facts about {t}." for t in topics]
    ds = [GGUFDrafter(str(draft), n_threads=1, n_ctx=512) for _ in prompts]
    try:
        def backend(batching):
            return LlamaCppBackend(str(bundled_model_path()), n_ctx=512, n_threads=2, batching=batching,
                                   kv_tokens=8 * 512)
        serial = backend(False)
        async with running_server(serial) as server:
            alone_serial = [(await _generate(server.port, d, p, seed=k, n=48)).token_ids
                            for k, (d, p) in enumerate(zip(ds, prompts))]
        serial.close()
        batched = backend(True)
        async with running_server(batched) as server:
            alone = [(await _generate(server.port, d, p, seed=k, n=48)).token_ids
                     for k, (d, p) in enumerate(zip(ds, prompts))]
            together = await asyncio.gather(*[_generate(server.port, d, p, seed=k, n=48)
                                              for k, (d, p) in enumerate(zip(ds, prompts))])
            replayed = await _while_evicting(server, 0.05, [_generate(server.port, d, p, seed=k, n=48,
                                                                      max_replays=1000)
                                                            for k, (d, p) in enumerate(zip(ds, prompts))])
        batched.close()
    finally:
        for d in ds:
            d.close()
    print(f"{sum(s.replays for s in replayed)} replays; "
          f"{sum(s.rounds for s in together)} rounds in the batch of 8")
    assert alone == alone_serial
    assert [s.token_ids for s in together] == alone
    assert sum(s.replays for s in replayed) >= 4, "the test needs replays"
    assert [s.token_ids for s in replayed] == alone
    assert len({tuple(t) for t in alone}) == len(prompts)


async def test_cloud_only_streams_batch_and_match_single_streams(tiny_models):
    """Concurrent Generate streams share passes (one token per stream per pass) and each gives
    the tokens it gives alone."""
    backend = batched_backend(tiny_models)
    model = GGUFModel(str(tiny_models["target"]), vocab_only=True)

    async def stream(stub, k):
        req = pb.GenerateRequest(prompt_token_ids=model.tokenize(PROMPTS[k]),
                                 sampling=pb.SamplingParams(temperature=0.8, max_new_tokens=20, ignore_eos=True,
                                                            seed=k))
        return [t async for chunk in stub.Generate(req, timeout=60) for t in chunk.token_ids]

    async with running_server(backend) as server:
        async with stub_for(server) as stub:
            alone = [await stream(stub, k) for k in range(len(PROMPTS))]
            passes_alone = backend.batcher.passes
            sessions_before, tokens_before = _histogram("sessions"), _histogram("tokens")
            running = [len(PROMPTS)]   # each pass waits for every running stream's step
            held = HeldPasses(backend.batcher, lambda _: running[0], max_wait_s=5.0)

            async def counted(k):
                try:
                    return await stream(stub, k)
                finally:
                    running[0] -= 1
            together = await asyncio.gather(*[counted(k) for k in range(len(PROMPTS))])
            passes_together = backend.batcher.passes - passes_alone
            sessions_after, tokens_after = _histogram("sessions"), _histogram("tokens")
    backend.close()
    assert together == alone
    assert held.timed_out == 0
    assert passes_together < 0.6 * passes_alone, (passes_together, passes_alone)
    # The per-pass metrics saw the same passes, with more than one session in them on average.
    assert sessions_after[1] - sessions_before[1] == passes_together
    assert (sessions_after[0] - sessions_before[0]) / passes_together > 1.5
    assert tokens_after[0] - tokens_before[0] >= 20 * len(PROMPTS)


def _histogram(name: str) -> tuple[float, float]:
    """(sum, count) of hybridspec_batch_<name>."""
    from prometheus_client import REGISTRY
    return (REGISTRY.get_sample_value(f"hybridspec_batch_{name}_sum"),
            REGISTRY.get_sample_value(f"hybridspec_batch_{name}_count"))


# --- limits -----------------------------------------------------------------------------------

def open_req(model, key: bytes, prompt: str, drafts=(), max_new=20):
    ids = model.tokenize(prompt)
    return pb.VerifyRequest(round=1, committed_length=len(ids), draft_token_ids=list(drafts),
                            open=pb.OpenSession(prompt_token_ids=ids, open_key=key,
                                                tokenizer_fingerprint=model.fingerprint,
                                                sampling=pb.SamplingParams(temperature=0, max_new_tokens=max_new,
                                                                           ignore_eos=True)))


async def test_full_kv_cache_evicts_idle_sessions_or_refuses_clearly(tiny_models):
    backend = batched_backend(tiny_models, kv_tokens=2 * 512)
    backend.batcher.packer = SlowPacker(backend.kv, 0.01)  # streams of 400 tokens last > 4 s
    model = GGUFModel(str(tiny_models["target"]), vocab_only=True)
    assert backend.caps.max_states == 2
    async with running_server(backend, max_sessions=8) as server:
        assert server.engine.max_sessions == 2
        async with stub_for(server) as stub:
            first = await stub.Verify(open_req(model, b"a" * 16, "hello"), timeout=30)
            await stub.Verify(open_req(model, b"b" * 16, "world"), timeout=30)
            await stub.Verify(open_req(model, b"c" * 16, "the list"), timeout=30)  # evicts "a" (LRU)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Verify(pb.VerifyRequest(session_id=first.session_id, round=2,
                                                   committed_length=first.committed_length), timeout=30)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            # Two long Generate streams hold both KV slots: a new session finds no idle one to evict.
            for sid in [s.id for s in server.engine.sessions.sessions()]:
                server.engine.close(sid)
            gen = [stub.Generate(pb.GenerateRequest(prompt_token_ids=model.tokenize("hello"),
                                                    sampling=pb.SamplingParams(temperature=0, max_new_tokens=400,
                                                                               ignore_eos=True)), timeout=60)
                   for _ in range(2)]
            firsts = [await g.read() for g in gen]
            assert all(f.token_ids for f in firsts)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Verify(open_req(model, b"d" * 16, "hello"), timeout=30)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "KV cache" in e.value.details() and "retry" in e.value.details()
            for g in gen:
                g.cancel()
            await asyncio.sleep(0.5)
            ok = await stub.Verify(open_req(model, b"e" * 16, "hello"), timeout=30)  # slots came back
            assert ok.committed_length > 0
    backend.close()


class SlowPacker:
    """Wraps a packer: every pass takes at least `delay_s`; records releases during a pass."""

    def __init__(self, inner, delay_s):
        self.inner, self.delay_s, self.n_ubatch = inner, delay_s, inner.n_ubatch
        self.in_pass: set[int] = set()
        self.violations = 0

    def prepare(self, seq, tokens, rows):
        return self.inner.prepare(seq, tokens, rows)

    def decode(self, items):
        self.in_pass = {it.seq for it in items}
        time.sleep(self.delay_s)
        try:
            return self.inner.decode(items)
        finally:
            self.in_pass = set()

    def release(self, seq):
        if seq in self.in_pass:
            self.violations += 1
        self.inner.release(seq)


@pytest.mark.timing
async def test_an_edge_that_disappears_mid_round_does_not_stall_the_others(tiny_models, drafters):
    backend = batched_backend(tiny_models)
    slow = SlowPacker(backend.kv, 0.15)
    backend.batcher.packer = slow
    model = drafters[0].model
    async with running_server(backend) as server:
        async with stub_for(server) as stub:
            async def vanishing(k):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Verify(open_req(model, bytes([k]) * 16, PROMPTS[k], drafts=[5, 6, 7]), timeout=0.05)
                assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            t0 = time.perf_counter()
            results = await asyncio.gather(vanishing(1), vanishing(2),
                                           _generate(server.port, drafters[3], PROMPTS[3], seed=3, n=8),
                                           _generate(server.port, drafters[4], PROMPTS[4], seed=4, n=8))
            elapsed = time.perf_counter() - t0
            await asyncio.sleep(0.5)
    backend.close()
    assert [len(s.token_ids) for s in results[2:]] == [8, 8]
    assert elapsed < 30, "the others finished (a generous bound: nothing waited on the vanished edges)"
    assert slow.violations == 0


# --- statistics over real concurrent sessions -------------------------------------------------

V, L = 5, 3   # as in test_exactness_stats, whose exact probabilities and chi-square these use


class AcceptEverything(SyntheticBackend):
    """Negative control: a verifier that accepts every draft of a chain (biased toward the draft)."""

    def accept(self, logits, tree, draft_probs, settings, rng, position=None):
        out = super().accept(logits, tree, draft_probs, settings, rng, position)
        return TreeResult(list(range(len(tree))), out.next_token) if tree.is_chain else out


class FollowFirstChild(SyntheticBackend):
    """Negative control for trees: moves to a node's first child whenever any child would win."""

    def accept(self, logits, tree, draft_probs, settings, rng, position=None):
        if tree.is_chain:
            return super().accept(logits, tree, draft_probs, settings, rng, position)
        from test_tree_exactness import follow_first_child
        p = processed_probs(logits, settings.temperature, settings.top_k, settings.top_p)
        return follow_first_child(p, tree, draft_probs, rng)


async def _sequence_counts(backend, n, concurrency=48, tree="off", **limits):
    settings = SamplingSettings(temperature=1.0, max_new_tokens=L, ignore_eos=True)
    async with running_server(backend, max_sessions=concurrency + 8, **limits) as server:
        async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=2, qmode="float:0", tree=tree),
                              SyntheticDrafter(V, seed=0, noise=1.0), SyntheticTokenizer(V)) as c:
            stats = await generate_many(c, n, settings, concurrency)
    return dict(Counter(tuple(st.token_ids) for st in stats))


@pytest.mark.slow
@pytest.mark.parametrize("tree, schedule", [("off", "fair"), ("budget=4,depth=2,branching=2,width=2", "fair"),
                                            ("off", "slack")])
async def test_sequences_follow_the_target_with_sessions_in_shared_batches(tree, schedule):
    """N = 3000 generations of L = 3 tokens (V = 5, gamma = 2, T = 1, float q), 48 at a time on
    a batching synthetic target (a pass costs 2 ms, so rounds queue and share passes), with
    chains or with trees of 4 nodes, passes filled fair-share or least slack first: the counts of the 125 sequences match the target's exact
    probabilities (chi-square, p > 1e-4; cells with expected count < 5 pooled). Negative
    control: accepting every draft (chains) or always following the first child (trees) fails
    the same test."""
    n = 3000
    target, _ = synthetic_pair(V, 0, 1.0, 1)
    probs = exact_sequence_probs(target, [0], SamplingSettings(temperature=1.0))
    backend = SyntheticBackend(vocab=V, seed=0, step_ms=2.0, batching=True, schedule=schedule, prefill_chunk=1)
    # Each pass waits (at most 20 ms) for 8 rounds to be there: sharing by construction, not by luck.
    held = HeldPasses(backend.batcher, lambda _: 8, max_wait_s=0.02)
    PassLog(backend.batcher)   # each pass's composition, into the test's replay record
    exactness.note_config(n=n, tree=tree, schedule=schedule, vocab=V, gamma=2, sampling="T 1, unseeded")
    counts = await _sequence_counts(backend, n, tree=tree, slo_tpot_ms=3.0 if schedule == "slack" else 0.0)
    shared = backend.batcher.passes
    backend.close()
    assert sum(counts.values()) == n
    multi = sum(1 for k in held.sessions_per_pass if k > 1)
    assert multi > 0, f"no pass held rounds of two sessions ({shared} passes)"
    p_value = chi_square_p(counts, probs, n)
    control = (AcceptEverything if tree == "off" else FollowFirstChild)(vocab=V, seed=0, step_ms=2.0, batching=True)
    bad = await _sequence_counts(control, n, tree=tree)
    control.close()
    p_control = chi_square_p(bad, probs, n)
    print(f"{n} generations in {shared} passes ({multi} with more than one session); chi-square p = {p_value:.3g}, control p = {p_control:.3g}")
    assert p_value > 1e-4
    assert p_control < 1e-4


# --- memory: 64 sessions on the bundled target ------------------------------------------------

RSS_BOUND_MB = 1024  # 64 sessions x 256 tokens of KV (377 MB) + weights + compute buffers


def _peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


@pytest.mark.slow
async def test_sixty_four_sessions_on_the_bundled_target_stay_under_the_rss_bound():
    """A verifier process with KV room for exactly 64 sessions of 256 tokens: 64 concurrent
    sessions run three rounds each; the process's peak RSS stays under RSS_BOUND_MB; a 65th
    session is refused with RESOURCE_EXHAUSTED while every session was used within
    --evict-idle-after, then evicts the least recently used idle one (whose next round gets
    NOT_FOUND, to replay); nothing crashes."""
    from cloud_verifier.process import spawn_verifier
    from llama_runtime import bundled_model_path
    from spec_core.proto import verifier_pb2_grpc as pb_grpc
    model = GGUFModel(bundled_model_path(), vocab_only=True)
    proc, addr = spawn_verifier(["--batching", "on", "--n-ctx", "256", "--kv-tokens", str(64 * 256),
                                 "--max-sessions", "64", "--evict-idle-after", "1",
                                 # one thread: llama.cpp's threads spin-wait, so a verifier on both
                                 # of CI's 2 cores beside busy processes stalls past the deadlines
                                 "--threads", "1"])
    try:
        async with grpc.aio.insecure_channel(addr) as ch:
            stub = pb_grpc.VerifierStub(ch)
            info = await stub.GetServerInfo(pb.ServerInfoRequest(), timeout=30)
            assert info.max_sessions == 64

            async def session(k: int):
                reply = await stub.Verify(open_req(model, k.to_bytes(16, "big"), f"Item {k}: a list of",
                                                   drafts=[28, 29, 30]), timeout=300)
                for _ in range(2):
                    reply = await stub.Verify(pb.VerifyRequest(
                        session_id=reply.session_id, round=reply.round + 1, committed_length=reply.committed_length,
                        draft_token_ids=[28, 29]), timeout=300)
                return reply

            replies = await asyncio.gather(*[session(k) for k in range(64)])
            assert all(r.round == 3 for r in replies)
            # At the bound a newcomer is refused with a retry hint while every session was used
            # within --evict-idle-after, and evicts the least recently used one after that.
            refusals = 0
            for _ in range(20):
                try:
                    await stub.Verify(open_req(model, b"\xff" * 16, "one more"), timeout=60)
                    break
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry" in e.details(), e
                    refusals += 1
                    await asyncio.sleep(0.5)
            else:
                pytest.fail("the 65th session was never admitted")
            outcomes = []
            for r in replies:
                try:
                    await stub.Verify(pb.VerifyRequest(session_id=r.session_id, round=4,
                                                       committed_length=r.committed_length), timeout=60)
                    outcomes.append("ok")
                except grpc.aio.AioRpcError as e:
                    outcomes.append(e.code())
            assert outcomes.count(grpc.StatusCode.NOT_FOUND) == 1 and outcomes.count("ok") == 63, outcomes
            peak = _peak_rss_mb(proc.pid)
            print(f"verifier peak RSS with 64 sessions: {peak:.0f} MB (bound {RSS_BOUND_MB} MB); "
                  f"the 65th was refused {refusals} times before it evicted one")
            assert peak < RSS_BOUND_MB
        assert proc.poll() is None, "the verifier must still be running"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def test_a_full_store_evicts_finished_sessions_before_live_ones():
    """Finished sessions (kept for a retried last round) hold no KV cache: they go first."""
    def req(key, max_new):
        return pb.VerifyRequest(round=1, committed_length=2, open=pb.OpenSession(
            prompt_token_ids=[0, 5], open_key=key, tokenizer_fingerprint=synthetic_fingerprint(64),
            sampling=pb.SamplingParams(temperature=1.0, max_new_tokens=max_new, ignore_eos=True)))
    async with running_server(SyntheticBackend(), max_sessions=2) as server:
        async with stub_for(server) as stub:
            live = await stub.Verify(req(b"L" * 16, 50), timeout=10)          # older, still generating
            done = await stub.Verify(req(b"D" * 16, 1), timeout=10)           # finishes in its first round
            assert done.finish_reason == pb.LENGTH
            await stub.Verify(req(b"N" * 16, 50), timeout=10)                 # the store is full: evict one
            nxt = await stub.Verify(pb.VerifyRequest(session_id=live.session_id, round=2,
                                                     committed_length=live.committed_length), timeout=10)
            assert nxt.round == 2


class RecordingPacker:
    """A model-free packer: logits rows are zeros; records each pass's items."""

    def __init__(self, n_ubatch=32, delay_s=0.0):
        self.n_ubatch, self.delay_s = n_ubatch, delay_s
        self.passes: list[list] = []

    def prepare(self, seq, tokens, rows):
        return [PassItem(seq, pos, tok, pos >= len(tokens) - rows) for pos, tok in enumerate(tokens)]

    def decode(self, items):
        self.passes.append(list(items))
        time.sleep(self.delay_s)
        return [np.zeros(4, dtype=np.float32) for it in items if it.want_logits]

    def release(self, seq):
        pass


def test_a_long_prefill_does_not_hold_up_short_rounds():
    """A 300-token prefill and four 5-token rounds arrive together: the next pass holds all four
    rounds and a share of the prefill, which is spread over the following passes."""
    from cloud_verifier.backends.batcher import Batcher
    packer = RecordingPacker()
    batcher = Batcher(packer)
    held = HeldPasses(batcher, lambda i: 5 if i == 1 else 0)   # the second pass waits for the five
    out = {}

    def call(seq, n, rows):
        out[seq] = batcher.submit(seq, list(range(n)), rows)

    first = threading.Thread(target=call, args=(9, 1, 1))
    first.start()
    assert held.entered.wait(30)
    threads = [threading.Thread(target=call, args=(0, 300, 1))] + \
              [threading.Thread(target=call, args=(k, 5, 5)) for k in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads + [first]:
        t.join(timeout=30)
    batcher.close()
    assert out[0][0].shape == (1, 4) and all(out[k][0].shape == (5, 4) for k in range(1, 5))
    assert {it.seq for it in packer.passes[0]} == {9}
    second_pass = {it.seq for it in packer.passes[1]}
    assert second_pass == {0, 1, 2, 3, 4}, second_pass
    assert all(len(p) <= 32 for p in packer.passes)
    assert sum(1 for p in packer.passes for it in p if it.seq == 0) == 300


@pytest.mark.slow
def test_rows_do_not_depend_on_cell_order():
    """Bundled target: the same 7 rows whether or not another sequence released the cells below
    this one's. Before SharedKV retired released cells instead of freeing them, the sequence's
    later positions landed in those lower cells and its rows moved by up to 1.44 logits."""
    from llama_runtime import bundled_model_path
    m = GGUFModel(bundled_model_path(), n_threads=1)
    a = m.tokenize("Write a short list of facts about chess. 1. The", False)[:12]
    b = m.tokenize("Bread is made from flour water and yeast and salt", False)[:10]
    rows = {}
    for variant in ("ordered", "out of order"):
        kv = SharedKV(m, 3, 256)
        sb, sa = kv.acquire(), kv.acquire()
        kv.decode(kv.prepare(sb, b, 1))              # b in cells 0..9
        kv.decode(kv.prepare(sa, a[:5], 1))          # a's positions 0..4 in cells 10..14
        if variant == "out of order":
            kv.release(sb)                           # a's positions 5.. will land in cells 0..6
        rows[variant] = np.stack(kv.decode(kv.prepare(sa, a, 7)))
        kv.close()
    np.testing.assert_array_equal(rows["ordered"], rows["out of order"])

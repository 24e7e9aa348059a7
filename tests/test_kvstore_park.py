"""KV checkpoints (--kv-store) with KV parking (--kv-park on), llama.cpp, --batching on: a parked
session holds no cells in the cache (SharedKV.snapshot gives nothing), so its checkpoint is taken
from its parked copy in host memory; that file restores a replay's rows bit for bit (a restarted
verifier, parking too); a drain with sessions parked writes theirs; and edges through a crash or a
drain with every session parked after each of its rounds get the fault-free run's output, token
for token, with replays restored from the store."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cloud_verifier.backends.llama_cpp import LlamaCppBackend
from cloud_verifier.engine import Limits
from cloud_verifier.server import VerifierServer
from spec_core.kvpark import ParkCost
from helpers import crash_or_drain_first
from test_kvpark import _park_after_every_round
from test_kvstore import (N_CTX, PROMPTS, TOKENS, _cells, _generate_all, _header, _restores, _sample, _tokens,
                          _when)

# PROMPTS: the `drafters` fixture (conftest) makes one drafter per prompt of this module.


def _backend(tiny_models, store, places: int = 1, park: bool = True) -> LlamaCppBackend:
    return LlamaCppBackend(str(tiny_models["target"]), n_ctx=N_CTX, n_threads=1, batching=True,
                           kv_tokens=places * N_CTX, kv_park=park, kv_store=str(store) if store else None,
                           kv_store_every_s=0)


def _replay(tiny_models, store, tokens, rows: int = 5) -> tuple[np.ndarray, int]:
    """A restarted (parking) verifier's first round of a replay of `tokens`: its rows and the tokens it decoded."""
    b = _backend(tiny_models, store, places=2)
    s = b.new_state()
    logits = b.target_logits(s, tokens, rows)[0]
    decoded = b.forward_tokens()
    b.release(s)
    b.close()
    return logits, decoded


@pytest.fixture(scope="module")
def reference(tiny_models):
    """Rows of the last 5 positions of each test sequence, by a verifier without a store (parking on, nothing parked)."""
    return {seed: _replay(tiny_models, None, _tokens(seed))[0] for seed in (0, 1)}


def test_a_parked_session_is_checkpointed_from_its_parked_copy(tiny_models, tmp_path, reference):
    """Parked, the session holds nothing in the cache; its checkpoint is its parked copy (same tokens,
    same bytes), and a restarted verifier restores the rows an uninterrupted session gets."""
    tokens = _tokens(0)
    b = _backend(tiny_models, tmp_path)
    s = b.new_state()
    b.target_logits(s, tokens[:25], 1)
    b.target_logits(s, tokens[:50], 4)
    assert b.book.park(s) and s.parked is not None and s.parked.tokens == tokens[:50]
    assert b.kv.snapshot(s.seq).tokens == []    # nothing in place: only the parked copy can be written
    b.checkpoint(s)                             # (as a drain's hand-back does: written before it returns)
    path, = tmp_path.rglob("*.kv")
    assert _header(path)["tokens"] == tokens[:50]
    assert np.array_equal(_cells(path), s.parked.data)
    assert s.parked is not None                 # checkpointing did not bring it back
    b.checkpoints.flush()
    b.close()                                   # a crash: never released, the file stays
    restored0 = _restores("restored")
    rows, decoded = _replay(tiny_models, tmp_path, tokens)
    assert _restores("restored") - restored0 == 1
    assert decoded == len(tokens) - 50
    assert np.array_equal(rows, reference[0])


def test_the_periodic_checkpoint_of_a_session_parked_before_the_copy_is_its_parked_copy(tiny_models, tmp_path):
    """A round queues its checkpoint for the next gap between passes; the session is parked before
    that gap comes: the copy taken then is the parked one."""
    tokens = _tokens(1)
    b = _backend(tiny_models, tmp_path)
    s = b.new_state()
    b.target_logits(s, tokens[:30], 1)
    b.checkpoints.flush()
    s.ckpt_at = 0.0
    b.book.park(s)                              # parked ...
    b.checkpoints.after_round(s)                # ... and then its checkpoint's copy is due
    b.checkpoints.flush()
    path, = tmp_path.rglob("*.kv")
    assert _header(path)["tokens"] == tokens[:30] and np.array_equal(_cells(path), s.parked.data)
    b.release(s)
    b.close()


def test_a_drain_with_sessions_parked_checkpoints_them_all_and_each_replay_restores(tiny_models, tmp_path,
                                                                                     reference):
    """One place, two sessions: A parked, B in the place. The drain's checkpoint_all writes both
    (A from its parked copy, B from the cache); the released sessions keep their files; a new
    verifier's replays of both restore their stored prefixes, with the uninterrupted rows."""
    a_tokens, b_tokens = _tokens(0), _tokens(1)
    b = _backend(tiny_models, tmp_path, places=1)
    b.book.cost = ParkCost(0.0, 0.0, 0.0)      # any idle time pays for a move
    a = b.new_state()
    b.target_logits(a, a_tokens[:50], 4)
    s = b.new_state()                          # the place is A's: A is parked
    assert a.parked is not None and a.parked.tokens == a_tokens[:50]
    b.target_logits(s, b_tokens[:50], 4)
    b.checkpoints.flush()
    b.checkpoint_all()                         # the drain begins
    heads = sorted(_header(p)["tokens"] for p in tmp_path.rglob("*.kv"))
    assert heads == sorted([a_tokens[:50], b_tokens[:50]])
    b.release(a)
    b.release(s)
    b.close()
    assert len(list(tmp_path.rglob("*.kv"))) == 2   # kept for the replica the sessions move to
    for seed, tokens in ((0, a_tokens), (1, b_tokens)):
        restored0 = _restores("restored")
        rows, decoded = _replay(tiny_models, tmp_path, tokens)
        assert _restores("restored") - restored0 == 1 and decoded == len(tokens) - 50
        assert np.array_equal(rows, reference[seed])


def test_control_without_parking_the_same_drain_copies_from_the_cache(tiny_models, tmp_path):
    """The control for the parked copies above: with parking off both sessions need a place, and
    their checkpoints hold the same tokens (from the cache's cells)."""
    b = _backend(tiny_models, tmp_path, places=2, park=False)
    states = [b.new_state(), b.new_state()]
    for st, seed in zip(states, (0, 1)):
        b.target_logits(st, _tokens(seed)[:50], 4)
    assert all(st.parked is None for st in states)
    b.checkpoint_all()
    heads = sorted(_header(p)["tokens"] for p in tmp_path.rglob("*.kv"))
    assert heads == sorted([_tokens(0)[:50], _tokens(1)[:50]])
    for st in states:
        b.release(st)
    b.close()


# --- end to end: edges through a crash and a drain, their sessions parked ---------------------------

def _server(tiny_models, store, port: int = 0, trees: list[int] | None = None) -> VerifierServer:
    """Two places for four edges, parking on, every session parked as each of its rounds ends;
    `trees` counts the tree rounds."""
    backend = LlamaCppBackend(str(tiny_models["target"]), n_ctx=N_CTX, n_threads=1, batching=True,
                              kv_tokens=2 * N_CTX, kv_park=True, kv_store=str(store) if store else None,
                              kv_store_every_s=0.05)
    _park_after_every_round(backend)
    if trees is not None:
        tree_logits = backend.tree_logits
        backend.tree_logits = lambda *a: trees.append(1) or tree_logits(*a)
    return VerifierServer(backend, "127.0.0.1", port, Limits(), grace_s=2.0)


TREE = "budget=6,depth=3,branching=2,width=2"
# window: up to 3 rounds in flight, continuations for one outcome (a seed pins the output,
# Speculation.timing_dependent); one that waits as its predecessor runs is fused into that pass.
EDGE = {"chain": {}, "tree": {"tree": TREE}, "window": {"window": 3, "max_continuations": 1}}


@pytest.fixture(scope="module")
def tree_drafters(tiny_models):
    """One tiny-model drafter per prompt that builds trees."""
    from edge_client.drafters import GGUFDrafter
    ds = [GGUFDrafter(str(tiny_models["draft"]), n_threads=1, n_ctx=512, max_tree_nodes=16) for _ in PROMPTS]
    yield ds
    for d in ds:
        d.close()


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["chain", "tree", "window"])
@pytest.mark.parametrize("fault", ["crash", "drain"])
async def test_edges_with_parked_sessions_through_a_fault_get_the_fault_free_output(request, tiny_models, tmp_path,
                                                                                  fault, shape):
    """As test_kvstore's fault test, with the sessions parked between their rounds: crash (the port
    closes, nothing released, a new verifier on it) or drain (two replicas, the first drained while
    the edges move to the second); chains, trees of 6 nodes, or a window of rounds in flight. Every output equals the fault-free
    run's (without store or parking), sessions were parked before the fault, and replays restored
    cells from the store."""
    drafters = request.getfixturevalue("tree_drafters" if shape == "tree" else "drafters")
    edge = EDGE[shape]
    plain = LlamaCppBackend(str(tiny_models["target"]), n_ctx=N_CTX, n_threads=1, batching=True,
                            kv_tokens=8 * N_CTX)
    ref = await VerifierServer(plain, "127.0.0.1", 0, Limits(), grace_s=2.0).start()
    try:
        expected = await _generate_all(f"127.0.0.1:{ref.port}", drafters, [0] * len(PROMPTS), **edge)
    finally:
        await ref.stop()
        plain.close()
    assert all(len(ids) == TOKENS for ids in expected)

    store = tmp_path / "kv"
    trees: list[int] = []
    servers = [await _server(tiny_models, store, trees=trees).start() for _ in range(1 if fault == "crash" else 2)]
    restored0, parks0 = _restores("restored"), _sample("hybridspec_kv_parks_total")
    progress = [0] * len(PROMPTS)
    try:
        run = asyncio.ensure_future(_generate_all(",".join(f"127.0.0.1:{s.port}" for s in servers), drafters,
                                                  progress, **edge))
        await _when(progress, 0.4, run)
        assert _sample("hybridspec_kv_parks_total") > parks0
        old = await crash_or_drain_first(servers, fault, lambda port: _server(tiny_models, store, port, trees).start())
        outputs = await run
        old.engine.backend.close()
    finally:
        for s in servers:
            await s.stop()
            s.engine.backend.close()
    assert outputs == expected
    assert _restores("restored") > restored0
    if shape != "window":   # (a window's round fused into its predecessor's pass is a tree: when one waits in time)
        assert (len(trees) > 0) == (shape == "tree")

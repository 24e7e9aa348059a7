"""Session KV checkpoints (--kv-store, cloud_verifier.backends.kvstore, issue 28): a replay
restores the longest stored prefix of its tokens and prefills only the tail, with the rows an
uninterrupted session gets, bit for bit; cells of another prompt (the control) change them; torn,
corrupt and mismatched files and other tenants' checkpoints are never used, and every such case
falls back to the plain prefill; a crash (no drain) and a drain between two replicas sharing the
store give every edge the output of a fault-free run, token for token."""
from __future__ import annotations

import asyncio
import json
import struct

import numpy as np
import pytest
from prometheus_client import REGISTRY

from cloud_verifier.backends.kvstore import MAGIC, KVStore, tenant_folder
from cloud_verifier.backends.llama_cpp import LlamaCppBackend
from cloud_verifier.cli import backend_from_args, build_parser
from cloud_verifier.engine import Limits, run_in_thread
from cloud_verifier.server import VerifierServer
from cloud_verifier.sessions import current_tenant
from edge_client import EdgeClient
from helpers import crash_or_drain_first, edge_options
from llama_runtime import ParkedSeq
from spec_core.warping import SamplingSettings

N_CTX = 256


def _sample(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _restores(outcome: str) -> float:
    return _sample("hybridspec_kv_checkpoint_restores_total", outcome=outcome)


def _backend(tiny_models, store, **kw) -> LlamaCppBackend:
    return LlamaCppBackend(str(tiny_models["target"]), n_ctx=kw.pop("n_ctx", N_CTX), n_threads=1, batching=True,
                           kv_tokens=4 * N_CTX, kv_store=str(store) if store else None, kv_store_every_s=0, **kw)


def _tokens(seed: int, n: int = 70) -> list[int]:
    rng = np.random.default_rng(seed)
    return [1] + [int(t) for t in rng.integers(3, 200, n - 1)]


def _crash(backend: LlamaCppBackend) -> None:
    """The process dies: its sessions are never released; checkpoints already queued are on disk."""
    backend.checkpoints.flush()
    backend.close()


def _checkpointed(tiny_models, store, tokens, upto: int, tenant: str = "") -> None:
    """A verifier that ran a session over tokens[:upto] in two rounds, checkpointed it, and died."""
    token = current_tenant.set(tenant)
    try:
        b = _backend(tiny_models, store)
        s = b.new_state()
        b.target_logits(s, tokens[:upto // 2], 1)
        b.target_logits(s, tokens[:upto], 4)
        _crash(b)
    finally:
        current_tenant.reset(token)


def _replay(tiny_models, store, tokens, rows: int = 5, tenant: str = "", **kw) -> tuple[np.ndarray, int]:
    """A restarted verifier's first round of a replay of `tokens`: its rows and the tokens it decoded."""
    token = current_tenant.set(tenant)
    try:
        b = _backend(tiny_models, store, **kw)
        s = b.new_state()
        logits = b.target_logits(s, tokens, rows)[0]
        decoded = b.forward_tokens()
        b.release(s)
        b.close()
    finally:
        current_tenant.reset(token)
    return logits, decoded


@pytest.fixture(scope="module")
def reference(tiny_models):
    """Rows of the last 5 positions of each test sequence, by a verifier without a store."""
    return {seed: _replay(tiny_models, None, _tokens(seed))[0] for seed in (0, 1)}


def test_a_replay_restores_the_stored_prefix_and_prefills_only_the_tail(tiny_models, tmp_path, reference):
    tokens = _tokens(0)
    _checkpointed(tiny_models, tmp_path, tokens, 50)
    restored0, tokens0 = _restores("restored"), _sample("hybridspec_kv_checkpoint_restored_tokens_total")
    rows, decoded = _replay(tiny_models, tmp_path, tokens)
    assert _restores("restored") - restored0 == 1
    assert _sample("hybridspec_kv_checkpoint_restored_tokens_total") - tokens0 == 50
    assert decoded == len(tokens) - 50          # only the tail was prefilled
    assert np.array_equal(rows, reference[0])   # bit for bit the uninterrupted rows


def test_a_checkpoint_longer_than_the_replay_is_cut_to_what_the_replay_keeps(tiny_models, tmp_path, reference):
    """The stored cells hold a rejected draft beyond the replayed tokens: those cells are rolled back."""
    tokens = _tokens(0)
    _checkpointed(tiny_models, tmp_path, tokens[:60] + _tokens(7)[:8], 68)
    rows, decoded = _replay(tiny_models, tmp_path, tokens)
    assert decoded == len(tokens) - 60
    assert np.array_equal(rows, reference[0])


def test_control_cells_of_another_prompt_change_the_rows(tiny_models, tmp_path, reference):
    """The negative control: a checkpoint whose header claims prompt A's tokens but holds prompt
    B's cells is restored (the store cannot tell), and the rows differ from A's: the equality the
    other tests assert is evidence that the right cells were restored."""
    a, b = _tokens(0), _tokens(1)
    _checkpointed(tiny_models, tmp_path, b, 50)
    path = next(tmp_path.rglob("*.kv"))
    data = _cells(path)
    store = KVStore(tmp_path, _header(path)["fingerprint"])
    store.put("", path.stem, ParkedSeq(a[:50], data))
    store.close()
    rows, decoded = _replay(tiny_models, tmp_path, a)
    assert decoded == len(a) - 50
    assert not np.allclose(rows, reference[0], atol=1e-3)


def _header(path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<I", raw[len(MAGIC):len(MAGIC) + 4])
    return json.loads(raw[len(MAGIC) + 4:len(MAGIC) + 4 + n])


def _cells(path) -> np.ndarray:
    raw = path.read_bytes()
    (n,) = struct.unpack("<I", raw[len(MAGIC):len(MAGIC) + 4])
    return np.frombuffer(raw[len(MAGIC) + 4 + n:], dtype=np.uint8).copy()


def _rewrite_header(path, **changes) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<I", raw[len(MAGIC):len(MAGIC) + 4])
    doc = json.loads(raw[len(MAGIC) + 4:len(MAGIC) + 4 + n])
    doc.update(changes)
    head = json.dumps(doc).encode()
    path.write_bytes(MAGIC + struct.pack("<I", len(head)) + head + raw[len(MAGIC) + 4 + n:])


BREAKS = {
    "torn": lambda p: p.write_bytes(p.read_bytes()[:-1000]),
    "corrupt": lambda p: p.write_bytes(p.read_bytes()[:-500] + bytes([p.read_bytes()[-500] ^ 1])
                                       + p.read_bytes()[-499:]),
    "bad magic": lambda p: p.write_bytes(b"XXXXX\n" + p.read_bytes()[len(MAGIC):]),
    "other fingerprint": lambda p: _rewrite_header(p, fingerprint="0" * 64),
    "other tenant in header": lambda p: _rewrite_header(p, tenant=tenant_folder("mallory")),
}


@pytest.mark.parametrize("how", list(BREAKS))
def test_torn_corrupt_and_mismatched_files_are_refused_and_the_replay_prefills(tiny_models, tmp_path, reference,
                                                                               how):
    tokens = _tokens(0)
    _checkpointed(tiny_models, tmp_path, tokens, 50)
    BREAKS[how](next(tmp_path.rglob("*.kv")))
    refused0, restored0 = _restores("refused"), _restores("restored")
    rows, decoded = _replay(tiny_models, tmp_path, tokens)
    assert _restores("refused") - refused0 == 1 and _restores("restored") == restored0
    assert decoded == len(tokens)
    assert np.array_equal(rows, reference[0])


def test_a_verifier_with_other_settings_does_not_see_the_checkpoints(tiny_models, tmp_path):
    """Another n_ctx changes the fingerprint, so the file lies in another folder: not read at all."""
    tokens = _tokens(0)
    _checkpointed(tiny_models, tmp_path, tokens, 50)
    none0, refused0 = _restores("none"), _restores("refused")
    _, decoded = _replay(tiny_models, tmp_path, tokens, n_ctx=2 * N_CTX)
    assert decoded == len(tokens)
    assert _restores("none") - none0 == 1 and _restores("refused") == refused0


def test_another_tenants_checkpoint_is_never_used(tiny_models, tmp_path, reference):
    tokens = _tokens(0)
    _checkpointed(tiny_models, tmp_path, tokens, 50, tenant="alice")
    restored0 = _restores("restored")
    rows, decoded = _replay(tiny_models, tmp_path, tokens, tenant="bob")
    assert decoded == len(tokens) and _restores("restored") == restored0
    assert np.array_equal(rows, reference[0])
    _, decoded = _replay(tiny_models, tmp_path, tokens, tenant="alice")   # the owner's replay does restore
    assert decoded == len(tokens) - 50 and _restores("restored") == restored0 + 1


async def test_backend_calls_run_as_the_calls_tenant():
    """The backend reads the tenant it files a session's checkpoints under from the call's context
    (engine.run_in_thread carries it into the worker thread)."""
    token = current_tenant.set("alice")
    try:
        assert await run_in_thread(current_tenant.get) == "alice"
    finally:
        current_tenant.reset(token)
    assert await run_in_thread(current_tenant.get) == ""


def test_a_released_session_deletes_its_file_unless_a_drain_keeps_it(tiny_models, tmp_path):
    b = _backend(tiny_models, tmp_path)
    s1, s2 = b.new_state(), b.new_state()
    for s, seed in ((s1, 0), (s2, 1)):
        b.target_logits(s, _tokens(seed)[:40], 1)
    b.checkpoints.flush()
    assert len(list(tmp_path.rglob("*.kv"))) == 2
    b.release(s1)
    b.checkpoints.flush()
    assert len(list(tmp_path.rglob("*.kv"))) == 1
    b.checkpoint_all()     # a drain begins
    b.release(s2)
    b.close()
    assert len(list(tmp_path.rglob("*.kv"))) == 1


def test_the_store_bound_drops_checkpoints_that_do_not_fit(tiny_models, tmp_path):
    full0 = _sample("hybridspec_kv_checkpoints_total", event="full")
    b = _backend(tiny_models, tmp_path)
    s1, s2 = b.new_state(), b.new_state()
    b.target_logits(s1, _tokens(0)[:40], 1)
    b.checkpoints.flush()
    one = next(tmp_path.rglob("*.kv")).stat().st_size
    b.checkpoints.store.max_bytes = one * 3 // 2    # room for one such file, not two
    b.target_logits(s2, _tokens(1)[:40], 1)
    b.checkpoints.flush()
    files = list(tmp_path.rglob("*.kv"))
    b.close()
    assert len(files) == 1
    assert _sample("hybridspec_kv_checkpoints_total", event="full") == full0 + 1


def test_kv_store_options_are_refused_where_they_cannot_work(tmp_path):
    parser = build_parser()
    for extra in (["--batching", "off"], ["--backend", "synthetic"]):
        args = parser.parse_args(["serve", "--kv-store", str(tmp_path), *extra])
        with pytest.raises(SystemExit, match="--kv-store"):
            backend_from_args(args)


# --- end to end: edges through a crash and a drain ------------------------------------------------

PROMPTS = ["hello world, the list", "def return the list of a", "the the the", "a list of hello"]
TOKENS = 48


def _server(tiny_models, store, port: int = 0) -> VerifierServer:
    backend = LlamaCppBackend(str(tiny_models["target"]), n_ctx=N_CTX, n_threads=1, batching=True,
                              kv_tokens=8 * N_CTX, kv_store=str(store) if store else None, kv_store_every_s=0.05)
    return VerifierServer(backend, "127.0.0.1", port, Limits(), grace_s=2.0)


async def _generate_all(address: str, drafters, progress: list[int], **edge):
    """One edge per prompt: even ones greedy, odd ones seeded sampling at T = 0.9. `edge`: more edge
    options (tests/helpers.edge_options), e.g. a tree shape."""
    async def one(k: int, drafter) -> list[int]:
        settings = SamplingSettings(temperature=0.0 if k % 2 == 0 else 0.9, max_new_tokens=TOKENS, ignore_eos=True,
                                    seed=None if k % 2 == 0 else 300 + k)
        async with EdgeClient(edge_options(address, gamma=4, deadline_s=30, **edge), drafter, drafter.model) as c:
            gen = c.generate(PROMPTS[k], settings)
            async for _ in gen:
                progress[k] = gen.stats.accepted + gen.stats.rounds
            return list(gen.stats.token_ids)
    return await asyncio.gather(*(one(k, d) for k, d in enumerate(drafters)))


async def _when(progress: list[int], share: float, run) -> None:
    while sum(progress) < share * len(progress) * TOKENS and not run.done():
        await asyncio.sleep(0.005)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["crash", "drain"])
async def test_edges_through_a_fault_get_the_fault_free_output_and_restore_from_the_store(tiny_models, drafters,
                                                                                        tmp_path, fault):
    """crash: the verifier stops answering without a drain (its sessions never released) and a new
    one starts on its port; drain: two replicas, the first drained (checkpoints written before the
    hand-back) while the edges move to the second. Every output equals the fault-free run's (the
    seeded ones too: the target is batch-invariant), and replays restored cells from the store."""
    ref = await _server(tiny_models, None).start()
    try:
        expected = await _generate_all(f"127.0.0.1:{ref.port}", drafters, [0] * len(PROMPTS))
    finally:
        await ref.stop()
        ref.engine.backend.close()
    assert all(len(ids) == TOKENS for ids in expected)

    store = tmp_path / "kv"
    servers = [await _server(tiny_models, store).start() for _ in range(1 if fault == "crash" else 2)]
    restored0 = _restores("restored")
    progress = [0] * len(PROMPTS)
    try:
        run = asyncio.ensure_future(_generate_all(",".join(f"127.0.0.1:{s.port}" for s in servers), drafters,
                                                  progress))
        await _when(progress, 0.4, run)
        old = await crash_or_drain_first(servers, fault, lambda port: _server(tiny_models, store, port).start())
        outputs = await run
        old.engine.backend.close()
    finally:
        for s in servers:
            await s.stop()
            s.engine.backend.close()
    assert outputs == expected
    assert _restores("restored") > restored0

"""A long prefill never stalls other sessions' rounds (issue 24): under every schedule and backend
path, a 1,500-token prompt is evaluated a chunk at a time, and a round that arrives meanwhile
waits for the pass in flight, then is served whole in the next.

Structure, not time: the synthetic target records which session each pass held. Negative
control: the same backend with chunking off (a chunk as long as the prompt) fails the checks.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from cloud_verifier.backends.synthetic import SyntheticBackend

PROMPT = 1500          # the long prefill's tokens
BUDGET = 32            # tokens a pass (batched), and the bound on any pass below
CHUNK = 8
ROUND = 17             # the small round: a chain of 16 drafts (17 rows), as --max-gamma 16 allows
NO_CHUNKS = 10_000     # the control: a chunk longer than the prompt (the old behaviour)

CONFIGS = {
    "serial": dict(batching=False),
    "batched fair": dict(batching=True, schedule="fair"),
    "batched slack, no deadlines": dict(batching=True, schedule="slack"),
    "batched slack, the prefill late": dict(batching=True, schedule="slack", late_prefill=True),
    # The parking path (PlacePacker brings parked sessions back as their rounds are prepared).
    "batched, kv-park on": dict(batching=True, kv_park=True, kv_tokens=2 * 4096),
}


class PassLog:
    """Per pass, in order, the tokens each session had in it ({"big": 8, "small": 17}); a pass is
    logged as it starts, so that len(log) at any time counts the passes begun."""

    def __init__(self, backend: SyntheticBackend, names: dict):
        self.passes: list[dict[str, int]] = []
        if backend.batcher is None:
            serial_pass = backend._serial_pass

            def logged(state, new, cached):
                self.passes.append({names[id(state)]: new})
                serial_pass(state, new, cached)
            backend._serial_pass = logged
        else:
            packer = backend.batcher.packer
            decode = packer.decode

            def logged_decode(items):
                counts: dict[str, int] = {}
                for it in items:
                    name = names[it.seq]
                    counts[name] = counts.get(name, 0) + 1
                self.passes.append(counts)
                return decode(items)
            packer.decode = logged_decode

    def begun_with(self, name: str) -> int:
        return sum(1 for p in self.passes if name in p)


def _seq_key(backend, state):
    return id(state) if backend.batcher is None else state.seq


def small_round_while_prefilling(chunk: int, batching: bool, schedule: str = "fair",
                                 late_prefill: bool = False, **backend_kw):
    """Start a 1,500-token prefill; after 3 of its passes (1 without chunks), a small round of
    another session (a pass costs 1 ms + 0.2 ms a token: the prompt alone would take 0.3 s).
    Returns (log, k0): the pass log and how many passes had begun when the round was sent."""
    backend = SyntheticBackend(vocab=16, step_ms=1.0, per_token_ms=0.2, batching=batching, batch_tokens=BUDGET,
                               schedule=schedule, prefill_chunk=chunk, **backend_kw)
    try:
        small, big = backend.new_state(), backend.new_state()
        log = PassLog(backend, {_seq_key(backend, small): "small", _seq_key(backend, big): "big"})
        if late_prefill:   # due a second ago: least slack, so first in every pass
            backend.set_deadline(big, time.perf_counter() - 1.0)
        backend.target_logits(small, [0, 1, 2], 1)
        prompt = [i % 16 for i in range(PROMPT)]
        prefill = threading.Thread(target=backend.target_logits, args=(big, prompt + [3, 4, 5, 6], 5))
        prefill.start()
        deadline = time.monotonic() + 60
        while log.begun_with("big") < (3 if chunk < PROMPT else 1) and time.monotonic() < deadline:
            time.sleep(0.0005)
        k0 = len(log.passes)
        logits, _, _ = backend.target_logits(small, [0, 1, 2] + [5] * (ROUND - 1), ROUND)
        assert logits.shape == (ROUND, 16)
        prefill.join(timeout=120)
        assert not prefill.is_alive()
        return log.passes, k0
    finally:
        backend.close()


def stall_problems(passes: list[dict[str, int]], k0: int) -> list[str]:
    """What breaks the rule: the small round is served whole in one pass, at most one pass after
    the one in flight when it arrived, and no pass it waited for held more than BUDGET tokens."""
    problems = []
    with_small = [j for j, p in enumerate(passes) if j >= k0 and "small" in p]
    if len(with_small) != 1 or passes[with_small[0]]["small"] != ROUND:
        problems.append(f"the round was split over passes {with_small}")
    if with_small and with_small[0] > k0 + 1:
        problems.append(f"the round waited for {with_small[0] - k0 + 1} passes")
    waited = passes[max(0, k0 - 1):with_small[0] if with_small else None]
    if any(sum(p.values()) > BUDGET for p in waited):
        problems.append(f"a pass it waited for held {max(sum(p.values()) for p in waited)} tokens")
    return problems


@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_round_waits_for_one_pass_at_most_while_another_session_prefills(config):
    passes, k0 = small_round_while_prefilling(CHUNK, **CONFIGS[config])
    assert not stall_problems(passes, k0), (stall_problems(passes, k0), passes[max(0, k0 - 2):k0 + 3])
    assert sum(p.get("big", 0) for p in passes) >= PROMPT   # the whole prompt was evaluated
    # No pass held more of the prompt than a pass's budget (serial: a chunk and the rows).
    assert all(p.get("big", 0) <= BUDGET for p in passes)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_control_without_chunks_stalls_the_round(config):
    """Negative control: a chunk as long as the prompt (the schedules as they were) breaks the
    rule on each path: serial, the prompt in one turn; fair, the round split by the prompt's
    share; slack, the round behind the whole prompt."""
    passes, k0 = small_round_while_prefilling(NO_CHUNKS, **CONFIGS[config])
    assert stall_problems(passes, k0)


def test_the_serial_llama_cpp_verifier_prefills_in_turns_with_the_rows_unchanged(tiny_models):
    """llama.cpp, --batching off: a 300-token prompt in chunks of 7 (a turn each) gives, bit for
    bit, the rows of the prompt in one turn, for a chain round and for a tree round after it; the
    chunked prompt took ceil(300 / 7) turns, the other one."""
    from cloud_verifier.backends.llama_cpp import LlamaCppBackend
    from spec_core.tree import DraftTree
    got = {}
    for chunk in (7, NO_CHUNKS):
        backend = LlamaCppBackend(str(tiny_models["target"]), n_ctx=512, n_threads=1, prefill_chunk=chunk)
        vocab = backend.info.n_vocab
        prompt = [int(t) for t in np.random.default_rng(1).integers(3, vocab, size=300)]
        state = backend.new_state()
        turns0 = backend.turns.turns
        chain = backend.target_logits(state, prompt + [5, 6, 7, 8], 5)[0]
        turns = backend.turns.turns - turns0
        # A tree round on a fresh state: its committed tokens are a prefill too.
        tree_state = backend.new_state()
        tree = DraftTree((5, 6, 9), (-1, 0, -1))
        rows = backend.tree_logits(tree_state, prompt, tree)[0]
        got[chunk] = chain, rows, turns
        backend.release(state)
        backend.release(tree_state)
        backend.close()
    np.testing.assert_array_equal(got[7][0], got[NO_CHUNKS][0])
    np.testing.assert_array_equal(got[7][1], got[NO_CHUNKS][1])
    assert (got[7][2], got[NO_CHUNKS][2]) == (-(-300 // 7), 1)

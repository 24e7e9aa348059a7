"""The gumbel coupling's noise in torch (cloud_verifier/backends/torch_accept.gumbel_noise_bits) is
numpy's (spec_core.gumbel.noise_bits), bit for bit: integer arithmetic only. The two logarithms that
turn bits into noise are each library's own; the Gumbel-max token of a row agrees on random rows.

The walk on the device (torch_accept.accept_pass, rounds whose settings say gumbel) against
spec_core.tree.gumbel_walk on the same rows, draw for draw: chains and trees, greedy / top-k / top-p /
plain rows (listed supports and whole rows), several rounds of both couplings in one pass. A round
counts only where no row's top two scores lie within 1e-6 (float32 warping against numpy's float64
could order them differently there); a negative control (the device told another position) must
differ.

Marked `vllm`: torch lives in the vLLM environment (scripts/test_vllm.sh)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is in the vLLM environment (scripts/test_vllm.sh)")

from cloud_verifier.backends.torch_accept import (PassRound, accept_pass, gumbel_noise, gumbel_noise_bits,  # noqa: E402
                                                  round_uniforms)
from spec_core.gumbel import PositionNoise, gumbel_argmax, noise_bits, target_token  # noqa: E402
from spec_core.tree import DraftTree, gumbel_walk  # noqa: E402
from spec_core.warping import GUMBEL, SamplingSettings, processed_probs  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("seed, position", [(0, 0), (11, 7), (2 ** 64 - 1, 2 ** 40), (123456789, 5000)])
def test_torch_and_numpy_noise_bits_are_the_same_integers(seed, position):
    ids = np.arange(262144)
    assert torch.equal(gumbel_noise_bits(seed, position, torch.as_tensor(ids)),
                       torch.as_tensor(noise_bits(seed, position, ids).astype(np.int64)))


def test_the_gumbel_max_token_agrees_on_random_rows():
    rng = np.random.default_rng(0)
    ids = np.arange(4096)
    for k in range(50):
        p = rng.dirichlet(np.full(len(ids), 0.3))
        noise = PositionNoise(9, k)
        scores = torch.log(torch.as_tensor(p)) + gumbel_noise(9, k, torch.as_tensor(ids))
        assert int(torch.argmax(scores)) == gumbel_argmax(p, noise)


# --- the walk on the device against gumbel_walk ----------------------------------------------------

V_WALK = 3000    # top-k / top-p rows are scored over their listed kept ids, plain rows (T 1.0) whole
SETTINGS = [dict(temperature=0.8, top_p=0.9), dict(temperature=1.0), dict(temperature=0.7, top_k=20),
            dict(temperature=0.0), dict(temperature=1.3, top_k=50, top_p=0.8)]
TREES = [DraftTree.chain([0, 0, 0, 0]), DraftTree((0, 0, 0, 0, 0, 0), (-1, 0, 0, -1, 3, 4)), DraftTree((), ())]


def _round(rng, k: int):
    """A gumbel round on random rows whose drafts often carry the target's token (so walks go deep)."""
    s = SamplingSettings(**SETTINGS[k % len(SETTINGS)], seed=int(rng.integers(0, 2 ** 64, dtype=np.uint64)),
                         coupling=GUMBEL)
    shape = TREES[k % len(TREES)]
    logits = (rng.standard_normal((len(shape) + 1, V_WALK)) * 2.5).astype(np.float32)
    position = int(rng.integers(0, 10 ** 6))
    row = lambda i: processed_probs(logits[i], s.temperature, s.top_k, s.top_p)  # noqa: E731
    depths = shape.depths()
    tokens = []
    for i, par in enumerate(shape.parents):   # a node carries y of its parent's row, or a sibling's miss
        y = target_token(row(par + 1), s.seed, position + depths[i] - 1)
        tokens.append(y if rng.random() < 0.75 else int(rng.integers(V_WALK)))
    tree = DraftTree(tuple(tokens), shape.parents)
    return s, tree, logits, position, row


def _near_tie(logits, s, seed, position, tree) -> bool:
    for i, pos in enumerate([position] + [position + d for d in tree.depths()]):
        p = processed_probs(logits[i], s.temperature, s.top_k, s.top_p)
        ids = np.flatnonzero(p)
        scores = np.sort(np.log(p[ids]) + PositionNoise(seed, pos)(ids))
        if len(scores) > 1 and scores[-1] - scores[-2] < 1e-6:
            return True
    return False


def test_the_device_walk_is_gumbel_walk_draw_for_draw():
    """120 gumbel rounds in 20 passes of 6, each pass also holding 2 rejection rounds."""
    rng = np.random.default_rng(3)
    compared = deep = 0
    for _ in range(20):
        rounds, rows, wanted = [], [], []
        for k in range(8):
            if k % 4 == 3:   # a rejection round in the same pass
                tree = DraftTree.chain([int(x) for x in rng.integers(V_WALK, size=3)])
                rounds.append(PassRound(len(rows), tree, None, SamplingSettings(temperature=0.9),
                                        round_uniforms(len(tree), rng)))
                rows += list((rng.standard_normal((len(tree) + 1, V_WALK)) * 2.5).astype(np.float32))
                wanted.append(None)
                continue
            s, tree, logits, position, row = _round(rng, len(rows) + k)
            rounds.append(PassRound(len(rows), tree, None, s, np.empty(0), position))
            rows += list(logits)
            want = gumbel_walk(row, tree, s.seed, position)
            wanted.append(None if _near_tie(logits, s, s.seed, position, tree) else want)
        got = accept_pass(torch.as_tensor(np.stack(rows)), rounds)
        for want, res in zip(wanted, got):
            if want is not None:
                compared += 1
                deep += len(want.path) >= 2
                assert (res.path, res.next_token) == (want.path, want.next_token)
    assert compared >= 110 and deep >= 40   # measured: 120 compared (no near tie), 65 with 2+ kept


def test_the_device_walk_reads_the_position():
    """Negative control: the same rounds told position + 1 end elsewhere (most of them)."""
    rng = np.random.default_rng(4)
    differ = 0
    for k in range(30):
        s, tree, logits, position, row = _round(rng, k)
        if s.greedy:   # y is the argmax at every position
            continue
        want = gumbel_walk(row, tree, s.seed, position)
        got, = accept_pass(torch.as_tensor(logits), [PassRound(0, tree, None, s, np.empty(0), position + 1)])
        differ += (got.path, got.next_token) != (want.path, want.next_token)
    assert differ >= 20   # measured: 24 of 24

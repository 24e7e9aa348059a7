"""The gumbel coupling's noise in torch (cloud_verifier/backends/torch_accept.gumbel_noise_bits) is
numpy's (spec_core.gumbel.noise_bits), bit for bit: integer arithmetic only. The two logarithms that
turn bits into noise are each library's own; the Gumbel-max token of a row agrees on random rows.

Marked `vllm`: torch lives in the vLLM environment (scripts/test_vllm.sh)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is in the vLLM environment (scripts/test_vllm.sh)")

from cloud_verifier.backends.torch_accept import gumbel_noise, gumbel_noise_bits  # noqa: E402
from spec_core.gumbel import PositionNoise, gumbel_argmax, noise_bits  # noqa: E402

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

"""The fleet simulator against what can be worked out by hand (no sockets, no models)."""
from __future__ import annotations

import pytest

from netsim.fleet import (H200, FleetConfig, LinearCost, alpha_from_tokens_per_round, calibrate_from_load, gpu_cost,
                          kv_sessions, simulate)


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


@pytest.mark.parametrize("alpha", [0.3, 0.63, 0.9])
def test_alpha_inverts_tokens_per_round(alpha):
    assert alpha_from_tokens_per_round(expected_tokens_per_round(alpha, 4), 4) == pytest.approx(alpha, abs=1e-9)


def test_one_edge_matches_the_round_arithmetic():
    # lan: 1 ms RTT, nothing random but a few microseconds of transmission. A round takes
    # γ·draft + RTT + pass + overheads = 8 + 1 + 20 + 2 + 3 = 34 ms and commits (1-α^5)/(1-α)
    # tokens on average; 60 s simulated is ~1800 rounds, so the mean is within ~2%.
    cfg = FleetConfig(edges=1, mode="hybrid", cost=LinearCost(0.020, 0.0), alpha=0.63, gamma=4, draft_s=0.002,
                      server_overhead_s=0.002, edge_overhead_s=0.003, duration_s=60.0, max_tokens=10_000)
    result = simulate(cfg)
    round_s = 4 * 0.002 + 0.001 + 0.020 + 0.002 + 0.003
    assert result["committed_tokens_per_s"] == pytest.approx(expected_tokens_per_round(0.63, 4) / round_s, rel=0.04)
    assert result["target_forward_passes_per_committed_token"] == pytest.approx(
        1 / expected_tokens_per_round(0.63, 4), rel=0.04)


def test_serial_verifier_saturates_and_batching_lifts_it():
    # Cloud-only on today's verifier: one token per 20 ms pass, whatever the number of streams.
    serial = [simulate(FleetConfig(edges=n, mode="cloud-only", cost=LinearCost(0.020, 0.0), duration_s=20.0))
              for n in (4, 16)]
    for result in serial:
        assert result["committed_tokens_per_s"] == pytest.approx(50.0, rel=0.03)
    assert serial[1]["tpot_p95_s"] > 3 * serial[0]["tpot_p95_s"]   # the streams take turns
    # Continuous batching: all 16 streams advance in each pass (pass cost independent of tokens here).
    batched = simulate(FleetConfig(edges=16, mode="cloud-only", cost=LinearCost(0.020, 0.0), batching=True,
                                   duration_s=20.0))
    assert batched["committed_tokens_per_s"] > 10 * serial[1]["committed_tokens_per_s"]
    assert batched["tpot_p95_s"] < 0.030


def test_calibration_recovers_the_parameters_of_a_load_run():
    load = {"config": {"gamma": 4, "draft_ms": 2.0, "max_tokens": 64, "profiles": ["lan"]},
            "runs": [{"edges": 1, "mode": "hybrid", "verify_rounds": 100, "model_seconds": 2.0, "round_seconds": 2.2,
                      "committed_tokens": 250, "duration_s": 3.4},
                     {"edges": 1, "mode": "cloud-only", "tpot_p50_s": 0.021}]}
    params = calibrate_from_load(load)
    assert params["cost"].pass_s(5, 1) == pytest.approx(0.020)
    assert params["server_overhead_s"] == pytest.approx(0.002)
    assert expected_tokens_per_round(params["alpha"], 4) == pytest.approx(2.5)
    # 34 ms per round = 8 ms drafting + 1 ms RTT + 20 ms pass + 2 ms server: 3 ms left on the edge side.
    assert params["edge_overhead_s"] == pytest.approx(0.003, abs=1e-9)
    assert params["cloud_server_overhead_s"] == pytest.approx(0.001)


def test_gpu_roofline_figures():
    cost = gpu_cost(H200, context_tokens=1024)
    # Memory-bound at small batches: 16.06 GB / (4.8 TB/s · 0.7) = 4.78 ms, + 0.5 ms overhead.
    assert cost.pass_s(1, 0) == pytest.approx(16.06e9 / (4.8e12 * 0.7) + 0.0005)
    # Compute-bound for big batches: 2 · 8.03e9 · 4096 / (989e12 · 0.5) = 133 ms.
    assert cost.pass_s(4096, 0) == pytest.approx(2 * 8.03e9 * 4096 / (989e12 * 0.5) + 0.0005)
    # (141 GB · 0.9 − 16.06 GB) / (131 kB · 1024 tokens) = 825 sessions.
    assert kv_sessions(141e9, cost) == 825

"""The fleet simulator against what can be worked out by hand and the proxy's own link model (no
sockets, no models). The verifier's pass planner, which the simulator shares with the Batcher, has
its own tests (tests/test_batchplan.py)."""
from __future__ import annotations

import random
import statistics

import pytest

from netsim.effects import LinkContext
from netsim.fleet import (H200, ROUND_BYTES, EdgeLink, FleetConfig, LinearCost, alpha_from_tokens_per_round,
                          calibrate_from_load, check_against_load, cpu_per_unit, gpu_cost, kv_sessions, load_batching,
                          pass_cost_from_histograms, simulate)
from netsim.profiles import get_profile
from netsim.proxy import connection_rng
from safe_ast import parse


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
    assert params.cost.pass_s(5, 1) == pytest.approx(0.020)
    assert params.server_overhead_s == pytest.approx(0.002)
    assert expected_tokens_per_round(params.alpha, 4) == pytest.approx(2.5)
    # 34 ms per round = 8 ms drafting + 1 ms RTT (+ 2.9 us of transmission at 1 Gbit/s) + 20 ms pass
    # + 2 ms server: 3 ms left on the edge side.
    transmission_s = sum(ROUND_BYTES) * 8 / 1e9
    assert params.edge_overhead_s == pytest.approx(0.003 - transmission_s, abs=1e-9)
    assert params.cloud_server_overhead_s == pytest.approx(0.001)
    assert params.batching is False                        # no --batching among its verifier's arguments


def test_gpu_roofline_figures():
    cost = gpu_cost(H200, context_tokens=1024)
    # Memory-bound at small batches: 16.06 GB / (4.8 TB/s · 0.7) = 4.78 ms (no host path given: none charged).
    assert cost.pass_s(1, 0) == pytest.approx(16.06e9 / (4.8e12 * 0.7))
    # Compute-bound for big batches: 2 · 8.03e9 · 4096 / (989e12 · 0.5) = 133 ms.
    assert cost.pass_s(4096, 0) == pytest.approx(2 * 8.03e9 * 4096 / (989e12 * 0.5))
    # (141 GB · 0.9 − 16.06 GB) / (131 kB · 1024 tokens) = 825 sessions.
    assert kv_sessions(141e9, cost) == 825


# --- links: the proxy's own model ----------------------------------------------------------

def test_edge_link_is_the_proxys_link():
    # Same profile, same seed, same connection: the simulator's delays are the proxy's, draw for draw.
    profile = get_profile("3g")
    link = EdgeLink(profile, seed=7)
    proxy_side = profile.uplink.open(LinkContext(rng=connection_rng(7, 0, "up"), rtt_s=profile.rtt_ms() / 1000.0,
                                                 seed=7))
    for k in range(500):
        sent_s = 0.013 * k
        assert link.arrival_s("up", 250, sent_s) == proxy_side.departure_s(250, sent_s)


def test_lone_messages_have_the_links_expected_delay():
    # 3g: 120 ms + jitter of mean 30 ms + 250 B at 700 kbit/s + 0.5% loss stalls of RTT + 200 ms.
    profile = get_profile("3g")
    link = EdgeLink(profile, seed=3)
    delays = [link.arrival_s("up", 250, 1.0 * k) - 1.0 * k for k in range(10_000)]
    expected_s = profile.uplink.expected_delay_ms(250, profile.rtt_ms()) / 1000.0
    assert statistics.fmean(delays) == pytest.approx(expected_s, abs=0.0012)   # ~3.5 standard errors
    # A lost segment stalls a lone message by RTT + 200 ms (and again, once the retransmission is lost
    # too), as netsim.effects.loss says.
    unstalled = (0.120 + 250 * 8 / 700e3, 0.120 + 0.060 + 250 * 8 / 700e3)
    stalled = [d for d in delays if d > 0.4]
    for d in stalled:
        assert any(unstalled[0] - 1e-9 <= d - 0.5 * k <= unstalled[1] + 1e-9 for k in (1, 2)), d
    assert len(stalled) / len(delays) == pytest.approx(0.005, abs=0.002)


def test_jitter_is_a_curve_not_a_draw_per_message():
    # Messages 1 ms apart see nearly the same jitter: the curve moves at most 2·30 ms per 240 ms.
    profile = get_profile("3g").without("loss")
    link = EdgeLink(profile, seed=5)
    delays = [link.arrival_s("up", 100, 0.001 * k) - 0.001 * k for k in range(5000)]
    steps = [abs(b - a) for a, b in zip(delays, delays[1:])]
    assert max(steps) <= 0.060 / 240 + 1e-9
    arrivals = [0.001 * k + d for k, d in enumerate(delays)]
    assert arrivals == sorted(arrivals)                                        # never reordered
    assert statistics.pstdev(delays) > 0.005                                  # yet it does wander
    # Independent per-message draws (the old model) would jump by ~20 ms between neighbours.
    rng = random.Random(5)
    draws = [min(max(rng.gauss(30, 15), 0), 60) for _ in range(5000)]
    assert max(abs(b - a) for a, b in zip(draws, draws[1:])) > 20


# --- the verifier ---------------------------------------------------------------------------

def test_the_simulators_passes_are_planned_as_the_batcher_plans_them():
    # A 300-token prefill between two 5-token rounds, 32 tokens a pass: the Batcher's fair share
    # (spec_core.batchplan.fair_share); a job with nothing in the pass is left out of it.
    from netsim.fleet.policies import plan_pass
    from netsim.fleet.simulation import _Job
    jobs = [_Job(edge=0, tokens=5), _Job(edge=1, tokens=300), _Job(edge=2, tokens=5)]
    assert [(take.job.edge, take.tokens) for take in plan_pass("fair-share", jobs, 32, 0.0, 8)] == [(0, 5), (1, 22), (2, 5)]
    many = [_Job(edge=i, tokens=1) for i in range(40)]
    assert [take.job.edge for take in plan_pass("fair-share", many, 32, 0.0, 8)] == list(range(32))
    # Whole requests first come (the GPU case): the prefill goes alone, however far past the budget.
    assert [(take.job.edge, take.tokens) for take in plan_pass("fcfs", jobs, 32, 0.0, 8)] == [(0, 5)]
    assert [(take.job.edge, take.tokens) for take in plan_pass("fcfs", jobs[1:], 32, 0.0, 8)] == [(1, 300)]
    # Least slack first (`--schedule slack`): the late round first, the prefill (300 tokens wanting no
    # logits) capped at the chunk while it has slack, then given the leftovers.
    late = [_Job(edge=0, tokens=5, rows=5, deadline=0.3), _Job(edge=1, tokens=300, rows=1, deadline=1.5),
            _Job(edge=2, tokens=5, rows=5, deadline=-0.1)]
    assert [(take.job.edge, take.tokens) for take in plan_pass("slack", late, 6, 0.0, 8)] == [(0, 1), (2, 5)]
    assert [(take.job.edge, take.tokens) for take in plan_pass("fair-share", late, 6, 0.0, 8)] == [(0, 2), (1, 2), (2, 2)]
    # Under the fair schedule too a prefill holds at most a chunk while rounds wait (the Batcher's
    # chunked prefill): rounds of 20 tokens beside a 300-token prompt, 40 a pass, chunk 8; without
    # the chunk (a chunk as large as the prompt) the prompt takes a share like the rounds.
    rounds = [_Job(edge=0, tokens=300, rows=1), _Job(edge=1, tokens=20, rows=20), _Job(edge=2, tokens=20, rows=20)]
    assert [take.tokens for take in plan_pass("fair-share", rounds, 40, 0.0, 8)] == [8, 19, 13]
    assert [take.tokens for take in plan_pass("fair-share", rounds, 40, 0.0, 300)] == [14, 13, 13]
    assert [(take.job.edge, take.tokens) for take in plan_pass("slack", late, 32, 0.0, 8)] == [(0, 5), (1, 22), (2, 5)]
    with pytest.raises(ValueError):
        plan_pass("random", jobs, 32, 0.0, 8)


def test_a_streams_next_token_misses_the_pass_that_starts_without_it():
    # Measured on the batched synthetic verifier: from 4 streams on, cloud-only takes two passes per
    # token (TPOT ~40 ms for 20 ms passes), because each stream asks for its next token ~1 ms after its
    # pass, when the next pass has already started with the other streams.
    base = FleetConfig(edges=4, mode="cloud-only", cost=LinearCost(0.020, 0.0), batching=True, duration_s=20.0,
                       server_overhead_s=0.0011)
    late = simulate(base)
    assert late["tpot_p50_s"] == pytest.approx(0.0411, rel=0.03)
    assert late["target_forward_passes_per_committed_token"] == pytest.approx(0.5, rel=0.03)
    at_once = simulate(FleetConfig(**{**base.__dict__, "server_overhead_s": 0.0}))   # an engine that keeps them
    assert at_once["tpot_p50_s"] == pytest.approx(0.020, rel=0.03)
    assert at_once["target_forward_passes_per_committed_token"] == pytest.approx(0.25, rel=0.03)


def test_the_servers_cpu_caps_its_rounds():
    # 4 ms of the server's own CPU per round, one round at a time: at most 250 rounds/s, however
    # cheap the batched passes are.
    cfg = FleetConfig(edges=64, mode="hybrid", cost=LinearCost(0.002, 0.0), batching=True, alpha=0.0,
                      server_cpu_s=0.004, duration_s=20.0)
    result = simulate(cfg)
    assert result["committed_tokens_per_s"] == pytest.approx(250.0, rel=0.03)   # α = 0: one token a round
    assert result["committed_tokens_per_s"] < simulate(FleetConfig(**{**cfg.__dict__, "server_cpu_s": 0.0}))[
        "committed_tokens_per_s"] / 4


# --- calibration ----------------------------------------------------------------------------

def _histograms(passes: int, tokens: int, seconds: float, sessions: int) -> dict:
    return {"hybridspec_batch_tokens": {"count": passes, "sum": tokens, "buckets": {}},
            "hybridspec_batch_seconds": {"count": passes, "sum": seconds, "buckets": {}},
            "hybridspec_batch_sessions": {"count": passes, "sum": sessions, "buckets": {}}}


@pytest.mark.parametrize("args, batching", [(["--batching", "on"], True), (["--batching=on"], True),
                                            (["--batching", "off"], False), ([], False),
                                            (["--max-sessions", "64", "--batching", "on"], True)])
def test_calibration_reads_the_verifiers_arguments(args, batching):
    load = {"config": {"verifier_args": args}, "runs": [{"batch_histograms": _histograms(10, 50, 0.2, 10)}]}
    assert load_batching(load) is batching


def test_the_check_simulates_the_schedule_the_verifier_ran():
    from netsim.fleet.calibration import load_schedule
    assert load_schedule({"config": {"verifier_args": ["--batching", "on"]}}) == {"packing": "fair-share"}
    assert load_schedule({"config": {"verifier_args": ["--schedule", "fair"]}}) == {"packing": "fair-share"}
    assert load_schedule({"config": {"verifier_args": ["--prefill-chunk=16"]}}) == {"packing": "fair-share",
                                                                                   "prefill_chunk": 16}
    args = ["--schedule=slack", "--prefill-chunk", "64", "--slo-tpot-ms", "250", "--slo-ttft-ms", "0"]
    assert load_schedule({"config": {"verifier_args": args}}) == {"packing": "slack", "prefill_chunk": 64,
                                                                  "slo_tpot_s": 0.25}


def test_a_verifier_we_did_not_start_batched_if_a_pass_held_two_sessions():
    serial = {"config": {"verifier_args": []}, "runs": [{"batch_histograms": _histograms(100, 500, 2.0, 100)}]}
    batched = {"config": {"verifier_args": []}, "runs": [{"batch_histograms": _histograms(100, 900, 2.1, 180)}]}
    assert not load_batching(serial) and load_batching(batched)


def test_pass_cost_is_fitted_to_the_per_pass_histograms():
    # Passes of 5 tokens took 21 ms, passes of 50 tokens 30 ms: 20 ms + 0.2 ms/token.
    runs = [{"batch_histograms": _histograms(100, 500, 2.1, 100)}, {"batch_histograms": _histograms(300, 15000, 9.0, 3000)},
            {"mode": "cloud-only"}]
    cost = pass_cost_from_histograms(runs)
    assert cost.fixed_s == pytest.approx(0.020) and cost.per_token_s == pytest.approx(0.0002)
    assert pass_cost_from_histograms(runs, per_token_s=0.0).pass_s(5, 1) == pytest.approx(11.1 / 400)   # all passes
    assert pass_cost_from_histograms([{"mode": "hybrid"}]) is None


def test_cpu_per_round_and_per_token_from_the_processes_cores():
    # 0.05 cores idle, 1 ms per round, 0.25 ms per streamed token.
    def run(mode, rounds, tokens):
        return {"mode": mode, "duration_s": 8.0, "verify_rounds": rounds, "committed_tokens": tokens,
                "verifier_cpu_cores": (0.05 * 8 + 0.001 * rounds + (0.00025 * tokens if mode == "cloud-only" else 0)) / 8}
    runs = [run("hybrid", 200, 500), run("hybrid", 2000, 5000), run("cloud-only", 0, 400), run("cloud-only", 0, 8000)]
    assert cpu_per_unit(runs, "verifier_cpu_cores") == pytest.approx((0.001, 0.00025))
    assert cpu_per_unit(runs, "edges_cpu_cores") == (0.0, 0.0)   # not recorded


def test_a_batched_load_run_is_checked_against_a_batching_verifier():
    # A load result whose verifier batched: its calibration says so and its check simulates a batching
    # verifier (16 cloud-only streams on 20 ms passes: far above the serial verifier's 50 tok/s).
    hist = _histograms(400, 1200, 8.0, 1200)
    load = {"config": {"gamma": 4, "draft_ms": 2.0, "max_tokens": 64, "profiles": ["lan"], "synthetic": True,
                       "verifier_args": ["--batching", "on"]},
            "runs": [{"edges": 1, "mode": "hybrid", "verify_rounds": 235, "model_seconds": 4.75, "round_seconds": 5.1,
                      "committed_tokens": 560, "duration_s": 8.0, "warmup_s": 1.0, "committed_tokens_per_s": 70.0,
                      "tpot_p95_s": 0.016, "batch_histograms": hist},
                     {"edges": 16, "mode": "cloud-only", "tpot_p50_s": 0.041, "duration_s": 8.0, "warmup_s": 1.0,
                      "committed_tokens": 3000, "committed_tokens_per_s": 380.0, "tpot_p95_s": 0.041,
                      "batch_histograms": hist}]}
    params = calibrate_from_load(load)
    assert params.batching is True and params.max_batch_tokens == 512
    rows = {row["mode"]: row for row in check_against_load(load, params, seeds=2)}
    assert rows["cloud-only"]["simulated_tokens_per_s"] > 300
    assert rows["hybrid"]["alpha"] == pytest.approx(alpha_from_tokens_per_round(560 / 235, 4))


def test_the_capacity_table_takes_each_verifiers_own_calibration(monkeypatch):
    import netsim.fleet.report as report

    def load(batching: bool, pass_s: float) -> dict:
        hist = _histograms(100, 500, 100 * pass_s, 250 if batching else 100)
        return {"config": {"gamma": 4, "draft_ms": 2.0, "max_tokens": 64, "profiles": ["lan"], "synthetic": True,
                           "verifier_args": ["--batching", "on" if batching else "off"], "out": f"b{batching}"},
                "runs": [{"edges": 1, "mode": "hybrid", "verify_rounds": 100, "model_seconds": 100 * pass_s,
                          "round_seconds": 100 * pass_s + 0.1, "committed_tokens": 240, "duration_s": 4.0,
                          "batch_histograms": hist}]}
    seen = {}
    monkeypatch.setattr(report, "check_against_load", lambda result, params: [])
    monkeypatch.setattr(report, "capacity_table", lambda scenarios, *a, **k: seen.update(
        {s.name: (s.params.cost.pass_s(5, 1), s.batching) for s in scenarios}) or [])
    result = report.run_fleet([load(False, 0.030), load(True, 0.020)], slo_s=0.15, totals=[1000], profiles=["lte"],
                              cpu_per_token_s=0.0, gpu="h200", gpu_alpha=0.7, gpu_draft_s=0.01, gpu_context=1024,
                              gpu_overhead_s=0.00005)
    assert result["capacity_calibration"] == {"serial": 0, "batched": 1}
    assert seen["CPU as measured, serial"] == (pytest.approx(0.030), False)
    assert seen["CPU as measured, batched"] == (pytest.approx(0.020), True)
    assert [check["calibration"]["batching"] for check in result["checks"]] == [False, True]


# --- the GPU verifier as shipped, KV offload, the draft budget, goodput at the SLO ------------------

from dataclasses import replace  # noqa: E402

from netsim.fleet.costs import KvOffload, RoundWork  # noqa: E402
from netsim.fleet.capacity import edges_per_verifier, simulation_meets_slo  # noqa: E402


def test_round_work_counts_the_backends_requests_and_tokens():
    # r = 3 committed tokens after the last full block, gamma = 4:
    # per-position: 5 requests of 3, 4, 5, 6, 7 tokens = 25; one request: 3 + 4 = 7; ideal: 5.
    assert RoundWork("per-position", 16).tokens(4, 3) == 25
    assert RoundWork("one-request", 16).tokens(4, 3) == 7
    assert RoundWork("ideal").tokens(4, 3) == 5
    assert (RoundWork("per-position").requests(4), RoundWork("one-request").requests(4)) == (5, 1)
    # Over a session's life r is uniform on 1..16 (mean 8.5): 5 · 8.5 + 10 = 52.5 and 8.5 + 4.
    assert RoundWork("per-position", 16).mean_tokens(4) == pytest.approx(52.5)
    assert RoundWork("one-request", 16).mean_tokens(4) == pytest.approx(12.5)
    with pytest.raises(ValueError):
        RoundWork("two-requests")


@pytest.mark.parametrize("path", ["per-position", "one-request"])
def test_round_work_grows_with_gamma_and_block_size(path):
    for block in (1, 16, 32):
        means = [RoundWork(path, block).mean_tokens(g) for g in range(9)]
        assert means == sorted(means) and len(set(means)) == len(means)
    for gamma in (1, 4, 8):
        assert RoundWork(path, 16).mean_tokens(gamma) < RoundWork(path, 32).mean_tokens(gamma)
    # one request never computes more than the per-position requests; with block 1 both reach gamma + 1 at r = 1
    for gamma in range(9):
        assert RoundWork("one-request", 16).mean_tokens(gamma) <= RoundWork("per-position", 16).mean_tokens(gamma)
    assert RoundWork("one-request", 1).mean_tokens(4) == RoundWork("ideal").mean_tokens(4) == 5


def test_the_simulator_charges_the_round_work():
    # One edge: every pass holds one round, so target tokens per committed token = mean work / tokens per round.
    base = FleetConfig(edges=1, mode="hybrid", cost=LinearCost(0.001, 0.0), alpha=0.63, gamma=4, draft_s=0.001,
                       duration_s=40.0, max_tokens=100_000)
    per_round = expected_tokens_per_round(0.63, 4)
    for work in (RoundWork("ideal"), RoundWork("one-request", 16), RoundWork("per-position", 16)):
        result = simulate(replace(base, round_work=work))
        assert result["target_tokens_per_committed_token"] == pytest.approx(work.mean_tokens(4) / per_round, rel=0.05)
        assert result["engine_requests_per_committed_token"] == pytest.approx(work.requests(4) / per_round, rel=0.05)


def _gpu_like(edges: int, **kw) -> FleetConfig:
    # A pass costs 10 ms + 0.1 ms a token; sessions hold 1 MB of KV each, copied back at 1 GB/s x 1 (1 ms).
    base = FleetConfig(edges=edges, mode="hybrid", cost=LinearCost(0.010, 0.0001), batching=True, packing="fcfs",
                       profiles=["lte"], gamma=4, alpha=0.7, draft_s=0.005, max_tokens=64, max_batch_tokens=4096,
                       kv_bytes_per_session=1e6, duration_s=8.0)
    return replace(base, **kw)


def test_kv_offload_keeps_resident_sessions_within_the_gpus_memory():
    offload = KvOffload(host_bytes_per_s=1e9, efficiency=1.0)
    parked = simulate(_gpu_like(40, kv_capacity=10, offload=offload))
    assert not parked["kv_exceeded"] and parked["kv_resident_max"] == 10
    # every copy is 1 ms of the host link: its busy share is copies/s x 1 ms
    assert parked["kv_copies_per_s"] > 0
    assert parked["host_link_utilisation"] == pytest.approx(min(1.0, parked["kv_copies_per_s"] * 0.001))
    # Sessions that all fit never copy; without offload, more sessions than fit is no answer at all.
    assert simulate(_gpu_like(10, kv_capacity=10, offload=offload))["kv_copies_per_s"] == 0
    over = simulate(_gpu_like(40, kv_capacity=10))
    assert over["kv_exceeded"] and not simulation_meets_slo(over, 10.0)


def test_a_faster_host_link_never_slows_the_parked_fleet():
    slow, fast = (simulate(_gpu_like(40, kv_capacity=10, offload=KvOffload(host_bytes_per_s=bw, efficiency=1.0)))
                  for bw in (0.05e9, 5e9))   # 20 ms and 0.2 ms per copy
    assert fast["committed_tokens_per_s"] > slow["committed_tokens_per_s"]
    assert fast["kv_copy_wait_p95_s"] < slow["kv_copy_wait_p95_s"]
    assert slow["host_link_utilisation"] > 0.9


def test_the_fleets_draft_budget_is_the_verifiers_price_rule():
    # The engine's rule: θ = per-token pass cost (the pass cost line) × commit rate, budget ⌊ln θ / ln α⌋.
    from netsim.fleet.policies import Acceptance, Steering
    steering = Steering(max_gamma=8)
    fresh = Acceptance()   # α = 0.5 (the Beta(1, 1) prior)
    assert steering.budget(fresh, 0.0) == 8          # nothing measured: idle, the whole gamma
    for tokens in (10, 20, 30, 40, 50):              # passes of 10 ms + 0.1 ms a token
        steering.observe_pass(tokens, 0.010 + 0.0001 * tokens)
    steering.observe_commit(1.0, 4000)               # 4000 tokens in the 2 s window: 2000 tokens/s
    # θ = 1e-4 s/token × 2000 tokens/s = 0.2; ln 0.2 / ln 0.5 = 2.32: two drafts pay, the third does not.
    assert steering.budget(fresh, 1.0) == 2
    steering.observe_commit(1.5, 12_000)             # 8000 tokens/s: θ = 0.8, ln 0.8 / ln 0.5 = 0.32
    assert steering.budget(fresh, 1.5) == 0
    # A flat pass cost (a GPU below its compute roof) never limits the draft, however loaded.
    flat = Steering(max_gamma=8)
    for tokens in (10, 20, 30, 40, 50):
        flat.observe_pass(tokens, 0.010)
    flat.observe_commit(1.0, 100_000)
    assert flat.budget(fresh, 1.0) == 8
    with pytest.raises(ValueError, match="batching"):
        simulate(_gpu_like(2, steer=True, batching=False))


def test_the_simulated_budget_follows_the_load():
    # 2 edges: the verifier commits little, drafts are cheap; 600 edges on per-position rounds:
    # the pass is compute bound and busy, the price of a verified token high.
    light = simulate(_gpu_like(2, steer=True, cost=gpu_cost(H200, context_tokens=1024), gamma=8))
    heavy = simulate(_gpu_like(600, steer=True, cost=gpu_cost(H200, context_tokens=1024), gamma=8,
                               round_work=RoundWork("per-position", 16)))
    assert light["budget_mean"] == pytest.approx(8.0)
    assert heavy["budget_mean"] < 8.0


def test_goodput_counts_only_requests_that_met_the_slo():
    loose = simulate(_gpu_like(4, slo_tpot_s=10.0, slo_ttft_s=100.0))
    assert loose["goodput_tokens_per_s"] > 0.9 * loose["committed_tokens_per_s"]
    assert loose["slo_met_share"] == 1.0
    impossible = simulate(_gpu_like(4, slo_tpot_s=1e-6, slo_ttft_s=100.0))
    assert impossible["goodput_tokens_per_s"] == 0.0 and impossible["slo_met_share"] == 0.0
    assert simulation_meets_slo(loose, 10.0, 100.0) and not simulation_meets_slo(loose, 10.0, 1e-6)   # the TTFT part counts


def test_capacity_grows_with_a_looser_slo():
    def make(n):
        return FleetConfig(edges=n, mode="cloud-only", cost=LinearCost(0.004, 0.0002), batching=True, packing="fcfs",
                           profiles=["lan"], max_tokens=32, duration_s=3.0)
    tight, _ = edges_per_verifier(make, 0.010, max_edges=256, duration_s=3.0)
    loose, _ = edges_per_verifier(make, 0.030, max_edges=256, duration_s=3.0)
    assert 0 < tight < loose


def test_the_gpu_table_puts_each_case_beside_cloud_only():
    from netsim.fleet.calibration import Calibration
    from netsim.fleet.costs import RooflineCost, kv_sessions
    from netsim.fleet.gpu import SPECEDGE_WAN, GpuCase, gpu_capacity, gpu_markdown
    assert SPECEDGE_WAN.rtt_ms() == pytest.approx(14.07)
    # A small GPU: 8 sessions' KV fit (2.8 GB x 0.9 - 2 GB of weights = 0.52 GB; 64 MB each), 40 in host memory.
    cost = RooflineCost(params=1e9, model_bytes=2e9, kv_bytes_per_token=64_000, context_tokens=1000,
                        hbm_bytes_per_s=1e12, flops_per_s=1e14)
    assert kv_sessions(2.8e9, cost) == 8
    params = Calibration(cost=cost, batching=True, alpha=0.7, gamma=4, draft_s=0.005, server_cpu_s=0.0,
                         server_overhead_s=0.0, edge_cpu_s=0.0, edge_overhead_s=0.0, cloud_server_cpu_s=0.0,
                         cloud_server_overhead_s=0.0, cloud_edge_cpu_s=0.0, proxy_cpu_s=0.0, cloud_proxy_cpu_s=0.0,
                         max_tokens=32, max_batch_tokens=4096, profiles=["lte"], tokens_per_round=0.0)
    offload = KvOffload(host_bytes_per_s=10e9, efficiency=1.0, host_memory_bytes=64e6 * 40 / 0.9 + 1)
    cases = [GpuCase("cloud", "cloud-only"), GpuCase("hybrid", "hybrid", RoundWork("ideal")),
             GpuCase("hybrid parked", "hybrid", RoundWork("ideal"), offload=True)]
    result = gpu_capacity(params, cost, 2.8e9, cases, offload, [1000], slo_tpot_s=0.5, slo_ttft_s=5.0, duration_s=3.0)
    cloud, hybrid, parked = result["rows"]
    assert result["kv_sessions"] == 8 and result["host_sessions"] == 40
    assert cloud["edges_per_gpu"] == hybrid["edges_per_gpu"] == 8 and cloud["bound"]   # loose SLO: KV binds
    assert 8 < parked["edges_per_gpu"] <= 40 and parked["kv_copies_per_s"] > 0            # parking lifts it
    assert cloud["committed_tokens_per_s_vs_cloud"] == 1.0
    assert parked["gpus_for_1000"] < hybrid["gpus_for_1000"] == 125
    assert "hybrid parked" in "\n".join(gpu_markdown(result, "t"))


def test_each_gpu_case_is_charged_the_host_path_it_names():
    """Two hybrid cases alike but for the acceptance maths they name: the slower host path (200 ms a round:
    8 rounds in a pass take 1.6 s, about 0.55 s a token at α 0.7, γ 4, against a 0.3 s TPOT SLO) holds
    fewer edges than the fast one, which fills the 8 KV slots; a case naming a path the table lacks is
    refused."""
    from netsim.fleet.calibration import Calibration
    from netsim.fleet.costs import RooflineCost
    from netsim.fleet.gpu import GpuCase, gpu_capacity
    from netsim.fleet.hostpath import HostPath
    cost = RooflineCost(params=1e9, model_bytes=2e9, kv_bytes_per_token=64_000, context_tokens=1000,
                        hbm_bytes_per_s=1e12, flops_per_s=1e14)
    params = Calibration(cost=cost, batching=True, alpha=0.7, gamma=4, draft_s=0.005, server_cpu_s=0.0,
                         server_overhead_s=0.0, edge_cpu_s=0.0, edge_overhead_s=0.0, cloud_server_cpu_s=0.0,
                         cloud_server_overhead_s=0.0, cloud_edge_cpu_s=0.0, proxy_cpu_s=0.0, cloud_proxy_cpu_s=0.0,
                         max_tokens=32, max_batch_tokens=4096, profiles=["lte"], tokens_per_round=0.0)
    hosts = {"fast": HostPath("fast", "test", "greedy", 1000, 0.0, 1e-5),
             "slow": HostPath("slow", "test", "greedy", 1000, 0.0, 0.2)}
    cases = [GpuCase("cloud", "cloud-only"), GpuCase("fast", "hybrid", RoundWork("ideal"), host_path="fast"),
             GpuCase("slow", "hybrid", RoundWork("ideal"), host_path="slow")]
    result = gpu_capacity(params, cost, 2.8e9, cases, KvOffload(), [1000], slo_tpot_s=0.3, slo_ttft_s=5.0,
                          duration_s=3.0, hosts=hosts)
    _, fast, slow = result["rows"]
    assert "fast" in fast["host_path"] and "slow" in slow["host_path"]
    assert slow["edges_per_gpu"] < fast["edges_per_gpu"] == 8
    with pytest.raises(ValueError, match="missing"):
        gpu_capacity(params, cost, 2.8e9, [GpuCase("x", "hybrid", RoundWork("ideal"), host_path="missing")],
                     KvOffload(), [1000], slo_tpot_s=0.3, slo_ttft_s=5.0, duration_s=1.0, hosts=hosts)


# --- the fleet runs the verifier's own policies ------------------------------------------------

# The shipped policies (and the estimates they run on) the fleet must import, never write again.
_SHIPPED = {
    "spec_core.steering": ["draft_budget", "gamma_budget", "tree_node_budget", "PassCostLine", "CommitRate", "Acceptance"],
    "spec_core.batchplan": ["fair_share", "least_slack_first"],
    "spec_core.kvpark": ["choose_victim", "next_use", "worth_moving", "ParkCost", "ParkCandidate"],
    "spec_core.slo": ["Slo", "meets_slo", "run_meets_slo", "window_tpot"],
    "spec_core.costmodel": ["expected_tokens_per_round"],
    "spec_core.estimates": ["fit_line", "ewma"],
}


def test_the_fleet_runs_the_verifiers_own_policies():
    import ast
    import importlib
    from pathlib import Path

    import netsim.fleet.policies as policies
    import netsim.fleet.simulation as simulation
    # The policy objects the fleet uses are the very ones the verifier runs.
    for module, names in _SHIPPED.items():
        shipped = importlib.import_module(module)
        for name in names:
            for fleet in (policies, simulation):
                if hasattr(fleet, name):
                    assert getattr(fleet, name) is getattr(shipped, name), f"netsim.fleet's {name} is not {module}'s"
    assert policies.draft_budget.__module__ == "spec_core.steering"
    assert simulation.choose_victim.__module__ == "spec_core.kvpark"
    # No module of the fleet defines a function or class under a shipped policy's name, nor the old
    # fleet-only rules it replaced (a budget maximising gamma per second, its own tokens-per-round formula).
    forbidden = {name for names in _SHIPPED.values() for name in names} | {"expected_tokens", "due", "meets"}
    fleet_dir = Path(policies.__file__).parent
    for path in sorted(fleet_dir.glob("*.py")):
        for node in ast.walk(parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                assert node.name not in forbidden, f"{path.name}:{node.lineno} defines its own {node.name}"
            # (1 - a ** (g + 1)) / (1 - a): expected tokens per round written out again
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow) and isinstance(node.right, ast.BinOp) \
                    and isinstance(node.right.op, ast.Add):
                raise AssertionError(f"{path.name}:{node.lineno}: a power of (x + 1): spec_core.costmodel's formula?")


def test_the_simulation_calls_the_shipped_policies(monkeypatch):
    # Each policy is not only imported but used: spies on the names the fleet calls them by.
    import netsim.fleet.policies as policies
    import netsim.fleet.simulation as simulation
    calls: dict[str, int] = {}

    def spy(module, name):
        real = getattr(module, name)

        def wrapper(*args, **kw):
            calls[name] = calls.get(name, 0) + 1
            return real(*args, **kw)
        monkeypatch.setattr(module, name, wrapper)

    for name in ("draft_budget", "fair_share", "least_slack_first"):
        spy(policies, name)
    for name in ("choose_victim", "meets_slo"):
        spy(simulation, name)
    offload = KvOffload(host_bytes_per_s=1e9, efficiency=1.0)
    simulate(_gpu_like(20, kv_capacity=10, offload=offload, steer=True, packing="fair-share", duration_s=3.0))
    simulate(_gpu_like(4, packing="slack", duration_s=2.0))
    assert all(calls.get(name, 0) > 0 for name in ("draft_budget", "fair_share", "least_slack_first",
                                                    "choose_victim", "meets_slo")), calls


def test_the_gpu_pass_charges_the_host_path_per_round_in_the_simulation():
    # 64 edges on lte against an 8B roofline: the shipped numpy maths (10 ms a round here, to stand out)
    # is paid once per round of every pass, so each pass is longer and the edges commit less.
    from netsim.fleet.hostpath import HostPath
    slow = HostPath("numpy-per-session", "cpu", "greedy", 128_256, 0.0, 0.010)
    bare = gpu_cost(H200, context_tokens=1024)
    charged = gpu_cost(H200, context_tokens=1024, host=slow)
    without = simulate(_gpu_like(64, cost=bare, duration_s=4.0))
    with_host = simulate(_gpu_like(64, cost=charged, duration_s=4.0))
    assert with_host["committed_tokens_per_s"] < 0.8 * without["committed_tokens_per_s"]
    # Control: cloud-only streams pay `stream_host` (vLLM's sampler), not the rounds' maths.
    cloud_bare = simulate(_gpu_like(64, mode="cloud-only", cost=bare, duration_s=4.0))
    cloud_charged = simulate(_gpu_like(64, mode="cloud-only", cost=charged, duration_s=4.0))
    assert cloud_charged["committed_tokens_per_s"] == pytest.approx(cloud_bare["committed_tokens_per_s"])


# --- vLLM speculating for itself (server-spec) -------------------------------------------------

@pytest.mark.parametrize("alpha, tokens_per_step", [(1.0, 4), (0.0, 1)])
def test_a_server_spec_stream_commits_a_burst_per_step_and_pays_the_drafts(alpha, tokens_per_step):
    # One stream on lan, a toy GPU: the target's pass reads 1 GB at 100 GB/s (10 ms), the draft's 0.1 GB
    # (1 ms); γ 3: a step is 10 + 3 x 1 = 13 ms and commits 4 tokens at α 1, 1 at α 0, in one burst.
    from netsim.fleet.costs import RooflineCost
    from netsim.fleet.serverspec import ServerSpecCost
    target = RooflineCost(params=1e6, model_bytes=1e9, kv_bytes_per_token=0.0, context_tokens=1,
                          hbm_bytes_per_s=1e11, flops_per_s=1e18, bw_efficiency=1.0)
    cost = ServerSpecCost(target, RooflineCost(**{**target.__dict__, "model_bytes": 1e8}), 3)
    result = simulate(FleetConfig(edges=1, mode="server-spec", cost=cost, batching=True, gamma=3, alpha=alpha,
                                  max_tokens=100_000, duration_s=10.0, packing="fcfs"))
    assert result["committed_tokens_per_s"] == pytest.approx(tokens_per_step / 0.013, rel=0.02)
    assert result["gap_p50_s"] == pytest.approx(0.013, rel=0.05)   # a gap per burst, not per token
    # Control: plain decoding on the same target, one token a 10 ms pass.
    plain = simulate(FleetConfig(edges=1, mode="cloud-only", cost=target, batching=True, max_tokens=100_000,
                                 duration_s=10.0, packing="fcfs"))
    assert plain["committed_tokens_per_s"] == pytest.approx(100.0, rel=0.02)


def test_the_gpu_table_charges_vllm_spec_its_drafts_memory():
    # 10k-token sessions of 640 MB on an 8 GB GPU with 2 GB of weights: 8 sessions for plain decoding and
    # n-gram; the 1B draft (2.47 GB, 33 kB a token) leaves 2, an EAGLE head (0.85 GB, 4 kB a token) 6.
    from netsim.fleet.calibration import Calibration
    from netsim.fleet.costs import RooflineCost
    from netsim.fleet.gpu import GpuCase, gpu_capacity
    from netsim.fleet.hostpath import HostPath
    cost = RooflineCost(params=1e9, model_bytes=2e9, kv_bytes_per_token=64_000, context_tokens=10_000,
                        hbm_bytes_per_s=1e12, flops_per_s=1e14)
    params = Calibration(cost=cost, batching=True, alpha=0.7, gamma=3, draft_s=0.005, server_cpu_s=0.0,
                         server_overhead_s=0.0, edge_cpu_s=0.0, edge_overhead_s=0.0, cloud_server_cpu_s=0.0,
                         cloud_server_overhead_s=0.0, cloud_edge_cpu_s=0.0, proxy_cpu_s=0.0, cloud_proxy_cpu_s=0.0,
                         max_tokens=32, max_batch_tokens=4096, profiles=["lan"], tokens_per_round=0.0)
    hosts = {"batched-on-device": HostPath("batched-on-device", "test", "greedy", 1000, 0.0, 1e-6)}
    cases = [GpuCase("cloud", "cloud-only")] + [GpuCase(m, "server-spec", host_path="batched-on-device", draft=m)
                                                for m in ("draft model", "EAGLE", "n-gram")]
    result = gpu_capacity(params, cost, 8e9, cases, KvOffload(), [1000], slo_tpot_s=1.0, slo_ttft_s=5.0,
                          duration_s=2.0, hosts=hosts)
    edges = {r["case"]: r["edges_per_gpu"] for r in result["rows"]}
    assert edges == {"cloud": 8, "draft model": 2, "EAGLE": 6, "n-gram": 8}
    # ... and the table goes to the figures registry as it is (one row a case).
    from netsim.fleet.gpu import gpu_registry
    _, tables = gpu_registry({"gpu_capacity": result})
    assert [row[0] for row in tables["capacity"].rows] == ["cloud", "draft model", "EAGLE", "n-gram"]
    assert [row[1] for row in tables["capacity"].rows] == ["8 (bound)", "2 (bound)", "6 (bound)", "8 (bound)"]


def test_staggered_first_requests_do_not_count_their_head_start_as_goodput():
    # Each edge's first request starts with up to max_tokens - 1 tokens "already made" (stagger): those
    # were never committed in the run, so goodput (tokens of requests that met the SLO) cannot exceed
    # the tokens committed in the window.
    # 4 edges, 1,000-token requests, 2 s of 20 ms passes: about 100 tokens each in the window, against
    # head starts of hundreds of tokens (uniform on 0..999).
    cost = LinearCost(0.020, 0.0)
    result = simulate(FleetConfig(edges=4, mode="cloud-only", cost=cost, batching=True, max_tokens=1000,
                                  duration_s=2.0, warmup_s=0.001, stagger=True, slo_tpot_s=1.0, slo_ttft_s=5.0))
    assert result["goodput_tokens_per_s"] == pytest.approx(result["committed_tokens_per_s"], rel=0.02)

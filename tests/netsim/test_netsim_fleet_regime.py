"""The regime map's claims that could fail, each beside a control (netsim/fleet/regime.py,
netsim/fleet/serverspec.py, netsim/fleet/measured.py, netsim/fleet/hostpath.py). The model is
deterministic: where a test pins its arithmetic, the figure is worked out by hand from the stated
inputs in the test, not recorded from a run."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from netsim.fleet.costs import KvOffload, RooflineCost, RoundWork, kv_sessions
from netsim.fleet.hostpath import HostPath, HostPathTable, stream_rows
from netsim.fleet.measured import HitRun, fit_guess, hit_runs, load_measured
from netsim.fleet.regime import (TARGETS, RegimeConfig, cloud_only, hit_probability, hybrid, hybrid_state,
                                 link_wait_s, main, make_target, regime_map, rounds_per_request, server_spec,
                                 spec_cost, stream_state, target_cost)
from netsim.fleet.serverspec import DRAFTS, ServerSpecCost, draft_cost

NUMPY = HostPath("numpy-per-session", "cpu", "greedy", 128_256, 0.0, 0.0018)
DEVICE = HostPath("batched-on-device", "cuda", "greedy", 128_256, 0.0002, 4e-7, "estimate")


# The edge these hand-worked figures assume: 10 ms a draft token whatever the context, no prompt prefill
# on the device (the map's default device is netsim.fleet.devices' laptop GPU, its KV and prefill charged).
EDGE10 = dict(draft_s=0.010, draft_kv=False, device_prefill=False)
MEAN = RegimeConfig(slo_on="mean-tpot", **EDGE10)


def _cost(target="8b-bf16", context=1024, host=DEVICE, cfg=RegimeConfig()):
    return target_cost(make_target(target, cfg.gpu, cfg.kv_dtype), context, cfg, host, stream_rows(DEVICE, 4))


# --- the host path is charged per round of a pass -------------------------------------------

def test_host_path_charge_scales_with_rounds_per_pass():
    cost = _cost(host=NUMPY)
    one, many = cost.parts(5, 1).host_s, cost.parts(5 * 64, 64).host_s
    assert one == pytest.approx(0.0018)
    assert many == pytest.approx(64 * 0.0018)      # 115 ms of host maths for 64 rounds
    # Control: batched on the device, the fixed part dominates: 64 rounds cost far less than 64 x one.
    device = _cost(host=DEVICE)
    assert device.parts(5 * 64, 64).host_s < 2 * device.parts(5, 1).host_s
    # Cloud-only passes charge the streams' sampler, not the rounds' maths.
    assert cost.parts(64, 64, hybrid=False).host_s == pytest.approx(0.0002 + 64 * 4e-7 / 5)


def test_the_shipped_host_path_binds_a_short_context_hybrid_and_the_device_path_does_not():
    cfg = MEAN
    kv = kv_sessions(cfg.memory_bytes, _cost())
    host_slots = cfg.offload.host_sessions(_cost())
    shipped = hybrid(_cost(host=NUMPY), 0.7, "lan", cfg, False, kv, host_slots)
    device = hybrid(_cost(host=DEVICE), 0.7, "lan", cfg, False, kv, host_slots)
    assert shipped.binds == "host path" and shipped.sessions < kv
    assert device.binds != "host path" and device.tokens_per_s > 5 * shipped.tokens_per_s


def test_host_path_table_fits_measured_rows_and_scales_with_vocabulary():
    rows = [{"path": "batched-on-device", "device": "cpu", "setting": "top-p", "vocab": 49_152, "sessions": s,
             "pass_s": 0.001 + 0.002 * s} for s in (1, 4, 16, 64)]
    rows.append({"path": "numpy-per-session", "device": "cpu", "setting": "top-p", "vocab": 128_256,
                 "fixed_s": 0.0, "per_round_s": 0.008, "source": "measured"})
    table = HostPathTable.from_json({"machine": "test", "rows": rows})
    fitted = table.get("batched-on-device", "top-p", vocab=49_152)
    assert fitted.fixed_s == pytest.approx(0.001) and fitted.per_round_s == pytest.approx(0.002)
    # At twice the vocabulary the per-round maths doubles (it reads every row); the fixed part does not.
    doubled = table.get("batched-on-device", "top-p", vocab=2 * 49_152)
    assert doubled.per_round_s == pytest.approx(0.004) and doubled.fixed_s == pytest.approx(0.001)
    with pytest.raises(KeyError, match="no host-path row"):
        table.get("batched-on-device", "greedy")


def test_host_path_table_reads_the_maths_bench_names():
    rows = [{"path": path, "device": "cuda", "setting": "T 0.7 top-p 0.95", "vocab": 128_256, "sessions": s,
             "pass_s": base + 0.0001 * s} for s in (1, 64, 256) for path, base in (("torch", 0.0003), ("floor", 0.0))]
    table = HostPathTable.from_json({"rows": rows})
    row = table.get("batched-on-device", "top-p", device="cuda")
    assert row.fixed_s == pytest.approx(0.0003) and row.per_round_s == pytest.approx(0.0001)
    assert len(table.rows) == 1   # the softmax floor is not a host path


def test_the_shipped_table_marks_the_device_rows_as_estimates():
    table = HostPathTable.load()
    for setting in ("greedy", "top-k", "top-p"):
        assert table.get("numpy-per-session", setting).source == "measured"
        assert "ESTIMATE" in table.get("batched-on-device", setting).describe()
    # Issue 25's figures: top-p's maths is several times greedy's.
    assert table.get("numpy-per-session", "top-p").per_round_s > 3 * table.get("numpy-per-session", "greedy").per_round_s


# --- what binds (judged on the mean TPOT: the roofline's parts, not the link's gaps) ------------

def test_hybrid_binding_flips_from_compute_to_kv_capacity_as_context_grows():
    # 8B bf16, lan, α 0.7, γ 4, mean TPOT <= 30 ms: at 1k context the rounds' tokens fill the GPU's
    # compute before its KV slots; at 32k the 25 sessions that fit leave the SLO met.
    cfg = replace(MEAN, gammas=(4,), slo_tpot_s=0.030)

    def point(context, memory_scale=1.0):
        c = replace(cfg, offload=KvOffload(host_memory_bytes=0.0))   # no parking: the GPU's own bound
        cost = _cost(context=context)
        slots = int(kv_sessions(c.memory_bytes * memory_scale, cost))
        return hybrid(cost, 0.7, "lan", c, False, slots, 0), slots
    short, short_kv = point(1024)
    long, long_kv = point(32768)
    assert short.binds == "compute" and short.sessions < short_kv
    assert long.binds == "KV capacity" and long.sessions == long_kv
    # Control: with ten times the memory the long context is bound by reading its KV, not by slots.
    big, big_kv = point(32768, 10)
    assert big.binds == "HBM bandwidth" and long.sessions < big.sessions < big_kv


def test_cloud_only_is_kv_bound_when_a_step_over_full_memory_meets_the_slo():
    # A step that reads every KV slot takes ~(0.9 x 141 GB) / (4.8 TB/s x 0.7) = 38 ms at any context.
    cost = _cost(context=8192)
    kv = kv_sessions(MEAN.memory_bytes, cost)
    assert cloud_only(cost, kv, "lan", MEAN).binds == "KV capacity"
    # Control: below that step time the bandwidth binds first.
    tight = cloud_only(cost, kv, "lan", replace(MEAN, slo_tpot_s=0.030))
    assert tight.binds == "HBM bandwidth" and tight.sessions < kv


def test_a_hybrid_that_cannot_meet_the_slo_with_one_session_names_the_link():
    cfg = RegimeConfig(**EDGE10)
    cost = _cost()
    kv, host = kv_sessions(cfg.memory_bytes, cost), cfg.offload.host_sessions(cost)
    slow = hybrid(cost, 0.5, "3g", cfg, False, kv, host)
    assert slow.tokens_per_s == 0 and slow.binds == "link"
    # Control: the same on lan meets it.
    assert hybrid(cost, 0.5, "lan", cfg, False, kv, host).tokens_per_s > 0


# --- KV parking ------------------------------------------------------------------------------

def test_parking_raises_capacity_only_when_the_restore_fits_in_the_link_wait():
    # 70B fp8 at 1k context on 3g: a restore (335 MB over PCIe, ~7 ms) fits in a ~300 ms link wait.
    cfg = replace(MEAN, slo_tpot_s=1.0, gammas=(4,), parking=True)
    cost = _cost("70b-fp8", 1024, DEVICE, cfg)
    kv, host = kv_sessions(cfg.memory_bytes, cost), cfg.offload.host_sessions(cost)
    parked = hybrid(cost, 0.7, "3g", cfg, False, kv, host)
    assert parked.parked > 0 and parked.sessions > kv
    # Control: a host link 1000x slower (a restore of ~7 s, longer than the link wait): no session is worth parking.
    slow = replace(cfg, offload=KvOffload(host_bytes_per_s=64e6))
    unparked = hybrid(cost, 0.7, "3g", slow, False, kv, host)
    assert unparked.parked == 0 and unparked.sessions == kv and unparked.binds == "KV capacity"
    # Control: parking off (the default, as the baselines hold their KV on the GPU): none parks.
    assert hybrid(cost, 0.7, "3g", replace(cfg, parking=False), False, kv, host).parked == 0


def test_parked_sessions_are_only_as_many_as_the_gpu_needs():
    cfg = RegimeConfig(**EDGE10)
    cost = _cost("70b-fp8", 1024, DEVICE, cfg)
    kv = kv_sessions(cfg.memory_bytes, cost)
    assert hybrid_state(kv, 4, 0.7, cost, "3g", cfg, 0, kv).parked == 0   # all fit: none parks
    over = hybrid_state(kv + 20, 4, 0.7, cost, "3g", cfg, 0, kv)
    assert 20 <= over.parked < kv + 20 and over.resident <= kv + 1e-9 and over.pcie_busy > 0


def test_a_parked_session_waits_for_its_restore_unless_it_is_prefetched():
    # 8B at 8k on 3g: a restore of 1.07 GB takes ~21 ms, well inside a ~300 ms link wait. As the verifier
    # restores (on arrival), the parked sessions' cycle is longer by the copy; prefetched, it is not.
    cfg = RegimeConfig(**EDGE10)
    cost = _cost("8b-bf16", 8192, DEVICE, cfg)
    kv = kv_sessions(cfg.memory_bytes, cost)
    copy_s = cfg.offload.copy_s(cost.kv_bytes_per_token * 8192)
    unparked = hybrid_state(kv, 4, 0.7, cost, "3g", cfg, 0, kv)
    shipped = hybrid_state(kv + 5, 4, 0.7, cost, "3g", cfg, 0, kv)
    ahead = hybrid_state(kv + 5, 4, 0.7, cost, "3g", replace(cfg, prefetch=True), 0, kv)
    assert shipped.parked > 0 and ahead.parked > 0
    assert shipped.period_s == pytest.approx(unparked.period_s + copy_s, rel=0.05)
    assert ahead.period_s == pytest.approx(unparked.period_s, rel=0.05)


# --- rounds in flight: measured inputs, every continuation paid for ---------------------------

def test_rounds_in_flight_shorten_the_period_only_when_continuations_hit():
    cfg = RegimeConfig(**EDGE10)
    cost = _cost()
    # γ 1, 4 continuations: the edge drafts 5 tokens (50 ms) a round, inside a ~120 ms cycle.
    one = hybrid_state(50, 1, 0.7, cost, "lte", cfg, 0)
    flight = hybrid_state(50, 1, 0.7, cost, "lte", cfg, 4)
    assert 0.3 < flight.hit < 0.95
    assert flight.period_s < 0.9 * one.period_s
    # ... but a miss waits the whole cycle, so the p95 gap a reader sees is not shorter (hit < 95%).
    assert flight.gap_p95_s >= one.period_s
    # Control: continuations that never guess the corrected token right never hit: no gain, only cost.
    never = replace(cfg, guess=0.0)
    assert hit_probability(0.7, 4, 0.0, 8) == 0.0
    assert hybrid_state(50, 1, 0.7, cost, "lte", never, 4).period_s >= one.period_s * (1 - 1e-9)


def test_every_continuation_drafted_is_charged_its_drafting_and_upload():
    # Drafting 50 ms a token on the device, γ 4: a round with c continuations keeps the edge busy
    # (1 + c)·4·50 ms + 2 ms, so at c = 8 the period is at least 1.802 s, however often it hits.
    cfg = replace(RegimeConfig(**EDGE10), draft_s=0.050, guess=1.0)
    cost = _cost()
    eight = hybrid_state(10, 4, 0.9, cost, "lan", cfg, 8)
    assert eight.period_s >= (1 + 8) * 4 * 0.050 + 0.002 - 1e-9
    one = hybrid_state(10, 4, 0.9, cost, "lan", cfg, 1)
    assert one.period_s < eight.period_s
    # The upload: each continuation's bytes cross the uplink (3g: 0.42 Mbit/s-class uplink).
    assert link_wait_s("3g", 250 + 8 * 137) > link_wait_s("3g", 250) + 0.01


def test_the_guess_is_fitted_to_the_measured_hits():
    runs = hit_runs(json.loads((Path(__file__).resolve().parents[2] / "bench" / "continuations" / "summary.json")
                               .read_text()))
    guess = fit_guess(runs)
    predicted = sum(r.rounds * hit_probability(r.alpha, 4, guess, max(1, round(r.continuations))) for r in runs)
    assert predicted == pytest.approx(sum(r.hits for r in runs), rel=1e-6)
    # Control: twice the hits need a higher guess.
    doubled = [replace(r, hits=min(r.rounds, 2 * r.hits)) for r in runs]
    assert fit_guess(doubled) > guess + 0.1
    # A run whose counters disagree (more hits than continuations sent) is left out.
    bad = [{"pair": "p", "profile": "lte", "mode": "hybrid-g4", "tokens": 64, "bytes_up_per_token": 80},
           {"pair": "p", "profile": "lte", "mode": "continuations-g4", "tokens": 64, "bytes_up_per_token": 90,
            "alpha": 0.8, "continuation_rounds": 13, "continuations_sent": 3, "continuation_hits": 5}]
    assert hit_runs(bad) == []
    measured = load_measured()
    assert measured.window == 2 and measured.bytes_per_continuation > 0


def test_rounds_per_request_by_hand():
    assert rounds_per_request(0.0, 4, 10) == pytest.approx(10.0)      # one token a round
    assert rounds_per_request(1.0, 4, 10) == pytest.approx(2.0)       # five a round
    assert rounds_per_request(1.0, 4, 7) == pytest.approx(2.0)        # 5, then γ capped at 1: 2
    # α 0.5, γ 1, 2 tokens: the first round commits 2 with probability 0.5, else 1 (then one more round).
    assert rounds_per_request(0.5, 1, 2) == pytest.approx(1.5)


# --- vLLM speculating for itself ---------------------------------------------------------------

def test_the_draft_models_weights_and_kv_take_sessions_from_the_gpu():
    # H200, 8B bf16 at 8k: (0.9 x 141e9 - 16.06e9) // (131,072 x 8192) = 103 sessions. With the 1B draft
    # (2.47 GB, 32,768 B of KV a token): (126.9e9 - 18.53e9) // (163,840 x 8192) = 80.
    cfg = RegimeConfig(**EDGE10)
    cost = _cost(context=8192)
    assert kv_sessions(cfg.memory_bytes, cost) == 103
    sc = spec_cost(TARGETS["8b-bf16"], "8b-bf16", "draft model", cost, 3, cfg)
    assert kv_sessions(cfg.memory_bytes, sc) == 80
    # Control: n-gram holds nothing on the GPU.
    ngram = spec_cost(TARGETS["8b-bf16"], "8b-bf16", "n-gram", cost, 3, cfg)
    assert kv_sessions(cfg.memory_bytes, ngram) == 103 and ngram.draft_s(400, 100) == 0.0


def test_a_spec_step_is_gamma_draft_passes_and_one_verify_pass():
    # A toy roofline, memory-bound: target pass 10 ms (weights 1 GB at 100 GB/s), draft pass 1 ms.
    target = RooflineCost(params=1e6, model_bytes=1e9, kv_bytes_per_token=0.0, context_tokens=1,
                          hbm_bytes_per_s=1e11, flops_per_s=1e18, bw_efficiency=1.0)
    draft = replace(target, model_bytes=1e8)
    step = ServerSpecCost(target, draft, 3)
    assert step.pass_s(4 * 8, 8) == pytest.approx(0.010 + 3 * 0.001)
    assert ServerSpecCost(target, None, 3).pass_s(32, 8) == pytest.approx(0.010)


def test_vllm_spec_wins_where_plain_decoding_is_memory_bound_and_loses_where_compute_binds():
    # 8B at 32k on an H200 (KV read dominates a step): EAGLE at α 0.85 gives well over 2x plain decoding.
    cfg = RegimeConfig(**EDGE10)
    long = _cost(context=32768)
    kv = kv_sessions(cfg.memory_bytes, long)
    cloud = cloud_only(long, kv, "lan", cfg)
    eagle = server_spec(TARGETS["8b-bf16"], "8b-bf16", "EAGLE", long, 0.85, "lan", cfg)
    assert eagle.tokens_per_s > 2 * cloud.tokens_per_s
    # Control: at 1k with 825 sessions the step is near compute-bound; γ + 1 tokens a sequence cost more
    # than they save at α 0.5.
    short = _cost(context=1024)
    cloud_short = cloud_only(short, kv_sessions(cfg.memory_bytes, short), "lan", cfg)
    eagle_short = server_spec(TARGETS["8b-bf16"], "8b-bf16", "EAGLE", short, 0.5, "lan", cfg)
    assert eagle_short.tokens_per_s < cloud_short.tokens_per_s


def test_spec_tokens_arrive_in_bursts_one_gap_a_step():
    cfg = RegimeConfig(**EDGE10)
    cost = _cost(context=8192)
    sc = spec_cost(TARGETS["8b-bf16"], "8b-bf16", "EAGLE", cost, 4, cfg)
    s = stream_state(50, sc, "lan", cfg, 4, 0.8)
    assert s.gap_p95_s == pytest.approx(s.step_s) and s.tpot_s < 0.5 * s.step_s


# --- the KV dtype and the efficiencies ------------------------------------------------------------

def test_attention_runs_at_the_kv_caches_rate():
    # 70B fp8 weights with a bf16 KV cache at 32k: per token 2 x 70.6e9 FLOPs at 1979 TFLOP/s and
    # 4 x 80 x 8192 x 32768 = 85.9e9 attention FLOPs at 989 TFLOP/s, both x 0.6.
    cfg = RegimeConfig(**EDGE10)
    bf16 = _cost("70b-fp8", 32768, None, cfg)
    per_token = (2 * 70.6e9 / 1979e12 + 4 * 80 * 8192 * 32768 / 989e12) / 0.6
    assert bf16.parts(1000, 1).compute_s == pytest.approx(1000 * per_token, rel=1e-9)
    # An fp8 cache: attention at the fp8 rate, half the KV bytes, twice the sessions (or more).
    fp8_cfg = replace(cfg, kv_dtype="fp8")
    fp8 = _cost("70b-fp8", 32768, None, fp8_cfg)
    assert fp8.parts(1000, 1).compute_s < bf16.parts(1000, 1).compute_s
    assert fp8.kv_bytes_per_token == bf16.kv_bytes_per_token / 2
    assert kv_sessions(cfg.memory_bytes, fp8) >= 2 * kv_sessions(cfg.memory_bytes, bf16)


def test_the_flop_efficiency_is_an_input():
    args = ["--flops-efficiency", "0.8", "--kv-dtype", "fp8", "--window", "3", "--guess", "0.4"]
    import argparse

    from netsim.fleet.regime import config_from_args, regime_arguments
    parser = argparse.ArgumentParser()
    regime_arguments(parser)
    cfg = config_from_args(parser.parse_args(args))
    assert (cfg.flops_efficiency, cfg.kv_dtype, cfg.window_(), cfg.guess_()) == (0.8, "fp8", 3, 0.4)
    assert _cost(cfg=cfg).flops_efficiency == 0.8
    assert RegimeConfig().describe()["flops_efficiency"] == 0.6


# --- the map and its command -----------------------------------------------------------------

def test_the_map_names_a_binding_for_every_cell(tmp_path):
    result = regime_map(gpus=("h200",), targets=("70b-fp8",), contexts=(32768,), links=("lan",), drafts=(0.85,))
    (cell,) = result["cells"]
    allowed = {"compute", "HBM bandwidth", "KV capacity", "KV capacity (host memory)", "host path",
               "host link (PCIe)", "link"}
    assert set(cell["modes"]) == {"cloud-only", "vLLM spec, draft model", "vLLM spec, EAGLE", "vLLM spec, n-gram",
                                  "hybrid, one round", "hybrid, in flight"}
    assert all(m["binds"] in allowed for m in cell["modes"].values())
    assert main(["--out", str(tmp_path), "--setting", "top-p", "--gpus", "h100"]) == 0
    written = json.loads((tmp_path / "regime.json").read_text())
    assert len(written["cells"]) == 54 and written["setting"] == "top-p"
    assert written["config"]["window"] == 2 and "guess" in written["config"]["measured"]
    assert "| target | context |" in (tmp_path / "regime.md").read_text()


def test_the_map_writes_its_tables_into_the_registry(tmp_path, monkeypatch):
    from hybridspec import figures
    from netsim.fleet.regime_report import summary, write_results
    result = regime_map(gpus=("h200",), targets=("8b-bf16",), contexts=(8192,), links=("lan", "3g"), drafts=(0.7,))
    monkeypatch.setattr(figures, "RESULTS", tmp_path)
    path = write_results(result, "gpu-regime-test")
    written = figures.read_result(path)
    assert len(written.tables["h200"].rows) == 2 and "hybrid ÷ best vLLM spec" in written.tables["h200"].columns
    assert written.figures["h200-hybrid-zero"].value == summary(result)["h200"]["hybrid_zero"] == 1   # 3g


# --- one model answer per cell: the map against the discrete-event simulation ---------------------

def test_the_map_and_the_simulation_agree_on_each_modes_tokens_per_s():
    # 70B at 1k on an H200 over lan (167 sessions: the cell where the simulation came out 14% below the
    # map, because a pass holding a new request's prompt is compute-bound while the mean pass was not)
    # and 70B at 32k over lan (5 sessions), the map's default device and drafts: every mode at the map's
    # point, rounds in flight included, simulated 6 s after 4 s of warm-up, tokens/s within 5%.
    from netsim.fleet.simcheck import SIM_MODES, sim_cell, tolerance
    cfg = RegimeConfig()
    for cell in (("h200", "70b-fp8", 1024, "lan", "τ4 3.08 (= EAGLE-3)"), ("h200", "70b-fp8", 32768, "lan", "τ4 3.80")):
        rows = sim_cell(*cell, cfg, DEVICE, duration_s=6.0)
        assert [r["mode"] for r in rows] == list(SIM_MODES)
        for row in rows:
            assert row["parked"] == 0 and row["sessions"] > 0
            assert abs(row["error"]) <= tolerance(row["mode"]) == 0.05, row
    # Control: the hybrid simulated on 3g against the map on lan disagrees by far more.
    (hyb,) = sim_cell("h200", "70b-fp8", 32768, "lan", "τ4 3.80", cfg, DEVICE, modes=("hybrid, one round",),
                      duration_s=6.0, sim_link="3g")
    assert hyb["error"] < -0.5


def test_a_pass_is_charged_the_prompts_it_holds_not_the_mean_pass():
    # 70B fp8 at 1k on an H200, 40 rounds of 3 tokens: the mean pass (120 + 0.5 prompts x 128 tokens) is
    # memory-bound, but a pass with a prompt is compute-bound (0.12 ms a token): the mean pass is longer.
    from netsim.fleet.regime import mean_pass_s
    cost = _cost("70b-fp8", 1024)
    flat = cost.pass_s(120 + 0.5 * 128, 40)
    assert cost.parts(120 + 0.5 * 128, 40).memory_s > cost.parts(120 + 0.5 * 128, 40).compute_s
    assert mean_pass_s(cost, 120, 40, 128, 0.5, True) > flat * 1.1
    # Control: no prompts, or a memory-bound pass far from the compute term, changes nothing.
    assert mean_pass_s(cost, 120, 40, 128, 0.0, True) == pytest.approx(cost.pass_s(120, 40))
    assert mean_pass_s(cost, 10, 5, 128, 0.01, True) == pytest.approx(cost.pass_s(10 + 0.01 * 128, 5), rel=1e-3)


def test_rounds_in_flight_pay_in_the_simulation_only_when_continuations_hit():
    # 8 edges on lte, a flat cost, γ 4: a window of 2 rounds whose continuations always hit commits
    # more tokens/s than one round at a time; continuations that never hit only add drafting and bytes.
    from netsim.fleet.costs import LinearCost
    from netsim.fleet.simulation import FleetConfig, simulate
    base = dict(edges=8, mode="hybrid", cost=LinearCost(0.02, 0.0), batching=True, profiles=["lte"], gamma=4,
                alpha=0.8, draft_s=0.005, max_tokens=64, duration_s=8.0, warmup_s=2.0, stagger=True)
    one = simulate(FleetConfig(**base))["committed_tokens_per_s"]
    hits = simulate(FleetConfig(**base, window=2, continuations=2, hit=1.0))["committed_tokens_per_s"]
    misses = simulate(FleetConfig(**base, window=2, continuations=2, hit=0.0))["committed_tokens_per_s"]
    assert hits > 1.3 * one
    assert misses <= one * 1.02


def test_a_margin_inside_the_models_error_is_a_tie():
    from netsim.fleet.regime_report import summary, verdict
    assert (verdict(1.03, 0.05), verdict(1.06, 0.05), verdict(0.96, 0.05), verdict(0.9, 0.05)) == \
        ("tie", "win", "tie", "loss")
    result = regime_map(gpus=("h200",), targets=("8b-bf16",), contexts=(1024,), links=("lan",), drafts=(0.85,),
                        cfg=RegimeConfig(**EDGE10))
    ratio = result["cells"][0]["modes"]["hybrid, one round"]["x_spec"]
    loose, tight = summary(result, tolerance=abs(ratio - 1) + 0.01)["h200"], summary(result, tolerance=0.0)["h200"]
    assert loose["hybrid_beats_spec"] == 0 and loose["hybrid_ties_spec"] == 1
    assert tight["hybrid_ties_spec"] == 0 and tight["hybrid_beats_spec"] + (ratio < 1) == 1


def test_the_break_even_is_where_the_ratio_crosses_one():
    # 8B at 8k on an H200 over lan (103 sessions), a device at 2 ms a token.
    from netsim.fleet.acceptance import get_curve
    from netsim.fleet.breakeven import Panel
    cfg = RegimeConfig()
    family = get_curve(cfg.eagle_curve)
    panel = Panel("h200", "8b-bf16", 8192, "lan", cfg, DEVICE)
    tau = panel.break_even(2.0, family)
    assert tau is not None and 1.1 < tau < 4.9
    assert panel.ratio(2.0, family.with_tokens_per_step(tau + 0.2)) > 1.0 > panel.ratio(2.0, family.with_tokens_per_step(tau - 0.2))
    # Control: a slower device needs a better draft.
    slower = panel.break_even(8.0, family)
    assert slower is None or slower > tau

"""The regime map's claims that could fail, each beside a control (netsim/fleet/regime.py,
netsim/fleet/hostpath.py). The model is deterministic: no sampling, no timing."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from netsim.fleet.costs import KvOffload, RoundWork, kv_sessions
from netsim.fleet.hostpath import HostPath, HostPathTable, stream_rows
from netsim.fleet.regime import (TARGETS, RegimeConfig, cloud_only, hit_probability, hybrid, hybrid_state,
                                 link_wait_s, main, regime_map, target_cost)

NUMPY = HostPath("numpy-per-session", "cpu", "greedy", 128_256, 0.0, 0.0018)
DEVICE = HostPath("batched-on-device", "cuda", "greedy", 128_256, 0.0002, 4e-7, "estimate")


def _cost(target="8b-bf16", context=1024, host=DEVICE, cfg=RegimeConfig()):
    return target_cost(TARGETS[target], context, cfg, host, stream_rows(DEVICE, 4))


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
    cfg = RegimeConfig()
    kv = kv_sessions(cfg.memory_bytes, _cost())
    host_slots = cfg.offload.host_sessions(_cost())
    wait = link_wait_s("lan")
    shipped = hybrid(_cost(host=NUMPY), 0.7, wait, cfg, 1, kv, host_slots)
    device = hybrid(_cost(host=DEVICE), 0.7, wait, cfg, 1, kv, host_slots)
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


# --- what binds ------------------------------------------------------------------------------

def test_hybrid_binding_flips_from_compute_to_kv_capacity_as_context_grows():
    # 8B bf16, lan, α 0.7, γ 4, TPOT <= 30 ms: at 1k context the rounds' tokens fill the GPU's compute
    # before its KV slots; at 32k the 25 sessions that fit leave the SLO met.
    cfg = RegimeConfig(gammas=(4,), slo_tpot_s=0.030)
    wait = link_wait_s("lan")

    def point(context, memory=cfg.memory_bytes):
        cost = _cost(context=context)
        return hybrid(cost, 0.7, wait, cfg, 1, kv_sessions(memory, cost), cfg.offload.host_sessions(cost)), \
            kv_sessions(memory, cost)
    short, short_kv = point(1024)
    long, long_kv = point(32768)
    assert short.binds == "compute" and short.sessions < short_kv
    assert long.binds == "KV capacity" and long.sessions == long_kv
    # Control: with ten times the memory the long context is bound by reading its KV, not by slots.
    big, big_kv = point(32768, 10 * cfg.memory_bytes)
    assert big.binds == "HBM bandwidth" and long.sessions < big.sessions < big_kv


def test_cloud_only_is_kv_bound_when_a_step_over_full_memory_meets_the_slo():
    # A step that reads every KV slot takes ~(0.9 x 141 GB) / (4.8 TB/s x 0.7) = 38 ms at any context.
    cost = _cost(context=8192)
    kv = kv_sessions(RegimeConfig().memory_bytes, cost)
    assert cloud_only(cost, kv, 0.150).binds == "KV capacity"
    # Control: below that step time the bandwidth binds first.
    tight = cloud_only(cost, kv, 0.030)
    assert tight.binds == "HBM bandwidth" and tight.sessions < kv


def test_a_hybrid_that_cannot_meet_the_slo_with_one_session_names_the_link():
    cfg = RegimeConfig()
    cost = _cost()
    kv, host = kv_sessions(cfg.memory_bytes, cost), cfg.offload.host_sessions(cost)
    slow = hybrid(cost, 0.5, link_wait_s("3g"), cfg, 1, kv, host)
    assert slow.tokens_per_s == 0 and slow.binds == "link"
    # Control: the same on lan meets it.
    assert hybrid(cost, 0.5, link_wait_s("lan"), cfg, 1, kv, host).tokens_per_s > 0


# --- KV parking ------------------------------------------------------------------------------

def test_parking_raises_capacity_only_when_the_restore_fits_in_the_link_wait():
    # 70B fp8 at 1k context on 3g: a restore (335 MB over PCIe, ~7 ms) fits in a ~300 ms link wait.
    cfg = RegimeConfig(slo_tpot_s=1.0, gammas=(4,))
    cost = _cost("70b-fp8", 1024, DEVICE, cfg)
    kv, host = kv_sessions(cfg.memory_bytes, cost), cfg.offload.host_sessions(cost)
    wait = link_wait_s("3g")
    parked = hybrid(cost, 0.7, wait, cfg, 1, kv, host)
    assert parked.parked > 0 and parked.sessions > kv
    # Control: a host link 1000x slower (a restore of ~7 s, longer than the link wait): no session is worth parking.
    slow = replace(cfg, offload=KvOffload(host_bytes_per_s=64e6))
    unparked = hybrid(cost, 0.7, wait, slow, 1, kv, host)
    assert unparked.parked == 0 and unparked.sessions == kv and unparked.binds == "KV capacity"


def test_parked_sessions_are_only_as_many_as_the_gpu_needs():
    cfg = RegimeConfig()
    cost = _cost("70b-fp8", 1024, DEVICE, cfg)
    kv = kv_sessions(cfg.memory_bytes, cost)
    wait = link_wait_s("3g")
    assert hybrid_state(kv, 4, 0.7, cost, wait, cfg, 1, kv).parked == 0   # all fit: none parks
    over = hybrid_state(kv + 20, 4, 0.7, cost, wait, cfg, 1, kv)
    assert 20 <= over.parked < kv + 20 and over.resident <= kv + 1e-9 and over.pcie_busy > 0


# --- rounds in flight ------------------------------------------------------------------------

def test_rounds_in_flight_shorten_the_period_only_when_continuations_hit():
    cfg = RegimeConfig()
    cost = _cost()
    wait = link_wait_s("lte")
    one = hybrid_state(50, 4, 0.7, cost, wait, cfg, 1)
    flight = hybrid_state(50, 4, 0.7, cost, wait, cfg, 4)
    assert 0.3 < hit_probability(0.7, 4, cfg.guess, cfg.max_continuations) < 1.0
    assert flight.period_s < 0.8 * one.period_s
    # Control: continuations that never guess the corrected token right never hit: no gain.
    never = replace(cfg, guess=0.0)
    assert hit_probability(0.7, 4, 0.0, 8) == 0.0
    assert hybrid_state(50, 4, 0.7, cost, wait, never, 4).period_s == pytest.approx(one.period_s, rel=1e-6)


def test_one_request_round_work_costs_more_than_gamma_plus_one():
    cfg = RegimeConfig(round_work=RoundWork("one-request"))
    ideal = hybrid_state(200, 4, 0.7, _cost(), link_wait_s("lan"), RegimeConfig(), 1)
    shipped = hybrid_state(200, 4, 0.7, _cost(), link_wait_s("lan"), cfg, 1)
    assert shipped.period_s > ideal.period_s


# --- the map and its command -----------------------------------------------------------------

def test_the_map_names_a_binding_for_every_cell(tmp_path):
    result = regime_map(targets=("70b-fp8",), contexts=(32768,), links=("lan",), alphas=(0.85,))
    (cell,) = result["cells"]
    allowed = {"compute", "HBM bandwidth", "KV capacity", "KV capacity (host memory)", "host path",
               "host link (PCIe)", "link"}
    assert cell["cloud"]["binds"] in allowed
    assert all(h["binds"] in allowed for h in cell["hybrid"].values())
    assert main(["--out", str(tmp_path), "--setting", "top-p"]) == 0
    written = json.loads((tmp_path / "regime.json").read_text())
    assert len(written["cells"]) == 54 and written["setting"] == "top-p"
    assert "| target | context |" in (tmp_path / "regime.md").read_text()


def test_the_mean_value_model_agrees_with_the_discrete_event_simulation():
    # One cell with few sessions (5: the 70B's KV slots at 32k), 4 s simulated: tokens/s within 10%.
    from netsim.fleet.regime import des_check
    cell = (("70b-fp8", 32768, "lte", 0.85),)
    for row in des_check(cell, duration_s=4.0):
        assert row["sim_tokens_per_s"] == pytest.approx(row["model_tokens_per_s"], rel=0.10), row
    # Control: the simulation on 3g against the model on lte: the hybrid rows disagree by far more.
    (hybrid_row, _) = des_check(cell, duration_s=4.0, sim_link="3g")
    assert hybrid_row["sim_tokens_per_s"] < 0.7 * hybrid_row["model_tokens_per_s"]


def test_a_parked_session_waits_for_its_restore_unless_it_is_prefetched():
    # 8B at 8k on 3g: a restore of 1.07 GB takes ~21 ms, well inside a ~300 ms link wait. As the verifier
    # restores (on arrival), the parked sessions' cycle is longer by the copy; prefetched, it is not.
    cfg = RegimeConfig()
    cost = _cost("8b-bf16", 8192, DEVICE, cfg)
    kv = kv_sessions(cfg.memory_bytes, cost)
    wait = link_wait_s("3g")
    copy_s = cfg.offload.copy_s(cost.kv_bytes_per_token * 8192)
    unparked = hybrid_state(kv, 4, 0.7, cost, wait, cfg, 1, kv)
    shipped = hybrid_state(kv + 5, 4, 0.7, cost, wait, cfg, 1, kv)
    ahead = hybrid_state(kv + 5, 4, 0.7, cost, wait, replace(cfg, prefetch=True), 1, kv)
    assert shipped.parked > 0 and ahead.parked > 0
    assert shipped.period_s == pytest.approx(unparked.period_s + copy_s, rel=0.05)
    assert ahead.period_s == pytest.approx(unparked.period_s, rel=0.05)


def test_where_bandwidth_binds_cloud_only_the_hybrid_holds_more_sessions():
    # 70B fp8 at 32k on lan: at TPOT <= 30 ms a decode step may read only 2 sessions' KV beside the
    # weights; a hybrid round reads them once for gamma + 1 tokens and fills the 5 KV slots.
    tight = RegimeConfig(slo_tpot_s=0.030)
    cost = _cost("70b-fp8", 32768, DEVICE, tight)
    kv, host = kv_sessions(tight.memory_bytes, cost), tight.offload.host_sessions(cost)
    cloud = cloud_only(cost, kv, tight.slo_tpot_s)
    hyb = hybrid(cost, 0.7, link_wait_s("lan"), tight, 4, kv, host)
    assert cloud.binds == "HBM bandwidth" and cloud.sessions < kv
    assert hyb.sessions >= 2 * cloud.sessions
    # Control: at 150 ms the KV slots bind both, and the hybrid holds no more.
    loose = RegimeConfig()
    cloud_loose = cloud_only(cost, kv, loose.slo_tpot_s)
    hyb_loose = hybrid(cost, 0.7, link_wait_s("lan"), loose, 4, kv, host)
    assert cloud_loose.binds == "KV capacity" and hyb_loose.sessions == cloud_loose.sessions == kv

"""The experiment end to end on the synthetic pair: verifier process, proxy, every mode, report."""
import json
import subprocess
import sys

REQUIRED = {"profile", "mode", "workload", "tokens", "wall_s", "tokens_per_s", "ttft_s", "round_trips",
            "round_trips_per_token", "bytes_up", "bytes_down", "acceptance_rate", "tokens_per_round",
            "target_forward_passes"}


def test_experiment_writes_results_report_and_plots(tmp_path):
    out = tmp_path / "results"
    r = subprocess.run([sys.executable, "-m", "netsim", "experiment", "--synthetic", "--profiles", "lan,3g",
                        "--modes", "all", "--workloads", "chat,code", "--max-tokens", "16", "--gammas", "2,4",
                        "--crossover-rtts", "5,300", "--crossover-steps", "5,60", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    rows = result["rows"]
    modes = {row["mode"] for row in rows}
    per_gamma = {f"{m}-g{g}" for m in ("hybrid", "tree", "proactive", "pipeline", "continuations", "fused", "window")
                 for g in (2, 4)}
    assert modes == {"edge-only", "cloud-only", "cloud-stepwise", "per-token", "adaptive", "auto"} | per_gamma
    assert len(rows) == 2 * 20 * 2   # 6 modes without gamma (auto: the planner's), 7 with (2 gammas), 2 profiles x 2 workloads
    assert all(row["window_depth"] >= 1 for row in rows if row["mode"].startswith("window"))
    for row in rows:
        assert REQUIRED <= row.keys()
        assert row["tokens"] == 16
    by = {(row["profile"], row["mode"], row["workload"]): row for row in rows}
    # Cloud-only is one request and one target pass per token; the hybrid needs fewer passes.
    assert by[("3g", "cloud-only", "chat")]["round_trips"] == 1
    assert by[("3g", "cloud-only", "chat")]["target_forward_passes"] == 16
    assert by[("3g", "hybrid-g4", "chat")]["target_forward_passes"] < 16
    # ... but each of its passes computes its drafts + 1 tokens: more target tokens than passes, at
    # most γ + 1 per pass; cloud-only computes one per token.
    assert by[("3g", "cloud-only", "chat")]["target_tokens"] == 16
    h = by[("3g", "hybrid-g4", "chat")]
    assert h["target_forward_passes"] < h["target_tokens"] <= 5 * h["target_forward_passes"]
    # The proxy measured real bytes in both directions for networked modes, none for edge-only.
    assert by[("3g", "hybrid-g4", "code")]["bytes_up"] > 0 and by[("3g", "hybrid-g4", "code")]["bytes_down"] > 0
    assert by[("lan", "edge-only", "chat")]["bytes_up"] == 0
    # A 300 ms RTT link costs every hybrid round a round trip: per-token on 3g is slower than on lan.
    assert by[("3g", "per-token", "chat")]["wall_s"] > by[("lan", "per-token", "chat")]["wall_s"]
    # cloud-stepwise asks for every token: one round trip per token, no drafts; trees send 4γ nodes.
    assert by[("3g", "cloud-stepwise", "chat")]["round_trips"] == 16
    assert by[("3g", "cloud-stepwise", "chat")]["nodes_per_round"] == 0
    assert 4 < by[("3g", "tree-g4", "chat")]["nodes_per_round"] <= 16
    assert by[("3g", "hybrid-g4", "chat")]["round_trips"] < 16
    assert len(result["crossover"]) == 4
    report = (out / "report.md").read_text()
    assert "Crossover" in report and "theory" in report and "RT reduction vs cloud-stepwise" in report
    for name in ("results.csv", "tokens_per_s.png", "round_trips_per_100_tokens.png", "crossover.png"):
        assert (out / name).stat().st_size > 0

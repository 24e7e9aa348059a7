"""The load test's verdicts on a run: goodput at an SLO, whether its p95s met it, and the capacity
(most edges) at the SLO per mode. The verdicts themselves are spec_core.slo's (the fleet simulator
judges with the same)."""
from __future__ import annotations

from spec_core.slo import meets_slo, run_meets_slo


def goodput_at(run: dict, slo_tpot_s: float, slo_ttft_s: float) -> float:
    """A run's goodput (tokens/s of requests that met it) at another SLO than the one it ran with,
    judged as Request.meets does: TPOT inside the window, TTFT if the request arrived inside it."""
    good = sum(tokens for tpot, ttft, tokens in run.get("per_request", [])
               if meets_slo(tpot, ttft, slo_tpot_s, slo_ttft_s))
    return good / run["duration_s"]


def meets_slo_p95(run: dict, slo_tpot_s: float, slo_ttft_s: float) -> bool:
    """A run meets the SLO when its p95 TPOT and p95 TTFT are within it (an unmeasured TTFT, e.g.
    no request arrived in the window, does not count against it)."""
    return run_meets_slo(run.get("tpot_p95_s"), run.get("ttft_p95_s"), slo_tpot_s, slo_ttft_s)


def capacity_at_slo(runs: list[dict], slo_tpot_s: float, slo_ttft_s: float) -> dict:
    """Per mode: the most edges among the counts run whose p95 TPOT and TTFT met the SLO (0: none
    did), and the goodput there. Counts between those run are not interpolated."""
    out = {}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        ok = [r for r in runs if r["mode"] == mode and meets_slo_p95(r, slo_tpot_s, slo_ttft_s)]
        best = max(ok, key=lambda r: r["edges"], default=None)
        out[mode] = {"edges": best["edges"] if best else 0,
                     "goodput_tokens_per_s": best["goodput_tokens_per_s"] if best else 0.0,
                     "edges_run": sorted({r["edges"] for r in runs if r["mode"] == mode})}
    return out

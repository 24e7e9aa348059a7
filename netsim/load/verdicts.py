"""The load test's verdicts on a run: goodput at an SLO, whether its p95s met it, and the capacity
(most edges) at the SLO per mode."""
from __future__ import annotations


def goodput_at(run: dict, slo_tpot_s: float, slo_ttft_s: float) -> float:
    """A run's goodput (tokens/s of requests that met it) at another SLO than the one it ran with,
    judged as Request.meets does: TPOT inside the window, TTFT if the request arrived inside it."""
    good = 0
    for tpot, ttft, tokens in run.get("per_request", []):
        if (tpot is not None or ttft is not None) and (tpot is None or tpot <= slo_tpot_s) \
                and (ttft is None or ttft <= slo_ttft_s):
            good += tokens
    return good / run["duration_s"]


def meets_slo_p95(run: dict, slo_tpot_s: float, slo_ttft_s: float) -> bool:
    """A run meets the SLO when its p95 TPOT and p95 TTFT are within it (an unmeasured TTFT, e.g.
    no request arrived in the window, does not count against it)."""
    tpot, ttft = run.get("tpot_p95_s"), run.get("ttft_p95_s")
    return tpot is not None and tpot <= slo_tpot_s and (ttft is None or ttft <= slo_ttft_s)


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

"""Capacity: the largest number of edges one verifier carries with the simulated fleet meeting its
SLO (`edges_per_verifier`, by bisection over `simulate`), and the verdict on one simulated run.
The fleet report (report.py) and the GPU tables (gpu.py) both read capacity from here."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from netsim.fleet.simulation import FleetConfig, simulate
from spec_core.slo import run_meets_slo


def simulation_meets_slo(result: dict, slo_tpot_s: float, slo_ttft_s: float | None = None) -> bool:
    """A simulated run meets the SLO: spec_core.slo's run verdict (p95 TPOT, and p95 TTFT when given
    and measured), with every session's KV on the verifier (or parked: offload)."""
    return not result.get("kv_exceeded") and run_meets_slo(result["tpot_p95_s"], result.get("ttft_p95_s"),
                                                           slo_tpot_s, slo_ttft_s)


def edges_per_verifier(make: Callable[[int], FleetConfig], slo_s: float, max_edges: int = 1 << 16,
                       duration_s: float = 20.0, slo_ttft_s: float | None = None) -> tuple[int, dict | None]:
    """The largest n whose simulation meets the SLO (`simulation_meets_slo`; 0 when even one edge misses); make(n) -> FleetConfig."""
    def ok(n: int) -> tuple[bool, dict]:
        result = simulate(replace(make(n), duration_s=duration_s))
        return simulation_meets_slo(result, slo_s, slo_ttft_s), result
    good, result = ok(1)
    if not good:
        return 0, result
    lo, best = 1, result
    hi = 2
    while True:
        if hi >= max_edges:
            good, result = ok(max_edges)
            if good:
                return max_edges, result
            hi = max_edges
            break
        good, result = ok(hi)
        if not good:
            break
        lo, best, hi = hi, result, hi * 2
    while hi - lo > max(1, lo // 32):   # to within ~3%
        mid = (lo + hi) // 2
        good, result = ok(mid)
        if good:
            lo, best = mid, result
        else:
            hi = mid
    return lo, best

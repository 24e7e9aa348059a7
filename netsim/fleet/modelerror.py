"""The regime map's stated error: the largest disagreement the simulation found against it.

`python -m netsim.fleet.simcheck` runs the map's points in the discrete-event simulation and writes,
per kind of mode, the largest |simulated / map − 1| of tokens/s it saw (bench/results/gpu-sim.json,
figures `max-error-*`). The published tolerance is the largest of them: a map ratio within it of 1 is
a tie (netsim.fleet.regime_report.verdict). Until a simulation has been recorded the tolerance is
the agreement the test requires (`REQUIRED`), the most the map may be off.
"""
from __future__ import annotations

from pathlib import Path

SIM_RESULT = "gpu-sim"
REQUIRED = 0.05   # what tests/netsim/test_netsim_fleet_regime.py requires of every checked cell


def published_tolerance(results_dir: Path | None = None) -> float:
    """The largest disagreement recorded in bench/results/gpu-sim.json, else REQUIRED."""
    from hybridspec.figures import RESULTS, read_result
    path = (results_dir or RESULTS) / f"{SIM_RESULT}.json"
    if not path.is_file():
        return REQUIRED
    figures = read_result(path).figures
    errors = [float(f.value) for key, f in figures.items() if key.startswith("max-error-")]
    return max(errors) if errors else REQUIRED

"""Synthetic Mahimahi traces: a cellular-like link whose rate wanders and sometimes fades.

The bundled traces in netsim/traces/ were made by this module; they are synthetic, not
measurements. Regenerate them with:

    python -m netsim.tracegen

The rate is piecewise constant over `step_ms` steps. Its logarithm follows an AR(1) walk
around log(mean rate) (a slowly varying radio channel), and each step starts a fade (rate
near zero for 0.2–1 s, a handover or a deep shadow) with a small probability. Opportunities
are then laid out one 1500-byte packet at a time at the rate of the moment.
"""
from __future__ import annotations

import argparse
import math
import random
from pathlib import Path

from .effects.trace import PACKET_BYTES

TRACES_DIR = Path(__file__).parent / "traces"


def cellular_trace_ms(duration_s: float, mean_rate_kbit_s: float, seed: int, *,
                      step_ms: int = 100, walk_memory: float = 0.9, walk_sigma: float = 0.35,
                      fade_probability: float = 0.01, fade_rate_kbit_s: float = 50.0) -> list[int]:
    """Opportunity times (ms) for `duration_s` of a varying link with about the given mean rate.

    walk_memory and walk_sigma are the AR(1) coefficient and innovation (in log-rate) per step;
    fade_probability is per step. The mean is approximate: fades and a finite walk move it.
    """
    rng = random.Random(seed)
    # The walk's stationary log-variance is sigma^2 / (1 - memory^2); shifting the centre by
    # half of it makes the log-normal rate's mean the requested one (fades aside).
    log_variance = walk_sigma ** 2 / (1.0 - walk_memory ** 2)
    log_mean = math.log(mean_rate_kbit_s) - log_variance / 2.0
    log_rate = log_mean
    fade_left_ms = 0
    times_ms: list[int] = []
    credit_bits = 0.0   # bits the link could have sent but not yet as a whole packet
    for step_start_ms in range(0, int(duration_s * 1000), step_ms):
        log_rate = log_mean + walk_memory * (log_rate - log_mean) + rng.gauss(0.0, walk_sigma)
        if fade_left_ms <= 0 and rng.random() < fade_probability:
            fade_left_ms = rng.randint(200, 1000)
        rate_kbit_s = fade_rate_kbit_s if fade_left_ms > 0 else math.exp(log_rate)
        fade_left_ms -= step_ms
        for t_ms in range(step_start_ms, step_start_ms + step_ms):
            credit_bits += rate_kbit_s   # kbit/s is bits per ms
            while credit_bits >= PACKET_BYTES * 8:
                credit_bits -= PACKET_BYTES * 8
                times_ms.append(t_ms + 1)   # Mahimahi traces start at 1 ms
    if not times_ms or times_ms[-1] < duration_s * 1000:
        times_ms.append(int(duration_s * 1000))   # the last line sets the period: keep it at the duration
    return times_ms


def write_trace(path: Path, times_ms: list[int]) -> None:
    path.write_text("".join(f"{t}\n" for t in times_ms), encoding="ascii")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=TRACES_DIR)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--duration-s", type=float, default=30.0)
    args = parser.parse_args(argv)
    # A phone's uplink is slower than its downlink; the means are in the range of WPT's LTE
    # (12 Mbit/s) and Lighthouse's slow 4G (1.6 Mbit/s down), not taken from any one source.
    write_trace(args.out / "synthetic-cellular.down", cellular_trace_ms(args.duration_s, 6000.0, args.seed))
    write_trace(args.out / "synthetic-cellular.up", cellular_trace_ms(args.duration_s, 1500.0, args.seed + 1))


if __name__ == "__main__":
    main()

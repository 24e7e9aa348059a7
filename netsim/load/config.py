"""The load test's settings (`LoadConfig`) and its modes."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

MODES = ("hybrid", "adaptive", "cloud-only", "auto")   # auto: the default edge (the planner picks each round)
SYNTHETIC_VOCAB = 64
ALL_LINKS = "all links"   # Locust runs: the name of a request type over every link profile of a mixed run


@dataclass
class LoadConfig:
    edges: list[int]                    # one run per value, per mode
    profiles: list[str]                 # edge i gets profiles[i % len(profiles)]
    modes: list[str]
    duration_s: float
    out: Path
    synthetic: bool = False
    server: str | None = None           # a running verifier (host:port); else one is started
    metrics_url: str | None = None      # its Prometheus endpoint, with --server
    verifier_args: list[str] = field(default_factory=list)
    gamma: int = 4
    max_tokens: int = 64                # per request
    arrival_rate: float = 0.0           # requests/s per edge (Poisson); 0: back to back
    seed: int = 1
    draft_ms: float = 2.0               # synthetic drafter: cost per drafted token (ms)
    synthetic_step_ms: float = 20.0     # synthetic verifier we start: cost per forward pass (ms)
    synthetic_alpha_noise: float = 1.0
    target: str | None = None
    draft: str | None = None
    pair: str | None = None             # the named pair target and draft came from (netsim/pairs.py)
    drafter: str = "gguf"               # real target: "gguf" (a draft model per edge, run on this CPU)
                                        # or "lookup" (prompt lookup, no model; draft_ms emulated per token)
    qmode: str = "fixed:16:16"
    warmup_s: float = 1.0               # each run's first seconds are not measured
    slo_tpot_ms: float = 150.0          # a request meets the SLO with time per output token at most this
    slo_ttft_ms: float = 2000.0         # ... and time to first token at most this (when it arrived in the window)
    coupling: str = "rejection"         # how drafts are checked ("gumbel": each request's text is the target's own)

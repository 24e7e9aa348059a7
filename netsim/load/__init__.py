"""The load test: N edges, each its own gRPC channel through its own emulated link, against one verifier.

All edges run on one asyncio event loop in this process; their links run in a process of their
own (netsim.proxyhost), so the edges' work never delays the network. Each edge is a device
that generates one request at a time: back to back (fixed concurrency, `arrival_rate` 0) or
requests arriving as a Poisson process of `arrival_rate` per edge, queued on the device while
it is busy (their TTFT counts the wait). The measured window opens after `warmup_s` once every
edge has committed a token (so the cold start of many sessions, or of many draft models, does
not eat it) and lasts `duration_s`; requests still running at its end are cut off there, and
their tokens committed by then count.

The synthetic drafter's cost per token is emulated by a sleep on the event loop before each
Verify call (a client interceptor), so each edge drafts as if on its own device; real GGUF
drafters (one model per edge) run for real, one at a time, on this machine's CPU, so with
more than a few edges they measure this machine's drafting, not the verifier: use --synthetic
for server capacity.

What is measured, per mode (hybrid = fixed γ chain, adaptive = γ from the cost model,
cloud-only = the verifier's Generate stream):
- committed tokens/s over all edges (server throughput);
- time per output token of each request over its commits inside the measured window, (last
  commit time - first commit time) / (tokens committed between them), and its p50/p95/p99 over
  requests; TTFT p50/p99 from the arrival, for requests that arrived inside the window;
- errors by gRPC status, session replays (the edge's count), sessions opened (the verifier's);
- from the verifier's Prometheus endpoint: rounds and draft tokens (hence target forward passes
  and target tokens per committed token: a Verify round is one pass over γ + 1 tokens; a
  Generate token is one pass over one token, prompts' prefill left out), and, when the verifier
  exports them, the per-batch histograms hybridspec_batch_tokens / _seconds / _sessions,
  which then replace the derived pass counts;
- the verifier process's CPU (cores busy) and peak RSS (psutil), and the CPU of this process (every
  edge) and of the proxy process (every link): the harness's own load.

Modules, one job each: config (LoadConfig), metering (the verifier's metrics, processes' CPU and
RSS), edges (the emulated edges and their requests), runs (one run and the sweep), verdicts (goodput
and capacity at an SLO), report (markdown, plots, files). The same edges as Locust users
(`netsim load --locust`, docs/many-edges.md): locustfile (the users; Locust imports it, nothing
else may: importing Locust patches the process for gevent), edgehost (a worker's edges on one
asyncio loop in a process of their own), locustrun (the master and workers of a run, and their
files read back into a run's record).
"""
from netsim.load.config import MODES, SYNTHETIC_VOCAB, LoadConfig
from netsim.load.edges import DraftCost, Edges, EmulatedDrafter, Request, Window, run_edge
from netsim.load.edges import _one_request  # noqa: F401 (bench/fleet_wire.py imports it from here)
from netsim.load.metering import (BATCH_HISTOGRAMS, ProcessMeter, free_port, histogram_delta, kv_between_rounds,
                                  metric_delta, scrape)
from netsim.load.report import markdown, plot, write_all
from netsim.load.report import _kv_lines  # noqa: F401 (tests/test_kvpark.py imports it from here)
from netsim.load.runs import (HARNESS_SATURATED, LOAD_N_CTX, drain, percentile, run_load, run_once, saturation,
                              server_info, verifier_args, verifier_threads)
from netsim.load.verdicts import capacity_at_slo, goodput_at, meets_slo_p95

__all__ = ["BATCH_HISTOGRAMS", "HARNESS_SATURATED", "LOAD_N_CTX", "MODES", "SYNTHETIC_VOCAB", "DraftCost", "Edges",
           "EmulatedDrafter", "LoadConfig", "ProcessMeter", "Request", "Window", "capacity_at_slo", "drain",
           "free_port", "goodput_at", "histogram_delta", "kv_between_rounds", "markdown", "meets_slo_p95",
           "metric_delta", "percentile", "plot", "run_edge", "run_load", "run_once", "saturation", "scrape",
           "server_info", "verifier_args", "verifier_threads", "write_all"]

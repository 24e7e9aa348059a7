"""The fleet on paper: a discrete-event simulation of edges sharing verifiers.

One verifier and the n edges assigned to it are simulated (edges are spread evenly, and one
verifier's edges do not interact with another's, so V verifiers for N edges behave like one
verifier with N/V edges). The parts, one job each:

  costs        what a forward pass costs (a line for a CPU backend, a roofline for a GPU and its host path)
  hostpath     the acceptance maths per pass, from a measured table (bench/fleet/host_path.json)
  links        an edge's connection: the proxy's own link model, draw for draw
  policies     the verifier's policies, the shipped functions themselves: batch order, draft budget,
               KV victim, SLO verdict (a test fails if the fleet writes its own)
  simulation   the event loop: edges, links, the verifier's passes (planned as the Batcher plans them)
  calibration  the simulator's parameters from a `netsim load` run (`Calibration`)
  report       each load run checked against its calibration; verifiers per N edges at an SLO
  gpu          capacity and goodput per GPU for each path of the vLLM backend; SpecEdge's set-up
  serverspec   the second baseline: vLLM speculating for itself (draft model, EAGLE, n-gram), its cost on the GPU
  measured     the rounds-in-flight inputs, from the project's own measurements
  regime       the regime map: the hybrid per GPU against both baselines across GPU, target, context, link
               and α, what binds, the p95 gap and TTFT
  simcheck     the map's points run in the simulation: one model answer per cell
"""
from netsim.fleet.calibration import (LLAMA_CPP_UBATCH, SYNTHETIC_UBATCH, Calibration, alpha_from_tokens_per_round,
                                      calibrate_from_load, cpu_per_unit, fleet_config, load_batching,
                                      pass_cost_from_histograms, run_alpha)
from netsim.fleet.costs import H100, H200, LLAMA_8B, LinearCost, RooflineCost, gpu_cost, kv_sessions
from netsim.fleet.links import MAX_CHUNK_BYTES, RECONNECT_S, ROUND_BYTES, STREAM_BYTES, EdgeLink
from netsim.fleet.capacity import edges_per_verifier
from netsim.fleet.report import (CHECK_SEEDS, GPU_BATCH_TOKENS, Scenario, capacity_table, check_against_load,
                                 fleet_markdown, fleet_plot, run_fleet)
from netsim.fleet.simulation import FleetConfig, simulate

__all__ = [
    "CHECK_SEEDS", "GPU_BATCH_TOKENS", "H100", "H200", "LLAMA_8B", "LLAMA_CPP_UBATCH", "MAX_CHUNK_BYTES",
    "RECONNECT_S", "ROUND_BYTES", "STREAM_BYTES", "SYNTHETIC_UBATCH", "Calibration", "EdgeLink", "FleetConfig",
    "LinearCost", "RooflineCost", "Scenario", "alpha_from_tokens_per_round", "calibrate_from_load",
    "capacity_table", "check_against_load", "cpu_per_unit", "edges_per_verifier", "fleet_config",
    "fleet_markdown", "fleet_plot", "gpu_cost", "kv_sessions", "load_batching", "pass_cost_from_histograms",
    "run_alpha", "run_fleet", "simulate",
]

"""`netsim load --clock virtual`: the load test's edges and verifier on the virtual clock.

The same edges as the wall-clock load test (netsim.load: `run_edge`, their drafters, prompts,
seeds, arrivals and measured window) run against the shipped verifier built in this process
(hybridspec.virtual.make_verifier, from the serve options a wall-clock run's verifier gets), all on
one virtual event loop (netsim.virtual.loop). Each edge has its own link (netsim.virtual.channel,
drawn from the run's seed and the edge's number, as the wall-clock run seeds its proxies). Time is
the cost table's: the verifier's batched passes (the batcher's own rule for what shares a pass,
each pass charged from the table's line), its host path, and the edges' drafting, which for the
synthetic and prompt-lookup drafters is `--draft-ms` a token as on the wall clock, and for a draft
model per edge the table's drafting line. A run's figures therefore depend on neither this
machine's speed nor its load, and many edges never compete for its cores: the answer is the
verifier's capacity on the table's costs, not this machine's harness.

Not modelled: the CPU columns of the wall-clock report (verifier CPU, RSS, the harness's cores),
the proxy's lateness, and what the virtual experiment leaves out (docs/netsim.md).
"""
from __future__ import annotations

import asyncio
import random
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import numpy as np

from netsim.cmdline import option_value
from netsim.load.config import LoadConfig
from netsim.load.edges import DraftCost, Edges, Window, run_edge
from netsim.load.metering import registry_samples
from netsim.load.runs import Traffic, edge_profiles, info_record, measure_window, run_record, verifier_args
from netsim.load.verdicts import capacity_at_slo
from netsim.virtual import loop as vloop
from netsim.virtual.channel import InProcessChannel
from netsim.virtual.costs import CostTable, synthetic_table
from netsim.virtual.experiment import MakeVerifier, costed_client

# Settings of a wall-clock load run that say where its verifier is, not what runs.
_NOT_RESULTS = ("out", "server", "metrics_url")
IN_PROCESS = "in-process"   # the verifier's metrics: this process's registry


def load_table(cfg: LoadConfig, name: str | None) -> CostTable:
    """The cost table a virtual load run charges: `name` (a shipped table or a file), else the
    synthetic pair's own (a pass of --synthetic-step-ms; drafting is --draft-ms, paid by the edges),
    else the pair's measured table."""
    from netsim.virtual.costs import default_table, load_table as named
    if name:
        return named(name)
    if cfg.synthetic:
        return synthetic_table(0.0, cfg.synthetic_step_ms / 1e3, name="synthetic (the load test's --synthetic-step-ms "
                                                                      "a pass; drafting --draft-ms a token)")
    return default_table(cfg)   # the pair's own (it reads synthetic, pair, target and draft)


def check(cfg: LoadConfig) -> None:
    """Refuse, before any run, what the virtual clock cannot do, naming both sides."""
    if cfg.server:
        raise ValueError("--clock virtual runs its own verifier in this process: it cannot load --server "
                         f"{cfg.server} (a running verifier keeps wall-clock time)")
    if option_value(cfg.verifier_args, "--batching") not in (None, "on"):
        raise ValueError("--clock virtual runs batching verifiers only (the default): a serial verifier takes its "
                         "model in turns between threads")


def run_virtual_load(cfg: LoadConfig, costs: CostTable, make_verifier: MakeVerifier, progress=None,
                     workers: int = 1) -> dict:
    """Each (edges, mode) of `cfg` on the virtual clock; load.json's record of them (the same keys as a
    wall-clock sweep's, the CPU figures None). Each run has a process of its own, started afresh
    (`workers` at a time): its verifier's counters start from zero, so its figures are the same
    bytes whatever ran before it or beside it."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    check(cfg)
    plan = [(n_edges, mode) for n_edges in cfg.edges for mode in cfg.modes]
    task = progress.add_task("virtual clock", total=len(plan)) if progress else None
    with ProcessPoolExecutor(max(1, workers), mp_context=multiprocessing.get_context("spawn"),
                             max_tasks_per_child=1) as pool:
        futures = [pool.submit(run_one, cfg, costs, make_verifier, n_edges, mode) for n_edges, mode in plan]
        done = []
        for (n_edges, mode), fut in zip(plan, futures):
            if progress:
                progress.update(task, description=f"{n_edges} edges, {mode} (virtual)")
            done.append(fut.result())
            if progress:
                progress.advance(task)
    runs, info = [run for run, _ in done], done[0][1]
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items() if k not in _NOT_RESULTS}
    config["server"] = None
    return {"clock": "virtual", "cost_table": costs.provenance(), "config": config, "server": info, "runs": runs,
            "started": "virtual clock", "verifier_threads": None,
            "capacity": capacity_at_slo(runs, cfg.slo_tpot_ms / 1e3, cfg.slo_ttft_ms / 1e3)}


def run_one(cfg: LoadConfig, costs: CostTable, make_verifier: MakeVerifier, n_edges: int, mode: str) -> tuple[dict, dict]:
    """One run (`n_edges` edges in `mode`) on a virtual loop of its own: its record and the verifier's info."""
    edges = Edges(cfg)
    random.seed(f"{cfg.seed}:{n_edges}:{mode}")   # the edges' retry jitter draws from `random`
    return vloop.run(lambda: _run_once(cfg, edges, mode, n_edges, costs, make_verifier))


async def _run_once(cfg: LoadConfig, edges: Edges, mode: str, n_edges: int, costs: CostTable,
                    make_verifier: MakeVerifier) -> tuple[dict, dict]:
    verifier = make_verifier(verifier_args(cfg, 0, n_edges), costs)
    try:
        server = info_record(verifier.engine.server_info())
        traffic = await _drive(cfg, edges, mode, n_edges, verifier, costs)
        return run_record(cfg, mode, n_edges, edge_profiles(cfg, n_edges), traffic, IN_PROCESS), server
    finally:
        verifier.close()


async def _drive(cfg: LoadConfig, edges: Edges, mode: str, n_edges: int, verifier, costs: CostTable) -> Traffic:
    """Run the edges through their virtual links until the measured window closes."""
    loop = asyncio.get_running_loop()
    profiles = edge_profiles(cfg, n_edges)
    emulated = cfg.synthetic or cfg.drafter == "lookup"   # drafting is --draft-ms a token, paid on the loop
    costs_paid = [DraftCost() for _ in range(n_edges)] if emulated else [None] * n_edges
    drafters = [edges.drafter(costs_paid[i] or DraftCost(), i) for i in range(n_edges)]
    client_class = None if emulated else costed_client(costs)   # a draft model: the table's drafting line

    def connect(i: int) -> Callable[[], InProcessChannel]:
        return lambda: InProcessChannel(verifier.server, profiles[i], costs, seed=cfg.seed * 100_003 + i,
                                        epoch_s=loop.time())
    requests, errors, round_trips = [], {}, []
    t_start = loop.time()
    window = Window(n_edges, cfg.warmup_s, cfg.duration_s)
    measuring = asyncio.create_task(measure_window(cfg, window, n_edges, registry_samples, None))
    await asyncio.gather(*(run_edge(edges, mode, i, 0, window, requests, errors,
                                    np.random.default_rng([cfg.seed, n_edges, i]), costs_paid[i], drafters[i],
                                    round_trips, connect=connect(i), client_class=client_class)
                           for i in range(n_edges)))
    measured = await measuring
    return Traffic(requests, errors, window, window.start_s - t_start, measured, [], round_trips)

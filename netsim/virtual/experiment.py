"""`netsim experiment --clock virtual`: the experiment's runs on the virtual clock.

The same modes, workloads, prompts, sampling and edge options as the wall-clock experiment
(netsim.experiment), run by the shipped edge loop against the shipped engine and backend in one
process on one virtual event loop (netsim.virtual.loop). The models are real (or the synthetic
pair): which tokens are drafted and accepted is what they say. Time is the cost table's
(netsim.virtual.costs: drafting, passes, host paths) and the profile's links (netsim.virtual.channel,
drawn from the run's seed). Each profile has a verifier of its own (so profiles may run in parallel
processes and the results do not change); on it the runs go prompt by prompt, every mode on each, each
run on a new connection of the profile's network, which starts with its first run.

The results carry `"clock": "virtual"` and the cost table they ran on; nothing in them depends on
this machine's speed or load, or on when they ran (those go to `run.json` beside them): the same
seed and table give the same bytes.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from dataclasses import asdict
from typing import Callable

from edge_client.client import EdgeClient
from netsim.experiment import ExperimentConfig, Row, Runner, expand_modes, load_workloads, make_row
from netsim.profiles import get_profile
from netsim.virtual import loop as vloop
from netsim.virtual.channel import InProcessChannel
from netsim.virtual.costed import CostedDrafter
from netsim.virtual.costs import CostTable
from spec_core import clock

log = logging.getLogger(__name__)

# Experiment settings that say how the wall-clock run reaches or paces its verifier, not what runs:
# left out of a virtual run's results (the table says what a pass costs; nothing is on a port).
_NOT_RESULTS = ("out", "verifier_threads", "draft_threads", "synthetic_draft_ms", "synthetic_step_ms",
                "synthetic_per_token_ms", "crossover", "crossover_rtts_ms", "crossover_steps_ms")

MakeVerifier = Callable[[list[str], CostTable], object]   # hybridspec.virtual.make_verifier


def costed_client(costs: CostTable) -> type:
    """An EdgeClient whose generations draft through a CostedDrafter: wrapped after the pairing, so a
    draft of another tokenizer is charged as the CrossVocabDrafter it drafts through."""
    class CostedClient(EdgeClient):
        async def pairing_for(self, st):
            pairing = await super().pairing_for(st)
            if not isinstance(pairing.drafter, CostedDrafter):
                pairing = dataclasses.replace(pairing, drafter=CostedDrafter(pairing.drafter, costs))
                self._pairing, self.drafter = pairing, pairing.drafter
            return pairing
    return CostedClient


def result_config(cfg: ExperimentConfig) -> dict:
    return {k: v for k, v in asdict(cfg).items() if k not in _NOT_RESULTS}


def run_virtual_experiment(cfg: ExperimentConfig, costs: CostTable, make_verifier: MakeVerifier,
                           progress=None, workers: int = 1) -> dict:
    """Every (profile, workload prompt, mode) of `cfg` on the virtual clock; the results dict. Each
    profile runs on a verifier of its own, so the results do not depend on `workers` (processes, one
    profile each at a time)."""
    cfg = dataclasses.replace(cfg, synthetic_draft_ms=0.0, crossover=False)   # time is the table's
    runs = len(load_workloads(cfg.workloads, cfg.prompts_per_workload)) * len(expand_modes(cfg.modes, cfg.gammas))
    task = progress.add_task("virtual clock", total=len(cfg.profiles) * runs) if progress else None
    rows: dict[str, list[dict]] = {}
    models: dict = {}
    if workers <= 1 or len(cfg.profiles) <= 1:
        for name in cfg.profiles:
            def tick(what: str) -> None:
                if progress:
                    progress.update(task, description=f"virtual: {what}")
                    progress.advance(task)
            rows[name], models = run_profile(cfg, costs, make_verifier, name, tick)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {name: pool.submit(run_profile, cfg, costs, make_verifier, name) for name in cfg.profiles}
            for name, fut in futures.items():
                rows[name], models = fut.result()
                if progress:
                    progress.advance(task, runs)
    return {"clock": "virtual", "cost_table": costs.provenance(), "config": result_config(cfg),
            "profiles": {n: get_profile(n).to_dict() for n in cfg.profiles},
            "rows": [r for name in cfg.profiles for r in rows[name]], "models": _portable(models)}


def run_profile(cfg: ExperimentConfig, costs: CostTable, make_verifier: MakeVerifier, name: str,
                tick: Callable[[str], None] | None = None) -> tuple[list[dict], dict]:
    """One profile's runs, prompt by prompt and every mode on each (interleaved, as a quiet wall-clock
    comparison runs them), on a fresh verifier and virtual loop; its rows and the models."""
    workloads = load_workloads(cfg.workloads, cfg.prompts_per_workload)
    modes = expand_modes(cfg.modes, cfg.gammas)
    profile = get_profile(name)

    async def main():
        runner = Runner(cfg)
        client = costed_client(costs)
        verifier = make_verifier(runner.verifier_args(), costs)
        rows: list[Row] = []
        connection = 0
        try:
            for workload, index, prompt in workloads:
                ids = runner.prompt_ids(prompt)
                settings = runner.settings(workload, cfg.max_tokens)
                for mode, gamma in modes:
                    if mode == "edge-only":
                        row = await clock.run_inline(_EdgeOnly(runner, costs).run, profile, workload, index,
                                                     runner.draft_prompt_ids(prompt), settings)
                    else:
                        channel = InProcessChannel(verifier.server, profile, costs, seed=cfg.seed,
                                                   first_connection=connection)
                        st, cross = await runner.run_on(channel, "in-process", mode, gamma, ids, settings, prompt,
                                                        client_class=client)
                        connection += channel.connections
                        row = make_row(profile, mode, gamma, workload, index, st, channel.counts.bytes_up,
                                       channel.counts.bytes_down, cross)
                    rows.append(row)
                    if tick:
                        tick(f"{name} {row.mode} {workload}")
        finally:
            verifier.close()
        return rows, runner.models()

    random.seed(f"{cfg.seed}:{name}")   # the edge's retry and back-off jitter draw from `random`
    rows, models = vloop.run(main)
    order = {(m, g): k for k, (m, g) in enumerate(modes)}   # the results list modes in the experiment's order
    rows.sort(key=lambda r: (order.get(_mode_key(r.mode, modes), 0), cfg.workloads.index(r.workload), r.prompt_index))
    return [asdict(r) for r in rows], models


def _mode_key(label: str, modes) -> tuple:
    from netsim.experiment import mode_label
    return next(((m, g) for m, g in modes if mode_label(m, g) == label), (label, None))


class _EdgeOnly:
    """The runner's edge-only run with its drafter charged from the table."""

    def __init__(self, runner: Runner, costs: CostTable):
        self.drafter = CostedDrafter(runner.drafter, costs)

    def run(self, *args) -> Row:
        return Runner._edge_only(self, *args)


def _portable(models: dict) -> dict:
    """The models, named by file (not by where this machine keeps them)."""
    out = dict(models)
    for key in ("target", "draft"):
        if isinstance(out.get(key), str):
            out[key] = out[key].rsplit("/", 1)[-1]
    return out

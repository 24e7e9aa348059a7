"""The verifier's policies as the fleet simulator runs them: the shipped functions themselves.

Each policy the verifier ships is imported here from spec_core and only fed the simulation's
records (its jobs, its sessions' timings); none is written again, and a test fails if the fleet
defines its own (tests/netsim/test_netsim_fleet.py, `test_the_fleet_runs_the_verifiers_own_policies`):

  draft budget  `spec_core.steering.draft_budget` at the price θ = per-token pass cost × commit
                rate, as cloud_verifier.engine prices it: the per-token cost from `PassCostLine` over
                the simulated passes (the Batcher measures the shipped ones with it), the commit rate
                from `CommitRate` (every commit, rounds and streamed tokens), α per session from
                `Acceptance`. The shipped verifier steers only with a batching backend (only the
                Batcher measures a pass cost line), so the simulator does too;
  batch order   `spec_core.batchplan.fair_share` (the Batcher's default schedule, `--schedule fair`)
                and `least_slack_first` (`--schedule slack`), each request's deadline from
                `spec_core.slo.Slo.due` as the engine sets it; "fcfs" (whole requests in arrival order)
                is a vLLM-like scheduler, not one of ours;
  KV victim     `spec_core.kvpark.choose_victim` (the next round expected last first; ski rental
                without a forecast), each session's forecast its mean idle gap (`ewma`), as
                cloud_verifier.backends.kvpark's SeqBook keeps it;
  SLO verdict   `spec_core.slo.meets_slo` for a request, `run_meets_slo` for a run (as netsim.load).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

from spec_core.batchplan import fair_share, least_slack_first
from spec_core.estimates import ewma
from spec_core.kvpark import ParkCandidate, ParkCost, choose_victim
from spec_core.slo import Slo, meets_slo, run_meets_slo, window_tpot
from spec_core.steering import Acceptance, CommitRate, PassCostLine, draft_budget

__all__ = ["PACKINGS", "Acceptance", "ParkCandidate", "ParkCost", "Slo", "Steering", "Take", "choose_victim",
           "draft_budget", "ewma", "fair_share", "least_slack_first", "meets_slo", "plan_pass", "run_meets_slo",
           "window_tpot"]

PACKINGS = ("fair-share", "slack", "fcfs")


class Take(NamedTuple):
    """A job's share of a pass."""
    job: object
    tokens: int


def plan_pass(packing: str, active: Sequence, budget: int, now: float, prefill_chunk: int) -> list[Take]:
    """The takes of the next pass over `active` (in arrival order; each job has `tokens` left to
    evaluate, `rows` of them wanting logits, at the end, a `deadline` or None, and `arrived_s`).

    fair-share  the Batcher's default: spec_core.batchplan.fair_share;
    slack       the Batcher's `--schedule slack`: least_slack_first with slack = deadline − now
                (a job without a deadline: its arrival − now);
                under both, a prefill (more than prefill_chunk tokens wanting no logits) takes at
                most prefill_chunk of a pass while rounds wait, as the Batcher plans it;
    fcfs        whole jobs in arrival order while they fit (the first always does): vLLM-like.
    """
    if packing == "fcfs":
        plan, tokens = [], 0
        for job in active:
            if plan and tokens + job.tokens > budget:
                break
            plan.append(Take(job, job.tokens))
            tokens += job.tokens
        return plan
    pending = [job.tokens for job in active]
    prefill = [job.tokens - job.rows > prefill_chunk for job in active]
    if packing == "fair-share":
        takes = fair_share(pending, budget, prefill, prefill_chunk)
    elif packing == "slack":
        slack = [(job.deadline if job.deadline is not None else job.arrived_s) - now for job in active]
        takes = least_slack_first(pending, slack, budget, prefill_chunk, prefill)
    else:
        raise ValueError(f"packing must be one of {PACKINGS}, got {packing!r}")
    return [Take(job, n) for job, n in zip(active, takes) if n]


class Steering:
    """The engine's draft budget, fed by the simulation: its passes, its commits, each session's α."""

    def __init__(self, max_gamma: int):
        self.max_gamma = max_gamma
        self.cost = PassCostLine()
        self.commits = CommitRate()
        self._per_token_s: float | None = None   # the line as of the last pass

    def observe_pass(self, tokens: int, seconds: float) -> None:
        self.cost.observe(tokens, seconds)
        self._per_token_s = None

    def observe_commit(self, now: float, tokens: int) -> None:
        self.commits.observe(now, tokens)

    def budget(self, acceptance: Acceptance, now: float) -> int:
        """The longest draft that pays for a session with this α now (chains: no tree nodes)."""
        if self._per_token_s is None:
            self._per_token_s = self.cost.line()[1]
        price = self._per_token_s * self.commits.rate(now)
        return draft_budget(acceptance.alpha, price, self.max_gamma, 0, 1).max_gamma

"""Feeding the planner's estimates (edge_client.estimates) as the round loop does, one reply at a time:
for tests of plan_round without a server."""
from __future__ import annotations

from edge_client.estimates import Estimates, ReplyTaught, RoundTaught
from edge_client.planner import Budget, RoundPlan, plan_round


def teach(est: Estimates, plan: RoundPlan, *, tokens: int, rtt_s: float, model_s: float | None, draft_s: float,
          accepted: int | None = None, drafted: int | None = None, nodes: int | None = None, rows: int | None = None,
          server_s: float | None = None, request_bytes: int = 0) -> None:
    """One reply that committed one round of `plan`: `tokens` committed (a chain: `accepted` + 1, with
    a rejection when fewer than its γ were accepted), its round trip, its pass (`model_s` None: one
    that also held the prompt), its drafting."""
    nodes = plan.nodes if nodes is None else nodes
    rows = plan.rows if rows is None else rows
    drafted = nodes if drafted is None else drafted
    accepted = tokens - 1 if accepted is None else accepted
    server_s = (model_s or 0.0) if server_s is None else server_s
    round_ = RoundTaught(plan.arm, plan.shape is None, drafted, accepted, accepted < drafted, tokens, rows, draft_s)
    est.observe(ReplyTaught((round_,), rtt_s + server_s, server_s, model_s, 0.0, nodes, request_bytes, nodes))


def chain_round(est: Estimates, gamma: int, accepted: int, model_s: float | None, rtt_s: float = 0.3,
                row_s: float = 0.002) -> None:
    teach(est, RoundPlan("chain", gamma), tokens=accepted + 1, rtt_s=rtt_s, model_s=model_s, draft_s=row_s * gamma)


def plan(est: Estimates, spec, remaining: int = 10_000, **budget) -> RoundPlan:
    return plan_round(est, spec, Budget(remaining, **budget))

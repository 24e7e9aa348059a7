"""What one session drafts: a round's chain or tree after a base (`prepare`), and continuations, the
next round drafted for each likely outcome of a round (`continuations`), as many as pay
(edge_client.continuations). Drafting runs where the client's drafting runs (a thread or the
server's drafting executor), so nothing here touches the session's committed state.
"""
from __future__ import annotations

import threading

import numpy as np

from edge_client.continuations import ContinuationBudget, FusedBudget, choose_length, ranked_outcomes
from edge_client.drafters import Drafter
from edge_client.gamma import RoundPlan, TreePolicy
from edge_client.options import Speculation
from edge_client.rounds import GREEDY, Guess, Prepared
from spec_core import clock
from spec_core.continuations import MAX_CONTINUATION_NODES, MAX_CONTINUATIONS, Outcome
from spec_core.drafting import QMode
from spec_core.estimates import Acceptance
from spec_core.proto import qpayload
from spec_core.proto import verifier_pb2 as pb
from spec_core.tree import DraftTree
from spec_core.warping import EDGE_STREAM, SamplingSettings, seeded_rng


class RoundDrafts:
    """One session's drafting: its drafter, options, sampling settings, the planner's measured costs
    and the acceptance of its chains (for ranking outcomes)."""

    def __init__(self, drafter: Drafter, spec: Speculation, settings: SamplingSettings, planner: TreePolicy,
                 acceptance: Acceptance, stop_ids: frozenset[int]):
        self.drafter, self.spec, self.settings, self.planner = drafter, spec, settings, planner
        self.acceptance, self.stop_ids = acceptance, stop_ids
        self.rng = seeded_rng(settings.seed, EDGE_STREAM)  # never the verifier's stream (see warping)
        self.fixed_lengths = False   # continuations keep the fresh round's plan (pinned planner inputs)

    def base_rng(self, base: list[int]) -> np.random.Generator:
        # With a user seed, a round's draft depends only on the committed tokens (a stream per
        # committed length, like the verifier's): a round redone after a replay drafts the same.
        seed = self.settings.seed
        return self.rng if seed is None else seeded_rng(seed, EDGE_STREAM, len(base))

    def prepare(self, base: list[int], plan: RoundPlan) -> Prepared:
        """Draft the planned chain or tree after `base`; either way the round's draft is a tree (a
        chain: one path)."""
        drafter, rng = self.drafter, self.base_rng(base)
        # The gumbel coupling: the verifier never reads q, so none travels (the draft still drew from it).
        gumbel = self.settings.gumbel
        if plan.shape is None:
            d = drafter.propose(base, plan.gamma, self.settings, self.spec.qmode, rng)
            return Prepared(base, plan, DraftTree.chain(d.tokens), None if gumbel else d.qs, d.seconds, len(d.tokens),
                            drawn_qs=d.qs if gumbel else None)
        d = drafter.propose_tree(base, plan.shape, self.settings, self.spec.qmode, rng)
        return Prepared(base, plan, DraftTree(tuple(d.tokens), tuple(d.parents)), None if gumbel else d.qs, d.seconds,
                        d.rows, d.path_probs, drawn_qs=d.qs if gumbel else None)

    def budget(self, prep: Prepared, now: float, s_per_byte: float, depth: int = 1) -> ContinuationBudget:
        """When the reply is expected and what a hit saves, from the planner's measured costs. depth:
        the rounds in flight once the continuations are sent (1: kept for when the reply comes)."""
        pl = self.planner
        draft_s = prep.rows * (pl.t_row_s or 0.0)
        round_s = pl.predicted_round_s(prep.plan)
        return ContinuationBudget(t_reply=now + max(0.0, round_s - draft_s), rtt_s=pl.rtt_s or 0.0,
                                  fresh_draft_s=draft_s, s_per_byte=s_per_byte, round_s=round_s, depth=depth)

    def fused_budget(self, prep: Prepared, s_per_byte: float) -> FusedBudget:
        """What fused continuations for `prep`'s outcomes must pay against (edge_client.continuations)."""
        pl = self.planner
        per_node = max(pl.verify_line()[1], 0.0)
        return FusedBudget(pl.predicted_round_s(prep.plan), s_per_byte, per_node / pl.t_row_s if pl.t_row_s else 0.0)

    def continuations(self, prep: Prepared, remaining: int, budget: ContinuationBudget | FusedBudget,
                      stop: threading.Event) -> list[Guess]:
        """Continuations for the round's likely outcomes, most probable first, while one more pays
        (edge_client.continuations) and the reply is not in. Empty when the round may end generation.
        With max_continuations 1: the one guess that every draft is accepted, then the draft's argmax."""
        path = prep.guess_path()
        if not path or len(path) + 1 >= remaining or self.stop_ids & set(path):
            return []
        # Planned for the shortest outcome (a rejection at the first draft), cut per outcome below.
        plan = self.planner.plan(remaining - 1, peek=True)
        out: list[Guess] = []
        covered, spent, nodes, nbytes = 0.0, [prep.seconds], 0, self.payload_bytes(prep)
        outcomes = self.outcomes(prep, path)
        if (self.spec.pipeline or budget.check_first) and plan.shape is None and len(outcomes) > 1 and plan.gamma > 1 \
                and not self.fixed_lengths:
            # How long: as many outcomes covered as pay, times what a hit commits (edge_client.continuations).
            t_row = self.planner.t_row_s or prep.seconds / max(prep.rows, 1)
            gamma = choose_length(outcomes, self.acceptance.alpha, plan.gamma, t_row, nbytes / max(len(prep.tree), 1),
                                  budget, clock.now())
            plan = RoundPlan(plan.arm, gamma)
            spent = [(gamma + 1) * t_row]
        for outcome in outcomes:
            if out and stop.is_set() or len(out) > MAX_CONTINUATIONS:  # the first is drafted in any case
                break
            tokens = list(outcome.tokens)
            if self.stop_ids & set(tokens) or len(tokens) + 1 >= remaining:
                continue
            if (out or budget.check_first) and (self.spec.pipeline or budget.check_first) and \
                    not budget.worth(outcome.prob, covered, clock.now(), sum(spent) / len(spent), nbytes):
                break
            t0 = clock.now()
            nxt = self.prepare(prep.base + tokens, plan.within(remaining - len(tokens)))
            spent.append(clock.now() - t0)
            nodes += len(nxt.tree)   # the verifier bounds all of a round's continuations together
            if out and nodes > MAX_CONTINUATION_NODES:
                break
            if len(nxt.tree):
                out.append(Guess(tokens, nxt))
                covered += outcome.prob
                nbytes = self.continuation(out[-1]).ByteSize()
        return out

    def outcomes(self, prep: Prepared, path: list[int]) -> list[Outcome]:
        """The round's outcomes ranked by the draft's estimate (spec_core.continuations), at most
        max_continuations of them."""
        drafter, after = self.drafter, prep.base + path
        if self.spec.max_continuations <= 1:
            bonus = drafter.propose(after, 1, GREEDY, QMode("none"), self.base_rng(after)).tokens
            return [Outcome(tuple(path + bonus), 1.0)] if bonus else []
        # The draft's distribution where the verifier draws a token (greedy sessions rank by T = 1).
        est = self.settings if not self.settings.greedy else SamplingSettings(temperature=1.0)

        def probe(seq: list[int]):
            qs = drafter.propose(seq, 1, est, QMode("float", 16), np.random.default_rng(0)).qs
            return qs[0] if qs else None
        nodes, tree, shipped = prep.guess_nodes(), prep.tree, prep.qs if prep.qs is not None else prep.drawn_qs
        # Position j's other candidates: the siblings of the path's node there (none in a chain).
        children = tree.children()
        siblings = [[tree.tokens[c] for c in children[tree.parents[n]] if c != n] for n in nodes]
        position_q = (lambda j: shipped[nodes[j]]) if shipped is not None else (lambda j: probe(prep.base + path[:j]))
        return ranked_outcomes(path, self.acceptance.alpha, position_q, probe(after), self.spec.max_continuations,
                               excluded=lambda j: siblings[j])

    def continuation(self, guess: Guess) -> pb.Continuation:
        p = guess.prep
        return pb.Continuation(assumed_tokens=guess.tokens, draft_token_ids=p.tree.tokens,
                               draft_parents=p.wire_parents(), q=qpayload.to_proto(p.qs, self.spec.qmode.scale_bits))

    def payload_bytes(self, prep: Prepared) -> int:
        """The bytes of `prep`'s q on the wire."""
        return qpayload.to_proto(prep.qs, self.spec.qmode.scale_bits).ByteSize()

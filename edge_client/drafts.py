"""What one session drafts: a round's chain or tree after a base (`prepare`), and continuations, the
next round drafted for each likely outcome of a round (`continuations`), as many as pay
(edge_client.planner.ContinuationBudget). Drafting runs where the client's drafting runs (a thread or the
server's drafting executor), so nothing here touches the session's committed state.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Callable

import numpy as np

from edge_client.continuations import ranked_outcomes
from edge_client.drafters import Drafter
from edge_client.estimates import Estimates
from edge_client.options import Speculation
from edge_client.planner import ContinuationBudget, RoundPlan, continuation_length
from edge_client.remote import continuation_bytes, payload_bytes
from edge_client.rounds import GREEDY, Continuation, Prepared
from spec_core import clock as clock_seam
from spec_core.continuations import MAX_CONTINUATION_NODES, MAX_CONTINUATIONS, Outcome
from spec_core.drafting import QMode
from spec_core.tree import DraftTree
from spec_core.warping import EDGE_STREAM, SamplingSettings, seeded_rng


class RoundDrafts:
    """One session's drafting: its drafter, options, sampling settings, what the session measured
    (the acceptance that ranks outcomes, the costs continuations are priced by) and the clock."""

    def __init__(self, drafter: Drafter, spec: Speculation, settings: SamplingSettings, est: Estimates,
                 stop_ids: frozenset[int], clock: Callable[[], float] = clock_seam.now):
        self.drafter, self.spec, self.settings, self.est = drafter, spec, settings, est
        self.stop_ids, self.clock = stop_ids, clock
        self.rng = seeded_rng(settings.seed, EDGE_STREAM)  # never the verifier's stream (see warping)
        self.view0 = drafter.retokenization()   # across tokenizers: the draft view's counters so far

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

    def continuations(self, prep: Prepared, remaining: int, plan: RoundPlan, budget: ContinuationBudget,
                      stop: threading.Event) -> list[Continuation]:
        """Continuations for the round's likely outcomes, most probable first, while one more pays
        (`budget`) and the reply is not in. `plan`: a fresh round's after the shortest outcome (a
        rejection at the first draft), cut per outcome. Empty when the round may end generation.
        With max_continuations 1: the one outcome that every draft is accepted, then the draft's argmax."""
        path = prep.likely_path()
        if not path or len(path) + 1 >= remaining or self.stop_ids & set(path):
            return []
        out: list[Continuation] = []
        bits = self.spec.qmode.scale_bits
        covered, spent, nodes, nbytes = 0.0, [prep.seconds], 0, payload_bytes(prep.qs, bits)
        outcomes = self.outcomes(prep, path)
        priced = self.spec.pipeline or budget.check_first   # drafted to be sent: each must pay
        if priced and plan.shape is None and len(outcomes) > 1 and plan.gamma > 1 and self.est.learning:
            plan, spent = self._length(prep, plan, outcomes, nbytes, budget)
        for outcome in outcomes:
            if out and stop.is_set() or len(out) > MAX_CONTINUATIONS:  # the first is drafted in any case
                break
            tokens = list(outcome.tokens)
            if self.stop_ids & set(tokens) or len(tokens) + 1 >= remaining:
                continue
            if (out or budget.check_first) and priced and \
                    not budget.worth(outcome.prob, covered, self.clock(), sum(spent) / len(spent), nbytes):
                break
            t0 = self.clock()
            nxt = self.prepare(prep.base + tokens, plan.within(remaining - len(tokens)))
            spent.append(self.clock() - t0)
            nodes += len(nxt.tree)   # the verifier bounds all of a round's continuations together
            if out and nodes > MAX_CONTINUATION_NODES:
                break
            if len(nxt.tree):
                out.append(Continuation(tokens, nxt))
                covered += outcome.prob
                nbytes = continuation_bytes(out[-1], bits)
        return out

    def _length(self, prep: Prepared, plan: RoundPlan, outcomes: list[Outcome], nbytes: int,
                budget: ContinuationBudget) -> tuple[RoundPlan, list[float]]:
        """How long the continuations are: as many outcomes covered as pay, times what a hit commits
        (edge_client.planner.continuation_length; with pinned inputs the fresh round's length, so that
        a seed pins the output); and the drafting time expected of one."""
        t_row = self.est.t_row_s or prep.seconds / max(prep.rows, 1)
        gamma = continuation_length(outcomes, self.est.alpha, plan.gamma, t_row, nbytes / max(len(prep.tree), 1),
                                    budget, self.clock())
        return dataclasses.replace(plan, gamma=gamma), [(gamma + 1) * t_row]

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
        nodes, tree, shipped = prep.likely_nodes(), prep.tree, prep.qs
        # Position j's other candidates: the siblings of the path's node there (none in a chain).
        children = tree.children()
        siblings = [[tree.tokens[c] for c in children[tree.parents[n]] if c != n] for n in nodes]
        position_q = (lambda j: shipped[nodes[j]]) if shipped is not None else (lambda j: probe(prep.base + path[:j]))
        return ranked_outcomes(path, self.est.alpha, position_q, probe(after), self.spec.max_continuations,
                               excluded=lambda j: siblings[j])

"""Acceptance by draft position: what a chain of γ drafts commits per step, from teacher-forced scores.

eval-draft scores every position of a continuation the target wrote (`acceptance`: the probability
that the draft's token there is accepted, given the target's prefix; 0 or 1 at T = 0). A chain round
starting at position j accepts its k-th draft only if drafts 1..k were all accepted, so

    P(accepted >= k | step at j) = a_j · a_{j+1} · ... · a_{j+k-1}

(exact at T = 0, where the prefix a draft sees after k − 1 acceptances is the target's own; at T > 0
the positions are taken as independent given the continuation the target sampled). Walking the
continuation as a chain of γ drafts does (a step commits 1 + accepted tokens and the next starts
after them; the walk is a distribution over starting positions at T > 0) gives, for each γ:

  reach[k]        P(accepted >= k), over the steps that had a k-th draft: vLLM's per-position
                  acceptance ("acceptance at token k-1": accepted at that position / drafts), the
                  end of the continuation not counted against it
  tokens_per_step 1 + sum_k reach[k]: vLLM's and the EAGLE papers' mean acceptance length (τ,
                  the bonus or corrected token included)

`lookup_acceptance` does the same for a prompt-lookup (n-gram) proposer on the target's greedy text:
its proposal at each step is what `edge_client.drafters.PromptLookupDrafter` (vLLM's n-gram rule:
the latest earlier occurrence of the longest suffix n-gram, n in [min, max]) finds in the prompt and
the text so far; a step with no match (or a shorter one) counts its missing drafts as rejected, so
`reach` is over every step, as throughput sees it (`proposed_share`: the steps that found a match).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

GAMMAS = tuple(range(1, 9))


@dataclass
class ChainTally:
    """Sums over prompts, per γ: expected steps and, per position k, steps with a k-th draft and steps
    that accepted it."""
    steps: dict = field(default_factory=dict)       # γ -> expected steps
    tokens: dict = field(default_factory=dict)      # γ -> tokens committed (the continuations' lengths)
    drafted: dict = field(default_factory=dict)     # γ -> [k] steps with a k-th draft
    accepted: dict = field(default_factory=dict)    # γ -> [k] of them, accepted at k
    proposed: dict = field(default_factory=dict)    # γ -> steps that drafted anything (n-gram: a match)

    def add(self, gamma: int, steps: float, tokens: int, drafted: np.ndarray, accepted: np.ndarray,
            proposed: float | None = None) -> None:
        self.steps[gamma] = self.steps.get(gamma, 0.0) + steps
        self.tokens[gamma] = self.tokens.get(gamma, 0) + tokens
        self.drafted[gamma] = self.drafted.get(gamma, np.zeros(gamma)) + drafted
        self.accepted[gamma] = self.accepted.get(gamma, np.zeros(gamma)) + accepted
        if proposed is not None:
            self.proposed[gamma] = self.proposed.get(gamma, 0.0) + proposed

    def summary(self) -> dict:
        """{"reach": {γ: [k]}, "tokens_per_step": {γ: τ}, "committed_per_step": {γ: tokens / steps}}."""
        out = {"reach": {}, "tokens_per_step": {}, "committed_per_step": {}}
        for g in sorted(self.steps):
            d, a = self.drafted[g], self.accepted[g]
            reach = [float(a[k] / d[k]) if d[k] else 0.0 for k in range(g)]
            for k in range(1, g):   # a chain cannot accept k + 1 without k (end effects aside)
                reach[k] = min(reach[k], reach[k - 1])
            out["reach"][str(g)] = [round(r, 4) for r in reach]
            out["tokens_per_step"][str(g)] = round(1.0 + sum(reach), 4)
            out["committed_per_step"][str(g)] = round(self.tokens[g] / self.steps[g], 4) if self.steps[g] else None
        if self.proposed:
            out["proposed_share"] = {str(g): round(self.proposed[g] / self.steps[g], 4) for g in sorted(self.proposed)}
        out["counts"] = {str(g): {"steps": round(self.steps[g], 4), "tokens": self.tokens[g],
                                  "drafted": [round(float(x), 4) for x in self.drafted[g]],
                                  "accepted": [round(float(x), 4) for x in self.accepted[g]],
                                  **({"proposed": round(self.proposed[g], 4)} if g in self.proposed else {})}
                         for g in sorted(self.steps)}
        return out

    @classmethod
    def from_counts(cls, summaries: list[dict]) -> "ChainTally":
        """Summaries' counts added up (pooling categories or runs exactly)."""
        tally = cls()
        for summary in summaries:
            for g, c in summary["counts"].items():
                tally.add(int(g), c["steps"], c["tokens"], np.asarray(c["drafted"]), np.asarray(c["accepted"]),
                          c.get("proposed"))
        return tally


def chain_walk(accept: Sequence[float], gamma: int) -> tuple[float, np.ndarray, np.ndarray]:
    """A chain of `gamma` drafts over positions with acceptance `accept` (one per position to commit):
    (expected steps, [k] expected steps with a k-th draft, [k] expected steps that accepted it). A step
    at j drafts min(γ, L − j − 1) tokens (the request's last token needs no draft), as the edge caps it."""
    a = np.asarray(accept, dtype=np.float64)
    n = len(a)
    start = np.zeros(n + 1)   # probability that a step starts at j
    start[0] = 1.0
    drafted, accepted = np.zeros(gamma), np.zeros(gamma)
    steps = 0.0
    for j in range(n):
        p = start[j]
        if p <= 0.0:
            continue
        steps += p
        g = min(gamma, n - j - 1)
        reach = 1.0
        for k in range(g):
            drafted[k] += p
            stop = reach * (1.0 - a[j + k])       # accepted exactly k, then rejected
            start[j + k + 1] += p * stop
            reach *= a[j + k]
            accepted[k] += p * reach
        start[min(j + g + 1, n)] += p * reach      # all g accepted (plus the bonus)
    return steps, drafted, accepted


def score_chain(tally: ChainTally, accept: Sequence[float], gammas: Sequence[int] = GAMMAS) -> None:
    for g in gammas:
        steps, drafted, accepted = chain_walk(accept, g)
        tally.add(g, steps, len(accept), drafted, accepted)


def lookup_walk(prompt: Sequence[int], continuation: Sequence[int], gamma: int, min_ngram: int = 2,
                max_ngram: int = 4) -> tuple[int, np.ndarray, np.ndarray, int]:
    """The n-gram proposer as a chain over the target's greedy `continuation`: (steps, [k] steps with a
    k-th draft, [k] accepted there, steps that proposed anything)."""
    from edge_client.drafters import PromptLookupDrafter
    drafter = PromptLookupDrafter(max_ngram=max_ngram, min_ngram=min_ngram)
    seq = list(prompt)
    cont = list(continuation)
    n = len(cont)
    drafted, accepted = np.zeros(gamma), np.zeros(gamma)
    steps = proposed = 0
    j = 0
    while j < n:
        steps += 1
        g = min(gamma, n - j - 1)
        draft = drafter.propose(seq + cont[:j], g, None, None, None).tokens[:g] if g else []
        proposed += bool(draft)
        drafted[:g] += 1   # a step without a match (or a short one) counts its missing drafts as rejected
        ok = 0
        for k, tok in enumerate(draft):
            if tok != cont[j + k]:
                break
            ok += 1
            accepted[k] += 1
        j += ok + 1
    return steps, drafted, accepted, proposed


def score_lookup(tally: ChainTally, prompt: Sequence[int], continuation: Sequence[int],
                 gammas: Sequence[int] = GAMMAS) -> None:
    for g in gammas:
        steps, drafted, accepted, proposed = lookup_walk(prompt, continuation, g)
        tally.add(g, steps, len(continuation), drafted, accepted, proposed)

"""How many tokens to draft per round: fixed, or adaptive from the measured cost model.

The adaptive policy measures, as it goes, the draft time per token, the network round trip
(the RPC's wall time minus the server's own time), the verifier's time as a linear
function of γ, and the per-token acceptance α (accepted / tested drafts with a Beta(1, 1)
prior, exponentially forgotten), then picks the γ that maximises expected tokens per second (spec_core.costmodel).
On a slow link the round trip dominates and the best γ grows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from spec_core.costmodel import RoundCosts, best_gamma


class FixedGamma:
    def __init__(self, gamma: int):
        self.gamma = gamma

    def next_gamma(self) -> int:
        return self.gamma

    def observe(self, **_) -> None:
        pass

    def describe(self) -> str | int:
        return self.gamma


@dataclass
class AdaptiveGamma:
    max_gamma: int = 12
    min_gamma: int = 1
    start_gamma: int = 4
    decay: float = 0.9               # forgetting factor per round for every estimate
    accepted: float = 1.0            # Beta prior: 1 accepted of 2 tested drafts (α = 0.5)
    tested: float = 2.0              # drafts actually tested: the accepted ones + the rejected one
    t_draft_s: float | None = None
    rtt_s: float | None = None
    _verify_points: list[tuple[int, float]] = field(default_factory=list)
    chosen: list[int] = field(default_factory=list)

    @property
    def alpha(self) -> float:
        return self.accepted / self.tested

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def observe(self, gamma: int, num_accepted: int, draft_s: float, round_s: float, server_s: float,
                model_s: float, rejected: bool = False) -> None:
        if gamma > 0:
            # Drafts after the first rejection are never tested, so accepted / drafted would
            # underestimate α and shrink γ; count only tested drafts (the geometric model's MLE).
            self.accepted = self.decay * self.accepted + num_accepted
            self.tested = self.decay * self.tested + num_accepted + (1 if rejected else 0)
            self.t_draft_s = self._ewma(self.t_draft_s, draft_s / gamma)
        # round_s is timed around the RPC alone (drafting happens before it).
        self.rtt_s = self._ewma(self.rtt_s, max(0.0, round_s - server_s))
        self._verify_points = (self._verify_points + [(gamma, model_s)])[-32:]

    def _verify_line(self) -> tuple[float, float]:
        """Least-squares base + per-token verifier time over recent rounds."""
        pts = self._verify_points
        if not pts:
            return 0.0, 0.0
        n = len(pts)
        mx = sum(g for g, _ in pts) / n
        my = sum(t for _, t in pts) / n
        var = sum((g - mx) ** 2 for g, _ in pts)
        slope = max(0.0, sum((g - mx) * (t - my) for g, t in pts) / var) if var > 0 else 0.0
        return max(0.0, my - slope * mx), slope

    def next_gamma(self) -> int:
        if self.t_draft_s is None or self.rtt_s is None:
            g = self.start_gamma
        else:
            base, per_tok = self._verify_line()
            costs = RoundCosts(self.t_draft_s, self.rtt_s, base, per_tok)
            g = best_gamma(min(self.alpha, 0.999), costs, self.max_gamma, self.min_gamma)
        self.chosen.append(g)
        return g

    def describe(self) -> str:
        mean = sum(self.chosen) / len(self.chosen) if self.chosen else self.start_gamma
        return f"adaptive(mean {mean:.2f})"

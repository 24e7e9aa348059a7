"""The round's cost model, and the γ that maximises tokens per second.

Per round: time = γ·t_draft + rtt + bytes/bandwidth + t_verify(γ); tokens = 1 + accepted.
With per-token acceptance α, E[tokens per round] = (1 − α^(γ+1)) / (1 − α)  (Leviathan et al.).
Mean tokens per round measured = 1 + accepted / rounds (the bonus or corrected token counts).
With acceptance by draft position (α_j: the chance draft j is accepted given every draft before it
was), E[tokens per round] = Σ_{k=0..γ} Π_{j<k} α_j: the geometric formula when every α_j is α.
A tree or a round with more than its drafts' rows (a tree expands `width` nodes per level) costs
rows · t_draft and nodes · t_verify_per_token: `RoundCosts.seconds`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_tokens_by_position(alphas: Sequence[float]) -> float:
    """E[tokens per round] of a chain of len(alphas) drafts, alphas[j] the acceptance of draft j
    given every draft before it was accepted (the corrected or bonus token counts)."""
    total, reach = 1.0, 1.0
    for a in alphas:
        reach *= a
        total += reach
    return total


@dataclass
class RoundCosts:
    t_draft_s: float          # edge time to draft one token
    rtt_s: float              # network round trip (excluding transfer)
    t_verify_base_s: float    # verifier time for a round with γ = 0
    t_verify_per_token_s: float  # extra verifier time per draft token
    bytes_per_draft_token: float = 0.0
    bytes_per_s: float = float("inf")

    def round_time(self, gamma: int) -> float:
        return self.seconds(gamma, gamma, gamma * self.bytes_per_draft_token)

    def seconds(self, rows: int, nodes: int, request_bytes: float) -> float:
        """A round that drafts `rows` forward rows, sends `nodes` draft nodes in `request_bytes`."""
        return (rows * self.t_draft_s + self.rtt_s + request_bytes / self.bytes_per_s
                + self.t_verify_base_s + nodes * self.t_verify_per_token_s)


def best_gamma(alpha: float, costs: RoundCosts, max_gamma: int, min_gamma: int = 1) -> int:
    """argmax over γ of E[tokens per round] / round time."""
    return max(range(min_gamma, max_gamma + 1),
               key=lambda g: expected_tokens_per_round(alpha, g) / max(costs.round_time(g), 1e-9))

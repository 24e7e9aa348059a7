"""The records a session's rounds are made of: a prepared draft (`Prepared`: a tree of draft tokens
for one base, a chain being the tree with one path), a continuation (`Guess`: a draft for one likely
outcome of a round in flight), and a round sent and not yet answered (`Flight`). The round loop
(edge_client.loop) builds them; the window (edge_client.window) holds the flights.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import grpc

from edge_client.gamma import RoundPlan
from edge_client.transport import EdgeError
from spec_core.proto import verifier_pb2 as pb
from spec_core.qcodec import EncodedQ
from spec_core.tree import DraftTree
from spec_core.warping import SamplingSettings

GREEDY = SamplingSettings(temperature=0.0)


@dataclass
class Prepared:
    """A round's draft, made for one base (the committed sequence it follows): a tree of draft
    tokens, a chain being the tree with one path. On the wire a one-path tree stays a chain (no
    draft_parents), as every verifier takes it."""

    base: list[int]
    plan: RoundPlan                      # what the planner chose (its arm learns from the round)
    tree: DraftTree                      # [n] node tokens and parents
    qs: list[EncodedQ] | None            # [n] each node's shipped q, or None: point masses
    seconds: float                       # time spent drafting
    rows: int                            # draft forward rows it cost
    path_probs: Sequence[float] | None = None   # [n] the draft's probability of reaching each node
                                                # (None: a chain, whose one path is every node)
    drawn_qs: list[EncodedQ] | None = None      # [n] the q each node was drawn from when none is shipped
                                                # (the gumbel coupling): ranks outcomes as shipped q does

    def wire_parents(self) -> list[int]:
        """draft_parents on the wire: none for a chain."""
        return [] if self.tree.is_chain else list(self.tree.parents)

    def guess_path(self) -> list[int]:
        """The tokens of the most likely full acceptance: every draft, or the most probable branch."""
        return [self.tree.tokens[i] for i in self.guess_nodes()]

    def guess_nodes(self) -> list[int]:
        """The nodes of that path, root first."""
        leaves = self.tree.leaves()
        if not leaves:
            return []
        probs = self.path_probs
        return self.tree.path_to(max(leaves, key=lambda i: (probs[i] if probs is not None else 1.0, -i)))

    def kept_path(self, reply: pb.VerifyReply) -> list[int]:
        """The nodes the verifier kept, root first (a chain's reply says only how many); a reply that
        names no path of this tree is an error."""
        n = reply.num_accepted
        kept = list(range(n)) if self.tree.is_chain else list(reply.kept_nodes)
        if len(kept) != n or any(k >= len(self.tree) for k in kept) or (kept and self.tree.path_to(kept[-1]) != kept):
            raise EdgeError(grpc.StatusCode.INTERNAL, f"the verifier kept {n} nodes ({list(reply.kept_nodes)}), not a "
                                                      f"path from the root of this round's {len(self.tree)} draft nodes")
        return kept


class Guess(NamedTuple):
    """A continuation: one likely outcome of a round in flight, and the draft made after it."""

    tokens: list[int]       # what it assumes the round commits (kept drafts + corrected or bonus token)
    prep: Prepared          # the next round's draft, for base = that round's base + tokens


@dataclass
class Flight:
    """A round sent and not yet answered."""

    round: int
    guesses: list[Guess]             # its alternatives: 0 its own draft, then its continuations
    base_len: int                    # the committed length its keys count from
    task: asyncio.Future
    t_sent: float
    req_bytes: int
    live: bool = True                # False once an earlier round missed: its keys cannot come true
    pipelined: bool = True           # sent before the reply of the round before it
    fused: list[Guess] = field(default_factory=list)   # continuations for its own pass (next_continuations)


def pass_nodes(prep: Prepared, fused: Sequence[Guess]) -> int:
    """Nodes of a fused round's target pass: its own, then per continuation its key's last token
    and its drafts (spec_core.continuations.fuse_tree); 0 without continuations."""
    return len(prep.tree) + sum(1 + len(g.prep.tree) for g in fused) if fused else 0


def extends(base: list[int], committed: list[int]) -> bool:
    """Whether a draft made after `base` can still run: `base` is the committed sequence and more."""
    return len(base) >= len(committed) and base[:len(committed)] == committed

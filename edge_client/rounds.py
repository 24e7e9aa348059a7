"""The records a session's rounds are made of: a prepared draft (`Prepared`: a tree of draft tokens
for one base, a chain being the tree with one path), a continuation (`Continuation`: a draft for one
likely outcome of a round in flight, keyed by that outcome), and a round sent and not yet answered
(`Flight`). The round loop (edge_client.loop) builds them; the window (edge_client.window) holds the
flights; edge_client.remote puts them on the wire.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

from edge_client.planner import RoundPlan
from spec_core.qcodec import EncodedQ
from spec_core.tree import ROOT, DraftTree
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

    def likely_path(self) -> list[int]:
        """The tokens of the most likely full acceptance: every draft, or the most probable branch."""
        return [self.tree.tokens[i] for i in self.likely_nodes()]

    def likely_nodes(self) -> list[int]:
        """The nodes of that path, root first."""
        leaves = self.tree.leaves()
        if not leaves:
            return []
        probs = self.path_probs
        return self.tree.path_to(max(leaves, key=lambda i: (probs[i] if probs is not None else 1.0, -i)))

    def kept_path(self, accepted: int, kept_nodes: Sequence[int]) -> list[int] | None:
        """The nodes the verifier kept, root first (a chain's reply says only how many); None when
        the reply names no path of this tree."""
        kept = list(range(accepted)) if self.tree.is_chain else list(kept_nodes)
        if len(kept) != accepted or any(k >= len(self.tree) for k in kept) or \
                (kept and self.tree.path_to(kept[-1]) != kept):
            return None
        return kept

    def rejected(self, kept: list[int], drew: bool) -> bool:
        """Whether the round ended at a rejection: the verifier drew its token (`drew`) where a draft
        was still on offer (the last kept node, or the root, has children); else it was the bonus,
        after a leaf."""
        return drew and bool(self.tree.children()[kept[-1] if kept else ROOT])


class Continuation(NamedTuple):
    """One likely outcome of a round in flight, and the next round's draft made after it. A round
    sent with nothing in flight before it is the one continuation that assumes nothing."""

    tokens: list[int]       # what it assumes the round commits (kept drafts + corrected or bonus token)
    prep: Prepared          # the next round's draft, for base = that round's base + tokens


@dataclass
class Flight:
    """A round sent and not yet answered."""

    round: int
    continuations: list[Continuation]   # what it carries: a pipelined round, one per outcome of the round
                                        # before that it assumes (0 travels as the request's own draft);
                                        # else its own draft alone
    base_len: int                    # the committed length their keys count from
    task: asyncio.Future             # its edge_client.remote.Reply
    t_sent: float
    request_bytes: int
    request_nodes: int               # draft nodes in the request (its own, continuations', fused ones')
    live: bool = True                # False once an earlier round missed: its keys cannot come true
    pipelined: bool = True           # sent before the reply of the round before it
    fused: list[Continuation] = field(default_factory=list)   # continuations for its own pass
    ahead_draft_s: float | None = None   # pipelined: seconds its continuations took to draft
    t_answered: float | None = None   # when its reply (or failure) came, which may be before the loop
                                      # takes it (the loop was drafting): the round trip ends here


def pass_nodes(prep: Prepared, fused: Sequence[Continuation]) -> int:
    """Nodes of a fused round's target pass: its own, then per continuation its key's last token
    and its drafts (spec_core.continuations.fuse_tree); 0 without continuations."""
    return len(prep.tree) + sum(1 + len(g.prep.tree) for g in fused) if fused else 0


def extends(base: list[int], committed: list[int]) -> bool:
    """Whether a draft made after `base` can still run: `base` is the committed sequence and more."""
    return len(base) >= len(committed) and base[:len(committed)] == committed

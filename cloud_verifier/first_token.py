"""First tokens: a new session over its time-to-first-token target is queued here and told how long,
or, where another replica may serve it now, refused at once with a retry hint and its place kept.

The verifier keeps the opens it has admitted and not yet answered (`FirstTokens`), with the prompt
tokens each must prefill (counted with the target's tokenizer: a text prompt is tokenized before
admission). A new session's time to first token is predicted as the prefill work ahead of it plus
its own, over the rate at which this backend prefills now (`Backend.prefill_rate`: the measured
pass cost under the live-rounds-first budget, cloud_verifier.backends.prefill_budget):

    predicted_s = (backlog + held + own tokens) / prefill tokens per second + overhead
    backlog     = the admitted opens' tokens, drained at that rate since (a fluid queue; empty when
                  no open is pending)
    held        = the tokens of sessions refused earlier whose places are kept (below)
    overhead    = what the opens answered lately took beyond their prefill prediction (smoothed:
                  the first round's own pass, a pass in flight, the server's own work)

When the prediction is above the session's target (its SLO's ttft_ms, else the server's
--slo-ttft-ms, else `--admit-ttft-ms`):

- where no other replica is known (`elsewhere` False: a single address, the embedded default), the
  session is admitted and *queued*: its round goes on in its turn (prefills go in arrival order)
  and the servicer answers its edge at once, "first token in about N s" (admission.Queued:
  RESOURCE_EXHAUSTED with QUEUED_KEY and the same hint); the edge asks again with the same open
  and gets the reply when the round is done;
- where another replica may serve it now (the edge lists several, or the operator runs a fleet
  behind one address: `--admission refuse`), it is refused at once with RESOURCE_EXHAUSTED,
  `retry-after-ms` = predicted - target (when the work ahead will have drained enough: never more
  than the predicted wait) and ELSEWHERE_KEY, and its place is *held*: its tokens count ahead of
  every later arrival until it comes back (the same open_key) or the hold lapses (hint x 1.5 + 5 s).
  Back in time, it is admitted whatever the prediction then: refused at most once per replica, and
  a session refused earlier goes ahead of later arrivals (HELD_KEY tells the edge to come back at
  the hint, not at a random multiple of it);
- a session whose own prompt alone takes longer than its target here (nothing ahead of it) is
  queued in either case: no replica like this one would do better.

Unknown costs (a verifier that has not run passes yet) admit. Replays and handed-back sessions are
never refused or queued here: they go ahead of new sessions (the batcher serves their prefills
first), and their backlog counts ahead of every new session's prediction.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Callable

from cloud_verifier.admission import Refused
from spec_core.clock import now as clock_now

DEFAULT_TTFT_S = 10.0      # the first-token target of sessions, and servers, that state none
HOLD_FACTOR, HOLD_GRACE_S = 1.5, 5.0   # a refused session's place is kept for hint x 1.5 + 5 s


@dataclass
class Prediction:
    """One admitted open's predicted first token, and when it came (for benches and tests)."""
    tokens: int
    replay: bool
    predicted_s: float | None     # its first token, predicted at admission (None: costs not known yet)
    prefill_s: float | None       # ... of which the prefill queue ahead and its own
    t_admit: float
    queued: bool = False          # admitted over its target (its edge was told how long)
    held_since: float | None = None   # refused earlier with its place kept: when
    t_done: float | None = None
    key: bytes = b""              # its open_key

    @property
    def took_s(self) -> float | None:
        return None if self.t_done is None else self.t_done - self.t_admit


@dataclass
class Hold:
    """A refused session's place: its tokens, when it was refused, the hint it got, when it lapses."""
    tokens: int
    t_refused: float
    hint_s: float
    predicted_s: float
    expires: float
    key: bytes = b""


@dataclass(frozen=True)
class Admitted:
    """An admitted open: its ticket (give it back with FirstTokens.done), its predicted first token
    (None: not known), whether it was queued over its target (its edge is told `predicted_s`), the
    prompt tokens to prefill up to its own, its own included, and its target."""
    ticket: int
    predicted_s: float | None
    queued: bool
    ahead_tokens: float = 0.0
    target_s: float = 0.0


class FirstTokens:
    def __init__(self, rate: Callable[[], float | None], default_ttft_s: float = DEFAULT_TTFT_S,
                 clock: Callable[[], float] = clock_now, keep: int = 4096):
        self.rate, self.default_ttft_s, self._clock = rate, default_ttft_s, clock
        self._pending: dict[int, Prediction] = {}
        self._tickets = itertools.count()
        self.backlog, self._t = 0.0, clock()
        self.overhead_s = 0.0
        self.history: deque[Prediction] = deque(maxlen=keep)   # admitted opens, oldest first
        self.holds: dict[bytes, Hold] = {}                      # open_key -> a refused session's place
        self.refusals: deque[Hold] = deque(maxlen=keep)         # every refusal, oldest first (benches)
        self.refused = 0
        self.queued = 0

    def _drain(self, now: float, rate: float | None) -> None:
        if not self._pending:
            self.backlog = 0.0
        elif rate:
            self.backlog = max(0.0, self.backlog - rate * (now - self._t))
        self._t = now
        for key in [k for k, h in self.holds.items() if h.expires <= now]:
            del self.holds[key]

    def held_tokens(self, but: bytes = b"") -> int:
        """Tokens of the places held for refused sessions (other than `but`'s)."""
        return sum(h.tokens for k, h in self.holds.items() if k != but)

    def predict_s(self, tokens: int, key: bytes = b"") -> float | None:
        """Seconds to the first token of a new session of `tokens` prompt tokens (`key`: its open_key,
        whose own held place is not ahead of it); None: not known."""
        rate = self.rate()
        self._drain(self._clock(), rate)
        if not rate or rate <= 0:
            return None
        return (self.backlog + self.held_tokens(key) + tokens) / rate + self.overhead_s

    def admit(self, tokens: int, replay: bool, ttft_s: float | None, key: bytes = b"",
              elsewhere: bool = False) -> Admitted:
        """Admit an open of `tokens` prompt tokens (`key`: its open_key), queued when predicted past
        `ttft_s` (None or 0: the default); Refused instead where another replica may serve it now
        (`elsewhere`), unless its place was held here, or its prompt alone takes longer than the target."""
        predicted = self.predict_s(tokens, key)
        limit = ttft_s or self.default_ttft_s
        now = self._clock()
        hold = self.holds.pop(key, None) if key else None
        over = not replay and limit > 0 and predicted is not None and predicted > limit
        if over and elsewhere and hold is None and tokens / self.rate() + self.overhead_s <= limit:
            self.refused += 1
            hint_s = min(predicted, max(0.05, predicted - limit))   # the work ahead drained to what the target leaves
            if key:
                h = self.holds[key] = Hold(tokens, now, hint_s, predicted, now + hint_s * HOLD_FACTOR + HOLD_GRACE_S,
                                           key)
                self.refusals.append(h)
            raise Refused(f"a new session's first token would come in about {predicted:.1f} s here "
                          f"({self.backlog + self.held_tokens(key) + tokens:.0f} prompt tokens queued to prefill, its own "
                          f"included), after its time-to-first-token target of {limit:.1f} s: another replica may serve "
                          "it now; this one keeps its place", hint_s, "first_token", elsewhere=True, held=bool(key))
        ticket = next(self._tickets)
        prefill = None if predicted is None else predicted - self.overhead_s
        self._pending[ticket] = p = Prediction(tokens, replay, predicted, prefill, now, queued=over,
                                               held_since=hold.t_refused if hold is not None else None, key=key)
        ahead = self.backlog + self.held_tokens(key) + tokens
        self.backlog += tokens
        self.queued += over
        self.history.append(p)
        return Admitted(ticket, predicted, over, ahead, limit)

    def done(self, ticket: int) -> None:
        """The open's first round was answered (or failed)."""
        p = self._pending.pop(ticket, None)
        if p is not None:
            p.t_done = self._clock()
            if p.prefill_s is not None:   # learn what the prefill alone does not explain
                extra = max(0.0, p.took_s - p.prefill_s)
                self.overhead_s = 0.8 * self.overhead_s + 0.2 * extra
        self._drain(self._clock(), self.rate())

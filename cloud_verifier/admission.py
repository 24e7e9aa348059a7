"""Who gets served when there is not enough for everyone: per-tenant limits and admission control.

Everything here refuses early and cheaply, with RESOURCE_EXHAUSTED and a retry hint (trailing
metadata `retry-after-ms`, also in the message), instead of queueing without bound:

- per tenant: at most `tenant_max_sessions` unfinished sessions, and `tenant_rounds_per_s`
  rounds per second (a token bucket with `tenant_burst` rounds of burst), so one tenant cannot
  starve the others;
- per server: at most `max_inflight_rounds` Verify calls inside the server at once (waiting
  for a session's lock or for the model, or running); beyond that a call is refused before
  it waits, which bounds the queue and the memory it holds;
- a new session is admitted only when a slot is free or an idle one can be evicted: sessions
  used within `evict_idle_after_s` are not evicted to make room (evicting busy sessions under
  overload only makes every edge replay, and nobody finishes);
- replays (opens that carry resumed tokens: edges whose verifier restarted or drained) go ahead
  of new sessions: while one is being opened, a new session is refused with a short hint
  (`ReplaysFirst`), so the edges that were mid-generation get the verifier's prefill first;
- a new session predicted to get its first token after its target is queued (answered at once
  with how long, `Queued`, while its round goes on), or refused with its place held where another
  replica may serve it (cloud_verifier.first_token; `admission`);
- a draining verifier (SIGTERM) takes no new session (UNAVAILABLE, reason "draining").

An edge that sees the hint waits at least that long, plus jitter, and retries the same request
(rounds are idempotent), so the load spreads out and every edge finishes once it drops.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import grpc

from spec_core.clock import now as clock_now
from spec_core.wire import ELSEWHERE_KEY, HELD_KEY, MOVED_KEY, QUEUED_KEY, RETRY_AFTER_KEY

ADMISSION_MODES = ("auto", "refuse", "queue")


@dataclass(frozen=True)
class ServerPolicy:
    tenant_max_sessions: int = 0          # unfinished sessions per tenant; 0 = no per-tenant cap
    tenant_rounds_per_s: float = 0.0      # sustained rounds/s per tenant; 0 = no rate limit
    tenant_burst: int = 0                 # rounds a tenant may send at once above the rate (0: 2 s worth)
    max_inflight_rounds: int = 0          # Verify calls inside the server at once; 0 = 4 per session slot
    evict_idle_after_s: float = 0.0       # a session idle less than this is never evicted for a newcomer
    session_retry_after_s: float = 1.0    # hint when no session slot is free
    drain_retry_after_s: float = 0.1      # hint to a new session refused by a draining verifier: by then
                                          # its connection has moved to another replica (or a restart)
    drain_sessions_per_s: float = 0.0     # a draining verifier hands back its sessions this many a second
                                          # (at most a second's worth at once); 0: each at its next round,
                                          # all within one round of every session (the replica they go to
                                          # restores them from the KV store: docs/operations.md)
    drain_timeout_s: float = 60.0         # ... and exits after this long even if some were never handed back
    replay_first_retry_after_s: float = 0.25   # hint to a new session while replays are being admitted
    admit_ttft_s: float = 10.0            # the first-token target of a new session stating none (cloud_verifier.
                                          # first_token): past it, queued with a progress signal, or refused at
                                          # once where another replica may serve it; 0: no check
    admission: str = "auto"               # past the target: "auto" refuses when the edge knows other replicas
                                          # and queues otherwise, "refuse" always (a fleet behind one address),
                                          # "queue" never

    def __post_init__(self):
        if self.admission not in ADMISSION_MODES:
            raise ValueError(f"admission must be one of {', '.join(ADMISSION_MODES)}, got {self.admission!r}")


class Refused(Exception):
    """A request refused for load, not for what it says: retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float, reason: str,
                 code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED, moved: bool = False,
                 elsewhere: bool = False, held: bool = False):
        self.retry_after_ms = max(1, math.ceil(retry_after_s * 1000))
        self.message = f"{message}; retry after {self.retry_after_ms} ms"
        self.code, self.reason = code, reason   # reason: the metric label
        self.moved = moved                      # a draining verifier: another replica will take it now
        self.elsewhere = elsewhere              # this replica is too busy: another one may take it now
        self.held = held                        # ... and keeps its place until the hint (cloud_verifier.first_token)
        super().__init__(self.message)

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((RETRY_AFTER_KEY, str(self.retry_after_ms)),) + (((MOVED_KEY, "1"),) if self.moved else ()) \
            + (((ELSEWHERE_KEY, "1"),) if self.elsewhere else ()) + (((HELD_KEY, "1"),) if self.held else ())


class Queued(Refused):
    """A new session admitted past its first-token target where it has nowhere else to go
    (cloud_verifier.first_token): its round goes on here, and its edge is answered at once with
    the predicted first token (QUEUED_KEY, and as the retry hint) so that it can say so; asked again
    (the same open), it gets the reply when the round is done. An edge that does not know QUEUED_KEY
    waits the hint, as for any refusal for load, and asks again."""

    def __init__(self, admitted):
        wait_s = admitted.predicted_s
        super().__init__(f"queued: this new session's first token should come in about {wait_s:.1f} s here "
                         f"({admitted.ahead_tokens:.0f} prompt tokens to prefill, its own included, past its "
                         f"time-to-first-token target of {admitted.target_s:.1f} s); its prompt is being prefilled: "
                         "send the same open again (its open_key) to wait for the reply", wait_s, "queued")
        self.queued_ms = self.retry_after_ms

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return super().trailing_metadata() + ((QUEUED_KEY, str(self.queued_ms)),)


class TokenBucket:
    """`rate` tokens a second, at most `burst` saved up. take() -> 0 or the seconds to wait."""

    def __init__(self, rate: float, burst: float, clock=clock_now):
        self.rate, self.burst, self._clock = rate, burst, clock
        self.tokens, self.t = burst, clock()

    def take(self) -> float:
        now = self._clock()
        self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
        self.t = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate


class RoundLimiter:
    """Per-tenant token buckets, made on a tenant's first round."""

    def __init__(self, rate: float, burst: int):
        self.rate = rate
        self.burst = burst or max(1, math.ceil(2 * rate))
        self._buckets: dict[str, TokenBucket] = {}

    def admit(self, tenant: str) -> None:
        if self.rate <= 0:
            return
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = TokenBucket(self.rate, self.burst)
        wait_s = bucket.take()
        if wait_s > 0:
            raise Refused(f"this tenant's limit of {self.rate:g} rounds/s is reached", wait_s, "tenant_rate")


class InflightGate:
    """Counts calls inside the server; refuses beyond `limit` instead of queueing them."""

    def __init__(self, limit: int, retry_after_s: float = 0.2):
        self.limit, self.retry_after_s = limit, retry_after_s
        self.inflight = 0
        self.peak = 0

    def __enter__(self):
        if self.inflight >= self.limit:
            raise Refused(f"the verifier is at its limit of {self.limit} rounds in flight", self.retry_after_s,
                          "inflight")
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        return self

    def __exit__(self, *exc):
        self.inflight -= 1


class ReplaysFirst:
    """Opens that replay committed tokens go before new sessions: `admit(replay)` counts a replay
    in until it is opened (`done`), and refuses a new session while any is pending."""

    def __init__(self, retry_after_s: float):
        self.retry_after_s = retry_after_s
        self.pending = 0

    def admit(self, replay: bool) -> bool:
        """True: a replay, counted until `done`; False: a new session, admitted (none pending)."""
        if replay:
            self.pending += 1
            return True
        if self.pending:
            raise Refused(f"{self.pending} sessions are being replayed here first (their verifier restarted)",
                          self.retry_after_s, "replays_first", elsewhere=True)
        return False

    def done(self) -> None:
        self.pending -= 1

"""Prometheus metrics (prometheus_client), named after vLLM's spec-decode counters.

Acceptance rate = rate(accepted_tokens) / rate(draft_tokens); mean tokens per round =
1 + accepted_tokens / rounds (the corrected or bonus token counts).
"""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

ROUNDS = Counter("hybridspec_verify_rounds", "Verify rounds completed")
DRAFT_TOKENS = Counter("hybridspec_draft_tokens", "Draft tokens received for verification")
ACCEPTED_TOKENS = Counter("hybridspec_accepted_tokens", "Draft tokens accepted")
PIPELINE_DISCARDS = Counter("hybridspec_pipeline_discards", "Pipelined rounds not verified: their base was not committed")
PIPELINE_FUSED = Counter("hybridspec_pipeline_fused", "Pipelined rounds verified in their predecessor's pass "
                         "(they were waiting when it started)")
COMMITTED_TOKENS = Counter("hybridspec_committed_tokens", "Tokens committed: kept drafts plus the corrected or bonus "
                           "token of each Verify round, and each token a Generate stream produced")
RETRIES = Counter("hybridspec_verify_retries", "Repeated rounds answered from the reply cache")
ERRORS = Counter("hybridspec_request_errors", "Requests refused, by gRPC status code", ["code"])
SESSIONS = Gauge("hybridspec_sessions", "Sessions held")
SESSIONS_OPENED = Counter("hybridspec_sessions_opened", "Sessions opened (including replays)")
ROUND_SECONDS = Histogram("hybridspec_round_seconds", "Server time per round",
                          buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5))
MODEL_SECONDS = Histogram("hybridspec_model_seconds", "Target model time per round",
                          buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5))


def observe_round(gamma: int, accepted: int, model_s: float, total_s: float) -> None:
    ROUNDS.inc()
    DRAFT_TOKENS.inc(gamma)
    ACCEPTED_TOKENS.inc(accepted)
    MODEL_SECONDS.observe(model_s)
    ROUND_SECONDS.observe(total_s)

# Security and survival (cloud_verifier.guard, cloud_verifier.admission).
UNDECODABLE = Counter("hybridspec_undecodable_requests", "Requests whose bytes are not the method's message",
                      ["method"])
AUTH_FAILURES = Counter("hybridspec_auth_failures", "Calls refused for a missing or invalid bearer token",
                        ["reason"])
PERMISSION_DENIED = Counter("hybridspec_permission_denied", "Calls naming a session of another tenant")
REFUSED = Counter("hybridspec_refused_for_load", "Requests refused with a retry hint (admission control)",
                  ["reason"])
INFLIGHT = Gauge("hybridspec_inflight_rounds", "Verify calls inside the server (waiting or running)")

# Per target pass (one llama_decode; in the serial verifier, one round's decodes). The load
# test's simulator calibrates its cost-per-pass model from these three.
_BATCH_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256, 512)
BATCH_TOKENS = Histogram("hybridspec_batch_tokens", "Tokens evaluated per target pass (padding excluded)",
                         buckets=_BATCH_TOKEN_BUCKETS)
BATCH_SESSIONS = Histogram("hybridspec_batch_sessions", "Sessions (sequences) per target pass",
                           buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64))
BATCH_SECONDS = Histogram("hybridspec_batch_seconds", "Seconds per target pass",
                          buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                                   1, 2))


def observe_batch(tokens: int, sessions: int, seconds: float) -> None:
    BATCH_TOKENS.observe(tokens)
    BATCH_SESSIONS.observe(sessions)
    BATCH_SECONDS.observe(seconds)


# The batched llama.cpp verifier's shared KV cache (llama_runtime.SharedKV): cells held by live
# sessions, cells taken in all (live + retired by rollbacks and releases, freed by a compaction),
# and the compactions themselves (their time is not counted in hybridspec_batch_seconds).
KV_CELLS = Gauge("hybridspec_kv_cells", "Shared KV cache cells, by state", ["state"])
KV_COMPACTIONS = Counter("hybridspec_kv_compactions", "Shared KV cache compactions")
KV_COMPACTION_SECONDS = Counter("hybridspec_kv_compaction_seconds", "Seconds spent compacting the shared KV cache")


def track_kv(kv) -> None:
    """Read the cache's cell counts at each scrape (kv: llama_runtime.SharedKV)."""
    KV_CELLS.labels("live").set_function(lambda: kv.live_cells)
    KV_CELLS.labels("used").set_function(lambda: kv.used_cells)
    KV_CELLS.labels("total").set_function(lambda: kv.n_cells)


def observe_compaction(seconds: float) -> None:
    KV_COMPACTIONS.inc()
    KV_COMPACTION_SECONDS.inc(seconds)


# Sessions' KV between rounds in the batched llama.cpp verifier (cloud_verifier.backends.kvpark).
# Session-seconds by state, counted per round over the gap that ends with the round's arrival and
# the round itself: busy (arrival to the end of its pass), idle (its KV in the cache, unused),
# parked (its KV in host memory). Idle share = (idle + parked) / all three.
KV_SESSION_SECONDS = Counter("hybridspec_kv_session_seconds",
                             "Session-seconds between rounds' arrivals, by state: busy, idle (KV in the cache), parked",
                             ["state"])
KV_IDLE_GAP = Histogram("hybridspec_kv_idle_gap_seconds", "Seconds from a round's pass to the session's next round",
                        buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30))
KV_PARKS = Counter("hybridspec_kv_parks", "Sessions' KV cells parked in host memory")
KV_RESTORES = Counter("hybridspec_kv_restores", "Parked KV cells restored into the cache")
KV_PARK_SECONDS = Counter("hybridspec_kv_park_seconds", "Seconds spent parking (copying cells out)")
KV_RESTORE_SECONDS = Counter("hybridspec_kv_restore_seconds", "Seconds spent restoring (copying cells back)")
KV_PARK_BYTES = Counter("hybridspec_kv_park_bytes", "Bytes parked")
KV_RESTORE_WAIT_SECONDS = Counter("hybridspec_kv_restore_wait_seconds",
                                  "Seconds parked sessions' rounds waited to be restored (including the copy)")
KV_PARK_FAILURES = Counter("hybridspec_kv_park_failures",
                           "Park or restore failures (the session is evaluated again, or replays: no_place)", ["stage"])
KV_PARKED = Gauge("hybridspec_kv_parked", "Parked sessions and their bytes in host memory now", ["what"])
KV_CHECKPOINTS = Counter("hybridspec_kv_checkpoints",
                         "Session KV checkpoints in the --kv-store: written, or dropped (full: over --kv-store-bytes; "
                         "failed: the write failed)", ["event"])
KV_CHECKPOINT_BYTES = Counter("hybridspec_kv_checkpoint_bytes", "Bytes of session KV checkpoints written")
KV_CHECKPOINT_COPY_SECONDS = Counter("hybridspec_kv_checkpoint_copy_seconds",
                                     "Seconds the model spent copying sessions' cells out for checkpoints "
                                     "(between passes; the files are written on another thread)")
KV_CHECKPOINT_RESTORES = Counter("hybridspec_kv_checkpoint_restores",
                                 "Replays that looked in the --kv-store: restored, or fell back to a plain re-prefill "
                                 "(none: no checkpoint of this tenant holds a prefix; refused: torn, corrupt or "
                                 "mismatched file; failed: llama.cpp refused the cells)", ["outcome"])
KV_CHECKPOINT_TOKENS = Counter("hybridspec_kv_checkpoint_restored_tokens",
                               "Tokens whose cells came from the --kv-store instead of a prefill")


def observe_idle_gap(idle_s: float, parked_s: float) -> None:
    KV_SESSION_SECONDS.labels("idle").inc(max(0.0, idle_s))
    KV_SESSION_SECONDS.labels("parked").inc(max(0.0, parked_s))
    KV_IDLE_GAP.observe(idle_s + parked_s)


def observe_park(nbytes: int, seconds: float) -> None:
    KV_PARKS.inc()
    KV_PARK_BYTES.inc(nbytes)
    KV_PARK_SECONDS.inc(seconds)


def observe_restore(seconds: float) -> None:
    KV_RESTORES.inc()
    KV_RESTORE_SECONDS.inc(seconds)


def track_parking(book) -> None:
    """Read the parked sessions and bytes at each scrape (book: cloud_verifier.backends.kvpark.SeqBook)."""
    KV_PARKED.labels("sessions").set_function(lambda: book.parked_sessions)
    KV_PARKED.labels("bytes").set_function(lambda: book.parked_bytes)

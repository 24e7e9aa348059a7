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

"""Prometheus metrics (prometheus_client), named after vLLM's spec-decode counters.

Acceptance rate = rate(accepted_tokens) / rate(draft_tokens); mean tokens per round =
1 + accepted_tokens / rounds (the corrected or bonus token counts).
"""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

ROUNDS = Counter("hybridspec_verify_rounds", "Verify rounds completed")
DRAFT_TOKENS = Counter("hybridspec_draft_tokens", "Draft tokens received for verification")
ACCEPTED_TOKENS = Counter("hybridspec_accepted_tokens", "Draft tokens accepted")
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

"""The edge's Prometheus metrics (prometheus_client) for `edge-client serve`: what a person tuning
γ or watching a link looks at.

Acceptance rate = rate(accepted_tokens) / rate(draft_tokens); mean tokens per round =
rate(committed_tokens) / rate(rounds) (1 + accepted: the corrected or bonus token counts). The
round trip is the Verify RPC's wall time minus the verifier's own time: the network's share.

Each server has its own registry (not the process-wide default), so two servers in one process
(tests, a benchmark) do not collide and the verifier's metrics never mix with the edge's.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from edge_client.client import GenerationStats, RoundEvent

SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class EdgeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("hybridspec_edge_requests", "HTTP generation requests received",
                                ["endpoint", "stream"], registry=r)
        self.errors = Counter("hybridspec_edge_request_errors", "Requests answered with an error, by HTTP status",
                              ["status"], registry=r)
        self.disconnects = Counter("hybridspec_edge_client_disconnects",
                                   "Requests whose HTTP client left before the end (session closed)", registry=r)
        self.in_flight = Gauge("hybridspec_edge_requests_in_flight", "Requests being generated now", registry=r)
        self.prompt_tokens = Counter("hybridspec_edge_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter("hybridspec_edge_completion_tokens",
                                         "Completion tokens returned (usage.completion_tokens)", registry=r)
        self.rounds = Counter("hybridspec_edge_rounds", "Verify rounds committed", registry=r)
        self.draft_tokens = Counter("hybridspec_edge_draft_tokens", "Draft tokens sent for verification", registry=r)
        self.accepted_tokens = Counter("hybridspec_edge_accepted_tokens", "Draft tokens the verifier accepted",
                                       registry=r)
        self.committed_tokens = Counter("hybridspec_edge_committed_tokens",
                                        "Tokens committed by rounds (accepted + corrected or bonus)", registry=r)
        self.tokens_per_round = Histogram("hybridspec_edge_tokens_per_round", "Tokens committed per round",
                                          buckets=tuple(range(1, 18)), registry=r)
        self.acceptance = Histogram("hybridspec_edge_request_acceptance_rate",
                                    "Per request: accepted / drafted tokens",
                                    buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0), registry=r)
        self.round_trip = Histogram("hybridspec_edge_round_trip_seconds",
                                    "Per round: Verify RPC wall time minus the verifier's own time",
                                    buckets=SECONDS_BUCKETS, registry=r)
        self.rpc = Histogram("hybridspec_edge_verify_rpc_seconds", "Per round: Verify RPC wall time (retries included)",
                             buckets=SECONDS_BUCKETS, registry=r)
        self.draft = Histogram("hybridspec_edge_draft_seconds", "Per round: time drafting", buckets=SECONDS_BUCKETS,
                               registry=r)
        self.ttft = Histogram("hybridspec_edge_time_to_first_token_seconds",
                              "Per request: time from the first round to the first committed token",
                              buckets=SECONDS_BUCKETS, registry=r)
        self.retries = Counter("hybridspec_edge_retries", "Verify RPCs retried (UNAVAILABLE, DEADLINE_EXCEEDED)",
                               registry=r)
        self.replays = Counter("hybridspec_edge_replays", "Sessions replayed after the verifier lost them", registry=r)

    def observe_round(self, ev: RoundEvent) -> None:
        self.rounds.inc()
        self.draft_tokens.inc(ev.gamma)
        self.accepted_tokens.inc(ev.accepted)
        self.committed_tokens.inc(ev.tokens)
        self.tokens_per_round.observe(ev.tokens)
        self.rpc.observe(ev.rpc_s)
        self.round_trip.observe(max(0.0, ev.rpc_s - ev.server_s))
        self.draft.observe(ev.draft_s)

    def observe_request(self, stats: GenerationStats, prompt_tokens: int, completion_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        self.retries.inc(stats.retries)
        self.replays.inc(stats.replays)
        if stats.drafted:
            self.acceptance.observe(stats.acceptance_rate)
        if stats.ttft_s:
            self.ttft.observe(stats.ttft_s)

    def serve(self, port: int, host: str) -> int:
        """Expose /metrics on its own port (a thread); returns the port bound (0 picks one)."""
        httpd, _ = start_http_server(port, addr=host, registry=self.registry)
        return httpd.server_port

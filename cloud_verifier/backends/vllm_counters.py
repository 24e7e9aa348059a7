"""vLLM's own counters, read in the frontend's process (for figures and tests)."""
from __future__ import annotations

from typing import NamedTuple


class EngineCounters(NamedTuple):
    """vLLM's own counters (its Prometheus metrics in this process, vllm.v1.metrics.reader), summed over
    label values. Differences of two readings give what a stretch of work cost the engine."""
    requests: float                 # vllm:request_success (finished requests)
    prompt_tokens: float            # vllm:prompt_tokens
    cached_prompt_tokens: float     # vllm:prompt_tokens_cached (served from the prefix cache)
    computed_tokens: float          # vllm:iteration_tokens_total sum (prompt tokens computed + generated)
    engine_steps: float             # vllm:iteration_tokens_total count (engine steps that produced output)
    prefix_cache_queries: float     # vllm:prefix_cache_queries (tokens looked up)
    prefix_cache_hits: float        # vllm:prefix_cache_hits (tokens found)

    def __sub__(self, other: "EngineCounters") -> "EngineCounters":
        return EngineCounters(*(a - b for a, b in zip(self, other)))


def read_engine_counters() -> EngineCounters:
    from vllm.v1.metrics.reader import Counter, Histogram, get_metrics_snapshot
    sums: dict[str, float] = {}
    for m in get_metrics_snapshot():
        if isinstance(m, Counter):
            sums[m.name] = sums.get(m.name, 0.0) + m.value
        elif isinstance(m, Histogram):
            sums[m.name + ":sum"] = sums.get(m.name + ":sum", 0.0) + m.sum
            sums[m.name + ":count"] = sums.get(m.name + ":count", 0.0) + m.count
    return EngineCounters(sums.get("vllm:request_success", 0.0), sums.get("vllm:prompt_tokens", 0.0),
                          sums.get("vllm:prompt_tokens_cached", 0.0), sums.get("vllm:iteration_tokens_total:sum", 0.0),
                          sums.get("vllm:iteration_tokens_total:count", 0.0),
                          sums.get("vllm:prefix_cache_queries", 0.0), sums.get("vllm:prefix_cache_hits", 0.0))

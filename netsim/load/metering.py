"""What the load test measures outside the edges: the verifier's Prometheus samples (scrape,
deltas, histograms, the KV between rounds) and processes' CPU and peak RSS (ProcessMeter)."""
from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
import urllib.request

log = logging.getLogger(__name__)

BATCH_HISTOGRAMS = ("hybridspec_batch_tokens", "hybridspec_batch_seconds", "hybridspec_batch_sessions")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$')


def scrape(url: str | None) -> dict[str, float]:
    """Prometheus text format -> {"name{labels}": value}; {} when there is no endpoint."""
    if not url:
        return {}
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
    except OSError as exc:
        log.warning("could not scrape %s: %s", url, exc)
        return {}
    return samples(text)


def samples(text: str) -> dict[str, float]:
    """Prometheus text format -> {"name{labels}": value}."""
    out = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match:
            out[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return out


def registry_samples() -> dict[str, float]:
    """This process's own Prometheus registry, as `scrape` reads an endpoint: a verifier that runs in
    this process (the virtual clock's) counts there."""
    from prometheus_client import REGISTRY, generate_latest
    return samples(generate_latest(REGISTRY).decode())


def metric_delta(before: dict, after: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


COMMITTED = "hybridspec_committed_tokens_total"


def verifier_committed(before: dict, after: dict) -> float | None:
    """Tokens the verifier committed between two scrapes (its own counter: Verify rounds and Generate
    streams); None when it does not export the counter (or nothing was scraped)."""
    return metric_delta(before, after, COMMITTED) if COMMITTED in after else None


def histogram_delta(before: dict, after: dict, name: str) -> dict | None:
    """Count, sum and per-bucket counts of a histogram over the run; None if the verifier has none."""
    if f"{name}_count" not in after:
        return None
    buckets = {}
    for key, value in after.items():
        if key.startswith(f"{name}_bucket{{"):
            le = re.search(r'le="([^"]+)"', key).group(1)
            buckets[le] = value - before.get(key, 0.0)
    return {"count": metric_delta(before, after, f"{name}_count"), "sum": metric_delta(before, after, f"{name}_sum"),
            "buckets": buckets}


class ProcessMeter:
    """CPU (cores busy) and peak RSS of a process (the verifier, the edges, the proxies), sampled every `every_s`."""

    def __init__(self, pid: int | None, every_s: float = 0.25) -> None:
        import psutil
        self.process = psutil.Process(pid) if pid else None
        self.every_s = every_s
        self.peak_rss = 0
        self._task: asyncio.Task | None = None

    def _sample(self) -> None:
        try:
            self.peak_rss = max(self.peak_rss, self.process.memory_info().rss)
        except Exception:   # psutil.Error: the process is gone; keep the last figures
            pass

    async def _loop(self) -> None:
        while True:
            self._sample()
            await asyncio.sleep(self.every_s)

    def start(self) -> None:
        if self.process is None:
            return
        self.cpu0 = sum(self.process.cpu_times()[:2])
        self.t0 = time.monotonic()
        self.peak_rss = 0
        self._task = asyncio.create_task(self._loop())

    def stop(self) -> dict:
        if self.process is None:
            return {"cpu_cores": None, "peak_rss_mb": None}
        self._task.cancel()
        self._sample()
        cpu_s = sum(self.process.cpu_times()[:2]) - self.cpu0
        return {"cpu_cores": cpu_s / (time.monotonic() - self.t0), "peak_rss_mb": self.peak_rss / 2**20}



def kv_between_rounds(before: dict, after: dict, rounds: float) -> dict | None:
    """Where sessions' KV spent the time between rounds (the batched llama.cpp verifier's
    hybridspec_kv_* metrics), and what parking cost; None when the verifier exports none."""
    from spec_core.kvpark import idle_share
    key = 'hybridspec_kv_session_seconds_total{{state="{}"}}'
    if key.format("busy") not in after:
        return None
    busy, idle, parked = (metric_delta(before, after, key.format(k)) for k in ("busy", "idle", "parked"))
    d = {k: metric_delta(before, after, f"hybridspec_kv_{k}_total")
         for k in ("parks", "restores", "park_seconds", "restore_seconds", "park_bytes", "restore_wait_seconds",
                   "compaction_seconds")}
    per = lambda x, n: x / n if n else None   # noqa: E731
    return {"idle_share": idle_share(busy, idle + parked), "parked_share": per(parked, busy + idle + parked),
            "parks": d["parks"], "restores": d["restores"], "park_ms": per(1e3 * d["park_seconds"], d["parks"]),
            "restore_ms": per(1e3 * d["restore_seconds"], d["restores"]),
            "park_bytes": per(d["park_bytes"], d["parks"]),
            "restore_wait_ms": per(1e3 * d["restore_wait_seconds"], d["restores"]),
            "move_ms_per_round": per(1e3 * (d["park_seconds"] + d["restore_seconds"]), rounds),
            "compaction_ms_per_round": per(1e3 * d["compaction_seconds"], rounds),
            "failures": sum(metric_delta(before, after, k) for k in after
                            if k.startswith("hybridspec_kv_park_failures_total{"))}

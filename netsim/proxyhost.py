"""Many link proxies in a process of their own: one event loop, one LinkProxy per link.

The load generator runs dozens of edges in one process; were the proxies in that process too,
every link's timing would wait on the edges' work (the GIL, a busy event loop) and a loaded
edge would slow the network. `ProxyHost` starts `python -m netsim.proxyhost`, hands it the
links as JSON on stdin, and reads back one line with their ports; `add` hands it more links the
same way (edges that join a running load test: Locust users); closing stdin stops every proxy
(delivering what is in flight) and the process answers one last line with their stats.

    with ProxyHost([LinkSpec(profile, ("127.0.0.1", 50051), seed=i) for i, profile in ...]) as host:
        host.ports   # one listening port per spec, in order
        host.add([LinkSpec(...)])   # -> their ports (host.ports grows by as many)
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import dataclass

from .profiles import Profile
from .proxy import LinkProxy


@dataclass(frozen=True)
class LinkSpec:
    profile: Profile
    upstream: tuple[str, int]
    seed: int = 0

    def to_dict(self) -> dict:
        return {"profile": self.profile.to_dict(), "upstream": list(self.upstream), "seed": self.seed}


class ProxyHost:
    """A child process running one LinkProxy per LinkSpec; `.ports`, `.stop()` -> per-proxy stats."""

    def __init__(self, specs: list[LinkSpec], start_timeout_s: float = 30.0) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "netsim.proxyhost"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        self.stats: list[dict] | None = None
        try:
            self.process.stdin.write(json.dumps([spec.to_dict() for spec in specs]) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError("netsim.proxyhost exited before it listened (see its stderr)")
            self.ports: list[int] = json.loads(line)["ports"]
        except BaseException:
            self.process.kill()
            self.process.wait()
            self.process.stdin.close()
            self.process.stdout.close()
            raise

    def add(self, specs: list[LinkSpec]) -> list[int]:
        """Start one more proxy per spec; returns their ports (blocking: a line each way)."""
        self.process.stdin.write(json.dumps([spec.to_dict() for spec in specs]) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("netsim.proxyhost exited (see its stderr)")
        ports = json.loads(line)["ports"]
        self.ports.extend(ports)
        return ports

    def stop(self, timeout_s: float = 30.0) -> list[dict]:
        """Stop every proxy; returns each one's ProxyStats as a dict."""
        if self.stats is None:
            try:
                self.process.stdin.close()
                line = self.process.stdout.readline()
                self.stats = json.loads(line)["stats"] if line else []
                self.process.wait(timeout_s)
            finally:
                if self.process.poll() is None:
                    self.process.kill()
                    self.process.wait()
                self.process.stdout.close()
        return self.stats

    def __enter__(self) -> ProxyHost:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


async def serve(specs: list[dict]) -> None:
    proxies: list[LinkProxy] = []
    loop = asyncio.get_running_loop()
    try:
        # Each line of specs starts their proxies and is answered with their ports; the parent
        # closing our stdin (or dying) ends the run.
        while specs is not None:
            added = [LinkProxy(upstream=tuple(spec["upstream"]), profile=Profile.from_dict(spec["profile"]),
                               seed=int(spec.get("seed", 0))) for spec in specs]
            for proxy in added:
                await proxy.start()
                proxies.append(proxy)
            sys.stdout.write(json.dumps({"ports": [proxy.port for proxy in added]}) + "\n")
            sys.stdout.flush()
            line = await loop.run_in_executor(None, sys.stdin.readline)
            specs = json.loads(line) if line.strip() else None
    finally:
        for proxy in proxies:
            await proxy.stop()
    sys.stdout.write(json.dumps({"stats": [proxy.stats.as_dict() for proxy in proxies]}) + "\n")
    sys.stdout.flush()


def main() -> None:
    import logging
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    specs = json.loads(sys.stdin.readline())
    asyncio.run(serve(specs))


if __name__ == "__main__":
    main()

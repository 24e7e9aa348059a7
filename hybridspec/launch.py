"""Start `cloud-verifier serve` and `edge-client serve` as their own processes (as on other machines)
and wait until they listen: the ready lines are printed and parsed in one place.

Standard library only, and nothing of ours: the demo, netsim's experiments, the benches and the
tests all start servers through here, and none of them needs to import the package it starts.
"""
from __future__ import annotations

import collections
import subprocess
import sys
import threading
from typing import NamedTuple

VERIFIER_READY = "cloud-verifier serving on"  # `cloud-verifier serve` prints it and "host:port" once bound
EDGE_SERVER_READY = "edge-client serving on"  # `edge-client serve`: it, the base URL, [metrics URL]


class Verifier(NamedTuple):
    proc: subprocess.Popen
    address: str              # "host:port"


class EdgeServer(NamedTuple):
    proc: subprocess.Popen
    base_url: str             # "http://host:port/v1"
    metrics_url: str | None   # "http://host:port/metrics", or None without --metrics-port


def spawn_verifier(args: list[str], stderr=subprocess.DEVNULL) -> Verifier:
    """`python -m cloud_verifier serve --port 0 ARGS`; returns (process, "host:port"). `stderr`: where
    its log goes (a file to keep it; dropped by default).

    Lines printed before the ready line (vLLM logs to standard output while it loads) are
    skipped; after it, standard output is drained in a thread so a chatty verifier never blocks
    on a full pipe."""
    proc, line = _start(["cloud_verifier", "serve", "--port", "0", *args], VERIFIER_READY, stderr,
                        "the verifier", "verifier-stdout")
    return Verifier(proc, line[len(VERIFIER_READY):].strip())


def spawn_edge_server(args: list[str], stderr=subprocess.DEVNULL) -> EdgeServer:
    """`python -m edge_client serve --port 0 ARGS`; returns (process, base url ".../v1", metrics url
    or None). Lines before the ready line are skipped, and standard output is drained after it."""
    proc, line = _start(["edge_client", "serve", "--port", "0", *args], EDGE_SERVER_READY, stderr,
                        "edge-client serve", "edge-server-stdout")
    words = line.split()
    metrics = words[words.index("metrics") + 1] if "metrics" in words else None
    return EdgeServer(proc, words[len(EDGE_SERVER_READY.split())], metrics)


def _start(module_args: list[str], ready: str, stderr, what: str, thread_name: str) -> tuple[subprocess.Popen, str]:
    """Run `python -m MODULE_ARGS` and return it with its ready line."""
    proc = subprocess.Popen([sys.executable, "-m", *module_args], stdout=subprocess.PIPE, stderr=stderr, text=True)
    last = collections.deque(maxlen=5)
    for line in proc.stdout:
        if line.startswith(ready):
            threading.Thread(target=collections.deque, args=(proc.stdout, 0), daemon=True, name=thread_name).start()
            return proc, line
        last.append(line.rstrip())
    proc.kill()
    raise RuntimeError(f"{what} exited before it listened (its last lines: {list(last)!r}); "
                       "run it by hand to see why")

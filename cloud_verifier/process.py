"""Start a verifier as its own process (as on another machine) and wait until it listens.

Used by the demo, the netsim experiment and the CLI tests, so the ready line is parsed in one place.
"""
from __future__ import annotations

import collections
import subprocess
import sys
import threading

READY = "cloud-verifier serving on"  # printed by `cloud-verifier serve` once the port is bound


def spawn_verifier(args: list[str]) -> tuple[subprocess.Popen, str]:
    """`python -m cloud_verifier serve --port 0 ARGS`; returns (process, "host:port").

    Lines printed before the ready line (vLLM logs to standard output while it loads) are
    skipped; after it, standard output is drained in a thread so a chatty verifier never blocks
    on a full pipe."""
    proc = subprocess.Popen([sys.executable, "-m", "cloud_verifier", "serve", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    last = collections.deque(maxlen=5)
    for line in proc.stdout:
        if line.startswith(READY):
            threading.Thread(target=collections.deque, args=(proc.stdout, 0), daemon=True,
                             name="verifier-stdout").start()
            return proc, line[len(READY):].strip()
        last.append(line.rstrip())
    proc.kill()
    raise RuntimeError(f"the verifier exited before it listened (its last lines: {list(last)!r}); "
                       "run it by hand to see why")

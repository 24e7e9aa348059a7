"""Start a verifier as its own process (as on another machine) and wait until it listens.

Used by the demo, the netsim experiment and the CLI tests, so the ready line is parsed in one place.
"""
from __future__ import annotations

import subprocess
import sys

READY = "cloud-verifier serving on"  # printed by `cloud-verifier serve` once the port is bound


def spawn_verifier(args: list[str]) -> tuple[subprocess.Popen, str]:
    """`python -m cloud_verifier serve --port 0 ARGS`; returns (process, "host:port")."""
    proc = subprocess.Popen([sys.executable, "-m", "cloud_verifier", "serve", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if not line.startswith(READY):
        proc.kill()
        raise RuntimeError(f"the verifier did not start (printed {line!r}); run it by hand to see why")
    return proc, line[len(READY):].strip()

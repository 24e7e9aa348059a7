"""Start `edge-client serve` as its own process and wait until it accepts requests (the benches
and tests of the OpenAI-compatible endpoint), so its ready line is parsed in one place."""
from __future__ import annotations

import collections
import subprocess
import sys
import threading

from edge_client.cli import SERVE_READY


def spawn_edge_server(args: list[str], stderr=subprocess.DEVNULL) -> tuple[subprocess.Popen, str, str | None]:
    """`python -m edge_client serve --port 0 ARGS`; returns (process, base url ".../v1", metrics url
    or None). Lines before the ready line are skipped, and standard output is drained after it."""
    proc = subprocess.Popen([sys.executable, "-m", "edge_client", "serve", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=stderr, text=True)
    last = collections.deque(maxlen=5)
    for line in proc.stdout:
        if line.startswith(SERVE_READY):
            threading.Thread(target=collections.deque, args=(proc.stdout, 0), daemon=True,
                             name="edge-server-stdout").start()
            words = line.split()
            metrics = words[words.index("metrics") + 1] if "metrics" in words else None
            return proc, words[len(SERVE_READY.split())], metrics
        last.append(line.rstrip())
    proc.kill()
    raise RuntimeError(f"edge-client serve exited before it listened (its last lines: {list(last)!r})")

"""This machine as a device: the bundled draft's time per token and per prompt token (a benchmark).

The device table of the per-GPU model (netsim/fleet/devices.py) takes published llama.cpp runs of a
1B draft on a phone, a laptop CPU and a laptop GPU; this adds our own edge as it runs here: the
bundled SmolLM2 draft (models/smollm2-draft.gguf) decoding one token per call after a prompt (one
thread, as the demo's edge), and prefilling a 128-token prompt, medians of --repeats. The result
records the machine and its load; netsim.fleet.devices.this_machine() reads it and marks the row busy
when the load at the start or the end was above 0.5 per core (then it is not a published figure).

  python bench/device_speed.py                      # quiet machine: nothing else running
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def prefill_s(path: str, tokens: int, repeats: int, threads: int) -> float:
    from llama_runtime import GGUFModel
    model = GGUFModel(path, n_threads=threads)
    ctx = model.new_context(n_ctx=tokens + 8)
    try:
        ids = [model.tokenize("The verifier checks every drafted token in one pass. ", add_special=False)[i % 8]
               for i in range(tokens)]
        times = []
        for _ in range(repeats + 1):
            ctx.reset()
            t0 = time.perf_counter()
            ctx.logits(ids, 1)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:]) / tokens
    finally:
        ctx.close()
        model.close()


def main(argv: list[str] | None = None) -> int:
    from edge_client.draftmaker.evaluate import decode_speeds
    from edge_client.drafters import DEFAULT_DRAFT
    from hybridspec.figures import Figure, write_result
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64, help="tokens decoded per repeat")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--result", default="device-this-machine")
    args = ap.parse_args(argv)
    load = [round(x, 2) for x in os.getloadavg()]
    (rate,) = decode_speeds([args.draft], args.threads, [1] * 16, args.tokens, args.repeats)
    pre = prefill_s(args.draft, args.prompt_tokens, args.repeats, args.threads)
    setup = f"{Path(args.draft).name}, {args.threads} thread(s), this machine"
    print(f"decode {1e3 / rate:.2f} ms/token, prompt {pre * 1e3:.3f} ms/token ({setup})")
    path = write_result(args.result, load_start=load, figures={
        "draft-ms": Figure(round(1e3 / rate, 3), "drafting time per token, one token per call after a prompt",
                           setup, "ms", "{:.1f} ms"),
        "prefill-ms": Figure(round(pre * 1e3, 4), f"prompt time per token ({args.prompt_tokens} tokens in one call)",
                             setup, "ms", "{:.2f} ms")})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

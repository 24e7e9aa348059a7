"""What the HTTP layer of `edge-client serve` costs per request.

One verifier, one prompt, greedy, the same draft model and γ; requests run one at a time and the
three ways are interleaved (A B C A B C ...) so machine load hits them alike:

  direct     EdgeClient.generate in this process (what an app in Python would call)
  http       raw HTTP to `edge-client serve` (http.client, stream: true): FastAPI + uvicorn + SSE
  openai     the `openai` package's streaming client against the same server

Time to first byte (TTFB) is the time from sending the request to the first text: the first
piece from EdgeClient, the first SSE chunk with content over HTTP. The server answers only once
the first round has committed text (so that a verifier that is down gets a 503, not a 200), so
both measure the same work. Total is the time to the end of the generation.

    python bench/serve_overhead.py                      # bundled SmolLM2 target, models/smollm2-draft.gguf
    python bench/serve_overhead.py --synthetic           # the synthetic model pair: model time ~0, the
                                                        # framework's own cost stands out
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge_client import EdgeClient  # noqa: E402
from edge_client.drafters import DEFAULT_DRAFT, GGUFDrafter, SyntheticDrafter  # noqa: E402
from edge_client.options import EdgeOptions, Speculation, Transport  # noqa: E402
from edge_client.text import SyntheticTokenizer  # noqa: E402
from hybridspec.launch import spawn_edge_server, spawn_verifier  # noqa: E402
from hybridspec.machine import announce
from llama_runtime import bundled_model_path  # noqa: E402
from spec_core.warping import SamplingSettings  # noqa: E402


async def direct(client: EdgeClient, prompt: str, max_tokens: int) -> tuple[float, float, str]:
    t0 = time.perf_counter()
    gen = client.generate(prompt, SamplingSettings(temperature=0.0, max_new_tokens=max_tokens, ignore_eos=True))
    ttfb, text = 0.0, []
    async for piece in gen:
        ttfb = ttfb or time.perf_counter() - t0
        text.append(piece)
    return ttfb, time.perf_counter() - t0, "".join(text)


def raw_http(host: str, port: int, prompt: str, max_tokens: int) -> tuple[float, float, str]:
    body = json.dumps({"model": "any", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True})
    conn = http.client.HTTPConnection(host, port, timeout=120)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    resp = conn.getresponse()
    ttfb, text = 0.0, []
    for line in resp:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        piece = json.loads(line[6:])["choices"][0]["text"]
        if piece:
            ttfb = ttfb or time.perf_counter() - t0
            text.append(piece)
    total = time.perf_counter() - t0
    conn.close()
    return ttfb, total, "".join(text)


def openai_stream(client, prompt: str, max_tokens: int) -> tuple[float, float, str]:
    t0 = time.perf_counter()
    ttfb, text = 0.0, []
    for chunk in client.completions.create(model="any", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}):
        piece = chunk.choices[0].text if chunk.choices else ""
        if piece:
            ttfb = ttfb or time.perf_counter() - t0
            text.append(piece)
    return ttfb, time.perf_counter() - t0, "".join(text)


def summary(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"{statistics.median(xs) * 1e3:7.1f} {xs[int(0.9 * (len(xs) - 1))] * 1e3:7.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="target GGUF (default: the bundled SmolLM2-135M)")
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--prompt", default="Write a Python function that reverses a list.")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=20, help="per way, after 2 warm-up rounds")
    ap.add_argument("--gamma", default="4")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--synthetic", action="store_true", help="the synthetic pair on both ends instead of GGUF models")
    args = ap.parse_args()
    announce()
    import openai

    if args.synthetic:
        target, args.draft = "synthetic", "synthetic"
        args.prompt = " ".join(str(i) for i in range(3, 40, 3))
        verifier, address = spawn_verifier(["--backend", "synthetic", "--n-ctx", "1024"])
        drafter_args = ["--drafter", "synthetic"]
    else:
        target = args.target or str(bundled_model_path())
        verifier, address = spawn_verifier(["--model", target, "--n-ctx", "1024", "--threads", str(args.threads)])
        drafter_args = ["--draft", args.draft]
    edge, url, _ = spawn_edge_server(["--server", address, *drafter_args, "--threads", str(args.threads),
                                      "--gamma", args.gamma, "--plan", "off"])
    try:
        host, port = url.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
        oai = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        if args.synthetic:
            drafter, tokenizer = SyntheticDrafter(), SyntheticTokenizer()
        else:
            drafter = GGUFDrafter(args.draft, n_threads=args.threads)
            tokenizer = drafter.model
        results: dict[str, list[tuple[float, float]]] = {"direct": [], "http": [], "openai": []}
        texts: dict[str, set[str]] = {k: set() for k in results}

        async def run_all():
            options = EdgeOptions(Transport(address), Speculation(plan="off", gamma=args.gamma))  # "5" or "adaptive"
            async with EdgeClient(options, drafter, tokenizer) as client:
                for i in range(args.requests + 2):
                    for way in results:
                        if way == "direct":
                            r = await direct(client, args.prompt, args.max_tokens)
                        elif way == "http":
                            r = await asyncio.to_thread(raw_http, host, int(port), args.prompt, args.max_tokens)
                        else:
                            r = await asyncio.to_thread(openai_stream, oai, args.prompt, args.max_tokens)
                        texts[way].add(r[2])
                        if i >= 2:  # warm-up: model pages, connections, first-request imports
                            results[way].append(r[:2])
        asyncio.run(run_all())
        drafter.close()
    finally:
        edge.terminate()
        edge.wait(30)
        verifier.terminate()
        verifier.wait(30)

    same = len(set.union(*texts.values())) == 1
    print(f"target {Path(target).name}, draft {Path(args.draft).name}, gamma {args.gamma}, {args.max_tokens} tokens "
          f"greedy, {args.requests} requests per way (interleaved), threads {args.threads}")
    print(f"same text all ways: {same}")
    print(f"{'way':8} {'TTFB ms median p90':>20} {'total ms median p90':>22}")
    for way, rs in results.items():
        print(f"{way:8} {summary([r[0] for r in rs]):>20} {summary([r[1] for r in rs]):>22}")
    base_ttfb = statistics.median(r[0] for r in results["direct"])
    base_total = statistics.median(r[1] for r in results["direct"])
    for way in ("http", "openai"):
        d_ttfb = statistics.median(r[0] for r in results[way]) - base_ttfb
        d_total = statistics.median(r[1] for r in results[way]) - base_total
        print(f"overhead {way} vs direct: TTFB {d_ttfb * 1e3:+.1f} ms, total {d_total * 1e3:+.1f} ms (medians)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

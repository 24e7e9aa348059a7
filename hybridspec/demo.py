"""hybridspec demo: start a verifier on the bundled target, run the edge against it, print stats.

The verifier runs as its own process (as it would on another machine), on 127.0.0.1, with one
llama.cpp thread; the edge drafts with one thread: on a 2-core box that keeps the two "devices"
from fighting over cores. It then asks the same verifier for the cloud-only baseline (the target
streaming its own output) on the same prompt, so the two can be compared.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path

from edge_client.drafters import DEFAULT_DRAFT

DEFAULT_PROMPT = "Write a Python function that reverses a list."


def add_parser(sub) -> None:
    from edge_client.cli import add_sampling_args
    from edge_client.options import add_edge_options
    p = sub.add_parser("demo", help="run a verifier and an edge on the bundled models and print the stats",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target GGUF, or a bundled model's name: smollm2 (default: SmolLM2-135M-Instruct "
                                    "Q4_1) or gemma (Gemma 3 270M Q4_K_M, another tokenizer: scripts/setup.sh --with gemma)")
    p.add_argument("--verifier-threads", type=int, default=1, help="llama.cpp threads of the verifier it starts")
    p.add_argument("--no-baseline", action="store_true", help="skip the cloud-only comparison")
    p.add_argument("--json", action="store_true", help="end with one JSON line of statistics")
    add_sampling_args(p)
    add_edge_options(p, server=False, security=False)  # the demo starts its own verifier, on loopback
    p.set_defaults(func=cmd_demo, prompt=DEFAULT_PROMPT, chat=True, threads=1, seed=1, top_p=0.95)


async def cloud_only(server: str, ids: list[int], settings) -> dict:
    import grpc
    from edge_client.client import stream_cloud_only
    from spec_core.proto import verifier_pb2_grpc as pb_grpc
    async with grpc.aio.insecure_channel(server) as ch:
        st = await stream_cloud_only(pb_grpc.VerifierStub(ch), ids, settings)
    return {"tokens": st.tokens, "wall_s": st.wall_s, "ttft_s": st.ttft_s, "tokens_per_s": st.tokens_per_s}


def cmd_demo(args) -> int:
    from hybridspec.launch import spawn_verifier
    from edge_client.cli import prompt_ids, run_generate, settings_from_args
    from edge_client.options import options_from_args
    from llama_runtime import GGUFModel, find_model
    options, settings = options_from_args(args), settings_from_args(args)  # before anything starts
    try:   # a bundled name or a path; a missing file: one line saying how to get it
        target = str(find_model(args.target or "smollm2"))
        if args.draft:
            args.draft = str(find_model(args.draft))
    except FileNotFoundError as e:
        print(f"[demo] {e}", file=sys.stderr)
        return 2
    if args.drafter == "gguf" and not args.draft:
        if DEFAULT_DRAFT.is_file():
            args.draft = str(DEFAULT_DRAFT)
        else:
            print(f"[demo] no draft at {DEFAULT_DRAFT} (build it with: edge-client make-draft --target {target} "
                  f"--out {DEFAULT_DRAFT}); using the PROMPT-LOOKUP drafter as a stand-in", file=sys.stderr)
            args.drafter, args.tokenizer = "lookup", target
    label = args.draft if args.drafter == "gguf" else f"{args.drafter} (no model)"
    shape = f"gamma {args.gamma}" if args.gamma is not None else f"shape: planner ({args.plan})"
    print(f"[demo] target: {Path(target).name} on llama.cpp | draft: {label} | {shape} | q {args.qmode}",
          file=sys.stderr)
    proc, server = spawn_verifier(["--model", target, "--threads", str(args.verifier_threads)])
    try:
        print(f"[demo] verifier on {server}; edge output follows\n", file=sys.stderr)
        stats = asyncio.run(run_generate(args, options.at(server), settings))
        baseline = None
        if not args.no_baseline:
            tok = GGUFModel(target, vocab_only=True)   # the target's own rendering of the same prompt
            prompt = prompt_ids(args, tok)
            if isinstance(prompt, str):
                ids = tok.tokenize(prompt)
            elif hasattr(prompt, "messages"):   # a Chat: the target's chat template
                from edge_client.text import render_messages
                ids = render_messages(tok, list(prompt.messages))
            else:
                ids = list(prompt)
            baseline = asyncio.run(cloud_only(server, ids, settings))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    s = stats
    print(f"\n[demo] hybrid:     {s.tokens} tokens in {s.wall_s:.2f}s = {s.tokens_per_s:.1f} tok/s, "
          f"{s.rounds} rounds, acceptance {s.acceptance_rate:.2f}, {s.tokens_per_round:.2f} tokens/round "
          f"(theory at this α and γ: {s.expected_tokens_per_round:.2f}), "
          f"{s.bytes_up / max(s.rounds, 1):.0f} B up / {s.bytes_down / max(s.rounds, 1):.0f} B down per round",
          file=sys.stderr)
    if baseline:
        print(f"[demo] cloud-only: {baseline['tokens']} tokens in {baseline['wall_s']:.2f}s = "
              f"{baseline['tokens_per_s']:.1f} tok/s (the target alone, streamed; "
              f"on loopback there is no network cost to save)", file=sys.stderr)
    if args.json:
        out = s.to_json()
        out["cloud_only"] = baseline
        print(json.dumps(out))
    return 0

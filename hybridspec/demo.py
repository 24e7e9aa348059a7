"""hybridspec demo: start a verifier on the bundled target, run the edge against it, print what the
hybrid saves beside the cloud-only baseline.

The verifier runs as its own process (as it would on another machine), on 127.0.0.1, with one
llama.cpp thread; the edge drafts with one thread: on a 2-core box that keeps the two "devices"
from fighting over cores. The same verifier then serves the cloud-only baseline (the target
streaming its own output) on the same prompt. With --link PROFILE the edge reaches the verifier
through netsim's link proxy with that profile's link, and per-token serving (the hybrid with one
draft token per round, γ = 1) runs as a third row. --max-tokens defaults to 128, and to 32 with
--link.

Each row prints tokens/s, target passes per committed token, round trips per token and time to
first token. Passes are the verifier's own count (its /metrics counter of target forward passes,
read before and after each run), not derived from the rounds, less the passes it spends on the
prompt's chunks before the first token (the same prompt in every row, counted once by the verifier
for a one-token request); round trips are the Verify requests the verifier answered (its count too,
retries included), or cloud-only's one Generate stream.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

from edge_client.drafters import DEFAULT_DRAFT

DEFAULT_PROMPT = "Write a Python function that reverses a list."
MAX_TOKENS = 128        # --max-tokens when none is given
LINK_MAX_TOKENS = 32    # ... with --link: per-token serving pays a round trip per one or two tokens
HEARTBEAT_S = 5.0       # a run that streams nothing says it is still going this often


def add_parser(sub) -> None:
    from edge_client.cli import add_sampling_args
    from edge_client.options import add_edge_options
    from netsim.profiles import PROFILES
    p = sub.add_parser("demo", help="run a verifier and an edge on the bundled models and print what the hybrid saves",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target GGUF, or a bundled model's name: smollm2 (default: SmolLM2-135M-Instruct "
                                    "Q4_1) or gemma (Gemma 3 270M Q4_K_M, another tokenizer: scripts/setup.sh --with gemma)")
    p.add_argument("--link", choices=sorted(PROFILES), metavar="PROFILE",
                   help="reach the verifier through netsim's link proxy with this profile's link (`netsim profiles` "
                        "lists them, e.g. 3g: 300 ms RTT) and add per-token serving (one draft token per round) as a "
                        f"third row; --max-tokens then defaults to {LINK_MAX_TOKENS}")
    p.add_argument("--verifier-threads", type=int, default=1, help="llama.cpp threads of the verifier it starts")
    p.add_argument("--no-baseline", action="store_true", help="skip the cloud-only comparison")
    p.add_argument("--json", action="store_true", help="end with one JSON line of statistics")
    add_sampling_args(p)
    add_edge_options(p, server=False, security=False)  # the demo starts its own verifier, on loopback
    p.set_defaults(func=cmd_demo, prompt=DEFAULT_PROMPT, chat=True, threads=1, seed=1, top_p=0.95, max_tokens=None)


class Row(NamedTuple):
    """One way of serving the prompt, measured."""
    name: str            # cloud-only, per-token, hybrid
    tokens: int          # committed (generated) tokens
    wall_s: float
    ttft_s: float        # time to the first committed token
    passes: int          # target forward passes, the verifier's own count over the run
    round_trips: int     # Verify requests the verifier answered (its count), or 1: cloud-only's Generate stream

    def per_token(self, n: int) -> float:
        return n / max(self.tokens, 1)

    def to_json(self) -> dict:
        return {**self._asdict(), "tokens_per_s": self.tokens / self.wall_s if self.wall_s else 0.0,
                "passes_per_token": self.per_token(self.passes),
                "round_trips_per_token": self.per_token(self.round_trips)}


class Count(NamedTuple):
    passes: int          # target forward passes (one per prefill chunk, round or Generate step)
    verify_requests: int  # Verify requests (unary or on a stream) the verifier answered


class VerifierCounters:
    """The verifier's own counters, read from its Prometheus endpoint: target forward passes
    (`hybridspec_batch_seconds`: one observation per pass), and the Verify requests it answered —
    rounds it ran (`hybridspec_round_seconds`: one observation per request; a round fused into the
    pass before has none), retries answered from its cache and pipelined rounds it dropped.
    Refusals and connections that never reached it are not counted."""

    LINE = re.compile(r"^(hybridspec_[a-z_]+)\s+([0-9.e+]+)$", re.M)
    REQUESTS = ("hybridspec_round_seconds_count", "hybridspec_verify_retries_total",
                "hybridspec_pipeline_discards_total")

    def __init__(self, port: int):
        self.url = f"http://127.0.0.1:{port}/metrics"

    def read(self) -> Count:
        with urllib.request.urlopen(self.url, timeout=10) as r:
            values = {name: int(float(v)) for name, v in self.LINE.findall(r.read().decode())}
        return Count(values.get("hybridspec_batch_seconds_count", 0), sum(values.get(n, 0) for n in self.REQUESTS))

    def settled(self) -> Count:
        """The counts once they stop moving: a pass is counted just after its answer leaves."""
        last = self.read()
        for _ in range(20):
            time.sleep(0.05)
            now = self.read()
            if now == last:
                return now
            last = now
        return last


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def heartbeat(label: str, work, every_s: float = HEARTBEAT_S):
    """Await `work`, printing a line every `every_s` seconds until it ends (never silent for long)."""
    task = asyncio.ensure_future(work)
    t0 = time.monotonic()
    while True:
        done, _ = await asyncio.wait({task}, timeout=every_s)
        if done:
            return task.result()
        print(f"[demo] {label}: {time.monotonic() - t0:.0f} s so far", file=sys.stderr, flush=True)


async def cloud_only(server: str, ids: list[int], settings) -> tuple[int, float, float]:
    """(tokens, wall s, TTFT s) of the target streaming its own output, over a warmed-up channel."""
    import grpc
    from edge_client.client import stream_cloud_only
    from spec_core.proto import verifier_pb2 as pb, verifier_pb2_grpc as pb_grpc
    async with grpc.aio.insecure_channel(server) as ch:
        stub = pb_grpc.VerifierStub(ch)
        await stub.GetServerInfo(pb.ServerInfoRequest(), timeout=60)   # connect first, as the edge does
        st = await heartbeat("cloud-only", stream_cloud_only(stub, ids, settings))
    return st.tokens, st.wall_s, st.ttft_s


def target_prompt_ids(args, target: str) -> list[int]:
    """The prompt as the target renders it (cloud-only sends ids)."""
    from edge_client.cli import prompt_ids
    from llama_runtime import GGUFModel
    tok = GGUFModel(target, vocab_only=True)
    prompt = prompt_ids(args, tok)
    if isinstance(prompt, str):
        return tok.tokenize(prompt)
    if hasattr(prompt, "messages"):   # a Chat: the target's chat template
        from edge_client.text import render_messages
        return render_messages(tok, list(prompt.messages))
    return list(prompt)


def resolve_models(args) -> str | None:
    """The target's path (and the draft's, in args); None after printing why there is none."""
    from llama_runtime import find_model
    try:   # a bundled name or a path; a missing file: one line saying how to get it
        target = str(find_model(args.target or "smollm2"))
        if args.draft:
            args.draft = str(find_model(args.draft))
    except FileNotFoundError as e:
        print(f"[demo] {e}", file=sys.stderr)
        return None
    if args.drafter == "gguf" and not args.draft:
        if DEFAULT_DRAFT.is_file():
            args.draft = str(DEFAULT_DRAFT)
        else:
            print(f"[demo] no draft at {DEFAULT_DRAFT} (build it with: edge-client make-draft --target {target} "
                  f"--out {DEFAULT_DRAFT}); using the PROMPT-LOOKUP drafter as a stand-in", file=sys.stderr)
            args.drafter, args.tokenizer = "lookup", target
    return target


def cmd_demo(args) -> int:
    from edge_client.cli import settings_from_args
    from edge_client.options import options_from_args
    if args.max_tokens is None:
        args.max_tokens = LINK_MAX_TOKENS if args.link else MAX_TOKENS
    options, settings = options_from_args(args), settings_from_args(args)  # before anything starts
    target = resolve_models(args)
    if target is None:
        return 2
    label = args.draft if args.drafter == "gguf" else f"{args.drafter} (no model)"
    shape = f"gamma {args.gamma}" if args.gamma is not None else f"shape: planner ({args.plan})"
    print(f"[demo] target: {Path(target).name} on llama.cpp | draft: {label} | {shape} | q {args.qmode} "
          f"| {args.max_tokens} tokens", file=sys.stderr)
    rows, stats, prefill = run_rows(args, target, options, settings)
    report(args, rows, stats, prefill)
    return 0


def run_rows(args, target: str, options, settings) -> tuple[list[Row], object, int]:
    """Start the verifier (and the link), run hybrid, per-token (with --link) and cloud-only.
    Returns the rows, the hybrid's GenerationStats and the prompt's prefill passes."""
    from edge_client.cli import run_generate
    from hybridspec.launch import spawn_verifier
    metrics_port = free_port()
    proc, server = spawn_verifier(["--model", target, "--threads", str(args.verifier_threads),
                                   "--metrics-port", str(metrics_port)])
    counters, link = VerifierCounters(metrics_port), None
    try:
        ids = target_prompt_ids(args, target)
        prefill = asyncio.run(prefill_passes(server, ids, settings, counters))
        address = server
        if args.link:
            from netsim.profiles import get_profile
            from netsim.proxy import LinkProxy
            host, port = server.rsplit(":", 1)
            profile = get_profile(args.link)
            link = LinkProxy(upstream=(host, int(port)), profile=profile, seed=args.seed or 0).start_in_thread()
            address = f"127.0.0.1:{link.port}"
            print(f"[demo] link: {profile.name} ({profile.description}) through netsim's proxy", file=sys.stderr)
        print(f"[demo] verifier on {server}; edge output follows\n", file=sys.stderr)
        before = counters.settled()
        stats = asyncio.run(run_generate(args, options.at(address), settings))
        rows = [measured("hybrid", stats, before, counters.settled(), prefill)]
        if args.link:
            print(f"[demo] per-token (one draft token per round) over {args.link} ...", file=sys.stderr, flush=True)
            before = counters.settled()
            st = asyncio.run(heartbeat("per-token", run_generate(args, per_token(options.at(address)), settings,
                                                                 quiet=True)))
            rows.insert(0, measured("per-token", st, before, counters.settled(), prefill))
        if not args.no_baseline:
            print("[demo] cloud-only (the target streams its own output) ...", file=sys.stderr, flush=True)
            before = counters.settled()
            tokens, wall, ttft = asyncio.run(cloud_only(address, ids, settings))
            rows.insert(0, Row("cloud-only", tokens, wall, ttft, counters.settled().passes - before.passes - prefill, 1))
    finally:
        if link is not None:
            link.stop()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return rows, stats, prefill


def per_token(options):
    """The same edge serving per token: one draft token per round, chains, nothing in flight."""
    from edge_client.options import Speculation
    spec = options.speculation
    return dataclasses.replace(options, speculation=Speculation(
        gamma=1, plan="off", qmode=spec.qmode, strict_tokenizer=spec.strict_tokenizer, target_vocab=spec.target_vocab))


def measured(name: str, stats, before: Count, after: Count, prefill: int) -> Row:
    """A hybrid row: the edge's tokens and times, the verifier's passes and Verify requests."""
    return Row(name, stats.tokens, stats.wall_s, stats.ttft_s, after.passes - before.passes - prefill,
               after.verify_requests - before.verify_requests)


async def prefill_passes(server: str, ids: list[int], settings, counters: VerifierCounters) -> int:
    """The passes the verifier spends on the prompt before the pass that gives the first token:
    it evaluates a long prompt in chunks, one pass each. Counted by the verifier for a one-token
    Generate of the same prompt (its passes less one); every row's count leaves them out, so
    passes per token are those of generation, the same for every row's prompt."""
    import grpc
    from edge_client.client import stream_cloud_only
    from spec_core.proto import verifier_pb2 as pb, verifier_pb2_grpc as pb_grpc
    async with grpc.aio.insecure_channel(server) as ch:
        stub = pb_grpc.VerifierStub(ch)
        await stub.GetServerInfo(pb.ServerInfoRequest(), timeout=60)
        before = counters.settled().passes
        await stream_cloud_only(stub, ids, dataclasses.replace(settings, max_new_tokens=1))
    return max(0, counters.settled().passes - before - 1)


def report(args, rows: list[Row], stats, prefill: int) -> None:
    s = stats
    print(f"\n[demo] hybrid: {s.tokens} tokens, {s.rounds} rounds, acceptance {s.acceptance_rate:.2f}, "
          f"{s.tokens_per_round:.2f} tokens/round (theory at this α and γ: {s.expected_tokens_per_round:.2f}), "
          f"{s.bytes_up / max(s.rounds, 1):.0f} B up / {s.bytes_down / max(s.rounds, 1):.0f} B down per round",
          file=sys.stderr)
    if s.planned:
        print(f"[demo] {planner_line(s)}", file=sys.stderr)
    print(table(rows), file=sys.stderr)
    print(f"[demo] passes: target forward passes the verifier counted during each run (its /metrics), less the "
          f"{prefill} it spends on the prompt's chunks before its first token in every row, per committed token; "
          "round trips: Verify requests the verifier answered (or cloud-only's one stream), per token", file=sys.stderr)
    print(f"[demo] {meaning(rows, args.link)}", file=sys.stderr)
    if args.json:
        out = s.to_json()
        named = {r.name: r.to_json() for r in rows}
        out["cloud_only"] = named.get("cloud-only")
        out["rows"] = named
        out["link"] = args.link
        out["prefill_passes"] = prefill
        print(json.dumps(out))


def planner_line(s) -> str:
    """Which shapes the planner chose (rounds sent per shape, the most used first) and why, one line."""
    shapes = ", ".join(f"{label} ×{n}" for label, n in list(s.shapes.items())[:4])
    more = f" and {len(s.shapes) - 4} more" if len(s.shapes) > 4 else ""
    return f"planner: {shapes}{more}; last round because: {s.plan_reasons or 'nothing measured yet'}"


def table(rows: list[Row]) -> str:
    lines = [f"[demo] {'':12} {'tok/s':>7} {'passes/token':>13} {'round trips/token':>18} {'first token':>12}"]
    for r in rows:
        lines.append(f"[demo] {r.name + ':':12} {r.tokens / r.wall_s if r.wall_s else 0.0:7.1f} "
                     f"{r.per_token(r.passes):13.2f} {r.per_token(r.round_trips):18.2f} {r.ttft_s:11.2f}s")
    return "\n".join(lines)


def meaning(rows: list[Row], link: str | None) -> str:
    """One plain sentence of what the rows say, from the rows themselves."""
    by = {r.name: r for r in rows}
    h = by["hybrid"]
    hp = h.per_token(h.passes)
    rate = lambda r: r.tokens / r.wall_s if r.wall_s else 0.0  # noqa: E731
    passes = (f"{hp:.2f} target passes per token where the target alone needs 1.00 ({1 / hp:.1f}x the tokens per "
              "pass of the large model)" if hp < 1 else
              "no fewer target passes than the target alone (the draft was accepted too rarely here)")
    if link and "per-token" in by:
        p = by["per-token"]
        fewer = p.per_token(p.round_trips) / max(h.per_token(h.round_trips), 1e-9)
        trips = (f"{fewer:.1f}x fewer round trips than per-token serving" if fewer >= 1 else
                 f"{1 / fewer:.1f}x the round trips of per-token serving (rounds sent ahead that were not kept)")
        return (f"Over {link} the hybrid needed {trips} ({rate(h) / max(rate(p), 1e-9):.1f}x its tokens/s) and "
                f"{passes}; cloud-only streams in one request, so where the cloud has the capacity it stays the "
                "fastest: the hybrid saves the cloud's passes and the round trips of per-token collaboration.")
    if "cloud-only" in by:
        c = by["cloud-only"]
        lead = ("On loopback there is no round trip to save and cloud-only streams faster; what the hybrid saves is"
                if rate(c) > rate(h) else "What the hybrid saves is")
        return f"{lead} the large model's work: {passes}, which is what bounds a loaded GPU server."
    return f"The hybrid ran {passes}."

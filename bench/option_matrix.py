"""The option matrix from the command line, with real models (issue 24's "done when").

For each target (the bundled SmolLM2; Gemma 3 270M when set-up assembled it, drafted across
vocabularies by the SmolLM2 draft), this starts `cloud-verifier serve` on 127.0.0.1 (llama.cpp,
`--threads 1`) and runs `edge-client generate` as a new user would:

- greedy: every combination of chain / tree / the planner's shape × none / proactive / pipeline
  (each with --plan off) / auto (the planner's) × q none / fixed / float:16 must exit 0, and all of
  one target's greedy runs must give the same ids; they are also compared with the verifier's own
  cloud-only stream (Generate) for the same text prompt;
- sampled: top-k and top-p, plain and pipelined (with the default continuations, and with one),
  and the default edge with the planner's inputs pinned (--plan-inputs), each q in --sampled-q,
  each run twice with the same seed: both runs must exit 0 and give the same ids.

It prints one table row per run and a verdict per target; exit status 1 when a row fails.

    .venv/bin/python bench/option_matrix.py                    # both targets when present
    .venv/bin/python bench/option_matrix.py --targets smollm2 --max-tokens 16
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hybridspec.launch import spawn_verifier

TREE = "budget=8,depth=3,branching=2,width=2"
SHAPES = {"chain": ["--tree", "off"], "tree": ["--tree", TREE], "planner's": []}
# --plan off: what is not given keeps its fixed default; auto: the planner picks what is not given.
WORKS = {"none": ["--plan", "off"], "proactive": ["--plan", "off", "--proactive"],
         "pipeline": ["--plan", "off", "--pipeline"], "auto": []}
PINNED_INPUTS = "rtt_ms=40,draft_ms=5,verify_ms=30,node_ms=2,alpha=0.7"   # the planner chooses once: a seed repeats
GREEDY_QS = ("none", "fixed", "float:16")
SAMPLINGS = {"top-k": ["--temperature", "0.8", "--top-k", "5"], "top-p": ["--temperature", "0.8", "--top-p", "0.9"]}
# --pipeline drafts continuations for up to 8 outcomes by default; with one, a seed pins the output
# whatever the timings (edge_client.options.Speculation.timing_dependent).
SAMPLED_WORKS = {"plain": ["--plan", "off"], "pipeline": ["--plan", "off", "--pipeline"],
                 "pipeline, 1 continuation": ["--plan", "off", "--pipeline", "--continuations", "1"],
                 "auto, pinned inputs": ["--plan-inputs", PINNED_INPUTS]}
PROMPT = "The three primary colours are"


@dataclass
class Row:
    target: str
    kind: str                      # greedy | sampled
    options: str                   # the edge options that vary
    rc: int
    wall_s: float
    ids: list[int] = field(default_factory=list)
    error: str = ""
    verdict: str = ""              # filled by the checks

    def line(self) -> str:
        return (f"| {self.target} | {self.kind} | {self.options} | {self.rc} | {len(self.ids)} | "
                f"{self.wall_s:.1f} | {self.verdict} |")


def models_dir() -> Path:
    return Path(os.environ.get("HYBRIDSPEC_MODELS", "models"))


def target_path(name: str) -> Path | None:
    if name == "smollm2":
        from llama_runtime import bundled_model_path
        return bundled_model_path("smollm2")
    path = models_dir() / "gemma-3-270m-q4_k_m.gguf"
    return path if path.is_file() else None


def edge(address: str, draft: Path, max_tokens: int, extra: list[str], timeout_s: float) -> tuple[int, float, dict, str]:
    """One `edge-client generate --json`: (exit status, wall seconds, its stats, stderr's last line)."""
    cmd = [sys.executable, "-m", "edge_client", "generate", "--server", address, "--draft", str(draft),
           "--threads", "1", "--max-tokens", str(max_tokens), "--prompt", PROMPT, "--json", *extra]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return 124, time.perf_counter() - t0, {}, f"timed out after {timeout_s:.0f} s"
    wall = time.perf_counter() - t0
    stats = {}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            stats = json.loads(line)
            break
    err = done.stderr.strip().splitlines()
    return done.returncode, wall, stats, (err[-1] if err else "")


async def cloud_only(address: str, max_tokens: int) -> list[int]:
    """The verifier's own greedy stream for PROMPT (it tokenizes the text for its target)."""
    import grpc
    from spec_core.proto import verifier_pb2 as pb, verifier_pb2_grpc as pb_grpc
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.VerifierStub(ch)
        req = pb.GenerateRequest(prompt_text=PROMPT, sampling=pb.SamplingParams(temperature=0,
                                                                                max_new_tokens=max_tokens))
        ids: list[int] = []
        async for chunk in stub.Generate(req, timeout=600):
            ids.extend(chunk.token_ids)
        return ids


def run_target(name: str, path: Path, draft: Path, args) -> list[Row]:
    verifier = spawn_verifier(["--model", str(path), "--threads", "1", "--n-ctx", "1024"])
    rows: list[Row] = []

    def one(kind: str, label: str, extra: list[str]) -> Row:
        rc, wall, stats, err = edge(verifier.address, draft, args.max_tokens, extra, args.timeout)
        row = Row(name, kind, label, rc, wall, stats.get("token_ids", []), "" if rc == 0 else err)
        rows.append(row)
        print(f"  {name} {kind} {label}: rc {rc}, {len(row.ids)} ids, {wall:.1f} s {row.error}", file=sys.stderr,
              flush=True)
        return row

    try:
        reference = asyncio.run(cloud_only(verifier.address, args.max_tokens))
        greedy = [one("greedy", f"{shape} / {work} / q {q}",
                      ["--temperature", "0", *tree, "--q", q, *flags])
                  for (shape, tree), (work, flags), q in itertools.product(SHAPES.items(), WORKS.items(), GREEDY_QS)]
        first = next((r.ids for r in greedy if r.rc == 0), None)
        for r in greedy:
            if r.rc:
                r.verdict = f"FAIL: exit {r.rc}"
            elif r.ids != first:
                r.verdict = "FAIL: other ids than the first greedy run"
            else:
                r.verdict = "pass" if r.ids == reference else "pass (differs from cloud-only)"
        rows.append(Row(name, "cloud-only", "Generate stream", 0, 0.0, reference,
                        verdict="same as greedy runs" if reference == first else "differs from greedy runs"))
        for (sampling, sflags), (work, wflags), q in itertools.product(SAMPLINGS.items(), SAMPLED_WORKS.items(),
                                                                      args.sampled_q):
            extra = [*sflags, *wflags, "--q", q, "--seed", str(args.seed)]
            a = one("sampled", f"{sampling} / {work} / q {q} / run 1", extra)
            b = one("sampled", f"{sampling} / {work} / q {q} / run 2", extra)
            ok = a.rc == b.rc == 0 and a.ids == b.ids and len(a.ids) > 0
            if ok:
                a.verdict = b.verdict = "pass"
            else:
                a.verdict = b.verdict = f"FAIL: exit {a.rc}/{b.rc}" if a.rc or b.rc else "FAIL: same seed, other ids"
    finally:
        verifier.proc.terminate()
        try:
            verifier.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            verifier.proc.kill()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default="smollm2,gemma", help="comma-separated: smollm2, gemma (skipped when absent)")
    p.add_argument("--draft", default=str(models_dir() / "smollm2-draft.gguf"))
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--sampled-q", default="fixed:16:16,float:16", type=lambda s: s.split(","),
                   help="q modes of the sampled runs (comma-separated)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per edge-client run")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    draft = Path(args.draft)
    if not draft.is_file():
        print(f"no draft at {draft}: run scripts/setup.sh", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rows: list[Row] = []
    for name in args.targets.split(","):
        path = target_path(name)
        if path is None:
            print(f"skipping {name}: no model (scripts/setup.sh --with {name})", file=sys.stderr)
            continue
        rows += run_target(name, path, draft, args)
    print("| target | run | options | exit | ids | wall s | verdict |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(r.line())
    failed = [r for r in rows if r.verdict.startswith("FAIL")]
    print(f"\n{len(rows)} rows, {len(failed)} failed, {time.perf_counter() - t0:.0f} s in all")
    for r in failed:
        print(f"  {r.target} {r.kind} {r.options}: {r.verdict} {r.error}")
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

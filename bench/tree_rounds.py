"""Chain vs token tree at equal depth: tokens per round, round trips per token, and where trees pay.
A benchmark, not a test: it prints figures measured side by side in one run.

Part 1, the bundled pair (SmolLM2 target on llama.cpp behind an in-process gRPC verifier, the
default Q4_0 draft on the edge): for each workload (code, chat, creative: the first prompt of
each in edge_client/prompts/eval.jsonl, chat-templated) and T in {0, 0.7} (top-p 0.95), a chain
of depth γ and trees of depth γ with 2γ and 4γ nodes (2 children per node; 1 and 2 frontier
nodes expanded per level). Reports tokens/round, round trips/token, nodes/round, verifier model
ms/round and edge draft ms/round, all measured.

Part 2, the verifier's cost per tree size: one tree pass of n nodes (n = 1..64) on the bundled
target (llama.cpp, the CPU verifier here), median model ms; and the least-squares line.

Part 3, where trees pay: the synthetic pair (tokens/round measured by verifying chains and trees
with spec_core; no network) combined with two verifier cost curves, GPU-like (base 20 ms + 0.05
ms/node, nearly flat) and this CPU's line from part 2, and a draft cost per row from part 1, over
link RTTs. tokens/s = tokens/round ÷ (draft rows × t_row + RTT + verify(nodes)): a model from
measured parts, printed as tree tok/s ÷ chain tok/s.

  PYTHONPATH=. python bench/tree_rounds.py                    # all parts (~5-10 min on 2 cores)
  PYTHONPATH=. python bench/tree_rounds.py --parts 2,3 --max-tokens 32
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from importlib import resources
from pathlib import Path

import numpy as np

from hybridspec.machine import announce

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORKLOADS = ("code", "chat", "creative")


def first_prompts() -> dict[str, str]:
    rows = [json.loads(line) for line in resources.files("edge_client").joinpath("prompts/eval.jsonl")
            .read_text().splitlines() if line.strip()]
    return {w: next(r["prompt"] for r in rows if r["category"] == w) for w in WORKLOADS}


def shapes(gamma: int) -> dict[str, str]:
    return {"chain": "off",
            f"tree {2 * gamma} nodes": f"budget={2 * gamma},depth={gamma},branching=2,width=1",
            f"tree {4 * gamma} nodes": f"budget={4 * gamma},depth={gamma},branching=2,width=2"}


async def part1(args) -> list[dict]:
    from cloud_verifier.backends.llama_cpp import LlamaCppBackend
    from cloud_verifier.engine import Limits
    from cloud_verifier.server import VerifierServer
    from edge_client.client import EdgeClient
    from edge_client.drafters import DEFAULT_DRAFT, GGUFDrafter
    from edge_client.options import EdgeOptions, Speculation, Transport
    from edge_client.text import render_chat
    from llama_runtime import bundled_model_path
    from spec_core.warping import SamplingSettings

    backend = LlamaCppBackend(str(bundled_model_path()), n_ctx=1024, n_threads=args.threads)
    drafter = GGUFDrafter(str(args.draft or DEFAULT_DRAFT), n_threads=args.threads, n_ctx=1024, max_tree_nodes=64)
    rows = []
    try:
        async with VerifierServer(backend, "127.0.0.1", 0, Limits(max_tree_nodes=64)) as server:
            for workload, prompt in first_prompts().items():
                ids = render_chat(drafter.model, prompt)
                for temperature in (0.0, 0.7):
                    for name, tree in shapes(args.gamma).items():
                        options = EdgeOptions(Transport(f"127.0.0.1:{server.port}"),
                                              Speculation(plan="off", gamma=args.gamma, tree=tree))
                        async with EdgeClient(options, drafter, drafter.model) as c:
                            gen = c.generate(ids, SamplingSettings(temperature=temperature, top_p=0.95,
                                                                   max_new_tokens=args.max_tokens, seed=1,
                                                                   ignore_eos=True))
                            await gen.text()
                        st = gen.stats
                        rows.append({"workload": workload, "T": temperature, "shape": name, "tokens": st.tokens,
                                     "rounds": st.rounds, "tokens_per_round": st.tokens_per_round,
                                     "rt_per_token": (st.rounds + st.retries) / max(st.tokens, 1),
                                     "nodes_per_round": st.nodes_per_round,
                                     "model_ms_per_round": 1e3 * st.server_model_s / max(st.rounds, 1),
                                     "draft_ms_per_round": 1e3 * st.draft_s / max(st.rounds, 1)})
                        r = rows[-1]
                        print(f"  {workload:8s} T={temperature:<4} {name:14s} tokens/round {r['tokens_per_round']:.2f}  "
                              f"RT/token {r['rt_per_token']:.3f}  nodes/round {r['nodes_per_round']:.1f}  "
                              f"verify {r['model_ms_per_round']:.1f} ms  draft {r['draft_ms_per_round']:.1f} ms",
                              flush=True)
    finally:
        drafter.close()
        backend.close()
    return rows


def part2(args) -> dict:
    from llama_runtime import GGUFModel, bundled_model_path
    model = GGUFModel(bundled_model_path(), n_threads=args.threads)
    ctx = model.new_context(1024, n_seq_max=65)
    rng = np.random.default_rng(0)
    committed = [int(t) for t in rng.integers(10, 5000, 200)]
    out = {}
    for n in (1, 2, 4, 8, 16, 32, 64):
        # A tree of depth ~4 with n nodes: node i's parent is (i - 2) // 2 style (binary, breadth first).
        parents = [-1 if i < 2 else (i - 2) // 2 for i in range(n)]
        times = []
        for rep in range(args.reps):
            tokens = [int(t) for t in rng.integers(10, 5000, n)]
            t0 = time.perf_counter()
            ctx.tree_logits(committed + [int(rng.integers(10, 5000))], tokens, parents)
            times.append(time.perf_counter() - t0)
            ctx.keep_tree_path([], [])
        out[n] = 1e3 * statistics.median(times)
        print(f"  tree of {n:2d} nodes: {out[n]:.1f} ms per pass (median of {args.reps})", flush=True)
    ctx.close()
    model.close()
    xs, ys = np.array(list(out)), np.array(list(out.values()))
    slope, base = np.polyfit(xs, ys, 1)
    print(f"  least squares: {base:.1f} ms + {slope:.2f} ms per node", flush=True)
    return {"points": out, "base_ms": float(base), "per_node_ms": float(slope)}


def synthetic_tokens_per_round(gamma: int, shape_text: str, noise: float, temperature: float, rounds: int) -> tuple[float, float]:
    """Measured on the synthetic pair with spec_core alone: mean tokens per round and draft rows per round."""
    from spec_core.drafting import QMode, draft_step
    from spec_core.synthetic import synthetic_pair
    from spec_core.tree import ROOT, DraftTree, TreeShape, grow_tree, tree_sampling, verify_tree
    from spec_core.warping import SamplingSettings, processed_probs
    target, draft = synthetic_pair(vocab=64, seed=0, noise=noise, order=2)
    s = SamplingSettings(temperature=temperature, top_p=0.95)
    q = QMode("fixed", 16, 16)
    rng = np.random.default_rng(0)
    committed = [0, 5]
    tokens, rows = 0, 0
    to_probs, encode = tree_sampling(s, q)
    for _ in range(rounds):
        def p_after(ctx):
            return processed_probs(target.logits(ctx), s.temperature, s.top_k, s.top_p)
        if shape_text == "off":
            seq, drafts, qs = list(committed), [], []
            for _ in range(gamma):
                tok, qq = draft_step(draft.logits(seq), s, q, rng)
                drafts.append(tok); qs.append(qq); seq.append(tok)
            p = np.stack([p_after(committed + drafts[:i]) for i in range(gamma + 1)])
            res = verify_tree(p, DraftTree.chain(drafts), qs if all(x is not None for x in qs) else None, rng)
            new = drafts[:res.num_accepted] + [res.next_token]
            rows += gamma
        else:
            def next_probs(nodes, toks, parents, base=list(committed)):
                tree = DraftTree(tuple(toks), tuple(parents))
                return np.stack([to_probs(draft.logits(base + ([] if n == ROOT else [toks[j] for j in tree.path_to(n)])))
                                 for n in nodes])
            grown = grow_tree(next_probs, TreeShape.parse(shape_text), rng, encode)
            tree = grown.tree
            p = np.stack([p_after(committed)] + [p_after(committed + [tree.tokens[j] for j in tree.path_to(i)])
                                                 for i in range(len(tree))])
            res = verify_tree(p, tree, grown.qs, rng)
            new = [tree.tokens[i] for i in res.path] + [res.next_token]
            rows += grown.draft_rows
        committed += new
        tokens += len(new)
    return tokens / rounds, rows / rounds


def part3(args, cpu_curve: dict | None, t_row_ms: float) -> list[dict]:
    gamma = args.gamma
    curves = {"GPU-like (20 ms + 0.05 ms/node)": (20.0, 0.05)}
    if cpu_curve:
        curves[f"this CPU ({cpu_curve['base_ms']:.0f} ms + {cpu_curve['per_node_ms']:.2f} ms/node)"] = (
            cpu_curve["base_ms"], cpu_curve["per_node_ms"])
    rtts = (5, 50, 150, 300, 600)
    out = []
    for noise in (0.5, 1.0):
        for temperature in (0.0, 0.7):
            measured = {name: synthetic_tokens_per_round(gamma, text, noise, temperature, args.synthetic_rounds)
                        for name, text in shapes(gamma).items()}
            print(f"  synthetic noise {noise} T={temperature}: " + ", ".join(
                f"{k} {v[0]:.2f} tokens/round ({v[1]:.1f} draft rows)" for k, v in measured.items()), flush=True)
            for curve, (base, per_node) in curves.items():
                cells = []
                for rtt in rtts:
                    rate = {}
                    for name, (tpr, draft_rows) in measured.items():
                        nodes = gamma if name == "chain" else int(name.split()[1])
                        round_ms = draft_rows * t_row_ms + rtt + base + per_node * nodes
                        rate[name] = tpr / round_ms
                    best = max((k for k in rate if k != "chain"), key=rate.get)
                    cells.append(f"{rate[best] / rate['chain']:.2f} ({best.split()[1]})")
                    out.append({"noise": noise, "T": temperature, "curve": curve, "rtt_ms": rtt,
                                **{f"tok_per_s[{k}]": 1e3 * v for k, v in rate.items()}})
                print(f"    {curve}: best tree tok/s ÷ chain tok/s at RTT {', '.join(map(str, rtts))} ms: "
                      + " | ".join(cells), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="1,2,3")
    ap.add_argument("--gamma", type=int, default=4, help="chain length = tree depth")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--draft", help="draft GGUF (default models/smollm2-draft.gguf)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--synthetic-rounds", type=int, default=300)
    ap.add_argument("--t-row-ms", type=float, default=None, help="draft ms per forward row for part 3 "
                    "(default: measured in part 1, else 15)")
    ap.add_argument("--json", help="also write every figure to this JSON file")
    args = ap.parse_args()
    machine = announce()
    parts = {int(p) for p in args.parts.split(",")}
    result: dict = {}
    if 1 in parts:
        print(f"Part 1: bundled pair, chain vs trees at depth {args.gamma}, {args.max_tokens} tokens per run", flush=True)
        result["part1"] = asyncio.run(part1(args))
        for shape in shapes(args.gamma):
            rs = [r for r in result["part1"] if r["shape"] == shape]
            print(f"  mean over workloads and T, {shape}: tokens/round "
                  f"{statistics.mean(r['tokens_per_round'] for r in rs):.2f}, RT/token "
                  f"{statistics.mean(r['rt_per_token'] for r in rs):.3f}")
    if 2 in parts:
        print("Part 2: the CPU verifier's cost per tree pass (bundled target, llama.cpp)", flush=True)
        result["part2"] = part2(args)
    if 3 in parts:
        t_row = args.t_row_ms
        if t_row is None and "part1" in result:
            chain = [r for r in result["part1"] if r["shape"] == "chain"]
            t_row = statistics.mean(r["draft_ms_per_round"] for r in chain) / args.gamma
        t_row = 15.0 if t_row is None else t_row
        print(f"Part 3: where trees pay (synthetic pair tokens/round; draft {t_row:.1f} ms per row)", flush=True)
        result["part3"] = part3(args, result.get("part2"), t_row)
    if args.json:
        result["machine"] = machine
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

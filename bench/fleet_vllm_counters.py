"""What the vLLM backend computes per round and per tree, from vLLM's own counters (a benchmark).

For each sampling setting (greedy; T = 1 with top-k 20; T = 1 with top-p 0.9; plain T = 1; greedy trees;
trees at T = 1, top-k 20; trees at T = 1, top-p 0.9), each verification path of cloud_verifier/backends/vllm.py that can run it, and
each gamma, a session on a context of --context tokens runs --rounds steady-state rounds (random drafts,
q = none, mostly rejected, so the committed sequence grows by about one a round and the tail after the
last full KV block, r, walks through 1..block_size), and vLLM's own counters (vllm.v1.metrics.reader:
requests, prompt tokens, prompt tokens served from the prefix cache, tokens computed, engine steps) are
read before and after. The path the backend ships for the setting (`VllmBackend.round_path`) is marked
"shipped": true. Beside them: what netsim.fleet.costs.RoundWork charges for the same rounds (the exact r
of each round), and the median time per round, measured side by side in one run.

  paths: per-position  gamma + 1 requests per round (sampled rounds without top-k)
         one-request   one request with prompt logprobs (greedy rounds; sampled rounds with top-k)
         session       one chunk of the session's own request, which keeps its KV (the same settings;
                       cloud_verifier/backends/vllm_sessions.py): counted as one request a round; its
                       rows cross to this process, which decides the round
         session-engine  the same chunk, the round decided in vLLM's worker (vllm_engine_ext.accept_step:
                       one torch accept_pass per engine step); only the verdict crosses
         tree          one request per node and the root (sampled trees)
         tree-leaves   one request per leaf with prompt logprobs (greedy trees; sampled trees with top-k)
         tree-session  one chunk of the session's request per leaf, in turn (every tree setting)
         tree-session-engine  the same chunks, the round decided in vLLM's worker

  .venv-vllm/bin/python bench/fleet_vllm_counters.py                 # SmolLM2-135M dequantized, CPU
  .venv-vllm/bin/python bench/fleet_vllm_counters.py --vllm-arg gpu_memory_utilization=0.3   # on a GPU

Writes --out (JSON) and the same with .md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from hybridspec.machine import announce, summary as machine_summary

ROOT = Path(__file__).resolve().parent.parent
TEXT = ("Speculative decoding lets a small draft model propose several tokens that a large target "
        "model checks in one forward pass. The output has exactly the target's distribution. ")


def tail_after_block(length: int, block: int) -> int:
    """r: committed tokens after the last full block that can be cached (the last token never is)."""
    return length - ((length - 1) // block) * block


# setting -> (SamplingSettings keyword arguments, tree?)
SETTINGS = {"greedy": ({"temperature": 0.0}, False), "top-k": ({"temperature": 1.0, "top_k": 20}, False),
            "top-p": ({"temperature": 1.0, "top_p": 0.9}, False), "sampled": ({"temperature": 1.0}, False),
            "tree": ({"temperature": 0.0}, True), "tree-top-k": ({"temperature": 1.0, "top_k": 20}, True),
            "tree-top-p": ({"temperature": 1.0, "top_p": 0.9}, True)}


# path -> (backend.one_request, backend.sessions, backend.engine_maths) that make round_path take it
PATH_SWITCHES = {"per-position": (False, False, False), "tree": (False, False, False),
                 "one-request": (True, False, False), "tree-leaves": (True, False, False),
                 "session": (True, True, False), "tree-session": (True, True, False),
                 "session-engine": (True, True, True), "tree-session-engine": (True, True, True)}


def set_path(backend, path: str) -> None:
    backend.one_request, backend.sessions, backend.engine_maths = PATH_SWITCHES[path]


def shipped_switches(backend) -> None:
    backend.one_request = backend.sessions = backend.engine_maths = True


def paths_for(backend, setting: str) -> list[tuple[str, bool]]:
    """(path, shipped) for every path the backend can take for this setting: with its switches as
    shipped (one_request, sessions and engine_maths on) and off (the paths every round took before)."""
    from spec_core.warping import SamplingSettings
    kwargs, tree = SETTINGS[setting]
    settings = SamplingSettings(**kwargs)
    out = []
    for switches in ((False, False, False), (True, False, False), (True, True, False), (True, True, True)):
        backend.one_request, backend.sessions, backend.engine_maths = switches
        path = backend.round_path(settings, tree=tree)
        if path not in out:
            out.append(path)
    shipped_switches(backend)
    shipped = backend.round_path(settings, tree=tree)
    return [(p, p == shipped) for p in out]


def run_cell(backend, prompt: list[int], setting: str, path: str, shipped: bool, gamma: int, rounds: int,
             vocab: int, block: int, seed: int) -> dict:
    from netsim.fleet.costs import RoundWork
    from spec_core.tree import DraftTree
    from spec_core.verify import commit_round
    from spec_core.warping import SamplingSettings
    rng = np.random.default_rng(seed)
    kwargs, _ = SETTINGS[setting]
    settings = SamplingSettings(**kwargs)
    set_path(backend, path)
    assert backend.round_path(settings, tree=path.startswith("tree")) == path
    state = backend.new_state()
    committed = list(prompt)
    # A tree: two branches of `gamma` nodes each from the root (2·gamma nodes, 2 leaves).
    parents = tuple([-1] + list(range(gamma - 1)) + [-1] + list(range(gamma, 2 * gamma - 1))) if gamma else ()
    times, predicted = [], 0.0
    before = None
    for k in range(rounds + 1):
        if k == 1:   # the first round prefilled the context: counted from the second on
            before, ran, chunks = backend.engine_counters(), backend.model_tokens(), state.rounds
        drafts = [int(t) for t in rng.integers(3, vocab, gamma)]
        t0 = time.perf_counter()
        if path.startswith("tree"):
            tree = DraftTree(tuple(drafts + [int(t) for t in rng.integers(3, vocab, gamma)]), parents)
            result = backend.verify_tree(state, committed, tree, None, settings, rng).result
            tokens = [tree.tokens[i] for i in result.path] + [result.next_token]
            r = tail_after_block(len(committed), block)
            depths = tree.depths()
            if path == "tree":   # the root's request and a request per node
                work = r + sum(r + d for d in depths)
            elif path == "tree-leaves":   # a request per leaf
                work = sum(r + depths[leaf] for leaf in tree.leaves())
            else:   # a chunk per leaf: its branch and the last committed token (branches leave at the root)
                work = len(tree) + len(tree.leaves())
        else:
            result = backend.verify(state, committed, drafts, None, settings, rng).result
            tokens = commit_round(drafts, result, frozenset(), remaining=10**9, context_left=10**9).tokens
            work = RoundWork("ideal" if path.startswith("session") else path, block).tokens(
                gamma, tail_after_block(len(committed), block))
        dt = time.perf_counter() - t0
        committed.extend(tokens)
        if k >= 1:
            times.append(dt)
            predicted += work
    after = backend.engine_counters()
    d = after - before
    ran, chunks = backend.model_tokens() - ran, state.rounds - chunks
    backend.release(state)
    per = lambda x: x / rounds  # noqa: E731
    shipped_switches(backend)
    return {"setting": setting, "path": path, "shipped": shipped, "gamma": gamma,
            **({"nodes": 2 * gamma} if path.startswith("tree") else {}), "rounds": rounds, "block_size": block,
            "requests_per_round": per(d.requests + chunks), "finished_requests_per_round": per(d.requests),
            "session_chunks_per_round": per(chunks), "prompt_tokens_per_round": per(d.prompt_tokens),
            "cached_tokens_per_round": per(d.cached_prompt_tokens),
            "computed_prompt_tokens_per_round": per(d.prompt_tokens - d.cached_prompt_tokens),
            "computed_tokens_per_round": per(d.computed_tokens), "engine_steps_per_round": per(d.engine_steps),
            "model_tokens_per_round": per(ran) if backend.sessions_supported else None,
            "prefix_cache_hit_share": d.prefix_cache_hits / d.prefix_cache_queries if d.prefix_cache_queries else None,
            "predicted_prompt_tokens_per_round": predicted / rounds,
            "round_median_s": statistics.median(times), "round_min_s": min(times)}


def markdown(result: dict) -> str:
    lines = ["# What the vLLM backend computes per round (vLLM's own counters)", "",
             f"Machine: {result['machine']}. Model: {result['model']}; context {result['context']} tokens; "
             f"{result['rounds']} steady-state rounds per cell; random drafts (q = none), mostly rejected; KV block "
             f"{result['block_size']} tokens. Command: `{result['command']}`.", "",
             "| setting | path | shipped | γ | requests / round | prompt tokens computed / round (vLLM) | "
             "charged by RoundWork | tokens computed / round (incl. sampled) | tokens the model ran / round | "
             "engine steps / round | prefix-cache hit share | round median ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in result["cells"]:
        hit = "–" if c["prefix_cache_hit_share"] is None else f"{100 * c['prefix_cache_hit_share']:.0f}%"
        lines.append(f"| {c['setting']} | {c['path']} | {'**yes**' if c['shipped'] else ''} | {c['gamma']} | "
                     f"{c['requests_per_round']:.2f} | "
                     f"{c['computed_prompt_tokens_per_round']:.1f} | {c['predicted_prompt_tokens_per_round']:.1f} | "
                     f"{c['computed_tokens_per_round']:.1f} | "
                     f"{'–' if c.get('model_tokens_per_round') is None else format(c['model_tokens_per_round'], '.1f')} | "
                     f"{c['engine_steps_per_round']:.2f} | {hit} | "
                     f"{c['round_median_s'] * 1e3:.1f} |")
    lines += ["", "Settings: greedy; top-k: T = 1, top-k 20; top-p: T = 1, top-p 0.9; sampled: T = 1; tree: greedy; "
              "tree-top-k: T = 1, top-k 20; tree-top-p: T = 1, top-p 0.9. Trees: two branches of γ nodes from the root (2γ nodes, 2 leaves); "
              "path tree: one request per node and one for the root; tree-leaves: one request per leaf; tree-session: "
              "one chunk of the session's request per leaf (counted as requests), charged nodes + leaves. "
              "session / tree-session: the rows cross to the frontend, which decides the round; session-engine / "
              "tree-session-engine: the same chunks, the round decided in vLLM's worker (one torch accept_pass per "
              "engine step), only the verdict crosses.",
              "Sampled rounds may add a request for a full processed row (the residual after a rejection whose "
              "free proposal failed); it is counted.",
              "Charged by RoundWork: netsim.fleet.costs.RoundWork(path, block).tokens(γ, r) with each round's own r "
              "(the committed tokens after the last full block), which the fleet's GPU model charges; the session "
              "path is charged as 'ideal' (γ + 1).",
              "Requests / round: vLLM's finished requests plus session chunks (a session's one request finishes "
              "when the session ends; each round is one chunk of it). Tokens the model ran: vLLM's "
              "total_num_scheduled_tokens per step as the model runner was handed them (prompt tokens computed; "
              "the sampled token is not run).", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gammas", default="1,4,8")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=None, help="steady-state rounds per cell (default: the block size)")
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"some of {','.join(SETTINGS)}")
    ap.add_argument("--paths", default=None,
                    help="only cells of these paths (per-position, one-request, session, tree, tree-leaves, tree-session); 'top-k', the "
                         "name earlier versions gave it, is the top-k setting's one-request cell")
    ap.add_argument("--vllm-model", default=None, help="HF folder (default: the bundled SmolLM2 dequantized)")
    ap.add_argument("--vllm-arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default=str(ROOT / "bench" / "fleet" / "vllm_counters.json"))
    args = ap.parse_args()
    machine = announce()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from cloud_verifier.backends.vllm import VllmBackend
    from hybridspec.testing.vllm_model import smollm2_folder
    from llama_runtime import GGUFModel, bundled_model_path
    folder = args.vllm_model or str(smollm2_folder())
    gammas = [int(g) for g in args.gammas.split(",")]
    tok = GGUFModel(str(bundled_model_path()), vocab_only=True)
    base = tok.tokenize(TEXT)
    prompt = (base * (args.context // len(base) + 1))[: args.context]
    engine_args = dict(kv.split("=", 1) for kv in args.vllm_arg)
    backend = VllmBackend(folder, n_ctx=2048, engine_args=engine_args)
    block = int(backend._llm.vllm_config.cache_config.block_size)
    rounds = args.rounds or block
    cells = []
    try:
        wanted = set(args.paths.split(",")) if args.paths else None
        plan = [(s, p, shipped, g) for g in gammas for s in args.settings.split(",")
                for p, shipped in paths_for(backend, s)
                if wanted is None or p in wanted or (s, p) == ("top-k", "one-request") and "top-k" in wanted]
        for seed, (setting, path, shipped, gamma) in enumerate(plan):
            # A context of its own per cell (a different first token), so no cell reads another's cache.
            cell_prompt = [int(3 + seed)] + prompt[1:]
            c = run_cell(backend, cell_prompt, setting, path, shipped, gamma, rounds, backend.info.n_vocab, block, seed)
            cells.append(c)
            print(f"{setting:10s} {path:19s}{' (shipped)' if shipped else ''} gamma={gamma}: "
                  f"{c['requests_per_round']:.2f} requests, "
                  f"{c['computed_prompt_tokens_per_round']:.1f} prompt tokens computed / round "
                  f"(RoundWork {c['predicted_prompt_tokens_per_round']:.1f}), {c['engine_steps_per_round']:.2f} steps, "
                  f"median {c['round_median_s'] * 1e3:.1f} ms", flush=True)
        fallbacks = backend.one_request_fallbacks
    finally:
        backend.close()
    import vllm
    result = {"machine": machine_summary(machine), "vllm": vllm.__version__, "model": Path(folder).name,
              "engine_args": {k: v for k, v in backend.engine_args.items() if k != "model"},
              "context": args.context, "rounds": rounds, "block_size": block, "one_request_fallbacks": fallbacks,
              "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "cells": cells}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {out}, {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

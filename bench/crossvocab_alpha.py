"""Acceptance and re-drafting across tokenizers on the real pair: Gemma 3 270M (target, in-process
verifier on llama.cpp) and SmolLM2-135M (draft), chat prompts, γ = 5, 64 tokens each.

    python bench/crossvocab_alpha.py [--gemma PATH] [--arms spelled,tli] [--temperatures 0,0.7] [--result NAME]

Prints one JSON line per (temperature, arm): α, tokens per round, and the draft tokens rolled back
and re-tokenized per round (DraftView). 'spelled' is the default edge (point-mass drafts spelled in
target tokens beyond TLI); 'tli' switches that off. No timing: the figures are counts.
`--result NAME` also writes them to bench/results/NAME.json (hybridspec.figures) for the pages.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile

PROMPTS = ["Write a Python function that reverses a list.", "Explain why the sky is blue in three sentences.",
           "List the first ten prime numbers, separated by commas."]


async def run(args) -> list[dict]:
    from cloud_verifier.backends.llama_cpp import LlamaCppBackend
    from cloud_verifier.server import VerifierServer
    from edge_client import EdgeClient, crossvocab
    from edge_client.drafters import CrossVocabDrafter, GGUFDrafter
    from edge_client.options import EdgeOptions, Speculation, Transport
    from llama_runtime import bundled_model_path
    from spec_core.warping import SamplingSettings

    backend = LlamaCppBackend(args.gemma, n_ctx=1024, n_threads=2)
    drafter = GGUFDrafter(str(bundled_model_path()), n_threads=1, n_ctx=1024)
    rows = []
    async with VerifierServer(backend, "127.0.0.1", 0) as server:
        options = EdgeOptions(Transport(f"127.0.0.1:{server.port}", deadline_s=120), Speculation(plan="off", gamma=args.gamma))
        async with EdgeClient(options, drafter, drafter.model) as client:
            for t in args.temperatures:
                for arm in args.arms:
                    CrossVocabDrafter.spell_point_masses = arm == "spelled"
                    agg = dict(tokens=0, rounds=0, drafted=0, accepted=0, rejections=0, rolled_back=0, retokenized=0)
                    for i, p in enumerate(PROMPTS):
                        gen = client.generate(crossvocab.Chat.of(p), SamplingSettings(
                            temperature=t, max_new_tokens=args.max_tokens, seed=i, ignore_eos=True))
                        await gen.text()
                        st = gen.stats
                        for k, v in (("tokens", st.tokens), ("rounds", st.rounds), ("drafted", st.drafted),
                                     ("accepted", st.accepted), ("rejections", st.rejections),
                                     ("rolled_back", st.draft_rolled_back), ("retokenized", st.draft_retokenized)):
                            agg[k] += v
                    rows.append(dict(temperature=t, arm=arm,
                                     alpha=round(agg["accepted"] / max(1, agg["accepted"] + agg["rejections"]), 3),
                                     tokens_per_round=round(agg["tokens"] / max(1, agg["rounds"]), 2),
                                     rolled_back_per_round=round(agg["rolled_back"] / max(1, agg["rounds"]), 2),
                                     retokenized_per_round=round(agg["retokenized"] / max(1, agg["rounds"]), 2),
                                     overlap=client.drafter.token_map.describe(), **agg))
    drafter.close()
    backend.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gemma", default=os.environ.get("HYBRIDSPEC_GEMMA"),
                   help="Gemma GGUF (default: the one `scripts/setup.sh --with gemma` installed)")
    p.add_argument("--arms", default="spelled,tli")
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--gamma", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--result", help="also write bench/results/RESULT.json (the figures registry)")
    args = p.parse_args()
    load_start = list(os.getloadavg())
    if not args.gemma:
        from llama_runtime import bundled_model_path
        args.gemma = str(bundled_model_path("gemma"))
    args.arms = args.arms.split(",")
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    os.environ.setdefault("HYBRIDSPEC_CACHE", tempfile.mkdtemp())
    from hybridspec.machine import summary
    print(json.dumps({"machine": summary()}))
    rows = asyncio.run(run(args))
    for row in rows:
        print(json.dumps(row))
    if args.result:
        from hybridspec.figures import Table, write_result
        arms = {"spelled": "point masses spelled in target tokens (default)", "tli": "TLI only"}
        cols = ["T", "drafts", "α", "tokens per round", "draft tokens rolled back per round",
                "re-tokenized per round"]
        table = Table(cols, [[r["temperature"], arms[r["arm"]], r["alpha"], r["tokens_per_round"],
                              r["rolled_back_per_round"], r["retokenized_per_round"]] for r in rows],
                      {"α": "{:.3f}", "tokens per round": "{:.2f}", "draft tokens rolled back per round": "{:.2f}",
                       "re-tokenized per round": "{:.2f}"})
        print(f"wrote {write_result(args.result, tables={'by-arm': table}, load_start=load_start, note=f'Gemma 3 270M target ← SmolLM2-135M draft, {len(PROMPTS)} chat prompts × {args.max_tokens} tokens, γ {args.gamma}; counts, not times')}")


if __name__ == "__main__":
    main()

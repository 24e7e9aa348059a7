"""What the planner chooses from pinned inputs (`--plan-inputs`), per set-up, and what a seeded run
on the synthetic pair then commits.

Each set-up is a link (netsim's profile: its round trip and uplink rate), a verifier curve (flat,
GPU-like: 20 ms + 0.05 ms per node; this CPU's: 50 ms + 6.4 ms per node), a per-token acceptance α,
and drafting at 2 ms per row. For each it prints the plan (edge_client.planner.plan_round on the
pinned estimates: chain or tree and γ, rounds in flight, fused or not), the model's expected tokens
per second for it, and a seeded run of the synthetic pair in this process (the verifier's pass costs
the curve, the drafter 2 ms per row; no link: the plan comes from the pinned inputs, not from the
run): a hash of its token ids and the rounds sent per shape. The choices and the ids are counts, not
timings: they do not depend on the machine's load. The rounds per shape do in part (whether a reply
came back before the next round was drafted).

    PYTHONPATH=. .venv/bin/python bench/plan_choices.py --out results/plan_choices.json
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROFILES = ("lan", "lte", "3g", "geo-sat")
CURVES = {"flat": (20.0, 0.05), "cpu": (50.0, 6.4)}
ALPHAS = (0.5, 0.8)
DRAFT_MS = 2.0
NOISE = {0.5: 1.0, 0.8: 0.3}   # the synthetic draft's noise for a run near that α


def setups():
    from netsim.profiles import PROFILES as NETSIM
    for name in PROFILES:
        p = NETSIM[name]
        rate = next(e.rate_kbit_s for e in p.uplink.effects if hasattr(e, "rate_kbit_s"))
        up_ms_per_kb = 1024 * 8 / rate   # ms per KiB at rate kbit/s
        for curve, (verify_ms, node_ms) in CURVES.items():
            for alpha in ALPHAS:
                yield {"profile": name, "curve": curve, "alpha": alpha,
                       "inputs": f"rtt_ms={p.rtt_ms():g},draft_ms={DRAFT_MS:g},verify_ms={verify_ms:g},"
                                 f"node_ms={node_ms:g},up_ms_per_kb={up_ms_per_kb:.4g},alpha={alpha:g}"}


def choice(inputs: str) -> dict:
    """The pinned plan, in the planner's API of this checkout (plan_round; before it, pinned_choices)."""
    from edge_client.options import Speculation
    spec = Speculation(plan_inputs=inputs)
    try:
        from edge_client.planner import Budget, pinned_estimates, plan_round, plan_rate
    except ImportError:
        from edge_client.planner import pinned_choices
        from spec_core.costmodel import expected_tokens_per_round
        c = pinned_choices(spec)
        x = spec.plan_inputs
        g = c["gamma"]
        round_s = (g * x.draft_ms + x.rtt_ms + x.verify_ms + g * x.node_ms + g * 80 * x.up_ms_per_kb / 1024) / 1e3
        return {"arm": "chain" if c["tree"] == "off" else c["tree"], "gamma": g, "depth": c["window"],
                "fuse": c["fuse"], "ahead": c["proactive"],
                "model_tokens_per_s": round(expected_tokens_per_round(x.alpha, g) / round_s, 2)}
    est = pinned_estimates(spec.plan_inputs)
    plan = plan_round(est, spec, Budget(remaining=10_000))
    return {"arm": plan.arm, "gamma": plan.gamma, "depth": plan.depth, "fuse": plan.fuse, "ahead": plan.ahead,
            "model_tokens_per_s": round(plan_rate(est, plan), 2), "why": plan.why}


async def run(setup: dict, tokens: int, seed: int) -> dict:
    from cloud_verifier.backends.synthetic import SyntheticBackend
    from cloud_verifier.server import VerifierServer
    from edge_client import EdgeClient
    from edge_client.drafters import SyntheticDrafter
    from edge_client.options import EdgeOptions, Speculation, Transport
    from edge_client.text import SyntheticTokenizer
    from spec_core.warping import SamplingSettings
    verify_ms, node_ms = CURVES[setup["curve"]]
    backend = SyntheticBackend(vocab=64, step_ms=verify_ms, per_token_ms=node_ms)
    async with VerifierServer(backend, "127.0.0.1", 0) as server:
        options = EdgeOptions(Transport(f"127.0.0.1:{server.port}"), Speculation(plan_inputs=setup["inputs"]))
        drafter = SyntheticDrafter(64, noise=NOISE[setup["alpha"]], per_token_ms=DRAFT_MS)
        async with EdgeClient(options, drafter, SyntheticTokenizer(64)) as c:
            gen = c.generate([0, 5, 6], SamplingSettings(temperature=0.7, max_new_tokens=tokens, ignore_eos=True,
                                                         seed=seed))
            await gen.text()
    st = gen.stats
    return {"ids_sha1": hashlib.sha1(json.dumps(st.token_ids).encode()).hexdigest()[:12], "tokens": st.tokens,
            "rounds": st.rounds, "shapes": st.shapes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--no-runs", action="store_true", help="only the plans, no seeded runs")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    rows = []
    for s in setups():
        row = {**s, **choice(s["inputs"])}
        if not args.no_runs:
            row["run"] = asyncio.run(run(s, args.tokens, args.seed))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

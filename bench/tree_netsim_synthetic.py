"""The netsim experiment on the synthetic pair with two verifier cost curves: where do trees,
proactive drafting, pipelining, continuations (sent early or fused into the round's own pass) and a
window of rounds in flight pay? A benchmark: it prints the experiment's report per curve.

  GPU-like: 20 ms per pass + 0.05 ms per token or tree node (nearly flat in the node count);
  CPU-like: this machine's measured line for the bundled target (bench/tree_rounds.py part 2,
            50 ms + 6.4 ms per node on the 2-core Zen 4 VM, quiet, 2026-12-02; under load it
            measured 19 ms + 31 ms, which bench/continuations.sh passes to reproduce its table;
            pass your own with --cpu).

  PYTHONPATH=. python bench/tree_netsim_synthetic.py --profiles 3g,geo-sat --workloads chat
  PYTHONPATH=. python bench/tree_netsim_synthetic.py --profiles lan,lte,3g,geo-sat \
      --modes per-token,hybrid,pipeline,continuations,fused,window      # docs/window.md's table
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from hybridspec.machine import announce

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    from netsim.experiment import ExperimentConfig, run_experiment
    from netsim.report import write_all
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", default="lan,3g,geo-sat")
    ap.add_argument("--workloads", default="chat")
    ap.add_argument("--modes", default="cloud-only,cloud-stepwise,per-token,hybrid,tree,proactive,pipeline")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--noise", type=float, default=0.5, help="synthetic draft noise (lower: higher α)")
    ap.add_argument("--draft-ms", type=float, default=2.0, help="synthetic draft cost per row")
    ap.add_argument("--gpu", default="20,0.05", help="GPU-like curve: ms per pass, ms per node")
    ap.add_argument("--cpu", default="50,6.4", help="CPU curve: ms per pass, ms per node")
    ap.add_argument("--curves", default="gpu-like,cpu", help="which of the two curves to run")
    ap.add_argument("--out", default="results/tree_synthetic")
    args = ap.parse_args()
    announce()
    for name, curve in (("gpu-like", args.gpu), ("cpu", args.cpu)):
        if name not in args.curves.split(","):
            continue
        step, per_node = (float(x) for x in curve.split(","))
        cfg = ExperimentConfig(profiles=args.profiles.split(","), modes=args.modes.split(","),
                               out=Path(args.out) / name, workloads=args.workloads.split(","),
                               max_tokens=args.max_tokens, gammas=[args.gamma], synthetic=True,
                               synthetic_alpha_noise=args.noise, synthetic_draft_ms=args.draft_ms,
                               synthetic_step_ms=step, synthetic_per_token_ms=per_node, crossover=False)
        result = asyncio.run(run_experiment(cfg))
        paths = write_all(result, cfg.out)
        print(f"# verifier curve {name}: {step:g} ms per pass + {per_node:g} ms per node\n")
        print(paths["report"].read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

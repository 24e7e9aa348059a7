"""The sweep's table and plots, rendered from its result file (sweep.json) alone.

    python -m netsim.virtual.sweep_report results/sweep/sweep.json [--out DIR]

sweep.md: every cell with its best mode and each mode's tokens/s; how often each mode is best.
tokens_per_s_vs_rtt.png: tokens/s per mode against the round trip, one panel per (α, slope), at the
grid's middle drafting and pass costs. best_mode_map.png: the best mode per cell, one panel per
(α, slope): round trip across, (pass, drafting) down.
"""
from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path


def _values(cells: list[dict], key: str) -> list:
    return sorted({c["cell"][key] for c in cells})


def _middle(values: list):
    return values[len(values) // 2]


def markdown(result: dict) -> str:
    cells = result["cells"]
    labels = list(cells[0]["tokens_per_s"]) if cells else []
    wins = collections.Counter(c["best"] for c in cells)
    lines = ["# Sweep: the synthetic pair on the virtual clock", "",
             f"{len(cells)} cells, {cells[0]['cell']['tokens'] if cells else 0} tokens each, every mode; "
             f"clock: {result['clock']} ({result['cost_table']}); workload {result['workload']} (T 0.7, top-p 0.95).",
             "", "## How often each mode is best", "", "| mode | cells where it is best |", "|---|---|"]
    lines += [f"| {m} | {wins.get(m, 0)} |" for m in sorted(labels, key=lambda m: -wins.get(m, 0))]
    lines += ["", "## Every cell (tokens/s)", "",
              "| RTT ms | draft ms/row | pass ms | slope | α | noise | best | " + " | ".join(labels) + " |",
              "|---|---|---|---|---|---|---|" + "---|" * len(labels)]
    for c in cells:
        k = c["cell"]
        lines.append(f"| {k['rtt_ms']:g} | {k['draft_ms']:g} | {k['pass_ms']:g} | {k['slope']:.0%} | {k['alpha']:g} | "
                     f"{c['noise']:g} | {c['best']} | "
                     + " | ".join(f"{c['tokens_per_s'].get(m, 0):.1f}" for m in labels) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict, out: Path) -> dict[str, Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    cells = result["cells"]
    if not cells:
        return {}
    modes = list(cells[0]["tokens_per_s"])
    alphas, slopes, rtts = _values(cells, "alpha"), _values(cells, "slope"), _values(cells, "rtt_ms")
    drafts, passes = _values(cells, "draft_ms"), _values(cells, "pass_ms")
    draft_mid, pass_mid = _middle(drafts), _middle(passes)
    paths = {}
    palette = plt.get_cmap("tab20").colors[::2] + plt.get_cmap("tab20").colors[1::2]   # 20 distinct, the dark ones first

    fig, axes = plt.subplots(len(alphas), len(slopes), figsize=(6 * len(slopes), 4 * len(alphas)), squeeze=False)
    for i, alpha in enumerate(alphas):
        for j, slope in enumerate(slopes):
            ax = axes[i][j]
            chosen = sorted((c for c in cells if c["cell"]["alpha"] == alpha and c["cell"]["slope"] == slope
                             and c["cell"]["draft_ms"] == draft_mid and c["cell"]["pass_ms"] == pass_mid),
                            key=lambda c: c["cell"]["rtt_ms"])
            for k, m in enumerate(modes):
                ax.plot([c["cell"]["rtt_ms"] for c in chosen], [c["tokens_per_s"][m] for c in chosen], marker="o",
                        label=m, color=palette[k % len(palette)], linestyle=("-", "--", ":")[k // 10 % 3])
            ax.set_xscale("log")
            ax.set_title(f"α {alpha:g}, pass {pass_mid:g} ms + {slope:.0%}/token, draft {draft_mid:g} ms/row",
                         fontsize=9)
            ax.set_xlabel("round trip (ms)")
            ax.set_ylabel("tokens/s")
    axes[0][-1].legend(fontsize=7, loc="upper right")
    fig.suptitle("Tokens/s per mode against the round trip (synthetic pair, virtual clock)")
    fig.tight_layout()
    paths["rtt"] = out / "tokens_per_s_vs_rtt.png"
    fig.savefig(paths["rtt"], dpi=110)
    plt.close(fig)

    colours = ListedColormap(palette[: len(modes)])
    rows = [(p, d) for p in passes for d in drafts]
    fig, axes = plt.subplots(len(alphas), len(slopes), figsize=(5.5 * len(slopes), 0.45 * len(rows) * len(alphas) + 2),
                             squeeze=False)
    by = {(c["cell"]["alpha"], c["cell"]["slope"], c["cell"]["pass_ms"], c["cell"]["draft_ms"], c["cell"]["rtt_ms"]): c
          for c in cells}
    for i, alpha in enumerate(alphas):
        for j, slope in enumerate(slopes):
            ax = axes[i][j]
            grid = [[modes.index(by[(alpha, slope, p, d, r)]["best"]) if (alpha, slope, p, d, r) in by else -1
                     for r in rtts] for p, d in rows]
            ax.imshow(grid, cmap=colours, vmin=0, vmax=len(modes) - 1, aspect="auto")
            for y, row in enumerate(grid):
                for x, k in enumerate(row):
                    if k >= 0:
                        ax.text(x, y, modes[k].replace("-g4", ""), ha="center", va="center", fontsize=6)
            ax.set_xticks(range(len(rtts)), [f"{r:g}" for r in rtts])
            ax.set_yticks(range(len(rows)), [f"pass {p:g} / draft {d:g}" for p, d in rows], fontsize=7)
            ax.set_xlabel("round trip (ms)")
            ax.set_title(f"best mode: α {alpha:g}, slope {slope:.0%} of the pass's base", fontsize=9)
    fig.tight_layout()
    paths["map"] = out / "best_mode_map.png"
    fig.savefig(paths["map"], dpi=110)
    plt.close(fig)
    return paths


def write_all(result: dict, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "sweep.json", "md": out / "sweep.md"}
    paths["json"].write_text(json.dumps(result, indent=1) + "\n")
    paths["md"].write_text(markdown(result))
    paths.update(plot(result, out))
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result", help="sweep.json")
    parser.add_argument("--out", help="folder for sweep.md and the plots (default: the result's)")
    args = parser.parse_args(argv)
    path = Path(args.result)
    result = json.loads(path.read_text())
    out = Path(args.out) if args.out else path.parent
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.md").write_text(markdown(result))
    for p in plot(result, out).values():
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

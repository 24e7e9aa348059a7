"""Draw the per-GPU break-even (bench/results/gpu-breakeven.json) with matplotlib.

One panel per GPU, target and context: the device's drafting time per token (x, log scale) against the
device draft's mean acceptance length at 4 drafts (τ4, y); the line where the hybrid's tokens/s per GPU
equal the best of vLLM's own proposers (above it the hybrid gets more); the devices of the table as
vertical lines and the drafts measured as horizontal ones; at each device × draft crossing, its own
ratio's verdict (win / tie within the model's error / loss).

  python bench/plot_breakeven.py                        # -> docs/img/gpu-breakeven.png
  python bench/plot_breakeven.py --result bench/results/gpu-breakeven.json --out /tmp/b.png

`render(result, out)` is the hook for the docs build (it reads nothing else).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RESULT = ROOT / "bench" / "results" / "gpu-breakeven.json"
DEFAULT_OUT = ROOT / "docs" / "img" / "gpu-breakeven.png"
VERDICT_STYLE = {"win": ("o", "tab:green"), "tie": ("s", "tab:orange"), "loss": ("x", "tab:red")}


def _rows(result: dict, table: str) -> list[dict]:
    t = result["tables"][table]
    return [dict(zip(t["columns"], row)) for row in t["rows"]]


def render(result: dict, out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines, marks, devices = _rows(result, "lines"), _rows(result, "marks"), _rows(result, "devices")
    panels = sorted(dict.fromkeys((r["GPU"], r["target"], r["context"], r["link"]) for r in lines),
                    key=lambda p: (p[0], float(p[1].split("b")[0]), int(str(p[2]).rstrip("k")), p[3]))
    cols = 4
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows), squeeze=False, sharey=True)
    drafts = {}
    for m in marks:
        drafts.setdefault(m["draft"], m["τ4"])
    for ax, (gpu, target, context, link) in zip(axes.flat, panels):
        ls = [r for r in lines if (r["GPU"], r["target"], r["context"], r["link"]) == (gpu, target, context, link)]
        xs = [r["drafting ms/token"] for r in ls]
        if all(r["break-even τ4"] == "no session fits" for r in ls):
            ax.text(0.5, 0.5, "no session's KV fits\nbeside the weights", transform=ax.transAxes, ha="center",
                    va="center", fontsize=9)
            ax.set_title(f"{gpu.upper()}, {target}, {context}, {link}", fontsize=9)
            ax.set_xscale("log")
            ax.set_xlim(min(r["drafting ms/token"] for r in ls), max(r["drafting ms/token"] for r in ls))
            ax.set_ylim(1.0, 5.0)
            continue
        ys = [r["break-even τ4"] if isinstance(r["break-even τ4"], (int, float)) else None for r in ls]
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "k-", lw=2, label="hybrid = best vLLM (ratio 1)")
            ax.fill_between([p[0] for p in pts], [p[1] for p in pts], 5.0, color="tab:green", alpha=0.08)
        never = [x for x, y in zip(xs, ys) if y is None]
        if never:
            ax.axvspan(min(never), max(xs), color="tab:red", alpha=0.06, label="no τ4 ≤ 4.9 pays")
        for d in devices:
            ax.axvline(d["ms/token (short context)"], color="tab:blue", ls="--", lw=0.8)
            ax.text(d["ms/token (short context)"], 4.95, d["device"], rotation=90, va="top", ha="right", fontsize=7,
                    color="tab:blue")
        for i, (name, tau) in enumerate(sorted(drafts.items(), key=lambda kv: kv[1])):
            ax.axhline(tau, color="grey", ls=":", lw=0.8)
            ax.text(xs[0] if i % 2 == 0 else xs[-1], tau, name, va="bottom" if i % 2 == 0 else "top",
                    ha="left" if i % 2 == 0 else "right", fontsize=6, color="grey")
        for m in (m for m in marks if (m["GPU"], m["target"], m["context"], m["link"]) == (gpu, target, context, link)):
            marker, color = VERDICT_STYLE[m["verdict"]]
            ax.plot(m["ms/token"], m["τ4"], marker, color=color, ms=5)
        ax.set_xscale("log")
        ax.set_xlim(min(xs), max(xs))
        ax.set_ylim(1.0, 5.0)
        ax.set_title(f"{gpu.upper()}, {target}, {context}, {link}", fontsize=9)
        ax.set_xlabel("device drafting ms/token (short context)", fontsize=8)
        ax.set_ylabel("device draft τ4", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles = [plt.Line2D([], [], color="k", lw=2, label="ratio 1: hybrid = best of vLLM's proposers"),
               *[plt.Line2D([], [], ls="", marker=mk, color=c, label=f"measured device × draft: {v}")
                 for v, (mk, c) in VERDICT_STYLE.items()]]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle("Per GPU: the hybrid pays above the line (a model, not a GPU measurement; "
                 "bench/results/gpu-breakeven.json)", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--result", default=str(DEFAULT_RESULT))
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    print(f"wrote {render(json.loads(Path(args.result).read_text()), Path(args.out))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The pictures on the pages, each drawn from result files of the registry (bench/results/).

    python -m hybridspec.plots            # draw every picture into docs/img/
    python -m hybridspec.plots --check    # exit 1 when a picture is older than a result file it is drawn from
    python -m hybridspec.plots --list     # each picture, its result files and the pages that show it

Each picture is an SVG in docs/img/ whose metadata (its `dc:description`) records the SHA-256 of every
result file it was drawn from, so a test can tell a picture drawn from an older run (file times are
not kept by git; content hashes are). A page shows a picture with the command that draws it on the
line below (tests/test_docs_pictures.py). A wall-clock result recorded on a busy machine is drawn
with "busy" and its load in the picture's footnote, as a page marks such a figure.

Adding a picture: write `draw(fig, results) -> None` and add a `Picture` to PICTURES with the result
files it reads. The tokens/s-against-RTT picture takes any result file with a table of profile (or
`RTT ms`), mode and tok/s columns (the wall-clock experiment, `bench/headline.py`, or a virtual-clock
run); the per-GPU picture takes a table with a `hybrid ÷ best vLLM spec` column, or its own `draw`.

matplotlib (a dependency of the package) draws them; the SVGs keep their text as text and carry no
date, so drawing twice from the same files gives the same bytes.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from hybridspec import figures as _figures

ROOT = Path(__file__).resolve().parents[1]
IMG = ROOT / "docs" / "img"
COMMAND = "python -m hybridspec.plots"
_META = re.compile(r"<dc:description>(.*?)</dc:description>", re.S)


@dataclass(frozen=True)
class Picture:
    name: str                                   # docs/img/<name>.svg
    title: str
    sources: tuple[str, ...]                    # result names in bench/results/ it is drawn from
    draw: Callable                              # draw(fig, {name: Result}) -> None
    size: tuple[float, float] = (7.5, 4.2)
    pages: tuple[str, ...] = field(default=())  # where it is shown (for --list)

    @property
    def path(self) -> Path:
        return IMG / f"{self.name}.svg"


def result_hash(name: str, results_dir: Path | None = None) -> str:
    base = _figures.RESULTS if results_dir is None else results_dir
    return hashlib.sha256((base / f"{name}.json").read_bytes()).hexdigest()


def recorded(path: Path) -> dict:
    """What a picture's metadata records: {"sources": {result: sha256}, "command": ...}; {} if none."""
    try:
        m = _META.search(path.read_text(encoding="utf-8"))
    except OSError:
        return {}
    if not m:
        return {}
    text = m.group(1).replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">")
    try:
        return json.loads(text)
    except ValueError:
        return {}


def stale(picture: Picture, results_dir: Path | None = None) -> list[str]:
    """Why a picture is out of date: missing, or drawn from a result file whose content has changed."""
    where = picture.path.relative_to(ROOT) if picture.path.is_relative_to(ROOT) else picture.path
    if not picture.path.is_file():
        return [f"{where} is missing"]
    have = recorded(picture.path).get("sources", {})
    out = []
    for name in picture.sources:
        if have.get(name) != result_hash(name, results_dir):
            out.append(f"{where} is older than bench/results/{name}.json")
    if set(have) != set(picture.sources):
        out.append(f"{where} records sources {sorted(have)}, not {list(picture.sources)}")
    return out


# --- Drawing helpers -------------------------------------------------------------------------------

COLOURS = {"cloud-only": "#4c72b0", "per-token": "#dd8452", "hybrid": "#55a868", "auto": "#8172b3",
           "edge-only": "#937860"}


def _colour(mode: str) -> str:
    return next((c for k, c in COLOURS.items() if mode.startswith(k)), "#333333")


def footnote(fig, results: dict) -> None:
    """Where the data came from, under the plot: result file, date, machine's load; busy when busy."""
    parts = []
    for name, r in results.items():
        load = r.busy_load()
        clock = {"wall": "", "virtual": ", virtual clock", "model": ", a model, not a measurement"}.get(r.clock, "")
        busy = f", busy machine (load {load:.1f} per core): tokens/s noisy" if load is not None else ""
        parts.append(f"bench/results/{name}.json ({r.date}{clock}{busy})")
    fig.text(0.01, 0.01, "Data: " + "; ".join(parts) + f". Drawn by {COMMAND}.", fontsize=6.5, color="#555555",
             ha="left", va="bottom", wrap=True)


def _table_rows(table) -> list[dict]:
    return [dict(zip(table.columns, row)) for row in table.rows]


def _rtt_of(row: dict) -> float:
    for key in ("RTT ms", "rtt ms", "rtt_ms"):
        if key in row:
            return float(row[key])
    from netsim.profiles import PROFILES     # a profile's RTT as netsim defines it
    return float(PROFILES[row["profile"]].rtt_ms())


# --- The pictures ----------------------------------------------------------------------------------

def draw_system(fig, results: dict) -> None:
    """Edge, link, verifier, and what one round carries each way."""
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch
    ax = fig.add_axes((0, 0.04, 1, 0.96))
    ax.set_xlim(0, 100)
    ax.set_ylim(0, 56)
    ax.axis("off")

    def box(x, y, w, h, title, lines, colour):
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.6,rounding_size=2", fc=colour, ec="#333333"))
        ax.text(x + w / 2, y + h - 3, title, ha="center", va="top", fontsize=10.5, weight="bold")
        for i, line in enumerate(lines):
            ax.text(x + 1.5, y + h - 9 - i * 4.2, line, ha="left", va="top", fontsize=7.6)

    box(2, 10, 27, 40, "Edge (device CPU)",
        ["small draft model (GGUF,", "llama.cpp)", "drafts γ tokens from q,", "the draft's distribution,",
         "encoded as shipped", "holds the committed text;", "the planner picks each", "round's shape"], "#e8f1e4")
    box(71, 10, 27, 40, "Verifier (cloud)",
        ["large target model", "(llama.cpp on CPU, vLLM", "on a GPU)", "one pass over γ + 1 rows", "keeps a prefix by",
         "rejection sampling, adds", "a corrected or bonus token", "batches many edges' rounds"], "#e4ecf7")
    ax.add_patch(FancyBboxPatch((36, 21), 28, 18, boxstyle="round,pad=0.6,rounding_size=2", fc="#f7f0e1",
                                ec="#333333", ls="--"))
    ax.text(50, 37, "Link (gRPC over TCP)", ha="center", va="top", fontsize=9.5, weight="bold")
    for i, line in enumerate(["round trip, jitter, bandwidth,", "loss, outages", "netsim's proxy simulates them"]):
        ax.text(50, 32 - i * 3.8, line, ha="center", va="top", fontsize=7.4)
    up = FancyArrowPatch((30, 44), (70, 44), arrowstyle="-|>", mutation_scale=14, lw=1.4, color="#2b6a2b")
    down = FancyArrowPatch((70, 15), (30, 15), arrowstyle="-|>", mutation_scale=14, lw=1.4, color="#2b4f8a")
    ax.add_patch(up)
    ax.add_patch(down)
    ax.text(50, 53, "Verify request (one RPC per round)", ha="center", va="top", fontsize=8.5, weight="bold",
            color="#2b6a2b")
    ax.text(50, 49.3, "session, round, committed length; γ draft ids + q\n(first round: prompt and sampling settings)",
            ha="center", va="top", fontsize=7.2)
    ax.text(50, 12.6, "reply: accepted count, the corrected or bonus token,\nnew committed length, finished and why, "
            "server timings", ha="center", va="top", fontsize=7.2)
    ax.text(50, 3.4, "Output: exactly the target's distribution (every temperature, top-k, top-p).",
            ha="center", va="center", fontsize=8, style="italic")


def draw_tokens_vs_rtt(source: str, table: str, subtitle: str) -> Callable:
    """tokens/s against the link's round trip, one line per mode, from `source`'s `table` (columns
    profile or RTT ms, mode, tok/s)."""
    def draw(fig, results: dict) -> None:
        rows = _table_rows(results[source].tables[table])
        ax = fig.add_axes((0.09, 0.2, 0.62, 0.7))
        modes = list(dict.fromkeys(r["mode"] for r in rows))
        for mode in modes:
            pts = sorted((_rtt_of(r), r["tok/s"]) for r in rows if r["mode"] == mode)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode, color=_colour(mode))
        ticks = sorted({(_rtt_of(r), r.get("profile", "")) for r in rows})
        ax.set_xlim(left=0)
        ax.set_xticks([t[0] for t in ticks], [f"{name}\n{rtt:g} ms" if name else f"{rtt:g} ms" for rtt, name in ticks])
        ax.minorticks_off()
        ax.set_xlabel("link round trip")
        ax.set_ylabel("committed tokens/s")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.set_title(subtitle, fontsize=9, loc="left")
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
        footnote(fig, {source: results[source]})
    return draw


def draw_crossover(source: str = "headline", table: str = "crossover") -> Callable:
    """The crossover map: hybrid ÷ cloud-only tokens/s over the cloud's time per pass × the link's RTT."""
    def draw(fig, results: dict) -> None:
        import numpy as np
        from matplotlib.colors import TwoSlopeNorm
        t = results[source].tables[table]
        rtts = [float(c) for c in t.columns[1:]]
        steps = [str(r[0]) for r in t.rows]
        grid = np.array([[np.nan if v is None else float(v) for v in r[1:]] for r in t.rows])
        ax = fig.add_axes((0.12, 0.2, 0.66, 0.68))
        im = ax.imshow(grid, cmap="RdBu", norm=TwoSlopeNorm(vcenter=1.0, vmin=min(np.nanmin(grid), 0.5),
                                                             vmax=max(np.nanmax(grid), 1.5)), aspect="auto",
                       origin="lower")
        for i in range(grid.shape[0]):
            for j in range(grid.shape[1]):
                if not np.isnan(grid[i, j]):
                    v = grid[i, j]
                    ax.text(j, i, f"{v:.2f}×", ha="center", va="center", fontsize=8,
                            color="white" if v > 1.8 or v < 0.4 else "black")
        ax.set_xticks(range(len(rtts)), [f"{r:g}" for r in rtts])
        ax.set_yticks(range(len(steps)), steps)
        ax.set_xlabel("link round trip (ms)")
        ax.set_ylabel("cloud's time per target pass (ms)")
        ax.set_title("hybrid (adaptive γ) ÷ cloud-only tokens/s, synthetic pair: blue > 1, the hybrid is faster",
                     fontsize=8.5)
        fig.colorbar(im, ax=ax, fraction=0.05, pad=0.03)
        footnote(fig, {source: results[source]})
    return draw


def draw_many_edges(source: str = "many-edges-synthetic", table: str = "lan") -> Callable:
    """tokens/s and p95 time per output token against edges: hybrid and cloud-only on the same
    verifier, batching (solid) and serial (dashed)."""
    def draw(fig, results: dict) -> None:
        rows = _table_rows(results[source].tables[table])
        left = fig.add_axes((0.08, 0.2, 0.38, 0.68))
        right = fig.add_axes((0.58, 0.2, 0.38, 0.68))
        for verifier, style in (("batched", "-"), ("serial", "--")):
            for mode in ("hybrid", "cloud-only"):
                pts = sorted((r["edges"], r["tok/s"], r["p95 TPOT ms"]) for r in rows
                             if r["verifier"] == verifier and r["mode"] == mode)
                if not pts:
                    continue
                kw = dict(marker="o", ls=style, color=_colour(mode), label=f"{mode}, {verifier} verifier")
                left.plot([p[0] for p in pts], [p[1] for p in pts], **kw)
                right.plot([p[0] for p in pts], [p[2] for p in pts], **kw)
        edges = sorted({r["edges"] for r in rows})
        for ax, label in ((left, "committed tokens/s, all edges"), (right, "p95 time per output token (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(edges, [str(e) for e in edges])
            ax.minorticks_off()
            ax.set_yscale("log")
            ax.set_xlabel("edges")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3, which="both")
        left.legend(fontsize=7, frameon=False)
        fig.suptitle("Many edges on one verifier (synthetic pair, flat-cost verifier, lan)", fontsize=9.5)
        footnote(fig, {source: results[source]})
    return draw


def draw_gpu_map(source: str = "gpu-regime", tables: tuple[str, ...] = ("h100", "h200"),
                 column: str = "hybrid ÷ best vLLM spec") -> Callable:
    """Per GPU: the hybrid's tokens/s per GPU over the best of vLLM's own speculative decoding, per
    cell (target × context rows, link × α columns), one panel per GPU; 1.0 is the break-even."""
    def draw(fig, results: dict) -> None:
        import matplotlib
        import numpy as np
        from matplotlib.colors import TwoSlopeNorm
        for k, key in enumerate(tables):
            rows = _table_rows(results[source].tables[key])
            ys = list(dict.fromkeys((r["target"], r["context"]) for r in rows))
            col = "α" if "α" in rows[0] else "device draft"   # older maps: one α for both sides
            xs = list(dict.fromkeys((r["link"], r[col]) for r in rows))
            grid = np.full((len(ys), len(xs)), np.nan)
            for r in rows:
                v = r[column]
                grid[ys.index((r["target"], r["context"])), xs.index((r["link"], r[col]))] = (
                    float("nan") if v is None else float(v))
            ax = fig.add_axes((0.1 + k * 0.42, 0.22, 0.36, 0.62))
            cmap = matplotlib.colormaps["RdBu"].copy()
            cmap.set_bad("#dddddd")
            shown = np.ma.masked_where(~(grid > 0), grid)       # no hybrid session (0) or no cell (nan): grey
            im = ax.imshow(shown, cmap=cmap, norm=TwoSlopeNorm(vcenter=1.0, vmin=0.0, vmax=1.5), aspect="auto")
            for i in range(len(ys)):
                for j in range(len(xs)):
                    v = grid[i, j]
                    ax.text(j, i, "n/a" if np.isnan(v) else "—" if v == 0 else f"{v:.2f}", ha="center",
                            va="center", fontsize=5.5)
            ax.set_xticks(range(len(xs)), [f"{link} {a:g}" if isinstance(a, (int, float)) else f"{link} {a}"
                                           for link, a in xs], rotation=90, fontsize=6)
            ax.set_yticks(range(len(ys)), [f"{t} {c}" for t, c in ys] if k == 0 else [], fontsize=6.5)
            ax.set_title(key.upper(), fontsize=9)
        fig.colorbar(im, cax=fig.add_axes((0.92, 0.22, 0.015, 0.62)))
        fig.suptitle("Per GPU: the hybrid's tokens/s over the best of vLLM's own speculative decoding\n"
                     "blue > 1: the hybrid serves more per GPU; —: no hybrid session meets the SLO; "
                     "n/a: not even one session fits in KV", fontsize=8.5)
        footnote(fig, {source: results[source]})
    return draw


VERDICT_STYLE = {"win": ("o", "tab:green"), "tie": ("s", "tab:orange"), "loss": ("x", "tab:red")}


def draw_breakeven(source: str = "gpu-breakeven") -> Callable:
    """Per GPU, target and context (one panel each): the device's drafting time per token (x, log
    scale) against its draft's mean acceptance length at 4 drafts (τ4, y); the line where the hybrid's
    tokens/s per GPU equal the best of vLLM's own proposers (above it the hybrid gets more); the devices
    of the table as vertical lines, the drafts measured as horizontal ones, and at each device × draft
    crossing its own ratio's verdict (win / tie within the model's error / loss)."""
    def draw(fig, results: dict) -> None:
        import matplotlib.pyplot as plt
        t = results[source].tables
        lines, marks, devices = _table_rows(t["lines"]), _table_rows(t["marks"]), _table_rows(t["devices"])
        panels = sorted(dict.fromkeys((r["GPU"], r["target"], r["context"], r["link"]) for r in lines),
                        key=lambda p: (p[0], float(p[1].split("b")[0]), int(str(p[2]).rstrip("k")), p[3]))
        cols = 4
        rows = (len(panels) + cols - 1) // cols
        fig.set_size_inches(4.2 * cols, 3.6 * rows)
        axes = fig.subplots(rows, cols, squeeze=False, sharey=True)
        drafts: dict = {}
        for m in marks:
            drafts.setdefault(m["draft"], m["τ4"])
        for ax, (gpu, target, context, link) in zip(axes.flat, panels):
            ls = [r for r in lines if (r["GPU"], r["target"], r["context"], r["link"]) == (gpu, target, context, link)]
            xs = [r["drafting ms/token"] for r in ls]
            ax.set_xscale("log")
            ax.set_xlim(min(xs), max(xs))
            ax.set_ylim(1.0, 5.0)
            ax.set_title(f"{gpu.upper()}, {target}, {context}, {link}", fontsize=9)
            if all(r["break-even τ4"] == "no session fits" for r in ls):
                ax.text(0.5, 0.5, "no session's KV fits\nbeside the weights", transform=ax.transAxes, ha="center",
                        va="center", fontsize=9)
                continue
            ys = [r["break-even τ4"] if isinstance(r["break-even τ4"], (int, float)) else None for r in ls]
            pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "k-", lw=2)
                ax.fill_between([p[0] for p in pts], [p[1] for p in pts], 5.0, color="tab:green", alpha=0.08)
            never = [x for x, y in zip(xs, ys) if y is None]
            if never:
                ax.axvspan(min(never), max(xs), color="tab:red", alpha=0.06)
            for d in devices:
                ax.axvline(d["ms/token (short context)"], color="tab:blue", ls="--", lw=0.8)
                ax.text(d["ms/token (short context)"], 4.95, d["device"], rotation=90, va="top", ha="right",
                        fontsize=7, color="tab:blue")
            for i, (name, tau) in enumerate(sorted(drafts.items(), key=lambda kv: kv[1])):
                ax.axhline(tau, color="grey", ls=":", lw=0.8)
                ax.text(xs[0] if i % 2 == 0 else xs[-1], tau, name, va="bottom" if i % 2 == 0 else "top",
                        ha="left" if i % 2 == 0 else "right", fontsize=6, color="grey")
            for m in marks:
                if (m["GPU"], m["target"], m["context"], m["link"]) == (gpu, target, context, link):
                    marker, color = VERDICT_STYLE[m["verdict"]]
                    ax.plot(m["ms/token"], m["τ4"], marker, color=color, ms=5)
            ax.set_xlabel("device drafting ms/token (short context)", fontsize=8)
            ax.set_ylabel("device draft τ4", fontsize=8)
            ax.tick_params(labelsize=7)
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        handles = [plt.Line2D([], [], color="k", lw=2, label="ratio 1: hybrid = best of vLLM's proposers"),
                   plt.Line2D([], [], color="tab:red", lw=6, alpha=0.2, label="no τ4 up to 4.9 pays"),
                   *[plt.Line2D([], [], ls="", marker=mk, color=c, label=f"measured device × draft: {v}")
                     for v, (mk, c) in VERDICT_STYLE.items()]]
        fig.legend(handles=handles, loc="lower right", bbox_to_anchor=(0.995, 0.0), ncol=3, fontsize=8, frameon=False)
        fig.suptitle("Per GPU: the hybrid pays above the line", fontsize=10)
        fig.tight_layout(rect=(0, 0.07, 1, 0.97))
        footnote(fig, {source: results[source]})
    return draw


PICTURES: list[Picture] = [
    Picture("system", "Edge, link and verifier: what travels in one round", (), draw_system, (7.5, 4.2),
            ("README.md", "docs/architecture.md")),
    Picture("tokens-vs-rtt-bundled", "tokens/s against round trip, bundled pair", ("headline",),
            draw_tokens_vs_rtt("headline", "by-profile",
                               "Bundled pair (SmolLM2-135M target on a CPU, its Q4_0 draft)"),
            (7.5, 4.0), ("docs/when-it-pays.md",)),
    Picture("crossover", "the crossover map", ("headline",), draw_crossover(), (7.5, 4.2),
            ("docs/when-it-pays.md",)),
    Picture("many-edges", "many edges on one verifier", ("many-edges-synthetic",), draw_many_edges(), (8.5, 4.0),
            ("docs/many-edges.md",)),
    Picture("gpu-breakeven", "per GPU, target and context: the break-even of the device's speed and its draft's τ4",
            ("gpu-breakeven",), draw_breakeven(), (16.8, 10.8), ("docs/operators.md",)),
    Picture("per-gpu", "per GPU against vLLM's own speculation", ("gpu-regime",), draw_gpu_map(), (9.0, 5.2),
            ("docs/operators.md",)),
]


def render(picture: Picture, registry: dict | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    registry = _figures.load() if registry is None else registry
    results = {name: registry[name] for name in picture.sources}
    with matplotlib.rc_context({"svg.hashsalt": "hybridspec", "svg.fonttype": "none", "font.size": 8}):
        fig = plt.figure(figsize=picture.size)
        picture.draw(fig, results)
        meta = json.dumps({"sources": {n: result_hash(n) for n in picture.sources}, "command": COMMAND},
                          sort_keys=True)
        IMG.mkdir(parents=True, exist_ok=True)
        fig.savefig(picture.path, format="svg", metadata={"Title": picture.title, "Description": meta,
                                                          "Date": None, "Creator": COMMAND})
        plt.close(fig)
    return picture.path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", help="draw only these pictures (default: all)")
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--check", action="store_true", help="exit 1 when a picture is missing or older than its data")
    what.add_argument("--list", action="store_true", help="list the pictures, their result files and pages")
    args = ap.parse_args(argv)
    chosen = [p for p in PICTURES if not args.names or p.name in args.names]
    if args.list:
        for p in chosen:
            print(f"{p.path.relative_to(ROOT)}: {', '.join(p.sources) or '(no data)'} → {', '.join(p.pages)}")
        return 0
    if args.check:
        problems = [s for p in chosen for s in stale(p)]
        print("\n".join(problems) or "every picture is drawn from the current result files")
        return 1 if problems else 0
    registry = _figures.load()
    for p in chosen:
        print(f"wrote {render(p, registry).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

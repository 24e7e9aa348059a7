"""Write an experiment's results: JSON, CSV, a Markdown report and PNG plots (matplotlib)."""
from __future__ import annotations

import csv
import json
from pathlib import Path

from hybridspec.machine import summary as machine_summary
from netsim.experiment import same_text, summarise


def _fmt(v, nd=2):
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def write_all(result: dict, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "csv": out / "results.csv", "report": out / "report.md"}
    paths["json"].write_text(json.dumps(result, indent=1))
    rows = result["rows"]
    if rows:
        with paths["csv"].open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    summary = summarise(rows)
    paths.update(plot(summary, result.get("crossover", []), out))
    paths["report"].write_text(markdown(result, summary))
    return paths


def ratios(summary: list[dict]) -> list[dict]:
    """Per profile: the best fixed-γ hybrid against per-token and against cloud-only."""
    out = []
    for profile in dict.fromkeys(s["profile"] for s in summary):
        by = {s["mode"]: s for s in summary if s["profile"] == profile}
        hybrids = [s for m, s in by.items() if m.startswith("hybrid")]
        best = max(hybrids, key=lambda s: s["tokens_per_s"]) if hybrids else None
        row = {"profile": profile, "best_hybrid": best["mode"] if best else None}
        for other in ("per-token", "cloud-only", "adaptive"):
            if best and other in by and by[other]["tokens_per_s"]:
                row[f"hybrid/{other}"] = best["tokens_per_s"] / by[other]["tokens_per_s"]
        if "adaptive" in by and "cloud-only" in by and by["cloud-only"]["tokens_per_s"]:
            row["adaptive/cloud-only"] = by["adaptive"]["tokens_per_s"] / by["cloud-only"]["tokens_per_s"]
        out.append(row)
    return out


def _models_line(result: dict) -> str:
    cfg, models = result["config"], result.get("models") or {}
    if cfg["synthetic"]:
        return "synthetic pair"
    if not models.get("target"):
        return "bundled target + draft on llama.cpp"
    names = f"target {Path(models['target']).name} + draft {Path(models['draft']).name} on llama.cpp"
    pair = f"pair {models['pair']}: " if models.get("pair") else ""
    return pair + names + (" (two tokenizers: cross-vocabulary drafting)" if models.get("cross_vocabulary") else "")


def _clock_line(result: dict) -> str:
    """Which clock produced the figures: the wall (this machine, its load) or the virtual one (a cost table)."""
    if result.get("clock") == "virtual":
        t = result["cost_table"]
        marks = ", ".join(m for m, on in (("measured", t.get("measured")), ("BUSY machine", t.get("busy")),
                                          ("provisional", t.get("provisional"))) if on) or "not measured here"
        return (f"Clock: virtual (netsim.virtual): every time is the cost table's `{t['name']}` ({marks}; "
                f"{t.get('source') or t.get('description')}) and the profiles' links, drawn from the seed.")
    return f"Clock: wall. Machine: {machine_summary(result['machine']) if 'machine' in result else 'not recorded'}."


def _same_text_lines(result: dict) -> list[str]:
    """With --coupling gumbel: whether every mode committed cloud-only's ids for each prompt."""
    if result["config"].get("coupling") != "gumbel":
        return []
    check = same_text(result["rows"])
    if not check["differ"]:
        return [f"Same text: every mode committed the cloud-only ids for each prompt and profile "
                f"({check['compared']} runs compared; --coupling gumbel).", ""]
    return [f"Same text: NOT every mode committed the cloud-only ids ({len(check['differ'])} prompts differ: "
            f"{'; '.join(check['differ'][:8])}).", ""]


def markdown(result: dict, summary: list[dict]) -> str:
    cfg = result["config"]
    virtual = result.get("clock") == "virtual"
    when = "virtual clock" if virtual else result.get("started", "")
    lines = [f"# netsim experiment ({when})", "",
             f"Profiles {', '.join(cfg['profiles'])}; modes {', '.join(cfg['modes'])}; workloads "
             f"{', '.join(cfg['workloads'])} ({cfg['prompts_per_workload']} prompt each), up to {cfg['max_tokens']} "
             f"tokens; {_models_line(result)}; "
             f"q {cfg['qmode']}; seed {cfg['seed']}; coupling {cfg.get('coupling', 'rejection')}.", "",
             *_same_text_lines(result),
             _clock_line(result), "",
             "Round trips are Verify RPCs (retries included) or the one Generate stream; bytes are "
             + ("the messages' encoded sizes with their gRPC and HTTP/2 framing (netsim.virtual.channel)" if virtual else
                "measured on the wire by the proxy (HTTP/2 framing included)")
             + "; forward passes are target passes per generated token "
             "(one per round for the hybrid, one per token for cloud-only).", "",
             "## Per profile and mode", "",
             "| profile | mode | tokens | tok/s | TTFT s | RT/token | B up/token | B down/token | accepted/drafted "
             "| α per token | tokens/round | theory (1−α^(γ+1))/(1−α) | target passes/token |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['profile']} | {s['mode']} | {s['tokens']} | {_fmt(s['tokens_per_s'], 1)} | "
                     f"{_fmt(s['ttft_s'])} | {_fmt(s['round_trips_per_token'])} | {_fmt(s['bytes_up_per_token'], 0)} | "
                     f"{_fmt(s['bytes_down_per_token'], 0)} | {_fmt(s['acceptance_rate'])} | {_fmt(s['alpha'])} | "
                     f"{_fmt(s['tokens_per_round'])} | {_fmt(s['theory_tokens_per_round'])} | "
                     f"{_fmt(s['forward_passes_per_token'])} |")
    rs = ratios(summary)
    if rs:
        keys = sorted({k for r in rs for k in r if "/" in k})
        lines += ["", "## Ratios of tokens/s", "", "| profile | best hybrid | " + " | ".join(keys) + " |",
                  "|---|---|" + "---|" * len(keys)]
        for r in rs:
            lines.append(f"| {r['profile']} | {r['best_hybrid']} | " + " | ".join(_fmt(r.get(k)) for k in keys) + " |")
        wins = [r["profile"] for r in rs if r.get("hybrid/cloud-only", 2) < 1]
        if wins:
            lines += ["", f"**Cloud-only is faster in tokens/s on: {', '.join(wins)}.** Streaming lets the target "
                      "pay the link's round trip once, while every hybrid round pays it again; the hybrid's case "
                      "there is the cloud's forward passes per token (see the last column) and a loaded cloud."]
    lines += round_trip_section(summary)
    workloads = sorted({r["workload"] for r in result["rows"] if r["acceptance_rate"] is not None})
    if workloads:
        lines += ["", "## Acceptance by workload (all hybrid modes, all profiles)", "", "| workload | α | tokens/round |",
                  "|---|---|---|"]
        for w in workloads:
            rr = [r for r in result["rows"] if r["workload"] == w and r["acceptance_rate"] is not None]
            lines.append(f"| {w} | {_fmt(sum(r['acceptance_rate'] for r in rr) / len(rr))} | "
                         f"{_fmt(sum(r['tokens_per_round'] for r in rr) / len(rr))} |")
    cross = result.get("crossover") or []
    if cross:
        steps = sorted({c["step_ms"] for c in cross})
        rtts = sorted({c["rtt_ms"] for c in cross})
        lines += ["", "## Crossover: hybrid (adaptive γ) tokens/s ÷ cloud-only tokens/s (synthetic pair)", "",
                  "Rows: cloud step time per forward pass (a loaded cloud is slow); columns: link RTT. Above 1 "
                  "the hybrid is faster.", "", "| step ms \\ RTT ms | " + " | ".join(f"{r:g}" for r in rtts) + " |",
                  "|---|" + "---|" * len(rtts)]
        for s in steps:
            cells = {c["rtt_ms"]: c for c in cross if c["step_ms"] == s}
            lines.append(f"| {s:g} | " + " | ".join(_fmt(cells[r]["speedup"]) if r in cells else "–" for r in rtts) + " |")
        fpt = [c["hybrid_forward_passes_per_token"] for c in cross]
        lines += ["", f"The hybrid used {min(fpt):.2f}–{max(fpt):.2f} target forward passes per token "
                      "(cloud-only: 1.00)."]
    lines += ["", "Plots: tokens_per_s.png, round_trips_per_100_tokens.png" + (", crossover.png" if cross else ""), ""]
    return "\n".join(lines)


def round_trip_section(summary: list[dict]) -> list[str]:
    """Every networked mode against cloud-stepwise (one round trip per token) and per-token / cloud-only.

    Round-trip reduction = RT/token of cloud-stepwise ÷ RT/token of the mode; the seed document's
    claim is "about γ-fold", its theory (1 − α^(γ+1))/(1 − α) at the mode's measured α and mean γ
    (for trees, the chain of the same depth: what a tree adds shows as measured above theory).
    Waited RT/token leaves out pipelined rounds (kept or discarded): their trip overlapped the previous one.
    """
    lines = ["", "## Round trips against cloud-stepwise, and tokens/s ratios", "",
             "| profile | mode | RT/token | waited RT/token | RT reduction vs cloud-stepwise | theory (1−α^(γ+1))/(1−α) "
             "| nodes/round | bytes/round | reused drafts | pipelined / discarded rounds | continuation hits / sent "
             "| tok/s ÷ per-token | tok/s ÷ cloud-only |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    any_row = False
    for profile in dict.fromkeys(s["profile"] for s in summary):
        by = {s["mode"]: s for s in summary if s["profile"] == profile}
        step = by.get("cloud-stepwise")
        for mode, s in by.items():
            if mode in ("edge-only", "cloud-only") or not s["tokens"]:
                continue
            any_row = True
            rt = s["round_trips_per_token"]
            # Pipelined rounds, kept or discarded, travel during the previous round's trip.
            waited = rt - (s.get("pipelined_rounds", 0) + s.get("discarded_rounds", 0)) / s["tokens"]
            reduction = step["round_trips_per_token"] / rt if step and rt else None
            vs = {o: (s["tokens_per_s"] / by[o]["tokens_per_s"] if o in by and by[o]["tokens_per_s"] else None)
                  for o in ("per-token", "cloud-only")}
            lines.append(f"| {profile} | {mode} | {_fmt(rt)} | {_fmt(waited)} | {_fmt(reduction)} | "
                         f"{_fmt(s['theory_tokens_per_round'])} | {_fmt(s.get('nodes_per_round'), 1)} | "
                         f"{_fmt(s.get('bytes_per_round'), 0)} | {s.get('reused_drafts', 0)} | "
                         f"{s.get('pipelined_rounds', 0)} / {s.get('discarded_rounds', 0)} | "
                         f"{s.get('continuation_hits', 0)} / {s.get('continuations_sent', 0)} | {_fmt(vs['per-token'])} | "
                         f"{_fmt(vs['cloud-only'])} |")
    return lines if any_row else []


def plot(summary: list[dict], crossover: list[dict], out: Path) -> dict[str, Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    paths = {}
    profiles = list(dict.fromkeys(s["profile"] for s in summary))
    modes = list(dict.fromkeys(s["mode"] for s in summary))
    for key, fname, scale, ylabel in (("tokens_per_s", "tokens_per_s.png", 1, "tokens/s"),
                                      ("round_trips_per_token", "round_trips_per_100_tokens.png", 100,
                                       "round trips per 100 tokens")):
        fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(profiles)), 4))
        width = 0.8 / max(len(modes), 1)
        for i, m in enumerate(modes):
            vals = [next((s[key] * scale for s in summary if s["profile"] == p and s["mode"] == m), 0) for p in profiles]
            ax.bar(np.arange(len(profiles)) + i * width, vals, width, label=m)
        ax.set_xticks(np.arange(len(profiles)) + width * (len(modes) - 1) / 2, profiles)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        paths[fname] = out / fname
    if crossover:
        steps = sorted({c["step_ms"] for c in crossover})
        rtts = sorted({c["rtt_ms"] for c in crossover})
        grid = np.array([[next(c["speedup"] for c in crossover if c["step_ms"] == s and c["rtt_ms"] == r)
                          for r in rtts] for s in steps])
        fig, ax = plt.subplots(figsize=(6, 4))
        im = ax.imshow(np.log2(grid), cmap="RdBu", vmin=-3, vmax=3, origin="lower", aspect="auto")
        for i in range(len(steps)):
            for j in range(len(rtts)):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(rtts)), [f"{r:g}" for r in rtts])
        ax.set_yticks(range(len(steps)), [f"{s:g}" for s in steps])
        ax.set_xlabel("link RTT (ms)")
        ax.set_ylabel("cloud step time per forward pass (ms)")
        ax.set_title("hybrid ÷ cloud-only tokens/s (blue: hybrid wins)")
        fig.colorbar(im, label="log2 speedup")
        fig.tight_layout()
        fig.savefig(out / "crossover.png", dpi=110)
        plt.close(fig)
        paths["crossover.png"] = out / "crossover.png"
    return paths

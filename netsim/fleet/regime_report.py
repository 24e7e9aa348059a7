"""What the regime map says (netsim.fleet.regime): its tables, headline counts and registry entries.

A cell's ratio within the model's stated error (netsim.fleet.modelerror: the largest disagreement the
discrete-event simulation found against the map) is a tie, not a win (`verdict`).
"""
from __future__ import annotations

from netsim.fleet.measured import hit_probability, load_measured

# The map's modes (netsim.fleet.regime builds them; kept here so that the map imports its report, not the
# other way round)
SPEC_MODES = tuple(f"vLLM spec, {m}" for m in ("draft model", "EAGLE", "n-gram"))
HYBRID_MODES = ("hybrid, one round", "hybrid, in flight")
GPU_NAMES = {"h100": "H100 SXM", "h200": "H200 SXM"}

def _x(v) -> str:
    return "–" if v is None else f"{v:.2f}×"


def _ms(v) -> str:
    return "–" if v is None else f"{v * 1e3:.0f}"


def hybrid_best(cell: dict) -> str:
    return max(HYBRID_MODES, key=lambda m: cell["modes"][m]["tokens_per_s"])


def ratio_rows(result: dict, gpu: str) -> list[list]:
    """One row per cell of `gpu`: cloud-only tok/s, each mode × cloud-only, the hybrid ÷ the best vLLM spec."""
    rows = []
    for c in (c for c in result["cells"] if c["gpu"] == gpu):
        m = c["modes"]
        best = hybrid_best(c)
        rows.append([c["target"], f"{c['context'] // 1024}k", c["link"], c["draft"],
                     round(m["cloud-only"]["tokens_per_s"]), f"{m['cloud-only']['binds']}, n {m['cloud-only']['sessions']}",
                     *[m[k]["x_cloud"] for k in SPEC_MODES], *[m[k]["x_cloud"] for k in HYBRID_MODES],
                     m[best]["x_spec"], m[best]["x_best"], f"{m[best]['binds']}, γ {m[best]['gamma']}, n {m[best]['sessions']}"
                     + (f", c {m[best]['continuations']}, hit {m[best]['hit']:.2f}" if m[best]["continuations"] else "")])
    return rows


RATIO_COLUMNS = ["target", "context", "link", "device draft", "cloud-only tok/s", "cloud-only binds",
                 "draft model ×", "EAGLE ×", "n-gram ×", "hybrid one round ×", "hybrid in flight ×",
                 "hybrid ÷ best vLLM spec", "hybrid ÷ better baseline", "hybrid binds"]


def gap_rows(result: dict, gpu: str) -> list[list]:
    """One row per cell of `gpu`: the p95 gap and mean TTFT (ms) of plain decoding, the best vLLM spec
    and the best hybrid at their points."""
    rows = []
    for c in (c for c in result["cells"] if c["gpu"] == gpu):
        m = c["modes"]
        spec, hyb = m[c["best_spec"]], m[hybrid_best(c)]
        rows.append([c["target"], f"{c['context'] // 1024}k", c["link"], c["draft"],
                     *[round(p[k] * 1e3, 1) if p[k] is not None else None
                       for p in (m["cloud-only"], spec, hyb) for k in ("gap_p95_s", "ttft_s")],
                     round(hyb["tpot_s"] * 1e3, 1) if hyb["tpot_s"] else None])
    return rows


GAP_COLUMNS = ["target", "context", "link", "device draft", "cloud-only p95 gap ms", "cloud-only TTFT ms",
               "best vLLM spec p95 gap ms", "best vLLM spec TTFT ms", "hybrid p95 gap ms", "hybrid TTFT ms",
               "hybrid mean TPOT ms"]


def verdict(x: float | None, tolerance: float) -> str:
    """"win", "tie" or "loss" for a ratio whose model error is `tolerance` (relative)."""
    x = x or 0.0
    return "win" if x > 1.0 + tolerance else ("loss" if x < 1.0 - tolerance else "tie")


def summary(result: dict, tolerance: float | None = None) -> dict:
    """Counts for the prose, per GPU: cells where the hybrid (its better mode) beats plain decoding and
    the best vLLM spec, its best ratio to each, and the cells where vLLM spec beats plain decoding. A
    ratio within the model's stated error (`tolerance`, default netsim.fleet.modelerror's: the largest
    disagreement between the map and the simulation) is a tie, not a win."""
    from netsim.fleet.modelerror import published_tolerance
    tol = published_tolerance() if tolerance is None else tolerance
    out = {}
    for gpu in dict.fromkeys(c["gpu"] for c in result["cells"]):
        cells = [c for c in result["cells"] if c["gpu"] == gpu]
        hyb = [c["modes"][hybrid_best(c)] for c in cells]
        # EAGLE ÷ the hybrid at 8k-32k context, where both serve
        long = [c["modes"]["vLLM spec, EAGLE"]["tokens_per_s"] / h["tokens_per_s"] for c, h in zip(cells, hyb)
                if c["context"] >= 8192 and h["tokens_per_s"] and c["modes"]["vLLM spec, EAGLE"]["tokens_per_s"]]
        out[gpu] = {"cells": len(cells),
                    "hybrid_beats_cloud": sum((h["x_cloud"] or 0) > 1.0 for h in hyb),
                    "tolerance": tol,
                    "hybrid_beats_spec": sum(verdict(h["x_spec"], tol) == "win" for h in hyb),
                    "hybrid_ties_spec": sum(verdict(h["x_spec"], tol) == "tie" for h in hyb),
                    "hybrid_beats_best": sum(verdict(h["x_best"], tol) == "win" for h in hyb),
                    "hybrid_ties_best": sum(verdict(h["x_best"], tol) == "tie" for h in hyb),
                    "hybrid_2x_cloud": sum((h["x_cloud"] or 0) >= 2.0 for h in hyb),
                    "max_x_cloud": max((h["x_cloud"] or 0) for h in hyb),
                    "max_x_spec": max((h["x_spec"] or 0) for h in hyb),
                    "spec_beats_cloud": sum((c["modes"][c["best_spec"]]["x_cloud"] or 0) > 1.0 for c in cells),
                    "hybrid_zero": sum(h["tokens_per_s"] == 0 for h in hyb),
                    "eagle_over_hybrid_long": [min(long), max(long)] if long else None,
                    "max_x_best_3g": max([(h["x_best"] or 0) for c, h in zip(cells, hyb) if c["link"] == "3g"],
                                         default=None),
                    "beats_spec_cells": [f"{c['target']} {c['context'] // 1024}k {c['link']} {c['draft']}"
                                         for c, h in zip(cells, hyb) if verdict(h["x_spec"], tol) == "win"],
                    "ties_spec_cells": [f"{c['target']} {c['context'] // 1024}k {c['link']} {c['draft']}"
                                        for c, h in zip(cells, hyb) if verdict(h["x_spec"], tol) == "tie"]}
    return out


def regime_markdown(result: dict) -> str:
    cfg = result["config"]
    lines = [f"# Regime map: the hybrid per GPU against plain decoding and vLLM's own speculative decoding",
             "", f"A mean-value model (netsim/fleet/regime.py), not a measurement; {result['setting']} rounds. SLO: "
             f"{cfg['slo_on']} <= {cfg['slo_s'] * 1e3:g} ms. KV cache {cfg['kv_dtype']}; HBM × {cfg['bw_efficiency']:g}, "
             f"FLOPs × {cfg['flops_efficiency']:g}. Requests: {cfg['prompt_tokens']} new tokens, {cfg['max_tokens']} "
             f"generated. Edge: {cfg['device']['name']}, drafting {cfg['draft_ms']:.3g} ms/token at short context "
             f"({cfg['device']['draft']}; its KV charged with the context), a request's prompt {cfg['device_prefill_ms']:.3g} "
             f"ms on the device, {cfg['edge_ms']:g} ms a round. Rounds in flight: {cfg['measured']}. Acceptance: "
             + "; ".join(f"{m}: {c}" for m, c in cfg["curves"].items()) + f". {result['host']}.", ""]
    for gpu in dict.fromkeys(c["gpu"] for c in result["cells"]):
        lines += [f"## {GPU_NAMES.get(gpu, gpu)}", "", "| " + " | ".join(RATIO_COLUMNS) + " |",
                  "|" + "---|" * len(RATIO_COLUMNS)]
        for row in ratio_rows(result, gpu):
            lines.append("| " + " | ".join(_x(v) if i >= 6 and not isinstance(v, str) else
                                           (f"{v:g}" if isinstance(v, float) else str(v))
                                           for i, v in enumerate(row)) + " |")
        lines += ["", "| " + " | ".join(GAP_COLUMNS) + " |", "|" + "---|" * len(GAP_COLUMNS)]
        for row in gap_rows(result, gpu):
            lines.append("| " + " | ".join("–" if v is None else (f"{v:g}" if isinstance(v, float) else str(v))
                                           for v in row) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"



def _cell_figures(result: dict, setup: str) -> dict:
    """Headline figures per GPU: the counts of `summary`."""
    from hybridspec.figures import Figure
    figs = {}
    for gpu, s in summary(result).items():
        where = f"{GPU_NAMES.get(gpu, gpu)}, {s['cells']} cells; {setup}"
        figs[f"{gpu}-hybrid-beats-spec"] = Figure(s["hybrid_beats_spec"], "cells where the hybrid's tokens/s per GPU "
                                                  "beats the best of vLLM's own speculative decoding by more than the model's error", where, "cells")
        figs[f"{gpu}-hybrid-beats-best"] = Figure(s["hybrid_beats_best"], "cells where the hybrid's tokens/s per GPU "
                                                  "beats both plain decoding and vLLM's best speculative decoding",
                                                  where, "cells")
        figs[f"{gpu}-hybrid-beats-cloud"] = Figure(s["hybrid_beats_cloud"], "cells where the hybrid's tokens/s per "
                                                   "GPU beats plain decoding", where, "cells")
        figs[f"{gpu}-spec-beats-cloud"] = Figure(s["spec_beats_cloud"], "cells where vLLM's best speculative "
                                                 "decoding beats plain decoding", where, "cells")
        figs[f"{gpu}-max-x-spec"] = Figure(round(s["max_x_spec"], 4), "the hybrid's best tokens/s per GPU over the "
                                           "best vLLM speculative decoding", where, "x", "{:.2f}×")
        figs[f"{gpu}-max-x-cloud"] = Figure(round(s["max_x_cloud"], 4), "the hybrid's best tokens/s per GPU over "
                                            "plain decoding", where, "x", "{:.2f}×")
        figs[f"{gpu}-hybrid-zero"] = Figure(s["hybrid_zero"], "cells where no hybrid session meets the SLO", where,
                                            "cells")
        figs[f"{gpu}-cells"] = Figure(s["cells"], "cells in the map", where, "cells")
        if s["max_x_best_3g"] is not None:
            figs[f"{gpu}-max-x-best-3g"] = Figure(round(s["max_x_best_3g"], 4), "the hybrid's best tokens/s per GPU "
                                                  "over the better baseline on 3g", where, "x", "{:.2f}×")
        if s["eagle_over_hybrid_long"]:
            for end, v in zip(("min", "max"), s["eagle_over_hybrid_long"]):
                figs[f"{gpu}-eagle-over-hybrid-long-{end}"] = Figure(
                    round(v, 4), f"vLLM with an EAGLE head over the hybrid, tokens/s per GPU at the same α, the "
                    f"{end} over the 8k-32k cells where both serve", where, "x", "{:.2f}×")
    return figs


def write_results(result: dict, name: str, command: str | None = None, load_start=None):
    """The map into the figures registry: a ratio table and a gap table per GPU, the headline counts,
    the measured runs the rounds in flight are charged from."""
    from hybridspec.figures import Figure, Table, write_result
    from netsim.fleet.measured import MEASURED_GAMMA
    cfg = result["config"]
    setup = (f"SLO {cfg['slo_on']} <= {cfg['slo_s'] * 1e3:g} ms, KV {cfg['kv_dtype']}, FLOPs x "
             f"{cfg['flops_efficiency']:g}, HBM x {cfg['bw_efficiency']:g}, {result['setting']} rounds, device "
             f"{cfg['device']['key']} drafting {cfg['draft_ms']:.3g} ms/token"
             + (", hybrid parks KV in host memory" if cfg["parking"] else ""))
    fmt = {c: "{:.2f}×" for c in RATIO_COLUMNS[6:13]}
    fmt["cloud-only tok/s"] = "{:,}"
    tables = {}
    for gpu in dict.fromkeys(c["gpu"] for c in result["cells"]):
        tables[gpu] = Table(RATIO_COLUMNS, ratio_rows(result, gpu), fmt)
        tables[f"{gpu}-gaps"] = Table(GAP_COLUMNS, gap_rows(result, gpu))
    m = load_measured()
    tables["measured-hits"] = Table(
        ["pair", "profile", "mode", "α", "rounds", "continuations per round", "hits", "hit rate measured",
         "model's hit rate at the fitted guess"],
        [[r.pair, r.profile, r.mode, round(r.alpha, 3), r.rounds, round(r.continuations, 2), r.hits,
          round(r.hits / r.rounds, 2), round(hit_probability(r.alpha, MEASURED_GAMMA, m.guess,
                                                             max(1, round(r.continuations))), 2)] for r in m.runs])
    figures = _cell_figures(result, setup)
    for gpu, sm in summary(result).items():
        figures[f"{gpu}-hybrid-ties-spec"] = Figure(sm["hybrid_ties_spec"], "cells where the hybrid and the best of "
                                                   "vLLM's own speculative decoding are within the model's error",
                                                   f"{GPU_NAMES.get(gpu, gpu)}; {setup}", "cells")
        figures[f"{gpu}-tolerance"] = Figure(round(sm["tolerance"], 4), "the model's stated error a win must "
                                             "exceed", f"{GPU_NAMES.get(gpu, gpu)}; {setup}", "", "{:.1%}")
    return write_result(name, figures=figures, tables=tables, command=command,
                        load_start=load_start, clock="model",
                        note=f"a model: its figures do not depend on the machine. {setup}. {cfg['measured']}")

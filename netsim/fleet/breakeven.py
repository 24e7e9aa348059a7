"""The per-GPU answer as a break-even: how fast a device must draft, and how well, for the hybrid to pay.

Per GPU (H100, H200), target (8B, 70B) and context (1k, 8k), on a link (lan by default: the link that
costs the hybrid least), the regime map (netsim.fleet.regime) is solved along two axes:

  x  the device's drafting time per token at short context (ms; its draft's KV and its prefill of
     each request's prompt are charged on top, netsim.fleet.devices)
  y  the device draft's mean acceptance length at 4 drafts, τ4 (bonus included): the device's curve
     is vLLM's EAGLE-3 curve (RegimeConfig.eagle_curve) moved in logit space to that τ4
     (Curve.with_tokens_per_step), so at EAGLE-3's own τ4 the two sides accept alike

and for each x the τ4 at which the hybrid's better mode (one round at a time, or rounds in flight)
gets the tokens/s per GPU of the best of vLLM's own proposers (draft model running the device's
draft, EAGLE head, n-gram, each with its own curve): the ratio-1 line. Above it the hybrid gets more.
A ratio within the model's stated error (netsim.fleet.modelerror) of 1 is a tie, not a win.

Marked on it: the devices of the table (netsim.fleet.devices, vertical) and the drafts measured
(netsim.fleet.acceptance: the published curves and our pairs', horizontal), and, for each measured
device with each measured draft, its ratio and verdict computed with that draft's own curve.

`python -m netsim.fleet.breakeven` writes bench/results/gpu-breakeven.json (rendered into
docs/operators.md; `python -m hybridspec.plots` draws it).
"""
from __future__ import annotations

import functools
from dataclasses import replace

from netsim.fleet.acceptance import CURVES, Curve, get_curve, measured_curves
from netsim.fleet.costs import kv_sessions
from netsim.fleet.devices import DEVICES, this_machine
from netsim.fleet.regime import HYBRID_MODES, SPEC_MODES, RegimeConfig, cell_costs, cloud_only, hybrid, server_spec

PANELS = tuple((gpu, key, context) for gpu in ("h100", "h200") for key in ("8b-bf16", "70b-fp8")
               for context in (1024, 8192))
X_MS = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 11.0, 16.0, 22.0, 30.0, 45.0, 70.0, 110.0)
TAU_LO, TAU_HI = 1.1, 4.9
MARKED_DRAFTS = ("eagle3-llama8b", "eagle1-llama8b", "eagle3-minicpm3", "ours-bundled", "ours-gemma")


class Panel:
    """One GPU, target, context and link: the baseline computed once, the hybrid at any (x, curve)."""

    def __init__(self, gpu: str, key: str, context: int, link: str, cfg: RegimeConfig, row) -> None:
        self.gpu, self.key, self.context, self.link = gpu, key, context, link
        self.cfg = replace(cfg, gpu=gpu)
        self.row = row
        self.target, self.cost = cell_costs(key, context, self.cfg, row)
        self.kv_slots = kv_sessions(self.cfg.memory_bytes, self.cost)
        self.host_slots = self.cfg.offload.host_sessions(self.cost)
        fixed = [cloud_only(self.cost, self.kv_slots, link, self.cfg)]
        for mode in SPEC_MODES:
            method = mode.split(", ", 1)[1]
            if method != "draft model" or self.cfg.draft_model_curve is not None:
                fixed.append(server_spec(self.target, key, method, self.cost, self.cfg.curve(method, None), link,
                                         self.cfg))
        self.fixed_best = max(p.tokens_per_s for p in fixed)

    @functools.lru_cache(maxsize=256)
    def baseline(self, curve: Curve) -> float:
        """The best of plain decoding and vLLM's proposers (the draft model runs the device's draft)."""
        if self.cfg.draft_model_curve is not None:
            return self.fixed_best
        draft = server_spec(self.target, self.key, "draft model", self.cost, curve, self.link, self.cfg)
        return max(self.fixed_best, draft.tokens_per_s)

    def hybrid(self, x_ms: float, curve: Curve) -> float:
        cfg = replace(self.cfg, draft_s=x_ms / 1e3)
        return max(hybrid(self.cost, curve, self.link, cfg, mode.endswith("in flight"), self.kv_slots,
                          self.host_slots).tokens_per_s for mode in HYBRID_MODES)

    def ratio(self, x_ms: float, curve: Curve) -> float:
        base = self.baseline(curve)
        return self.hybrid(x_ms, curve) / base if base else float("inf")

    def break_even(self, x_ms: float, family: Curve, steps: int = 10) -> float | None:
        """The τ4 of `family` at which the ratio is 1 (None: not within TAU_LO..TAU_HI; TAU_LO: every τ4
        there pays)."""
        def at(tau: float) -> float:
            return self.ratio(x_ms, family.with_tokens_per_step(tau))
        grid = [TAU_LO + (TAU_HI - TAU_LO) * i / 8 for i in range(9)]
        values = [at(t) for t in grid]
        if values[0] >= 1.0:
            return TAU_LO
        for (t0, v0), (t1, v1) in zip(zip(grid, values), zip(grid[1:], values[1:])):
            if v0 < 1.0 <= v1:
                lo, hi = t0, t1
                for _ in range(steps):
                    mid = (lo + hi) / 2
                    lo, hi = (mid, hi) if at(mid) < 1.0 else (lo, mid)
                return (lo + hi) / 2
        return None


def marked_drafts() -> dict[str, Curve]:
    measured = measured_curves()
    out = {}
    for key in MARKED_DRAFTS:
        if key in CURVES or key in measured:
            out[key] = get_curve(key)
    return out


def breakeven(panels=PANELS, links=("lan",), xs=X_MS, cfg: RegimeConfig | None = None, setting: str = "greedy",
              table=None, progress=None) -> dict:
    from netsim.fleet.hostpath import HostPathTable
    from netsim.fleet.modelerror import published_tolerance
    from netsim.fleet.regime_report import verdict
    cfg = cfg or RegimeConfig()
    row = (table or HostPathTable.load()).get("batched-on-device", setting)
    family = get_curve(cfg.eagle_curve)
    tol = published_tolerance()
    drafts = marked_drafts()
    devices = dict(DEVICES)
    ours = this_machine()
    if ours is not None:   # our own edge (its 135M draft, timed here; busy unless measured quiet)
        devices[ours.key] = ours
    # Solved at each device's own speed too, so that its figure is the line's value there, not an
    # interpolation across a point where the break-even leaves the sweep.
    xs = tuple(sorted(set(xs) | {round(d.draft_s * 1e3, 2) for d in devices.values()}))
    lines, marks = [], []
    for gpu, key, context in panels:
        for link in links:
            if progress:
                progress(f"{gpu} {key} {context // 1024}k {link}")
            panel = Panel(gpu, key, context, link, cfg, row)
            if panel.kv_slots < 1:   # not one session's KV fits beside the weights: no mode serves
                lines += [{"gpu": gpu, "target": key, "context": context, "link": link, "x_ms": x, "tau4": None,
                           "fits": False} for x in xs]
                continue
            for x in xs:
                lines.append({"gpu": gpu, "target": key, "context": context, "link": link, "x_ms": x,
                              "tau4": panel.break_even(x, family)})
            for dkey, device in devices.items():
                for ckey, curve in drafts.items():
                    r = panel.ratio(device.draft_s * 1e3, curve)
                    marks.append({"gpu": gpu, "target": key, "context": context, "link": link, "device": dkey,
                                  "x_ms": round(device.draft_s * 1e3, 3), "draft": ckey, "draft_name": curve.name,
                                  "tau4": round(curve.tokens_per_step(4), 3), "ratio": round(r, 4),
                                  "verdict": verdict(r, tol)})
    return {"config": cfg.describe(), "setting": setting, "tolerance": tol, "family": family.to_json(),
            "devices": {k: d.to_json() for k, d in devices.items()},
            "drafts": {k: c.to_json() for k, c in drafts.items()}, "xs": list(xs), "lines": lines, "marks": marks}


def _at(lines: list[dict], x: float):
    """The break-even τ4 at drafting time x from a panel's solved points: interpolated in log x between
    the two around it, "none" when the point above has none (the line ends before x)."""
    import math
    if any(l.get("fits") is False for l in lines):
        return "no session fits", "no mode serves"
    pts = sorted((l["x_ms"], l["tau4"]) for l in lines)
    above = next((p for p in pts if p[0] >= x), pts[-1])
    below = [p for p in pts if p[0] <= x]
    if above[1] is None:
        return "none", f"none at {above[0]:g} ms"
    if not below or below[-1][1] is None or below[-1][0] == above[0]:
        return round(above[1], 2), f"at {above[0]:g} ms"
    (x0, y0), (x1, y1) = below[-1], above
    w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return round(y0 + w * (y1 - y0), 2), f"between {x0:g} and {x1:g} ms, log-interpolated"


def panel_name(gpu: str, key: str, context: int, link: str) -> str:
    """A panel's name in figure keys (no digit-dash-digit: a key names what it measures)."""
    return f"{gpu}-llama{key.split('-')[0]}-ctx{context // 1024}k-{link}"


def write_results(result: dict, name: str = "gpu-breakeven", load_start=None):
    """The registry's tables and figures; the verdicts are judged against the model's error as it is
    recorded now (a later simulation can move it without solving the lines again)."""
    from hybridspec.figures import Figure, Table, write_result
    from netsim.fleet.modelerror import published_tolerance
    from netsim.fleet.regime_report import verdict
    tol = result["tolerance"] = published_tolerance()
    for m in result["marks"]:
        m["verdict"] = verdict(m["ratio"], tol)
    setup = (f"regime map, {result['setting']} rounds; device draft: EAGLE-3's curve moved to τ4; the best of vLLM's "
             f"draft model (the device's draft), EAGLE-3 and n-gram; model error {tol:.1%}")
    figures = {}
    for dkey, d in result["devices"].items():
        figures[f"device-{dkey}-ms"] = Figure(d["draft_ms"], f"drafting time per token at short context, {d['draft']}",
                                              f"{d['name']}: {d['source']}", "ms", "{:.1f} ms")
        figures[f"device-{dkey}-prefill-ms"] = Figure(d["prefill_ms_per_token"], f"prompt time per token, {d['draft']}",
                                                      f"{d['name']}: {d['source']}", "ms", "{:.2f} ms")
    for dkey, d in result["devices"].items():
        for m in (m for m in result["marks"] if m["device"] == dkey and m["draft"] == "eagle3-llama8b"):
            pname = panel_name(m["gpu"], m["target"], m["context"], m["link"])
            figures[f"{pname}-{dkey}-ratio-eagle3"] = Figure(
                m["ratio"], "hybrid ÷ best vLLM proposer, tokens/s per GPU, device draft as good as EAGLE-3",
                f"{pname}, {d['name']} ({d['draft_ms']:g} ms/token); {setup}", "x", "{:.2f}×")
    by_panel: dict[str, list] = {}
    for line in result["lines"]:
        by_panel.setdefault(panel_name(line["gpu"], line["target"], line["context"], line["link"]), []).append(line)
    for pname, ls in by_panel.items():
        for dkey, d in result["devices"].items():
            x = d["draft_ms"]
            tau, how = _at(ls, x)
            if tau == "no session fits":
                continue
            figures[f"{pname}-{dkey}-tau4"] = Figure(
                TAU_HI if tau == "none" else tau,
                "device τ4 at which the hybrid equals vLLM's best proposer",
                f"{pname}, {d['name']} drafting {x:g} ms/token ({how}); {setup}", "tokens",
                "none up to {}" if tau == "none" else "{}")
    for gpu in dict.fromkeys(m["gpu"] for m in result["marks"]):
        ms = [m for m in result["marks"] if m["gpu"] == gpu]
        figures[f"{gpu}-measured-wins"] = Figure(sum(m["verdict"] == "win" for m in ms),
                                                 "measured device x measured draft cells where the hybrid wins "
                                                 "beyond the model's error", f"{gpu}; {setup}", "cells")
        figures[f"{gpu}-measured-ties"] = Figure(sum(m["verdict"] == "tie" for m in ms),
                                                 "measured device x measured draft cells within the model's error",
                                                 f"{gpu}; {setup}", "cells")
        figures[f"{gpu}-measured-cells"] = Figure(len(ms), "measured device x measured draft cells",
                                                  f"{gpu}; {setup}", "cells")
        best = max(ms, key=lambda m: m["ratio"])
        figures[f"{gpu}-measured-best"] = Figure(best["ratio"], "the best hybrid ÷ best vLLM proposer over measured "
                                                 "devices and drafts", f"{gpu}: {best['target']} "
                                                 f"{best['context'] // 1024}k {best['link']}, {best['device']}, "
                                                 f"{best['draft']}; {setup}", "x", "{:.2f}×")
    lines_table = Table(["GPU", "target", "context", "link", "drafting ms/token", "break-even τ4"],
                        [[l["gpu"], l["target"], f"{l['context'] // 1024}k", l["link"], l["x_ms"],
                          "no session fits" if l.get("fits") is False else
                          "none" if l["tau4"] is None else round(l["tau4"], 2)] for l in result["lines"]])
    marks_table = Table(["GPU", "target", "context", "link", "device", "ms/token", "draft", "τ4", "hybrid ÷ best vLLM",
                         "verdict"],
                        [[m["gpu"], m["target"], f"{m['context'] // 1024}k", m["link"], m["device"], m["x_ms"],
                          m["draft"], m["tau4"], m["ratio"], m["verdict"]] for m in result["marks"]],
                        {"hybrid ÷ best vLLM": "{:.2f}×"})
    devices = Table(["device", "class", "draft", "ms/token (short context)", "prompt ms/token", "measured by"],
                    [[k, d["name"], d["draft"], d["draft_ms"], d["prefill_ms_per_token"], d["source"]]
                     for k, d in result["devices"].items()])
    return write_result(name, figures=figures, tables={"lines": lines_table, "marks": marks_table, "devices": devices},
                        load_start=load_start, clock="model",
                        note="a model: its figures do not depend on the machine. " + setup)


def main(argv: list[str] | None = None) -> int:
    """`python -m netsim.fleet.breakeven`: the break-even lines and marks, printed and into the registry."""
    import argparse
    import json
    import logging
    import os
    from pathlib import Path

    from netsim.fleet.regime import config_from_args, regime_arguments
    parser = argparse.ArgumentParser(prog="python -m netsim.fleet.breakeven", description=__doc__.split("\n")[0])
    regime_arguments(parser)
    parser.add_argument("--links", default="lan", help="comma-separated links (one line each)")
    parser.add_argument("--xs", default=",".join(f"{x:g}" for x in X_MS), help="drafting ms per token to solve at")
    parser.add_argument("--out", default="results/breakeven.json", help="the full result (JSON)")
    parser.add_argument("--result", default="gpu-breakeven", help="registry name ('' for none)")
    parser.add_argument("--from-json", default=None,
                        help="write the registry from a saved --out file (verdicts against today's model error)")
    args = parser.parse_args(argv)
    if args.from_json:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        logging.info("wrote %s", write_results(json.loads(Path(args.from_json).read_text()), args.result))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    load = [round(x, 2) for x in os.getloadavg()]
    result = breakeven(links=tuple(args.links.split(",")), xs=tuple(float(x) for x in args.xs.split(",")),
                       cfg=config_from_args(args), setting=args.setting, progress=logging.info)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    for line in result["lines"]:
        logging.info("%s %s %dk %s  %5.1f ms/token -> τ4 %s", line["gpu"], line["target"], line["context"] // 1024,
                     line["link"], line["x_ms"], "none" if line["tau4"] is None else f"{line['tau4']:.2f}")
    if args.result:
        logging.info("wrote %s", write_results(result, args.result, load_start=load))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The load test's report: load.md (markdown), the plots, and load.json (write_all)."""
from __future__ import annotations

import json
import math
from pathlib import Path

from hybridspec.machine import summary as machine_summary


def _capacity_ratio(capacity: dict) -> str:
    """Each drafting mode's capacity over cloud-only's, when both ran (the issue's side by side)."""
    base = capacity.get("cloud-only", {}).get("edges")
    parts = [f"{mode} {c['edges'] / base:.2f}×" for mode, c in capacity.items() if mode != "cloud-only" and base]
    return f". Capacity over cloud-only's: {', '.join(parts)}" if parts else ""


def _pair(cfg: dict) -> str:
    if cfg["synthetic"]:
        target = f"target {cfg['synthetic_step_ms']} ms/pass" if cfg.get("synthetic_step_ms") else "its verifier's pass"
        return f"synthetic pair (draft {cfg['draft_ms']} ms/token, {target})"
    target = Path(cfg["target"]).name if cfg.get("target") else "bundled target"
    if cfg.get("drafter") == "lookup":
        return f"{target} (llama.cpp) + prompt-lookup drafts ({cfg['draft_ms']} ms/token emulated)"
    return f"{target} + draft model per edge (llama.cpp)"


def _server_says(info: dict | None) -> str:
    if not info:
        return ""
    return f" ({info['backend']}, {'batching' if info['batching'] else 'serial: one round at a time'})"


def _f(value, scale=1.0, digits=1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value * scale:.{digits}f}"


def markdown(result: dict) -> str:
    cfg = result["config"]
    virtual = result.get("clock") == "virtual"
    lines = [f"# netsim load ({'virtual clock, cost table ' + result['cost_table']['name'] if virtual else result['started']})", "",
             f"Profiles {', '.join(cfg['profiles'])}; {cfg['duration_s']:g} s per run after {cfg['warmup_s']:g} s "
             f"warm-up; {_pair(cfg)}; "
             f"γ {cfg['gamma']} (hybrid); up to {cfg['max_tokens']} tokens per request; "
             f"{'Poisson arrivals, ' + str(cfg['arrival_rate']) + '/s per edge' if cfg['arrival_rate'] else 'back-to-back requests'}; "
             f"{'verifier at ' + cfg['server'] if cfg['server'] else 'verifier started with ' + ' '.join(cfg['verifier_args'] or ['(defaults)'])}"
             f"{_server_says(result.get('server'))}"
             f"{'; verifier threads ' + str(result['verifier_threads']) if result.get('verifier_threads') else ''}.",
             "", _clock_line(result), ""]
    harness = result.get("harness")
    if harness and harness.get("kind") == "locust":
        lines += [f"Edges as Locust users on {harness['workers']} worker process(es) (each: its edges on one event loop, "
                  "its links in a process of their own); Locust's merged statistics, the verifier's counters scraped "
                  "when the window opened and closed. Committed tokens, the edges' count against the verifier's: "
                  + ", ".join(f"{r['edges']}/{r['mode']}: {r['committed_tokens']}/{_f(r.get('verifier_committed_tokens'), 1, 0)}"
                              for r in result["runs"]), ""]
    flagged = [r for r in result["runs"] if r.get("not_representative")]
    if flagged:
        lines += ["**Not representative** (the harness saturated this machine's CPU; the verifier's figures "
                  "are the harness's): " + "; ".join(f"{r['edges']} edges {r['mode']}: {r['not_representative']}"
                                                    for r in flagged), ""]
    slo = (f"p95 TPOT ≤ {cfg.get('slo_tpot_ms', 150.0):g} ms and p95 TTFT ≤ {cfg.get('slo_ttft_ms', 2000.0):g} ms")
    if result.get("capacity"):
        lines += [f"**Capacity at the SLO** ({slo}; the most edges among {', '.join(map(str, next(iter(result['capacity'].values()))['edges_run']))} "
                  "that met it): " + "; ".join(f"{mode} **{c['edges']}** edges ({c['goodput_tokens_per_s']:.1f} tok/s of "
                                              f"goodput there)" for mode, c in result["capacity"].items())
                  + _capacity_ratio(result["capacity"]), ""]
    lines += ["| edges | mode | tok/s | goodput tok/s | met SLO | TPOT p50 ms | p95 | p99 | TTFT p50 ms | p99 | passes/tok "
             "| target tok/tok | errors | replays | verifier CPU | RSS MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        errors = ", ".join(f"{k} {v}" for k, v in r["errors"].items()) or "0"
        mark = " ⚠" if r.get("not_representative") else ""
        lines.append(f"| {r['edges']}{mark} | {r['mode']} | {_f(r['committed_tokens_per_s'])} "
                     f"| {_f(r.get('goodput_tokens_per_s'))} | {_f(r.get('slo_met_share'), 100, 0)}% | {_f(r['tpot_p50_s'], 1e3)} "
                     f"| {_f(r['tpot_p95_s'], 1e3)} | {_f(r['tpot_p99_s'], 1e3)} | {_f(r['ttft_p50_s'], 1e3, 0)} "
                     f"| {_f(r['ttft_p99_s'], 1e3, 0)} | {_f(r['target_forward_passes_per_committed_token'], 1, 3)} "
                     f"| {_f(r['target_tokens_per_committed_token'], 1, 2)} | {errors} | {_f(r.get('session_replays'), 1, 0)} "
                     f"| {_f(r['verifier_cpu_cores'], 1, 2)} | {_f(r['verifier_peak_rss_mb'], 1, 0)} |")
    sources = sorted({r["target_cost_source"] for r in result["runs"]})
    lines += ["", "Goodput: tokens/s committed inside the window by requests that met the SLO (each judged on its "
                  "TPOT inside the window and, if it arrived inside it, its TTFT); 'met SLO' is the share of requests judged.",
              f"Target cost: {'; '.join(sources)}. TPOT is per request over its commits inside the window: "
                  "(last commit − first commit) / tokens between them; TTFT counts from the request's arrival. Verifier CPU is in cores busy.",
              *([] if virtual else [_harness_cpu_line(result)]),
              *_kv_lines(result["runs"]),
              *([] if virtual else ["Proxy lateness (mean per chunk, max): " + ", ".join(
                  f"{r['edges']}/{r['mode']}: {_f(r['proxy_mean_lateness_ms'], 1, 2)}/{_f(r['proxy_max_lateness_ms'], 1, 1)} ms"
                  for r in result["runs"])]), ""]
    return "\n".join(lines)


def _clock_line(result: dict) -> str:
    if result.get("clock") == "virtual":
        table = result["cost_table"]
        return (f"Clock: virtual. Every cost is the table's ({table['name']}: {table.get('source') or 'its source'}), the "
                "links are drawn from the seed, and the verifier runs in the same process: the figures do not depend on "
                "the machine that ran them or its load, and the CPU columns do not apply.")
    machine = result.get("machine", {})
    return f"Machine: {machine_summary(machine) if 'cpu_model' in machine else 'not recorded'}."


def _harness_cpu_line(result: dict) -> str:
    runs = result["runs"]
    if (result.get("harness") or {}).get("kind") == "locust":
        return ("CPU of the harness (cores busy; the busiest worker's edge host, the links of every worker, every "
                "Locust process, all of them; reporting to Locust, µs of the edges' loop per round): " + ", ".join(
                    f"{r['edges']}/{r['mode']}: {_f(r.get('edges_cpu_cores'), 1, 2)}/{_f(r.get('proxy_cpu_cores'), 1, 2)}/"
                    f"{_f(r.get('locust_cpu_cores'), 1, 2)}/{_f(r.get('harness_cpu_cores'), 1, 2)}; "
                    f"{_f(r.get('report_us_per_round'), 1, 1)} µs" for r in runs))
    return ("CPU of the harness (cores busy; edges: this process, every edge's client and drafting; proxies: every "
            "link): " + ", ".join(f"{r['edges']}/{r['mode']}: {_f(r.get('edges_cpu_cores'), 1, 2)}/"
                                  f"{_f(r.get('proxy_cpu_cores'), 1, 2)}" for r in runs))


def _kv_lines(runs: list[dict]) -> list[str]:
    kv = [(r, r["kv"]) for r in runs if r.get("kv")]
    if not kv:
        return []
    return ["Sessions' KV between rounds (idle share of the time from a round's arrival to the next's; parks, "
            "restores, ms each, MB per park; park + restore ms per round): " + ", ".join(
                f"{r['edges']}/{r['mode']}: {_f(k['idle_share'], 100, 0)}% idle, {k['parks']:.0f}/{k['restores']:.0f}, "
                f"{_f(k['park_ms'], 1, 2)}/{_f(k['restore_ms'], 1, 2)} ms, {_f(k['park_bytes'], 1e-6, 2)} MB, "
                f"{_f(k['move_ms_per_round'], 1, 2)} ms" for r, k in kv)]


def plot(result: dict, out: Path) -> dict[str, Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = {}
    modes = list(dict.fromkeys(r["mode"] for r in result["runs"]))
    for key, ylabel, name, scale in (("committed_tokens_per_s", "committed tokens/s (all edges)", "throughput", 1.0),
                                     ("tpot_p95_s", "time per output token p95 (ms)", "latency", 1e3)):
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode in modes:
            rs = sorted((r for r in result["runs"] if r["mode"] == mode), key=lambda r: r["edges"])
            xs = [r["edges"] for r in rs if r[key] is not None]
            ys = [r[key] * scale for r in rs if r[key] is not None]
            ax.plot(xs, ys, marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("edges")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{name} vs edges ({', '.join(result['config']['profiles'])})")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        paths[name] = out / f"{name}_vs_edges.png"
        fig.savefig(paths[name], dpi=110)
        plt.close(fig)
    return paths


def write_all(result: dict, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "load.json", "report": out / "load.md"}
    paths["json"].write_text(json.dumps(result, indent=1))
    paths["report"].write_text(markdown(result))
    paths.update(plot(result, out))
    return paths

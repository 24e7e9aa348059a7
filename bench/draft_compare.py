"""Build draft candidates from the bundled target, evaluate them together, write a markdown table.

    .venv/bin/python bench/draft_compare.py [--out-dir models/drafts] [--md results/draft_results.md]
                                            [--no-search] [--repeats 3]

Every candidate is built with the same code as `edge-client make-draft` (the table lists the
equivalent command) and scored by `edge-client eval-draft`'s code in one run, so every draft is
scored on the same target continuations and the speed runs take turns (see evaluate.py).
The recommendation is the candidate with the highest expected hybrid tokens/s on the 3g link,
among real drafts: the `copy` stand-in (the target itself) is listed but cannot be recommended,
because a draft that is as slow as the target leaves the edge nothing to gain from the cloud.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

from rich.console import Console

from edge_client.draftmaker import DraftSpec, make_draft, parse_blocks
from edge_client.draftmaker.evaluate import evaluate_drafts
from hybridspec.machine import announce, summary as machine_summary
from llama_runtime import bundled_model_path

# (file name, spec, make-draft arguments after --out)
CANDIDATES = [
    ("copy.gguf", DraftSpec(method="copy"), "--method copy"),
    ("q4_0.gguf", DraftSpec(method="requant", ftype="Q4_0"), "--method requant --type Q4_0"),
    ("q3_k_s.gguf", DraftSpec(method="requant", ftype="Q3_K_S"), "--method requant --type Q3_K_S"),
    ("q4_0-embq4_0.gguf", DraftSpec(method="requant", ftype="Q4_0", embd_type="Q4_0"),
     "--method requant --type Q4_0 --embd-type Q4_0"),
    ("drop4-7.gguf", DraftSpec(method="skip", drop=[4, 5, 6, 7]), "--method skip --drop 4-7"),
    ("drop26-27.gguf", DraftSpec(method="skip", drop=[26, 27]), "--method skip --drop 26-27"),
    ("drop4-7-q4_0.gguf", DraftSpec(method="skip+requant", drop=[4, 5, 6, 7], ftype="Q4_0"),
     "--method skip+requant --drop 4-7 --type Q4_0"),
]
SEARCH = ("search26.gguf", DraftSpec(method="search", search_blocks=26, min_agreement=0.5),
          "--method search --blocks 26")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="models/drafts")
    ap.add_argument("--md", default="results/draft_results.md")
    ap.add_argument("--json", help="also write the full eval reports here")
    ap.add_argument("--no-search", action="store_true", help="skip the (minutes-long) greedy search candidate")
    ap.add_argument("--reuse", action="store_true", help="reuse candidate files already in --out-dir")
    ap.add_argument("--repeats", type=int, default=3, help="speed repeats (medians)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--render", metavar="JSON", help="only re-render the markdown from a --json file of an earlier run")
    args = ap.parse_args()
    machine = announce()
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        built = [(b["name"], Path(b["path"]), b["command"], b["info"]) for b in saved["built"]]
        md = render_markdown(built, saved["reports"], saved["load_average"], saved["date"])
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md).write_text(md, encoding="utf-8")
        print(md)
        return 0

    console = Console(stderr=True)
    target = bundled_model_path()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    candidates = CANDIDATES + ([] if args.no_search else [SEARCH])
    built = []
    for name, spec, cli_args in candidates:
        path = out_dir / name
        sidecar = path.with_name(path.name + ".json")
        if args.reuse and path.is_file() and sidecar.is_file():
            info = json.loads(sidecar.read_text())
        else:
            with console.status(f"building {name}") as status:
                info = make_draft(target, path, spec, progress=status.update)
        console.print(f"built {name} in {info['elapsed_s']:.1f} s ({info['bytes'] / 1e6:.1f} MB)")
        built.append((name, path, f"edge-client make-draft --out {path} {cli_args}", info))
        if spec.method == "search":
            # The searched block set, requantized: the same drop list, so no second search.
            drop = info["dropped_blocks"]
            q_name, q_path = name.replace(".gguf", "-q4_0.gguf"), out_dir / name.replace(".gguf", "-q4_0.gguf")
            q_spec = DraftSpec(method="skip+requant", drop=parse_blocks(drop), ftype="Q4_0")
            q_info = (json.loads(q_path.with_name(q_path.name + ".json").read_text())
                      if args.reuse and q_path.is_file() else make_draft(target, q_path, q_spec))
            built.append((q_name, q_path, f"edge-client make-draft --out {q_path} --method skip+requant "
                                          f"--drop {drop} --type Q4_0", q_info))

    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    with console.status("evaluating") as status:
        reports = evaluate_drafts(target, [p for _, p, _, _ in built], max_new_tokens=args.tokens,
                                  speed_repeats=args.repeats, progress=status.update,
                                  prompts_file=None)
    console.print(f"evaluated {len(built)} drafts in {time.perf_counter() - t0:.0f} s")
    reps = [r.to_json() for r in reports]
    load = (load_before, os.getloadavg()[0])
    today = dt.date.today().isoformat()
    md = render_markdown(built, reps, load, today)
    Path(args.md).parent.mkdir(parents=True, exist_ok=True)
    Path(args.md).write_text(md, encoding="utf-8")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": today, "machine": machine, "load_average": load, "reports": reps,
            "built": [{"name": n, "path": str(p), "command": c, "info": i} for n, p, c, i in built]}, indent=1))
    print(md)
    return 0


def render_markdown(built, reps, load: tuple[float, float], today: str) -> str:
    lines = []
    r0 = reps[0]
    v, h0, s = r0["verify"], r0["hybrid"], r0["settings"]
    lines += [
        "# Draft candidates for the bundled target (SmolLM2-135M-Instruct Q4_1)",
        "",
        f"Measured on {today} on {machine_summary()} (shared with other jobs; timings "
        "are noisy, ±10–25 %), with `bench/draft_compare.py`. Every draft was scored in one `eval-draft` run "
        "on the same target continuations.",
        f"The 1-minute load average was {load[0]:.1f} before and {load[1]:.1f} after the evaluation (2 cores): "
        "other jobs were running. The 2-thread speeds suffer most from that (llama.cpp's two threads wait on "
        "each other when one is descheduled), so rank drafts by the 1-thread figures; on an idle machine the "
        "target decodes at 75–100 tok/s with 2 threads (shared/reference/measured-on-these-machines.md, A).",
        "",
        f"* Prompts: `edge_client/prompts/eval.jsonl` (6 categories x 3), chat template applied; "
        f"{s['continuation']} continuations of ≤{s['max_new_tokens']} tokens "
        "(T=0 greedy; T=0.7 and T=1 sampled by the target at that temperature); "
        f"{r0['overall']['positions']['0']} positions per temperature.",
        "* α = mean Σ_x min(p_T, q_T), exact, teacher-forced (both models in one batch); α at T=0 = greedy "
        "agreement.",
        f"* Decode speed: one token per call, median of {r0['speed']['repeats']} x {r0['speed']['tokens']} tokens, "
        "all models taking turns. Target decode (1 / 2 threads): "
        f"{r0['speed']['target']['1']:.1f} / {r0['speed']['target'].get('2', float('nan')):.1f} tok/s.",
        f"* Target verify cost (measured, {v['threads']} thread, the demo verifier's setting): "
        f"{v['base_s'] * 1e3:.1f} ms for a γ=0 round + {v['per_token_s'] * 1e3:.2f} ms per draft token "
        "(least-squares line over k = γ+1 = 1..13 rows).",
        f"* Hybrid tok/s: expected tokens per round / round time at the best γ ≤ 12 on the '{h0['link']}' "
        f"profile (RTT {h0['rtt_s'] * 1e3:.0f} ms, uplink {h0['uplink_bytes_per_s'] * 8 / 1e3:.0f} kbit/s), "
        f"α at T={h0['temperature']:g}, draft with 1 thread, q payload fixed:16:16. Loss and jitter left out.",
        f"* For scale: cloud-only (the verifier streams the target's own tokens) runs at about "
        f"{h0['cloud_only_tokens_per_s']:.0f} tok/s after the first token on this verifier, far above any hybrid "
        "figure here: with a 135M target the hybrid's case is cloud cost, not speed.",
        "",
        "| draft | make-draft command | blocks | MB | greedy agr. | α T=0.7 | α T=1 | draft tok/s 1t | 2t "
        "| E[tokens/round] γ=4 (T=0.7) | hybrid tok/s (3g) | best γ |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    best = None
    for (name, path, cmd, info), rep in zip(built, reps):
        a, sp, h = rep["overall"]["alpha"], rep["speed"], rep["hybrid"]
        label = name + (" (stand-in: the target itself)" if info["method"] == "copy" else "")
        lines.append(
            f"| {label} | `{cmd}` | {info['blocks']} | {info['bytes'] / 1e6:.1f} | {a['0']:.3f} | {a['0.7']:.3f} "
            f"| {a['1']:.3f} | {sp['draft']['1']:.1f} | {sp['draft'].get('2', float('nan')):.1f} "
            f"| {rep['expected_tokens_per_round']['0.7']['4']:.2f} | {h['tokens_per_s']:.2f} | {h['best_gamma']} |")
        if info["method"] != "copy" and (best is None or h["tokens_per_s"] > best[1]["hybrid"]["tokens_per_s"]):
            best = ((name, path, cmd, info), rep)
    lines.append("")
    lines.append("Per category (α at T=0 / 0.7 / 1):")
    lines.append("")
    cats = list(reps[0]["categories"])
    lines.append("| draft | " + " | ".join(cats) + " |")
    lines.append("|---|" + "---|" * len(cats))
    for (name, *_), rep in zip(built, reps):
        cells = []
        for c in cats:
            a = rep["categories"][c]["alpha"]
            cells.append(f"{a['0']:.2f} / {a['0.7']:.2f} / {a['1']:.2f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for (name, path, cmd, info), rep in zip(built, reps):
        if "search" in info:
            srch = info["search"]
            lines += ["", f"Greedy search for {name}: {srch['candidates_evaluated']} candidates in "
                          f"{srch['elapsed_s']:.0f} s, calibration {len(srch['calibration']['prompts'])} prompts x "
                          f"{srch['calibration']['tokens_per_prompt']} tokens; dropped (in order) "
                          + ", ".join(f"{st['removed']} ({st['agreement']:.3f})" for st in srch["steps"])
                          + f"; stopped: {srch['stopped']}."]
    if best is not None:
        (name, path, cmd, info), rep = best
        lines += ["", f"**Recommended demo draft: {name}** — highest expected hybrid tokens/s on the 3g link "
                      f"({rep['hybrid']['tokens_per_s']:.2f} tok/s at γ = {rep['hybrid']['best_gamma']}). Build it with:",
                  "", "```", f"edge-client make-draft --out models/smollm2-draft.gguf {cmd.split(str(path), 1)[1].strip()}",
                  "```"]
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

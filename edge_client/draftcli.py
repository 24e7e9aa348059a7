"""edge-client make-draft / eval-draft: build a draft GGUF from the target, and measure it.

  edge-client make-draft --target TARGET.gguf --out DRAFT.gguf [--method requant --type Q4_0]
  edge-client eval-draft --target TARGET.gguf --draft DRAFT.gguf [--prompts PROMPTS.jsonl] [--json]
  edge-client eval-draft --target gemma --draft models/smollm2-draft.gguf   # across tokenizers (TLI)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
import time
from typing import TYPE_CHECKING, Callable, Iterator

if TYPE_CHECKING:  # rich is the `draft` extra: `edge-client generate` must not need it
    from rich.console import Console

# The default draft: the best expected hybrid tokens/s on the 3g link among the candidates in
# bench/draft_compare.py (its report: results/draft_results.md), for the bundled SmolLM2-135M Q4_1 target.
RECOMMENDED_METHOD = "requant"
RECOMMENDED_TYPE = "Q4_0"


def add_parsers(sub) -> None:
    from edge_client.draftmaker.make import METHODS
    from edge_client.draftmaker.quantize import FTYPES, TENSOR_TYPES

    p = sub.add_parser("make-draft", help="build a draft GGUF from the target (requantize, skip layers, search)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target GGUF, or a bundled model's name: smollm2 (default) or gemma")
    p.add_argument("--out", required=True, help="draft GGUF to write (provenance goes to OUT.json)")
    p.add_argument("--method", choices=METHODS, default=RECOMMENDED_METHOD,
                   help=f"how to make the draft (default {RECOMMENDED_METHOD}); 'copy' is a stand-in for tests")
    p.add_argument("--type", dest="ftype", choices=list(FTYPES), default=RECOMMENDED_TYPE,
                   help=f"quantization type for the *requant methods (default {RECOMMENDED_TYPE})")
    p.add_argument("--embd-type", choices=list(TENSOR_TYPES),
                   help="also requantize the token embedding / output head to this type (default: llama.cpp's choice)")
    p.add_argument("--drop", help="skip methods: original block ids to drop, e.g. 4-7 or 3,26-27")
    p.add_argument("--keep", help="skip methods: original block ids to keep instead of --drop, e.g. 0-25,28-29")
    p.add_argument("--blocks", type=int, help="search: stop at this many blocks (default: all but 4)")
    p.add_argument("--min-agreement", type=float, default=0.5,
                   help="search: stop before calibration agreement drops below this (default 0.5)")
    p.add_argument("--candidates", help="search: only these block ids may be dropped (default: all)")
    p.add_argument("--shortlist", type=int, default=8,
                   help="search: blocks tried per step after the first, least harmful first (0 = all; default 8)")
    p.add_argument("--calib-prompts", type=int, default=3, help="search: calibration prompts (default 3)")
    p.add_argument("--calib-tokens", type=int, default=32, help="search: target tokens per prompt (default 32)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: robust on a busy 2-core machine)")
    p.add_argument("--json", action="store_true", help="print the provenance as JSON")
    p.set_defaults(func=cmd_make_draft)

    p = sub.add_parser("eval-draft", help="acceptance, speed and hybrid tokens/s of a draft against its target",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target GGUF, or a bundled model's name: smollm2 (default: SmolLM2-135M-Instruct "
                                    "Q4_1) or gemma (Gemma 3 270M, scripts/setup.sh --with gemma)")
    p.add_argument("--draft", required=True, action="append",
                   help="draft GGUF, or a bundled model's name (smollm2, gemma); repeat to compare several drafts on "
                        "the same target continuations. A draft of another tokenizer is scored across "
                        "vocabularies (token-level intersection), with the vocabulary overlap")
    p.add_argument("--strict-vocab", action="store_true",
                   help="refuse a draft whose tokenizer differs from the target's instead of scoring it across vocabularies")
    p.add_argument("--prompts", help="JSON lines {category, prompt} (default: edge_client/prompts/eval.jsonl)")
    p.add_argument("--per-category", type=int, default=0, help="use at most N prompts per category (0 = all)")
    p.add_argument("--tokens", type=int, default=48, help="target tokens per prompt to score (default 48)")
    p.add_argument("--temperatures", default="0,0.7,1", help="comma-separated (default 0,0.7,1)")
    p.add_argument("--continuation", choices=["sampled", "greedy"], default="sampled",
                   help="sampled: the target samples its continuation at each T (default); greedy: one greedy "
                        "continuation for every T (faster, optimistic for T > 0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the target's sampled continuations")
    p.add_argument("--threads", type=int, default=1,
                   help="threads for the acceptance runs (default 1: robust on a busy 2-core machine)")
    p.add_argument("--no-speed", action="store_true", help="skip the speed and verify-cost measurements")
    p.add_argument("--speed-tokens", type=int, default=32, help="tokens decoded per speed measurement")
    p.add_argument("--speed-repeats", type=int, default=3, help="speed measurements per model (the median is kept)")
    p.add_argument("--verify-threads", type=int, default=1,
                   help="threads of the target when timing verification (default 1, as the demo's verifier)")
    p.add_argument("--draft-threads", type=int, default=1,
                   help="draft threads in the figure of merit (default 1, as the demo's edge)")
    p.add_argument("--link", default="3g", help="netsim profile for the figure of merit (default 3g)")
    p.add_argument("--fom-temperature", type=float, default=0.7,
                   help="temperature whose α the figure of merit uses (default 0.7)")
    p.add_argument("--max-gamma", type=int, default=12, help="largest γ the figure of merit tries (default 12)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=cmd_eval_draft)


@contextlib.contextmanager
def steps(err: Console, what: str) -> Iterator[Callable[[str], None]]:
    """Progress of long work on standard error, as a callback that takes the step being done.

    On a terminal: a spinner with the step and the time elapsed, cleared when the work ends.
    Otherwise (piped, logged, in CI): one line per step with the seconds since the start, so a
    long run is never silent."""
    if err.is_terminal:
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err,
                      transient=True) as progress:
            task = progress.add_task(what, total=None)
            yield lambda step: progress.update(task, description=f"{what}: {step}")
        return
    start = time.monotonic()

    def line(step: str) -> None:
        print(f"[{time.monotonic() - start:5.0f} s] {what}: {step}", file=sys.stderr, flush=True)
    line("started")
    yield line


def _target(args) -> str:
    return _model(args.target or "smollm2")


def _model(spec: str) -> str:
    """A GGUF path, or a bundled model's name (smollm2, gemma), as a readable file's path
    (ModelMissing, a FileNotFoundError, says how to get one that is not there)."""
    from llama_runtime import find_model
    return str(find_model(spec))


def cmd_make_draft(args) -> int:
    from rich.console import Console
    from rich.table import Table
    from edge_client.draftmaker.layers import parse_blocks
    from edge_client.draftmaker.make import DraftSpec, make_draft

    err = Console(stderr=True)
    try:
        target = _target(args)
        drop: list[int] = []
        if args.method.startswith("skip"):
            if bool(args.drop) == bool(args.keep):
                raise ValueError("give exactly one of --drop or --keep with a skip method")
            if args.drop:
                drop = parse_blocks(args.drop)
            else:
                n_blocks = _block_count(target)
                keep = set(parse_blocks(args.keep, n_blocks))
                drop = [b for b in range(n_blocks) if b not in keep]
        spec = DraftSpec(method=args.method, ftype=args.ftype, embd_type=args.embd_type, drop=drop,
                         search_blocks=args.blocks, min_agreement=args.min_agreement,
                         search_candidates=parse_blocks(args.candidates) if args.candidates else None,
                         search_shortlist=args.shortlist,
                         calib_prompts=args.calib_prompts, calib_tokens=args.calib_tokens, threads=args.threads,
                         extra={"command": _make_command(args, target)})
        with steps(err, f"making {args.out}") as step:
            info = make_draft(target, args.out, spec, progress=step)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        err.print(f"[red]make-draft:[/red] {e}", soft_wrap=True)   # one line, however long
        return 2
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    out = Console()
    t = Table(title=f"draft {args.out}", show_header=False)
    for key in ("method", "blocks", "kept_blocks", "dropped_blocks", "ftype", "embd_type", "note"):
        if info.get(key) is not None:
            t.add_row(key, str(info[key]))
    t.add_row("size", f"{info['bytes'] / 1e6:.1f} MB (target {info['target_bytes'] / 1e6:.1f} MB)")
    t.add_row("fingerprint", f"{info['fingerprint'][:16]}… (same as the target)")
    t.add_row("time", f"{info['elapsed_s']:.1f} s")
    out.print(t)
    if "search" in info:
        s = info["search"]
        st = Table(title=f"greedy search ({s['candidates_evaluated']} candidates, {s['elapsed_s']:.0f} s): "
                         f"{s['stopped']}")
        for col in ("step", "dropped block", "blocks left", "agreement", "α (T=1)", "tried", "s"):
            st.add_column(col, justify="right")
        for i, step in enumerate(s["steps"], 1):
            st.add_row(str(i), str(step["removed"]), str(step["blocks_left"]), f"{step['agreement']:.3f}",
                       f"{step['alpha_t1']:.3f}", str(step["candidates"]), f"{step['seconds']:.1f}")
        out.print(st)
    out.print(f"provenance: {args.out}.json")
    return 0


def _make_command(args, target: str) -> str:
    """The make-draft command that reproduces this draft, for its provenance file."""
    parts = ["edge-client", "make-draft", "--target", target, "--out", args.out, "--method", args.method]
    if "requant" in args.method:
        parts += ["--type", args.ftype] + (["--embd-type", args.embd_type] if args.embd_type else [])
    if args.method.startswith("skip"):
        parts += ["--drop", args.drop] if args.drop else ["--keep", args.keep]
    if args.method.startswith("search"):
        parts += [f"--min-agreement={args.min_agreement}", f"--shortlist={args.shortlist}",
                  f"--calib-prompts={args.calib_prompts}", f"--calib-tokens={args.calib_tokens}"]
        parts += [f"--blocks={args.blocks}"] if args.blocks else []
        parts += [f"--candidates={args.candidates}"] if args.candidates else []
    return shlex.join(parts)


def _block_count(path: str) -> int:
    from llama_runtime import GGUFModel
    m = GGUFModel(path, n_threads=1)
    try:
        return int(m.metadata(f"{m.metadata('general.architecture')}.block_count"))
    finally:
        m.close()


def link_figures(name: str):
    """The figure of merit's LinkFigures of a netsim profile (KeyError names the known ones)."""
    from edge_client.draftmaker.evaluate import LinkFigures
    from netsim.profiles import get_profile
    profile = get_profile(name)
    rate = profile.uplink.rate_kbit_s()
    return LinkFigures(name, profile.rtt_ms() / 1000.0, (rate * 1000.0 / 8.0) if rate else float("inf"))


def cmd_eval_draft(args) -> int:
    from rich.console import Console
    from edge_client.draftmaker.evaluate import evaluate_drafts, load_prompts
    from spec_core.warping import SamplingSettings

    err = Console(stderr=True)
    try:
        # Checked as sampling settings (the one rule), before any model loads.
        temps = [SamplingSettings(temperature=float(t)).temperature for t in args.temperatures.split(",") if t.strip()]
        SamplingSettings(temperature=args.fom_temperature)
        prompts = load_prompts(args.prompts)
        if args.per_category:
            prompts = _first_per_category(prompts, args.per_category)
        target, drafts = _target(args), [_model(d) for d in args.draft]   # all there, before the work starts
        with steps(err, "eval-draft") as step:
            reports = evaluate_drafts(
                target, drafts, prompts, cross_vocab=not args.strict_vocab, max_new_tokens=args.tokens, temperatures=temps,
                continuation=args.continuation, seed=args.seed, threads=args.threads,
                measure_speed=not args.no_speed, speed_tokens=args.speed_tokens, speed_repeats=args.speed_repeats,
                verify_threads=args.verify_threads, link=link_figures(args.link), fom_temperature=args.fom_temperature,
                draft_threads=args.draft_threads, max_gamma=args.max_gamma,
                prompts_file=args.prompts or "edge_client/prompts/eval.jsonl",
                progress=step)
    except (ValueError, FileNotFoundError, KeyError) as e:
        err.print(f"[red]eval-draft:[/red] {e}", soft_wrap=True)   # one line, however long
        return 2
    if args.json:
        docs = [r.to_json() for r in reports]
        print(json.dumps(docs[0] if len(docs) == 1 else {"reports": docs}))
        return 0
    out = Console()
    for r in reports:
        print_report(r.to_json(), out)
    if len(reports) > 1:
        print_comparison([r.to_json() for r in reports], out)
    return 0


def print_comparison(reps: list[dict], out: Console) -> None:
    from rich.table import Table
    t = Table(title="drafts compared (same target continuations)")
    for col in ("draft", "vocab", "greedy agr.", "α T=0.7", "α T=1", "draft tok/s 1t", "2t", "hybrid tok/s", "best γ"):
        t.add_column(col, justify="left" if col in ("draft", "vocab") else "right")
    for rep in reps:
        a, s, h = rep["overall"]["alpha"], rep.get("speed"), rep.get("hybrid")
        v = rep.get("vocabulary")
        t.add_row(rep["draft"]["name"], f"TLI, {v['share']:.1%} shared" if v else "same", f"{a['0']:.3f}", f"{a.get('0.7', float('nan')):.3f}",
                  f"{a.get('1', float('nan')):.3f}",
                  f"{s['draft']['1']:.1f}" if s else "-", f"{s['draft'].get('2', float('nan')):.1f}" if s else "-",
                  f"{h['tokens_per_s']:.2f}" if h else "-", str(h["best_gamma"]) if h else "-")
    out.print(t)


def _first_per_category(prompts, n: int):
    seen: dict[str, int] = {}
    out = []
    for p in prompts:
        if seen.get(p.category, 0) < n:
            seen[p.category] = seen.get(p.category, 0) + 1
            out.append(p)
    return out


def print_report(rep: dict, out: Console) -> None:
    from rich.table import Table
    temps = list(rep["overall"]["alpha"])
    t = Table(title=f"{rep['draft']['name']} as a draft for {rep['target']['name']} "
                    f"({rep['settings']['continuation']} continuations, ≤{rep['settings']['max_new_tokens']} tokens)")
    t.add_column("category")
    t.add_column("prompts", justify="right")
    t.add_column("positions", justify="right")
    for temp in temps:
        t.add_column("greedy agreement" if temp == "0" else f"α T={temp}", justify="right")
    cover = "coverage" in rep["overall"]  # across tokenizers: share of target tokens the draft has
    for temp in temps if cover else []:
        t.add_column(f"covered T={temp}", justify="right")
    rows = list(rep["categories"].items()) + [("overall", rep["overall"])]
    for name, c in rows:
        if name == "overall":
            t.add_section()
        t.add_row(name, str(c["prompts"]), str(c["positions"].get("0", "")),
                  *(f"{c['alpha'][temp]:.3f}" for temp in temps),
                  *(f"{c['coverage'][temp]:.3f}" for temp in temps if cover))
    out.print(t)
    v = rep.get("vocabulary")
    if v:
        out.print(f"across tokenizers (TLI): {v['shared_strings']:,} of the draft's {v['draft_strings']:,} distinct "
                  f"token strings ({v['share']:.1%}) are target tokens; {v['mapped_tokens']:,} of its "
                  f"{v['draft_tokens']:,} ids can be proposed (target vocabulary {v['target_tokens']:,}); "
                  "'covered' = share of the target's generated tokens the draft has")

    e = Table(title="expected tokens per round (1 − α^(γ+1)) / (1 − α)")
    e.add_column("T")
    gammas = list(next(iter(rep["expected_tokens_per_round"].values())))
    for g in gammas:
        e.add_column(f"γ={g}", justify="right")
    for temp, row in rep["expected_tokens_per_round"].items():
        e.add_row(temp, *(f"{row[g]:.2f}" for g in gammas))
    out.print(e)

    if rep.get("speed"):
        s = Table(title=f"decode speed, tokens/s (median of {rep['speed']['repeats']} x {rep['speed']['tokens']} tokens)")
        s.add_column("model")
        threads = sorted(rep["speed"]["draft"], key=int)
        for th in threads:
            s.add_column(f"{th} thread{'s' if th != '1' else ''}", justify="right")
        for role in ("draft", "target"):
            s.add_row(role, *(f"{rep['speed'][role].get(th, float('nan')):.1f}" for th in threads))
        out.print(s)
        v, h = rep["verify"], rep["hybrid"]
        out.print(f"target verify cost ({v['threads']} thread): {v['base_s'] * 1e3:.1f} ms for γ=0 "
                  f"+ {v['per_token_s'] * 1e3:.2f} ms per draft token ({v['method']})")
        out.print(f"[bold]figure of merit[/bold] on '{h['link']}' (RTT {h['rtt_s'] * 1e3:.0f} ms, "
                  f"{h['bytes_per_draft_token']:.0f} B per draft token), α(T={h['temperature']:g}) = {h['alpha']:.3f}, "
                  f"draft {h['draft_threads']} thread: [bold]{h['tokens_per_s']:.2f} tokens/s[/bold] at γ = "
                  f"{h['best_gamma']} (cloud-only streaming on the same verifier: "
                  f"{h['cloud_only_tokens_per_s']:.1f} tokens/s after the first token)")
    out.print(f"[dim]{rep['elapsed_s']:.0f} s[/dim]")

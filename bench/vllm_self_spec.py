"""vLLM speculating for itself, beside plain decoding, on the machine at hand (a benchmark).

The per-GPU comparison (netsim/fleet/regime.py, docs/operators.md) names two baselines for the hybrid:
plain decoding and vLLM's own speculative decoding with the draft's cost charged on the GPU. This
measures the second on a real engine: the same prompts, the same greedy settings, one engine per
method, side by side in one run:

  none          plain decoding
  ngram         vLLM's n-gram proposer (prompt lookup on the CPU: speculative_config method "ngram")
  draft_model   a draft model on the same GPU (method "draft_model"); by default the target itself
                (the bundled SmolLM2, its own draft: α near 1, so the figure is what the draft's passes
                and the verify pass cost, not what a real pair gains)

EAGLE needs a trained head for the target, which no model here has: not measured.

Per method: output tokens/s over all requests (wall clock of one `generate` over --prompts requests at
once), vLLM's own spec-decode counters where it has them (drafts, draft tokens, accepted tokens:
acceptance = accepted / draft tokens; mean tokens per step = 1 + accepted / drafts; and per position,
`spec_decode_num_accepted_tokens_per_pos` / drafts: the proposer's acceptance curve, `reach`, as
netsim.fleet.acceptance reads one; vLLM counts the steps that drafted, so for n-gram it is the curve
given a match, where netsim's emulation (edge_client/draftmaker/chain.py) counts every step and
reports the share that matched), and whether each greedy output equals plain decoding's
(speculative decoding is lossless: it should). The engines keep their stats (disable_log_stats
False): without them `LLM.get_metrics()` has no spec-decode counters.

With --prompts-file (eval-draft's JSON lines, e.g. edge_client/prompts/eval.jsonl) the requests are
those prompts in the target's chat template, as token ids (the bundled GGUF's tokenizer, which the
dequantized folder shares): the same prompts `edge-client eval-draft --prompts FILE` scores our device
draft on, so the two curves compare (bench/gpu_check.sh does both). A method this
vLLM refuses (e.g. a CPU build without speculative decoding) is reported as refused, with vLLM's
message, and the run goes on.

  .venv-vllm/bin/python bench/vllm_self_spec.py --vllm-arg gpu_memory_utilization=0.3   # on a GPU
  .venv-vllm/bin/python bench/vllm_self_spec.py --prompts 2 --max-tokens 8              # CPU, small
  python bench/vllm_self_spec.py --dry-run        # print the engines' arguments; needs no vLLM

Writes --out (JSON) and the same with .md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("none", "ngram", "draft_model")
TEXT = ("The verifier checks every drafted token in one pass and answers with the accepted prefix and one "
        "more token. Repeat the key facts: the verifier checks every drafted token in one pass. ")


def literal(value: str):
    """KEY=VALUE's value as the engine wants it: int, float, bool or the string."""
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(value.lower(), value)


def speculative_config(method: str, gamma: int, draft: str) -> dict | None:
    """vLLM's `speculative_config` for a method (vLLM docs: features/speculative_decoding)."""
    if method == "none":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": gamma, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if method == "draft_model":
        return {"method": "draft_model", "model": draft, "num_speculative_tokens": gamma}
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def spec_counters(llm) -> dict:
    """vLLM's spec-decode counters (vllm:spec_decode_num_*), where this vLLM has `get_metrics`; the
    per-position one (a Vector) as a list."""
    out = {}
    try:
        for metric in llm.get_metrics():
            name = getattr(metric, "name", "")
            if name.startswith("vllm:spec_decode_num_"):
                values = getattr(metric, "values", None)
                out[name.removeprefix("vllm:spec_decode_num_")] = (list(values) if values is not None
                                                                     else getattr(metric, "value", None))
    except Exception:   # noqa: BLE001 - an older vLLM: no counters, the figure says so
        return {}
    return out


def run_method(method: str, folder: str, engine_args: dict, prompts: list, max_tokens: int, gamma: int,
               draft: str) -> dict:
    from vllm import LLM, SamplingParams
    spec = speculative_config(method, gamma, draft)
    try:
        llm = LLM(model=folder, **engine_args, **({"speculative_config": spec} if spec else {}))
    except Exception as exc:   # noqa: BLE001 - a refusal is a result here (e.g. no speculative decoding on CPU)
        return {"method": method, "refused": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompts[:1], params)   # warm-up (graphs, caches)
        before = spec_counters(llm)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        after = spec_counters(llm)
    finally:
        del llm
        try:
            import gc

            import torch
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    row = {"method": method, "speculative_config": spec, "requests": len(prompts), "output_tokens": tokens,
           "seconds": seconds, "tokens_per_s": tokens / seconds,
           "texts": [list(o.outputs[0].token_ids) for o in outputs]}
    delta = {}
    for k, v in after.items():
        b = before.get(k)
        delta[k] = ([x - (b[i] if b and i < len(b) else 0) for i, x in enumerate(v)] if isinstance(v, list)
                    else (v or 0) - (b or 0))
    if delta.get("draft_tokens"):
        row["acceptance"] = delta.get("accepted_tokens", 0) / delta["draft_tokens"]
        row["tokens_per_step"] = 1.0 + delta.get("accepted_tokens", 0) / max(delta.get("drafts", 0), 1)
        per_pos = delta.get("accepted_tokens_per_pos")
        if isinstance(per_pos, list) and delta.get("drafts"):
            row["reach"] = [x / delta["drafts"] for x in per_pos]
    row["counters"] = delta
    return row


def eval_prompts(path: str, per_category: int = 0) -> list:
    """eval-draft's prompts in the bundled target's chat template, as vLLM token prompts."""
    from edge_client.draftmaker.evaluate import load_prompts, prompt_ids
    from llama_runtime import GGUFModel, find_model
    prompts = load_prompts(path)
    if per_category:
        seen: dict[str, int] = {}
        prompts = [p for p in prompts if seen.setdefault(p.category, 0) < per_category
                   and not seen.__setitem__(p.category, seen[p.category] + 1)]
    model = GGUFModel(str(find_model("smollm2")), n_threads=1, vocab_only=True)
    try:
        return [{"prompt_token_ids": prompt_ids(model, p)} for p in prompts]
    finally:
        model.close()


def markdown(result: dict) -> str:
    lines = [f"# vLLM speculating for itself ({result['model']}, vLLM {result['vllm']})", "",
             f"{result['prompts']} requests at once, {result['max_tokens']} greedy tokens each, γ {result['gamma']}; "
             f"engine {result['engine_args']}; {result['machine']}.", "",
             "| method | tok/s | × plain | acceptance | tokens per step | per position | outputs equal to plain |",
             "|---|---|---|---|---|---|---|"]
    base = next((r for r in result["rows"] if r["method"] == "none" and "tokens_per_s" in r), None)
    for r in result["rows"]:
        if "refused" in r:
            lines.append(f"| {r['method']} | refused: {r['refused']} | | | | | |")
            continue
        x = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "–"
        acc = f"{r['acceptance']:.2f}" if "acceptance" in r else "–"
        tps = f"{r['tokens_per_step']:.2f}" if "tokens_per_step" in r else "–"
        reach = " / ".join(f"{v:.2f}" for v in r["reach"]) if r.get("reach") else "–"
        lines.append(f"| {r['method']} | {r['tokens_per_s']:,.1f} | {x} | {acc} | {tps} | {reach} | {r.get('equal', '–')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default=",".join(METHODS), help=f"some of {','.join(METHODS)}")
    ap.add_argument("--prompts", type=int, default=64, help="requests generated at once")
    ap.add_argument("--max-tokens", type=int, default=128, help="greedy tokens per request")
    ap.add_argument("--gamma", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--vllm-model", default=None, help="HF folder (default: the bundled SmolLM2 dequantized)")
    ap.add_argument("--draft-model", default=None, help="the draft model's folder (default: the target itself)")
    ap.add_argument("--vllm-arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--prompts-file", default=None,
                    help="eval-draft prompts (JSON lines): the requests are these, as the target's chat-template ids")
    ap.add_argument("--per-category", type=int, default=0, help="with --prompts-file: at most N prompts per category")
    ap.add_argument("--dry-run", action="store_true", help="print each engine's arguments and stop (no vLLM needed)")
    ap.add_argument("--out", default=str(ROOT / "results" / "vllm_self_spec.json"))
    args = ap.parse_args(argv)
    methods = args.methods.split(",")
    for m in methods:
        speculative_config(m, args.gamma, "draft")   # refuse an unknown method before any engine starts
    # disable_log_stats=False: LLM.get_metrics() has the spec-decode counters only when stats are kept
    engine_args = {"max_model_len": 1024, "disable_log_stats": False, **{k: literal(v) for k, v in (kv.split("=", 1) for kv in args.vllm_arg)}}
    prompts = (eval_prompts(args.prompts_file, args.per_category) if args.prompts_file
               else [f"[{i}] {TEXT * 3}" for i in range(args.prompts)])
    if args.dry_run:
        folder = args.vllm_model or "<the bundled SmolLM2 folder>"
        for m in methods:
            print(json.dumps({"method": m, "model": folder, **engine_args,
                              "speculative_config": speculative_config(m, args.gamma, args.draft_model or folder)}))
        return 0
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    import vllm

    from hybridspec.machine import summary as machine_summary
    folder = args.vllm_model
    if folder is None:
        from hybridspec.testing.vllm_model import smollm2_folder
        folder = str(smollm2_folder())
    rows = [run_method(m, folder, engine_args, prompts, args.max_tokens, args.gamma, args.draft_model or folder)
            for m in methods]
    base = next((r for r in rows if r["method"] == "none" and "texts" in r), None)
    for r in rows:
        if base and "texts" in r:
            r["equal"] = f"{sum(a == b for a, b in zip(r['texts'], base['texts']))} / {len(base['texts'])}"
    for r in rows:
        r.pop("texts", None)
    result = {"machine": machine_summary(), "vllm": vllm.__version__, "model": Path(folder).name,
              "engine_args": engine_args, "prompts": len(prompts), "prompts_file": args.prompts_file, "max_tokens": args.max_tokens, "gamma": args.gamma,
              "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
              "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {out}, {out.with_suffix('.md')}")
    return 0 if any("tokens_per_s" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The acceptance maths of one target pass: per-session numpy against one batched torch call.

For each vocabulary, sampling setting and number of sessions, a pass holds every session's round
of gamma drafts (gamma + 1 rows of logits each). Timed, side by side in one run:

  numpy    today's path: per session, spec_core.tree.verify_tree_on_logits on the chain (warping each row
           as the round reaches it, then the accept tests and the corrected or bonus draw), in a
           Python loop over the sessions of the pass (what every backend's `verify` does per round)
  torch    cloud_verifier.backends.torch_accept.accept_pass: all rounds in one call on the device
           holding the logits (CPU here; CUDA too when present), ids back on the host
  floor    one softmax over the same logits on that device (torch.softmax, float32): what any
           maths that reads every row must at least cost

The logits are synthetic and peaked like a language model's: normal noise (sigma 2) over the
vocabulary with 20 tokens raised by 6 to 16, different per row (top-p 0.95 at T 0.7 keeps a few of them). Every draft is its row's argmax,
q none (point masses, as prompt-lookup drafts ship), so greedy rounds keep every draft and the
numpy path warps all gamma + 1 rows (its worst case; a rejection at position i stops it at row i).
The logits are made before the clock starts; torch's time includes the uniforms' host-to-device
copy and the ids' way back (with torch.cuda.synchronize).

  .venv-vllm/bin/python bench/accept_maths.py                       # the full table (torch is in .venv-vllm)
  .venv-vllm/bin/python bench/accept_maths.py --sessions 1 4 --vocabs 49152 --reps 1   # a short run

Writes --out (markdown) with the machine line, and beside it the same figures as JSON rows (path,
device, setting, vocab, sessions, pass_s) that netsim.fleet.hostpath reads as its host-path table. Timing: the median of --reps passes (one untimed
pass first); cells whose logits would exceed --max-gib are skipped and say so, and with
--cpu-max-gib the CPU columns of larger cells read "-".
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hybridspec.machine import announce, summary as machine_summary  # noqa: E402
from spec_core.tree import DraftTree, verify_tree_on_logits  # noqa: E402
from spec_core.warping import SamplingSettings  # noqa: E402

SETTINGS = {
    "greedy": SamplingSettings(temperature=0.0),
    "top-k 50": SamplingSettings(temperature=1.0, top_k=50),
    "T 0.7 top-p 0.95": SamplingSettings(temperature=0.7, top_p=0.95),
}


def make_logits(sessions: int, gamma: int, vocab: int, seed: int) -> np.ndarray:
    """[sessions * (gamma + 1), vocab] float32, peaked (module docstring)."""
    rng = np.random.default_rng(seed)
    rows = sessions * (gamma + 1)
    logits = rng.standard_normal((rows, vocab), dtype=np.float32) * 2.0
    head = rng.integers(0, vocab, (rows, 20))
    np.put_along_axis(logits, head, np.take_along_axis(logits, head, 1) + np.linspace(16, 6, 20, dtype=np.float32), 1)
    return logits


def time_it(fn, reps: int, sync=lambda: None) -> float:
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cell(logits: np.ndarray, sessions: int, gamma: int, s: SamplingSettings, reps: int, devices: list[str],
         numpy_too: bool = True) -> dict:
    rows = gamma + 1
    drafts = [[int(t) for t in logits[i * rows:i * rows + gamma].argmax(axis=1)] for i in range(sessions)]

    def numpy_pass():
        for i in range(sessions):
            verify_tree_on_logits(logits[i * rows:(i + 1) * rows], s, DraftTree.chain(drafts[i]), None,
                                  np.random.default_rng(i))

    out = {"numpy": time_it(numpy_pass, reps)} if numpy_too else {}
    if devices:
        import torch
        from cloud_verifier.backends.torch_accept import PassRound, accept_pass, round_uniforms
    for dev in devices:
        t = torch.as_tensor(logits).to(dev)
        sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

        def torch_pass():
            rounds = [PassRound(i * rows, DraftTree.chain(drafts[i]), None, s,
                                round_uniforms(gamma, np.random.default_rng(i))) for i in range(sessions)]
            accept_pass(t, rounds)

        out[f"torch {dev}"] = time_it(torch_pass, reps, sync)
        out[f"floor {dev}"] = time_it(lambda: torch.softmax(t, dim=-1), reps, sync)
        del t
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--vocabs", type=int, nargs="+", default=[49152, 128256, 262144])
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--max-gib", type=float, default=2.0, help="skip cells whose logits are larger")
    ap.add_argument("--cpu-max-gib", type=float, default=None,
                    help="leave the CPU columns (numpy, torch cpu) out of cells whose logits are larger "
                         "(a GPU check's time box)")
    ap.add_argument("--devices", default=None, help="torch devices, comma-separated (default: cpu, and cuda if present)")
    ap.add_argument("--out", default="results/accept_maths.md")
    args = ap.parse_args()

    try:
        import torch
    except ImportError:   # the main environment: the numpy column alone (torch is in .venv-vllm)
        torch = None
    if args.threads and torch is not None:
        torch.set_num_threads(args.threads)
    machine = announce()
    if torch is None:
        devices = []
    else:
        devices = args.devices.split(",") if args.devices else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    cpu_max = args.max_gib if args.cpu_max_gib is None else args.cpu_max_gib
    gpu = torch.cuda.get_device_name(0) if "cuda" in devices else "none"
    versions = f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads" if torch is not None else "no torch"
    pressure = machine.get("cpu_pressure_10s")
    busy = f"load {machine.get('load_1min') or 0:.1f}" + (f", CPU pressure {pressure:.0%}" if pressure is not None else "")
    head = (f"Machine: {machine_summary(machine)}; {versions}; GPU: {gpu}; {busy} at the start. gamma {args.gamma}, "
            f"q none, drafts = row argmax; ms per pass, median of {args.reps}.")
    print(head, flush=True)
    cols = ["numpy"] + [f"{k} {d}" for d in devices for k in ("torch", "floor")]
    lines = ["| vocab | setting | sessions | " + " | ".join(cols) + " |", "|" + "---|" * (3 + len(cols))]
    rows = []   # for netsim.fleet.hostpath: one measurement per (column, cell)
    print(lines[0], flush=True)
    for vocab in args.vocabs:
        for name in args.settings:
            for sessions in args.sessions:
                gib = sessions * (args.gamma + 1) * vocab * 4 / 2**30
                if gib > args.max_gib:
                    line = f"| {vocab} | {name} | {sessions} | " + " | ".join(
                        [f"skipped ({gib:.1f} GiB > --max-gib)"] + [""] * (len(cols) - 1)) + " |"
                else:
                    logits = make_logits(sessions, args.gamma, vocab, seed=sessions)
                    cpu_too = gib <= cpu_max
                    r = cell(logits, sessions, args.gamma, SETTINGS[name], args.reps,
                             [d for d in devices if cpu_too or d != "cpu"], numpy_too=cpu_too)
                    del logits
                    line = f"| {vocab} | {name} | {sessions} | " + " | ".join(
                        f"{r[c] * 1e3:.1f}" if c in r else "-" for c in cols) + " |"
                    for c, seconds in r.items():
                        path, _, device = c.partition(" ")
                        rows.append({"path": path, "device": device or "cpu", "setting": name, "vocab": vocab,
                                     "sessions": sessions, "gamma": args.gamma, "pass_s": seconds})
                lines.append(line)
                print(line, flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        "# The acceptance maths per pass (bench/accept_maths.py)\n\n"
        f"`{' '.join([Path(sys.executable).name, 'bench/accept_maths.py'] + sys.argv[1:])}`\n\n{head}\n\n"
        + "\n".join(lines) + "\n")
    # The same figures as rows that netsim.fleet.hostpath.HostPathTable reads (its host-path table).
    Path(args.out).with_suffix(".json").write_text(json.dumps({"machine": head, "rows": rows}, indent=1))
    print(f"wrote {args.out}, {Path(args.out).with_suffix('.json')}")


if __name__ == "__main__":
    main()

"""The window's side-by-side table from `netsim experiment` runs: per profile and mode, tokens/s
against per-token and the chain (hybrid-g4) of the same run, the hit rate of what was sent or drafted
early, rounds in flight, round trips and bytes up per committed token, and (where the run recorded
them) the edge's draft time and the verifier's model time per round trip. Prints Markdown.

  python bench/window_summary.py results/w27_bundled/results.json [more results.json ...]

Hit rate, by mode: pipeline and window, pipelined rounds kept / rounds sent early (kept +
discarded); proactive and continuations, rounds whose outcome had a continuation / rounds during
which continuations were drafted; fused, rounds answered in the pass of the round before / rounds
sent with continuations for their own pass. Early rounds kept / sent: pipelined rounds kept / sent
before the previous reply, in every mode. Rounds in flight: the window's mean depth when a round was
sent (1 = only that round).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

MODES = ("per-token", "hybrid", "tree", "proactive", "pipeline", "continuations", "fused", "window")
PROFILES = ("lan", "lte", "3g", "geo-sat")


def hit_rate(s: dict) -> tuple[float | None, str]:
    """(hit rate, what it counts) for one summary line (netsim.experiment.summarise)."""
    mode = s["mode"].split("-g")[0]
    if mode in ("pipeline", "window"):
        sent = s["pipelined_rounds"] + s["discarded_rounds"]
        return (s["pipelined_rounds"] / sent if sent else None), f"{s['pipelined_rounds']} / {sent}"
    if mode in ("proactive", "continuations"):
        n = s["continuation_rounds"]
        return (s["continuation_hits"] / n if n else None), f"{s['continuation_hits']} / {n}"
    if mode == "fused":
        n = s.get("fused_rounds", 0)
        return (s.get("fused_hits", 0) / n if n else None), f"{s.get('fused_hits', 0)} / {n}"
    return None, "–"


def table(path: Path) -> list[str]:
    from netsim.experiment import summarise
    result = json.loads(path.read_text())
    summary = summarise(result["rows"])
    timed = any(r.get("draft_s") for r in result["rows"])
    fmt = lambda v, d=2: "–" if v is None else f"{v:.{d}f}"  # noqa: E731
    head = ["profile", "mode", "tokens", "tok/s", "÷ per-token", "÷ chain", "hit rate (hits / tries)",
            "early rounds kept / sent", "rounds in flight", "RT / token", "B up / token"]
    if timed:
        head += ["draft ms / RT", "model ms / RT"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = {p: i for i, p in enumerate(PROFILES)}
    for profile in sorted({s["profile"] for s in summary}, key=lambda p: order.get(p, len(order))):
        by = {s["mode"]: s for s in summary if s["profile"] == profile}
        chain = next((s for m, s in by.items() if m.startswith("hybrid")), None)
        for mode in MODES:
            for s in (s for m, s in by.items() if m.split("-g")[0] == mode):
                rate = lambda other: (s["tokens_per_s"] / other["tokens_per_s"]  # noqa: E731
                                      if other and other["tokens_per_s"] else None)
                hit, counts = hit_rate(s)
                row = [profile, s["mode"], str(s["tokens"]), fmt(s["tokens_per_s"]), fmt(rate(by.get("per-token"))),
                       fmt(rate(chain)), f"{fmt(hit)} ({counts})" if hit is not None else "–",
                       f"{s['pipelined_rounds']} / {s['pipelined_rounds'] + s['discarded_rounds']}"
                       if s["pipelined_rounds"] + s["discarded_rounds"] else "–",
                       fmt(s["rounds_in_flight"]), fmt(s["round_trips_per_token"]), fmt(s["bytes_up_per_token"], 0)]
                if timed:
                    trips = s["round_trips_per_token"] * s["tokens"]
                    row += [fmt(1e3 * s["draft_s"] / trips if trips else None, 0),
                            fmt(1e3 * s["server_model_s"] / trips if trips else None, 0)]
                lines.append("| " + " | ".join(row) + " |")
    return lines


def main(paths: list[str]) -> int:
    for p in paths:
        print(f"{p}\n")
        print("\n".join(table(Path(p))) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main(sys.argv[1:]))

"""The cost tables that are not measured here, made from published figures: a flat GPU-like line, and
one verifier per GPU (H100, H200) and target (Llama-3.1-8B bf16, 70B fp8) from netsim.fleet's
sourced roofline (netsim.fleet.costs, netsim.fleet.regime: datasheet bandwidth and FLOP/s, the
models' config.json, our efficiency assumptions) for one session at 1,024 tokens of context.

    python -m netsim.virtual.published     # writes netsim/virtual/tables/*.json (a test checks they match)

A GPU pass for one session is the slower of reading the weights and its KV (`floor_s`) and its
tokens' FLOPs (`per_token_s`); the host path after it is the fleet table's estimate for maths on
the device (bench/fleet/host_path.json, "batched-on-device", top-p). The edge's side (drafting
per row, its time per round) is netsim.fleet.regime's device assumption: a phone-class CPU.
"""
from __future__ import annotations

import json
from pathlib import Path

from netsim.fleet.costs import RooflineCost
from netsim.fleet.hostpath import DEFAULT_TABLE as HOST_PATH_TABLE
from netsim.fleet.regime import GPUS, TARGETS, RegimeConfig
from netsim.virtual.costs import CostTable, EdgeCosts, VerifierCosts

TABLES_DIR = Path(__file__).resolve().parent / "tables"
CONTEXT_TOKENS = 1024


def _device_host_s() -> tuple[float, str]:
    rows = json.loads(HOST_PATH_TABLE.read_text())["rows"]
    row = next(r for r in rows if r["path"] == "batched-on-device" and r["setting"] == "top-p")
    return row["fixed_s"] + row["per_round_s"], f"{row['source']}: {row['note']}"


DEVICE_DRAFT_S = 0.010   # a phone-class CPU's draft token (EDGE_NOTE); the regime map now reads its devices
                         # from a table (netsim.fleet.devices), this table keeps the assumption it states


def _edge() -> EdgeCosts:
    return EdgeCosts(draft_row_s=DEVICE_DRAFT_S, host_round_s=RegimeConfig().edge_s)


EDGE_NOTE = ("edge: netsim.fleet.regime's device assumption (10 ms a draft token, 2 ms a round outside drafting: "
             "a phone-class CPU), not measured")


def gpu_table(gpu: str, target: str) -> CostTable:
    g, t = GPUS[gpu], TARGETS[target]
    cost = RooflineCost(**t.weights, context_tokens=CONTEXT_TOKENS, hbm_bytes_per_s=g.hbm_bytes_per_s,
                        flops_per_s=t.flops_per_s, attention_flops_per_context_token=t.attention_flops,
                        attention_flops_per_s=t.attention_flops_per_s)
    one = cost.parts(1, 1)
    host_s, host_note = _device_host_s()
    return CostTable(
        name=f"{gpu}-{target}",
        verifier=VerifierCosts(base_s=0.0, per_token_s=one.compute_s, floor_s=one.memory_s, host_round_s=host_s),
        edge=_edge(), pair="any",
        description=f"{g.name}, {t.name}: one session at {CONTEXT_TOKENS} tokens of context (roofline)",
        source=f"netsim.fleet roofline: {cost.describe()}; datasheets ({g.name}: {g.hbm_bytes_per_s / 1e12:g} TB/s, "
               f"{t.flops_per_s / 1e12:g} TFLOP/s dense) and the model's config.json, efficiencies 0.7 (HBM) and 0.5 "
               f"(FLOPs) our assumption; host path after the pass: {host_note}; {EDGE_NOTE}. Not measured here.")


def flat_gpu_table() -> CostTable:
    return CostTable(
        name="flat-gpu", verifier=VerifierCosts(base_s=0.020, per_token_s=0.00005), edge=_edge(), pair="any",
        description="a flat GPU-like pass: 20 ms + 0.05 ms per token",
        source=f"chosen (issue 45's flat curve), not measured; {EDGE_NOTE}")


def published_tables() -> list[CostTable]:
    return [flat_gpu_table()] + [gpu_table(g, t) for g in ("h100", "h200") for t in ("8b-bf16", "70b-fp8")]


def write(folder: Path = TABLES_DIR) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for table in published_tables():
        path = folder / f"{table.name}.json"
        table.save(path)
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in write():
        print(p)

"""Cost tables: what each piece of a round costs on the virtual clock, and where the figures came from.

A table is read, never guessed at run time (Vidur's split: a profiling step writes tables, the
simulator only reads them). `netsim calibrate` measures one on this machine; the others ship with
their sources.

    verifier pass   pass_s(tokens, rows) = max(floor_s, base_s + per_token_s·tokens + per_row_s·rows)
                    tokens: every token the pass evaluates (prefill, drafts, tree nodes);
                    rows: the tokens whose logits are read (a round's drafts + 1, a tree's nodes + 1).
                    floor_s: a GPU's memory-bound floor (weights read once a pass); 0 for a CPU line.
                    With measured round passes (`round_curve`) a pass of r rows costs the curve at r
                    instead, plus per_token_s for each token evaluated without its logits read.
    verifier host   host_round_s per RPC outside the pass (gRPC server, validation, engine, reply)
                    + host_row_s per row of acceptance maths (warping, accept/reject, at the vocab);
                    stream_token_s per token of a cloud-only stream outside its pass.
    edge host       host_round_s per RPC on the edge (gRPC client, building the request, committing).
    drafting        draft_base_s + draft_row_s·rows per drafting call (rows: draft positions a chain
                    drafts), or draft_tree_row_s a row of a tree's growth (its levels are batches).

The link is not in the table: it is the profile's (netsim.profiles), drawn from the run's seed.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

TABLES_PACKAGE = "netsim.virtual.tables"


@dataclass(frozen=True)
class VerifierCosts:
    base_s: float                 # fixed cost of a pass (s)
    per_token_s: float = 0.0      # per token the pass evaluates (s)
    per_row_s: float = 0.0        # per token whose logits are read (s), on top of per_token_s
    floor_s: float = 0.0          # the least a pass costs (a GPU reads its weights once a pass)
    host_round_s: float = 0.0     # per RPC outside the pass (s)
    host_row_s: float = 0.0       # acceptance maths per row of logits (s); a cloud-only step's sampling: one row
    stream_token_s: float = 0.0   # per token of the cloud-only stream outside its pass (both ends' stream handling)
    # Measured passes of rounds (every token's logits read): [[tokens, seconds], ...] by tokens. When
    # given, a pass of r rows costs the curve at r (linear between the points, along the last two
    # beyond them) plus per_token_s for each token it evaluates without reading its logits (a
    # prompt's): a CPU's round cost is not a line (batching the rows is cheaper per row as they grow).
    round_curve: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "round_curve", tuple(tuple(p) for p in self.round_curve))

    def pass_s(self, tokens: int, rows: int) -> float:
        if self.round_curve:
            return max(self.floor_s, _along(self.round_curve, rows) + self.per_token_s * max(tokens - rows, 0))
        return max(self.floor_s, self.base_s + self.per_token_s * tokens + self.per_row_s * rows)


def _along(points: tuple, x: float) -> float:
    """Piecewise-linear through `points` ((x, y) by x), extended along the end segments."""
    if len(points) == 1:
        return points[0][1] * x / points[0][0] if points[0][0] else points[0][1]
    k = 1
    while k < len(points) - 1 and x > points[k][0]:
        k += 1
    (x0, y0), (x1, y1) = points[k - 1], points[k]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0)) if x1 != x0 else y1


@dataclass(frozen=True)
class EdgeCosts:
    draft_base_s: float = 0.0     # per drafting call (s): catching the draft's cache up, the call itself
    draft_row_s: float = 0.0      # per draft row (s)
    host_round_s: float = 0.0     # per RPC on the edge (s)
    draft_tree_row_s: float = 0.0  # per row of a tree's growth (a level's rows are one batch); 0: draft_row_s

    def draft_s(self, rows: int, tree: bool = False) -> float:
        per_row = self.draft_tree_row_s if tree and self.draft_tree_row_s > 0 else self.draft_row_s
        return self.draft_base_s + per_row * rows


@dataclass(frozen=True)
class CostTable:
    name: str
    verifier: VerifierCosts
    edge: EdgeCosts = field(default_factory=EdgeCosts)
    pair: str = ""                 # the model pair the figures are for ("smollm2", "gemma-smollm2", "synthetic", ...)
    description: str = ""
    measured: bool = False         # measured on a machine by `netsim calibrate` (else: from published figures or chosen)
    busy: bool = False             # measured above the quiet limit (--busy-ok): development only, never published
    provisional: bool = False      # stands in until a quiet measurement exists
    source: str = ""               # where the figures come from
    machine: dict | None = None    # calibrate: the machine (hybridspec.machine.describe)
    date: str = ""                 # calibrate: when (UTC date)
    command: str = ""              # what made it
    load: dict | None = None       # calibrate: load per core at start and end
    fits: dict | None = None       # calibrate: the points behind each line, for a reader to check

    def provenance(self) -> dict[str, Any]:
        """What a results file says about the table it ran on (all of it but the fit points)."""
        d = self.to_dict()
        d.pop("fits", None)
        return d

    def label(self) -> str:
        marks = [m for m, on in (("measured", self.measured), ("BUSY", self.busy), ("provisional", self.provisional),
                                 ("not measured here", not self.measured)) if on]
        return f"{self.name} ({', '.join(marks)})"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CostTable":
        d = dict(d)
        d["verifier"] = VerifierCosts(**d["verifier"])
        d["edge"] = EdgeCosts(**d.get("edge", {}))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown cost table fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    def with_verifier(self, **changes) -> "CostTable":
        return dataclasses.replace(self, verifier=dataclasses.replace(self.verifier, **changes))


def shipped_tables() -> dict[str, CostTable]:
    """The tables that ship with netsim (netsim/virtual/tables/*.json), by name."""
    out = {}
    for entry in sorted(resources.files(TABLES_PACKAGE).iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            table = CostTable.from_dict(json.loads(entry.read_text()))
            out[table.name] = table
    return out


def load_table(name_or_path: str) -> CostTable:
    """A shipped table by name, or a JSON file (what `netsim calibrate` writes)."""
    tables = shipped_tables()
    if name_or_path in tables:
        return tables[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"no cost table {name_or_path!r}: give a file or one of {', '.join(sorted(tables))}")
    return CostTable.from_dict(json.loads(path.read_text()))


def synthetic_table(draft_row_s: float, pass_base_s: float, per_token_s: float = 0.0,
                    host_round_s: float = 0.0, name: str | None = None) -> CostTable:
    """A table for the synthetic pair (sweeps): the costs are the cell's, chosen, not measured."""
    return CostTable(
        name or f"synthetic draft {draft_row_s * 1e3:g} ms/row, pass {pass_base_s * 1e3:g} ms + "
                f"{per_token_s * 1e3:g} ms/token",
        VerifierCosts(base_s=pass_base_s, per_token_s=per_token_s, host_round_s=host_round_s),
        EdgeCosts(draft_row_s=draft_row_s), pair="synthetic", source="chosen (a sweep cell)")


# The pair's own table for --clock virtual without --costs: measured quiet when it exists, else provisional.
PAIR_TABLES = {"smollm2": ("smollm2", "smollm2-provisional"), "gemma-smollm2": ("gemma-smollm2", "gemma-smollm2-provisional")}


def default_table(cfg) -> CostTable:
    """The table an experiment config runs on when none is named: the synthetic pair's own costs
    (its --synthetic-* settings), else the pair's measured table (or its provisional one)."""
    if cfg.synthetic:
        return synthetic_table(cfg.synthetic_draft_ms / 1e3, cfg.synthetic_step_ms / 1e3, cfg.synthetic_per_token_ms / 1e3,
                               name="synthetic (the experiment's --synthetic-* costs)")
    pair = cfg.pair or ("smollm2" if cfg.target is None and cfg.draft is None else None)
    tables = shipped_tables()
    for name in PAIR_TABLES.get(pair, ()):
        if name in tables:
            return tables[name]
    raise ValueError(f"no cost table for the pair {pair or 'given by --target/--draft'}: measure one with "
                     "`netsim calibrate` and pass it with --costs")

"""The verifier's host path per pass: the acceptance maths (warping, accept/reject, the corrected or
bonus token) that runs after each target pass, charged from a table, not assumed.

A row is one way the maths runs (`path`: "numpy-per-session", the shipped loop over sessions in
Python and numpy on one core; "batched-on-device", one call per pass where the logits are) on one
`device`, for one sampling `setting` ("greedy", "top-k", "top-p"), at one vocabulary:

    host_s(rounds) = fixed_s + per_round_s · rounds        (rounds: the hybrid rounds in the pass)

Where the table comes from (bench/fleet/host_path.json): bench/accept_maths.py measures per-pass
maths against sessions and vocabulary; `HostPathTable.from_json` reads either rows that carry
`fixed_s` and `per_round_s` directly, or measurement rows (`sessions`, `pass_s`) from which it fits the
line per (path, device, setting, vocab) by least squares. The bench's own names ("numpy", "torch";
"top-k 50", "T 0.7 top-p 0.95") are read as this module's; its "floor" rows are not a host path and
are skipped. Until that bench has run on a GPU node the table holds the figures measured for the
numpy path on one core of a 2-core Zen 4 EPYC VM and an *estimate* for the batched device path
(`source: "estimate"`; every report says so).

The cloud-only stream's sampling is vLLM's own sampler, on the device in the engine step: charged
by the "batched-on-device" row with one row per stream (`stream_rows`).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

SETTINGS = ("greedy", "top-k", "top-p")
PATHS = ("numpy-per-session", "batched-on-device")
DEFAULT_TABLE = Path(__file__).resolve().parents[2] / "bench" / "fleet" / "host_path.json"


@dataclass(frozen=True)
class HostPath:
    """The host path of one pass: fixed_s + per_round_s · rounds (seconds)."""

    path: str
    device: str
    setting: str
    vocab: int
    fixed_s: float
    per_round_s: float
    source: str = "measured"   # "measured" or "estimate"
    note: str = ""

    def pass_s(self, rounds: int) -> float:
        return self.fixed_s + self.per_round_s * rounds if rounds > 0 else 0.0

    def describe(self) -> str:
        mark = " (ESTIMATE, not measured)" if self.source != "measured" else ""
        return (f"host path {self.path} on {self.device}, {self.setting}, vocab {self.vocab:,}: "
                f"{self.fixed_s * 1e3:.3g} ms + {self.per_round_s * 1e3:.3g} ms/round{mark}")


def _fit(rows: list[dict]) -> tuple[float, float]:
    """fixed_s, per_round_s from measurement rows (sessions, pass_s): least squares, both >= 0."""
    x = np.array([r["sessions"] for r in rows], dtype=float)
    y = np.array([r["pass_s"] for r in rows], dtype=float)
    if len(set(x)) < 2:
        return 0.0, float(np.mean(y / x))
    slope, intercept = np.polyfit(x, y, 1)
    if intercept < 0:   # a line through the origin instead: a negative fixed cost is noise
        return 0.0, float((x @ y) / (x @ x))
    return float(intercept), max(float(slope), 0.0)


# bench/accept_maths.py's names for the same things: its columns (numpy, torch, floor) and settings.
PATH_ALIASES = {"numpy": "numpy-per-session", "torch": "batched-on-device"}
SETTING_ALIASES = {"top-k 50": "top-k", "T 0.7 top-p 0.95": "top-p"}


def _normalise(row: dict) -> dict | None:
    """A row with this module's path and setting names; None for a row that is not a host path (the
    softmax floor)."""
    path = PATH_ALIASES.get(row["path"], row["path"])
    if path not in PATHS:
        return None
    return {**row, "path": path, "setting": SETTING_ALIASES.get(row["setting"], row["setting"])}


class HostPathTable:
    """Host-path rows by (path, device, setting); `get` picks the row at the nearest vocabulary."""

    def __init__(self, rows: list[HostPath], machine: str = "") -> None:
        self.rows, self.machine = rows, machine

    @classmethod
    def from_json(cls, data: dict) -> "HostPathTable":
        rows, measured = [], {}
        for raw in data["rows"]:
            r = _normalise(raw)
            if r is None:
                continue
            if "per_round_s" in r:
                rows.append(HostPath(**{k: r[k] for k in HostPath.__dataclass_fields__ if k in r}))
            else:
                measured.setdefault((r["path"], r["device"], r["setting"], int(r["vocab"])), []).append(r)
        for (path, device, setting, vocab), group in measured.items():
            fixed, per_round = _fit(group)
            rows.append(HostPath(path, device, setting, vocab, fixed, per_round, "measured",
                                 f"fitted over {len(group)} sessions counts"))
        return cls(rows, data.get("machine", ""))

    @classmethod
    def load(cls, path: str | Path = DEFAULT_TABLE) -> "HostPathTable":
        return cls.from_json(json.loads(Path(path).read_text()))

    def to_json(self) -> dict:
        return {"machine": self.machine, "rows": [asdict(r) for r in self.rows]}

    def get(self, path: str, setting: str, device: str | None = None, vocab: int = 128_256) -> HostPath:
        found = [r for r in self.rows if r.path == path and r.setting == setting
                 and (device is None or r.device == device)]
        if not found:
            have = sorted({(r.path, r.device, r.setting) for r in self.rows})
            raise KeyError(f"no host-path row for {path}/{device or 'any device'}/{setting}; the table has {have}")
        # Measured rows before estimates, then the nearest vocabulary (the maths is linear in it).
        best = min(found, key=lambda r: (r.source != "measured", abs(r.vocab - vocab)))
        if best.vocab != vocab:   # scale to this vocabulary: every step of the maths reads each row once or more
            scale = vocab / best.vocab
            best = HostPath(best.path, best.device, best.setting, vocab, best.fixed_s, best.per_round_s * scale,
                            best.source, f"{best.note}; scaled from vocab {best.vocab:,}".strip("; "))
        return best


def stream_rows(device_row: HostPath, gamma: int) -> HostPath:
    """vLLM's own sampler for cloud-only streams: the device row, one logits row per stream instead of
    gamma + 1 per round."""
    return HostPath(device_row.path, device_row.device, device_row.setting, device_row.vocab, device_row.fixed_s,
                    device_row.per_round_s / (gamma + 1), device_row.source, "one row per stream")

"""Acceptance by draft position, per proposer: each side of the per-GPU comparison with its own curve.

A flat per-token α (P(accepted >= k) = α^k) is one number for every draft position and every
proposer. Measured acceptance is neither: it falls with position at its own rate per proposer and
implementation. A `Curve` is what vLLM reports per position (its Prometheus counter
`spec_decode_num_accepted_tokens_per_pos` over `spec_decode_num_drafts`, printed as "acceptance at
token k"): reach[k] = P(the k-th draft is accepted) = P(accepted >= k). For a chain this does not
depend on how many drafts follow, so the mean acceptance length at γ drafts (τ, the bonus or
corrected token included, as vLLM and the EAGLE papers count it) is 1 + reach[1] + ... + reach[γ].

Each curve names its measurement (`source`). Beyond its last measured position a curve goes on with
the mean conditional acceptance of its last (up to) three positions (stated in `describe`).

The catalogue (`CURVES`):

  eagle3-llama8b   vLLM, EAGLE-3 head yuhuili/EAGLE3-LLaMA3.1-Instruct-8B on Llama-3.1-8B-Instruct,
                      MT-bench, greedy, chain drafts, mean acceptance length by num_speculative_tokens
                      K = 2..7: 2.36, 2.79, 3.08, 3.32, 3.46, 3.54 (vllm-project/vllm issue #20780; K = 7
                      again 3.53 in issue #26191: 12,208 accepted in 4,816 drafts). Positions 1 and 2 are
                      split (their sum is 1.36) so that the conditional acceptance at positions 2 and 3
                      is equal; from position 3 on reach[k] = τ(k) − τ(k − 1).
  eagle1-llama8b   the same source, EAGLE-1 head: 2.1, 2.29, 2.39, 2.43, 2.45, 2.47 (split alike).
  eagle3-minicpm3     vLLM, an EAGLE-3 head for MiniCPM3 (vllm-project/vllm PR #24243): per-position
                      acceptance 0.58, 0.34, 0.22, 0.15, 0.11, mean acceptance length 2.47 (200 samples,
                      10 concurrent, RTX 4090; 2.44 at one at a time).
  ngram-code-edit     vLLM's n-gram proposer on code editing (vdaita/edit_5k_char, prompt_lookup 2..5,
                      vllm-project/vllm PR #24344): per-position 0.81, 0.74, 0.70, 0.68, 0.66 over the
                      993 steps that drafted; 821 of its 5,376 tokens came from steps without a draft, so
                      over every step the curve is scaled by 993 / (993 + 821).
  (measured)          our pairs' chains from `edge-client eval-draft` (chain.py: greedy, chain drafts,
                      the same positions vLLM counts) and vLLM's n-gram rule on our targets' greedy text,
                      read from bench/fleet/acceptance/*.json (`measured_curves`).

Tree drafts are not chains: SGLang's EAGLE-3 on Llama-3.1-8B (MT-bench) commits 4.68 tokens a step
at 5 steps and 5.39 at 8 (sgl-project/sglang PR #4247) with top-k 4 trees of up to 8 verified
tokens. The map's rounds are chains on both sides, so those figures are cited, not used.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MEASURED_DIR = ROOT / "bench" / "fleet" / "acceptance"
MAX_POSITIONS = 16


@dataclass(frozen=True)
class Curve:
    """P(accepted >= k) for k = 1, 2, ...: vLLM's per-position acceptance."""

    name: str
    reach: tuple[float, ...]
    source: str = ""
    note: str = ""

    def __post_init__(self) -> None:
        if not self.reach:
            raise ValueError(f"curve {self.name!r} has no positions")
        prev = 1.0
        for r in self.reach:
            if not 0.0 <= r <= prev + 1e-9:
                raise ValueError(f"curve {self.name!r}: reach must fall with position within [0, 1], got {self.reach}")
            prev = r

    @classmethod
    def flat(cls, alpha: float, name: str | None = None) -> "Curve":
        """The geometric model: every position accepted with probability α."""
        alpha = min(max(alpha, 0.0), 1.0)
        return cls(name or f"flat α {alpha:g}", tuple(alpha ** k for k in range(1, MAX_POSITIONS + 1)),
                   "flat per-token acceptance (a model, not a measurement)")

    @classmethod
    def from_lengths(cls, name: str, lengths: dict[int, float], source: str, note: str = "") -> "Curve":
        """From mean acceptance lengths τ(K) at consecutive K (bonus included). When the first K is 2, its
        two positions are split so that the conditional acceptance at positions 2 and 3 is equal."""
        ks = sorted(lengths)
        if ks != list(range(ks[0], ks[-1] + 1)) or ks[0] not in (1, 2):
            raise ValueError("lengths need consecutive K starting at 1 or 2")
        reach: list[float] = []
        if ks[0] == 1:
            reach.append(lengths[1] - 1.0)
        else:
            first_two = lengths[2] - 1.0
            third = lengths[3] - lengths[2] if 3 in lengths else None
            if third is None:
                c = first_two / 2.0
                reach += [c, c]
            else:   # r1 (1 + c) = first_two, r1 c^2 = third
                c = (third + math.sqrt(third ** 2 + 4.0 * first_two * third)) / (2.0 * first_two)
                r1 = first_two / (1.0 + c)
                reach += [r1, r1 * c]
        for k in ks[1:]:
            reach.append(lengths[k] - lengths[k - 1])
        return cls(name, tuple(_monotone(reach)), source, note)

    def conditional(self, k: int) -> float:
        """P(the k-th draft is accepted | the first k − 1 were)."""
        prev = self.at(k - 1)
        return self.at(k) / prev if prev > 0 else 0.0

    def _tail_ratio(self) -> float:
        r = self.reach
        ratios = [r[i] / r[i - 1] for i in range(max(1, len(r) - 3), len(r)) if r[i - 1] > 0]
        if not ratios:
            return r[0] if len(r) == 1 else 0.0
        return sum(ratios) / len(ratios)

    def at(self, k: int) -> float:
        """P(accepted >= k); 1 at k = 0."""
        if k <= 0:
            return 1.0
        if k <= len(self.reach):
            return self.reach[k - 1]
        return self.reach[-1] * self._tail_ratio() ** (k - len(self.reach))

    def tokens_per_step(self, gamma: int) -> float:
        """τ(γ): the mean committed tokens of a step of γ drafts (bonus or corrected token included)."""
        return 1.0 + sum(self.at(k) for k in range(1, gamma + 1))

    def pmf(self, gamma: int) -> list[float]:
        """P(accepted = a) for a = 0..γ."""
        return [self.at(a) - (self.at(a + 1) if a < gamma else 0.0) for a in range(gamma + 1)]

    def shifted(self, shift: float, name: str | None = None) -> "Curve":
        """The same shape, each position's conditional acceptance moved by `shift` in logit space (the
        family the break-even sweeps: positions stay in their order, τ grows with the shift)."""
        reach, prev = [], 1.0
        for k in range(1, MAX_POSITIONS + 1):
            c = min(max(self.conditional(k), 1e-9), 1 - 1e-9)
            c2 = 1.0 / (1.0 + math.exp(-(math.log(c / (1 - c)) + shift)))
            prev *= c2
            reach.append(prev)
        return Curve(name or f"{self.name} shifted {shift:+.2f}", tuple(reach), self.source,
                     f"{self.name}'s shape, conditional acceptance shifted {shift:+.2f} in logit space")

    def with_tokens_per_step(self, tau: float, gamma: int = 4, name: str | None = None) -> "Curve":
        """The member of `shifted`'s family whose τ(γ) is `tau` (bisection on the shift)."""
        if not 1.0 < tau < gamma + 1.0:
            raise ValueError(f"τ({gamma}) must lie in (1, {gamma + 1}), got {tau}")
        lo, hi = -20.0, 20.0
        for _ in range(80):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.shifted(mid).tokens_per_step(gamma) < tau else (lo, mid)
        return self.shifted((lo + hi) / 2, name or f"{self.name} at τ{gamma} {tau:.2f}")

    def describe(self) -> str:
        head = ", ".join(f"{r:.2f}" for r in self.reach[:8])
        return (f"{self.name}: per position {head}{'…' if len(self.reach) > 8 else ''}; τ(2/4/8) "
                f"{self.tokens_per_step(2):.2f}/{self.tokens_per_step(4):.2f}/{self.tokens_per_step(8):.2f}"
                + (f" ({self.source})" if self.source else ""))

    def to_json(self) -> dict:
        return {"name": self.name, "reach": [round(r, 4) for r in self.reach], "source": self.source,
                "note": self.note, "tau": {g: round(self.tokens_per_step(g), 3) for g in (1, 2, 4, 8)}}


def _monotone(reach: list[float]) -> list[float]:
    out, prev = [], 1.0
    for r in reach:
        prev = min(max(r, 0.0), prev)
        out.append(prev)
    return out


EAGLE3_LLAMA31_8B = Curve.from_lengths(
    "EAGLE-3, Llama-3.1-8B (vLLM, MT-bench)", {2: 2.36, 3: 2.79, 4: 3.08, 5: 3.32, 6: 3.46, 7: 3.54},
    "vllm-project/vllm issue #20780 (mean acceptance length by num_speculative_tokens, greedy, MT-bench; "
    "K = 7: 3.53 in issue #26191)")
EAGLE1_LLAMA31_8B = Curve.from_lengths(
    "EAGLE-1, Llama-3.1-8B (vLLM, MT-bench)", {2: 2.1, 3: 2.29, 4: 2.39, 5: 2.43, 6: 2.45, 7: 2.47},
    "vllm-project/vllm issue #20780")
EAGLE3_MINICPM3 = Curve("EAGLE-3, MiniCPM3 (vLLM)", (0.58, 0.34, 0.22, 0.15, 0.11),
                        "vllm-project/vllm PR #24243 (per-position acceptance, 200 samples, mean acceptance "
                        "length 2.47)")
_EDIT_DRAFTED, _EDIT_UNDRAFTED = 993, 821
NGRAM_CODE_EDIT = Curve(
    "n-gram, code editing (vLLM)",
    tuple(r * _EDIT_DRAFTED / (_EDIT_DRAFTED + _EDIT_UNDRAFTED) for r in (0.81, 0.74, 0.70, 0.68, 0.66)),
    "vllm-project/vllm PR #24344 (vdaita/edit_5k_char, prompt_lookup 2..5: per-position 0.81/0.74/0.70/0.68/0.66 "
    "over the 993 steps that drafted, 821 steps without a draft)")
CURVES = {"eagle3-llama8b": EAGLE3_LLAMA31_8B, "eagle1-llama8b": EAGLE1_LLAMA31_8B,
          "eagle3-minicpm3": EAGLE3_MINICPM3, "ngram-code-edit": NGRAM_CODE_EDIT}


# --- our own measurements (edge-client eval-draft) -----------------------------------------------

def curve_from_report(name: str, chain: dict, source: str, gamma: int = 8) -> Curve:
    """A curve from an eval-draft report's `chain` (or `ngram`) summary at one temperature: the reach
    measured with `gamma` drafts a step."""
    reach = chain["reach"][str(gamma)]
    return Curve(name, tuple(_monotone([float(r) for r in reach])), source)


@functools.lru_cache(maxsize=4)
def measured_curves(folder: str = str(MEASURED_DIR)) -> dict[str, Curve]:
    """Every curve recorded in bench/fleet/acceptance/*.json (`bench/fleet_acceptance.py` writes them):
    {key: Curve}."""
    out: dict[str, Curve] = {}
    for path in sorted(Path(folder).glob("*.json")):
        doc = json.loads(path.read_text())
        for key, entry in doc.get("curves", {}).items():
            out[key] = Curve(entry["name"], tuple(entry["reach"]), entry.get("source", str(path.name)),
                             entry.get("note", ""))
    return out


def get_curve(key: str) -> Curve:
    """A catalogue curve, a measured one, or `flat:0.7`."""
    if key.startswith("flat:"):
        return Curve.flat(float(key.split(":", 1)[1]))
    if key in CURVES:
        return CURVES[key]
    measured = measured_curves()
    if key in measured:
        return measured[key]
    raise KeyError(f"no acceptance curve {key!r}: one of {sorted(CURVES) + sorted(measured)} or flat:ALPHA")


# --- what a request takes -------------------------------------------------------------------------

@functools.lru_cache(maxsize=8192)
def rounds_per_request(curve: Curve, gamma: int, tokens: int) -> float:
    """Expected rounds (or spec steps) to commit `tokens`, each committing 1 + accepted within what is
    left (γ capped at the tokens left − 1, as the edge and the simulation cap it)."""
    f = [0.0] * (tokens + 1)
    for r in range(1, tokens + 1):
        g = max(0, min(gamma, r - 1))
        total = 1.0
        for a, p in enumerate(curve.pmf(g)):
            total += p * f[r - min(a + 1, r)]
        f[r] = total
    return f[tokens]

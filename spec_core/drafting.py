"""One draft step: from the draft model's logits to a draft token and the q that ships with it.

Every drafter (GGUF model, synthetic, ...) calls `draft_step`, so "quantize first, then sample"
holds in one place: the token is drawn from the encoded q, never from the unencoded one.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spec_core.gumbel import draft_choices
from spec_core.qcodec import DEFAULT_SCALE_BITS, DEFAULT_TOP_K, EncodedQ, encode_fixed, encode_float
from spec_core.warping import SamplingSettings, processed_probs


@dataclass(frozen=True)
class QMode:
    """How q travels: 'none' (point-mass drafts: the draft's argmax), 'fixed' or 'float'."""

    kind: str = "fixed"
    top_k: int = DEFAULT_TOP_K          # support kept per position; 0 = whole vocabulary
    scale_bits: int = DEFAULT_SCALE_BITS  # fixed-point resolution (FIXED only)

    def __post_init__(self):
        if self.kind not in ("none", "fixed", "float"):
            raise ValueError(f"q mode must be none, fixed or float, not {self.kind!r}")

    @classmethod
    def parse(cls, text: str) -> "QMode":
        """'none', 'fixed', 'fixed:16' (top-k), 'fixed:16:12' (top-k, bits), 'float', 'float:0'."""
        kind, *rest = text.split(":")
        if kind == "none":
            return cls("none", 0, 0)
        top_k = int(rest[0]) if rest else (DEFAULT_TOP_K if kind == "fixed" else 0)
        bits = int(rest[1]) if len(rest) > 1 else DEFAULT_SCALE_BITS
        return cls(kind, top_k, bits)


def draft_step(draft_logits: np.ndarray, settings: SamplingSettings, qmode: QMode,
               rng: np.random.Generator, noise=None) -> tuple[int, EncodedQ | None]:
    """draft_logits  # [vocab]. Returns (token, q it was drawn from, or None for a point mass).
    `noise` (spec_core.gumbel.draft_noise, the gumbel coupling): the token is argmax(log q + g) over
    the encoded q's support instead of a draw from `rng` (still the encoded q: its support and
    weights are what the coupling's acceptance is computed from)."""
    if qmode.kind == "none" or settings.greedy:
        return int(np.argmax(draft_logits)), None
    probs = processed_probs(draft_logits, settings.temperature, settings.top_k, settings.top_p)
    if qmode.kind == "fixed":
        enc = encode_fixed(probs, qmode.top_k, qmode.scale_bits)
    else:
        enc = encode_float(probs, qmode.top_k)
    if noise is not None:
        return draft_choices(enc, noise)[0], enc
    return enc.sample(rng), enc

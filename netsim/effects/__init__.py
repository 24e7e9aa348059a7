"""Link effects, one per module, and the registry that names them.

Every effect is a frozen dataclass of settings (see `base.Effect` for the interface). The
registry maps the `kind` written in profile dicts and JSON to the class, so a link can be
stored with a run's results and rebuilt from it.
"""
from __future__ import annotations

from typing import Any

from .bandwidth import Bandwidth
from .base import Chunk, Effect, LinkContext, LinkReset
from .delay import Delay
from .handover import Handover
from .jitter import Jitter
from .loss import GilbertElliottLoss, Loss
from .outage import Outage
from .trace import Trace

EFFECTS: dict[str, type[Effect]] = {
    cls.kind: cls
    for cls in (Delay, Jitter, Bandwidth, Loss, GilbertElliottLoss, Outage, Trace, Handover)
}


def effect_from_dict(spec: dict[str, Any]) -> Effect:
    """Build an effect from `{"kind": ..., **settings}` (the shape `Effect.to_dict` writes)."""
    fields = dict(spec)
    kind = fields.pop("kind", None)
    if kind not in EFFECTS:
        raise ValueError(f"unknown effect kind {kind!r}; known: {sorted(EFFECTS)}")
    return EFFECTS[kind](**fields)


__all__ = [
    "EFFECTS", "effect_from_dict", "Chunk", "Effect", "LinkContext", "LinkReset",
    "Bandwidth", "Delay", "GilbertElliottLoss", "Handover", "Jitter", "Loss", "Outage", "Trace",
]

"""The coupling between spec_core's names (spec_core.warping.COUPLINGS) and the wire's enum, in one place."""
from __future__ import annotations

from spec_core.proto import verifier_pb2 as pb
from spec_core.warping import GUMBEL, REJECTION

TO_WIRE = {REJECTION: pb.COUPLING_REJECTION, GUMBEL: pb.COUPLING_GUMBEL}
FROM_WIRE = {v: k for k, v in TO_WIRE.items()}


def from_wire(value: int) -> str | None:
    """The coupling's name, or None for a value this build does not know."""
    return FROM_WIRE.get(int(value))


def offered(info: pb.ServerInfo) -> tuple[str, ...]:
    """The couplings a verifier lists (ServerInfo.couplings); one from before the field: rejection only."""
    names = tuple(n for n in (from_wire(v) for v in info.couplings) if n is not None)
    return names or (REJECTION,)

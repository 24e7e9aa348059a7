"""The q payload on the wire (`QPayload` in the .proto) to and from spec_core.qcodec's EncodedQ.

Hand-written, beside the generated stubs: the one place where the pure core's q meets the wire, so
that spec_core's own modules stay free of generated protobuf code. `from_proto` validates every
field a client sends and raises qcodec.QError with a message that names it.
"""
from __future__ import annotations

import numpy as np

from spec_core.proto import verifier_pb2 as pb
from spec_core.qcodec import DEFAULT_SCALE_BITS, EncodedQ, QError


def to_proto(positions: list[EncodedQ] | None, scale_bits: int = DEFAULT_SCALE_BITS) -> pb.QPayload:
    if not positions:
        return pb.QPayload(format=pb.QPayload.NONE)
    fixed = positions[0].fixed
    payload = pb.QPayload(format=pb.QPayload.FIXED if fixed else pb.QPayload.FLOAT32,
                          scale_bits=scale_bits if fixed else 0)
    for q in positions:
        d = payload.positions.add()
        if q.token_ids is not None:
            d.token_ids.extend(q.token_ids.tolist())
        (d.weights if fixed else d.probs).extend(q.weights.tolist())
    return payload




def from_proto(payload: pb.QPayload, draft_tokens: list[int], vocab: int) -> list[EncodedQ] | None:
    """Validate and decode; None means point-mass drafts. Raises QError with a readable message."""
    gamma = len(draft_tokens)
    if payload.format == pb.QPayload.NONE:
        if payload.positions:
            raise QError("q.format is NONE but q.positions is not empty")
        return None
    if payload.format not in (pb.QPayload.FIXED, pb.QPayload.FLOAT32):
        raise QError(f"q.format {payload.format} is unknown")
    if len(payload.positions) != gamma:
        raise QError(f"q has {len(payload.positions)} positions but there are {gamma} draft tokens")
    fixed = payload.format == pb.QPayload.FIXED
    if fixed and not 1 <= payload.scale_bits <= 31:
        raise QError(f"q.scale_bits must be in 1..31, got {payload.scale_bits}")
    out = []
    for i, (d, token) in enumerate(zip(payload.positions, draft_tokens)):
        values = d.weights if fixed else d.probs
        other = d.probs if fixed else d.weights
        if len(other):
            raise QError(f"q.positions[{i}] mixes weights and probs; format says {'FIXED' if fixed else 'FLOAT32'}")
        # A sparse support is a few dozen entries: plain Python lists check it faster than numpy.
        if d.token_ids:
            id_list = list(d.token_ids)
            if len(id_list) != len(values):
                raise QError(f"q.positions[{i}] has {len(id_list)} token_ids but {len(values)} values")
            if max(id_list) >= vocab:
                raise QError(f"q.positions[{i}] names token id {max(id_list)}, outside the vocabulary (n_vocab={vocab})")
            if len(set(id_list)) != len(id_list):
                raise QError(f"q.positions[{i}] repeats a token id")
            ids = np.array(id_list, dtype=np.uint32)
            value_list = list(values)
            token_value = value_list[id_list.index(token)] if token in id_list else 0
        else:
            ids = None
            if len(values) != vocab:
                raise QError(f"q.positions[{i}] is dense with {len(values)} values; the vocabulary has {vocab}")
            value_list = values
            token_value = values[token] if token < len(values) else 0
        if fixed:
            w = np.array(value_list, dtype=np.int64) if ids is not None else \
                np.fromiter(values, dtype=np.int64, count=len(values))
            total = int(w.sum())
            if total <= 0 or total > (1 << payload.scale_bits):
                raise QError(f"q.positions[{i}] weights sum to {total}; must be in 1..2^{payload.scale_bits}")
        else:
            w = np.array(value_list, dtype=np.float32) if ids is not None else \
                np.fromiter(values, dtype=np.float32, count=len(values))
            if not np.all(np.isfinite(w)):
                raise QError(f"q.positions[{i}] has a NaN or infinite probability")
            if np.any(w < 0) or np.any(w > 1):
                raise QError(f"q.positions[{i}] has a probability outside [0, 1]")
            total = float(w.sum(dtype=np.float64))
            if total <= 0 or total > 1.0 + 1e-3:
                raise QError(f"q.positions[{i}] probabilities sum to {total:.6g}; must be in (0, 1]")
        # q(token) = weight / total with total > 0, so q(token) = 0 exactly when its weight is 0.
        if not token_value > 0:
            raise QError(f"draft token {token} at position {i} has q = 0, so it cannot have been sampled from q")
        out.append(EncodedQ(ids, w, fixed=fixed))
    return out

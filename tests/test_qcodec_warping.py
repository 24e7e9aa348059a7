"""The q codec and the warping that produces p and q."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from spec_core import qcodec
from spec_core.proto import qpayload
from spec_core.proto import verifier_pb2 as pb
from spec_core.warping import processed_probs


def test_temperature_zero_is_argmax_point_mass():
    p = processed_probs(np.array([0.1, 3.0, 2.9]), 0.0)
    assert p.tolist() == [0.0, 1.0, 0.0]


def test_top_k_keeps_k_and_renormalises():
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3]))
    p = processed_probs(logits, 1.0, top_k=2)
    np.testing.assert_allclose(p, [0, 0.4 / 0.7, 0, 0.3 / 0.7])


def test_top_p_smallest_set_reaching_p():
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3]))
    # sorted: 0.4, 0.3, 0.2, 0.1 -> 0.4 + 0.3 = 0.7 >= 0.6 so {1, 3} are kept.
    np.testing.assert_allclose(processed_probs(logits, 1.0, top_p=0.6), [0, 0.4 / 0.7, 0, 0.3 / 0.7])
    # 0.4 alone reaches 0.4.
    np.testing.assert_allclose(processed_probs(logits, 1.0, top_p=0.4), [0, 1, 0, 0])


def test_temperature_then_top_p():
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3]))
    p = processed_probs(logits, 0.5)  # sharpened: squares, renormalised
    sq = np.array([0.01, 0.16, 0.04, 0.09]); np.testing.assert_allclose(p, sq / sq.sum())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=2, max_size=40), st.integers(0, 12), st.integers(4, 20))
def test_fixed_encoding_sums_to_scale_and_has_no_zero_weights(raw, top_k, bits):
    probs = np.array(raw) + 1e-9
    probs /= probs.sum()
    enc = qcodec.encode_fixed(probs, top_k, bits)
    assert enc.weights.sum() == 1 << bits
    assert (enc.weights > 0).all()
    assert len(enc.token_ids) <= (top_k or len(probs))
    # round trip through protobuf gives the same distribution
    draft = [int(enc.token_ids[0])]
    dec = qpayload.from_proto(qpayload.to_proto([enc], bits), draft, len(probs))[0]
    np.testing.assert_array_equal(dec.dense(len(probs)), enc.dense(len(probs)))


def test_fixed_sampling_frequencies_match_the_shipped_weights():
    enc = qcodec.EncodedQ(np.array([3, 7, 9], dtype=np.uint32), np.array([1, 2, 5]), fixed=True)
    rng = np.random.default_rng(1)
    n = 40_000
    draws = np.array([enc.sample(rng) for _ in range(n)])
    for tok, w in [(3, 1 / 8), (7, 2 / 8), (9, 5 / 8)]:
        # binomial standard error at n = 40k is <= 0.0025; 5 sigma tolerance
        assert abs((draws == tok).mean() - w) < 0.0125


def _payload(fmt, positions, bits=16):
    return pb.QPayload(format=fmt, scale_bits=bits, positions=positions)


@pytest.mark.parametrize("payload, draft, message", [
    (_payload(pb.QPayload.FLOAT32, [pb.DraftDist(token_ids=[1, 2], probs=[float("nan"), 0.5])]), [1], "NaN"),
    (_payload(pb.QPayload.FLOAT32, [pb.DraftDist(token_ids=[1, 2], probs=[-0.1, 0.5])]), [2], "outside [0, 1]"),
    (_payload(pb.QPayload.FLOAT32, [pb.DraftDist(token_ids=[1, 2], probs=[0.7, 0.6])]), [1], "sum to"),
    (_payload(pb.QPayload.FIXED, [pb.DraftDist(token_ids=[1, 2], weights=[40000, 40000])]), [1], "sum to"),
    (_payload(pb.QPayload.FIXED, [pb.DraftDist(token_ids=[1, 2], weights=[5])]), [1], "token_ids but"),
    (_payload(pb.QPayload.FIXED, [pb.DraftDist(weights=[1, 2, 3])]), [1], "dense with 3"),
    (_payload(pb.QPayload.FIXED, [pb.DraftDist(token_ids=[1], weights=[5])]), [1, 2], "2 draft tokens"),
    (_payload(pb.QPayload.FIXED, [pb.DraftDist(token_ids=[99], weights=[5])]), [99], "outside the vocabulary"),
    (_payload(pb.QPayload.FIXED, [pb.DraftDist(token_ids=[1, 2], weights=[5, 0])]), [2], "q = 0"),
    (_payload(pb.QPayload.FIXED, [pb.DraftDist(token_ids=[1], weights=[5])], bits=0), [1], "scale_bits"),
])
def test_bad_q_is_refused_with_a_readable_message(payload, draft, message):
    with pytest.raises(qcodec.QError, match=message.replace("[", r"\[").replace("]", r"\]")):
        qpayload.from_proto(payload, draft, vocab=10)

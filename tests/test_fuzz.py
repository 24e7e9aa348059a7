"""Fuzz the verifier: hypothesis draws over 1,000 requests per run from strategies over the .proto
messages (hostile values included: ids past the vocabulary, NaN and infinite sampling values,
huge repeated fields, q of the wrong shape, unknown enum values, rounds and committed lengths out
of step, reused open keys, other callers' session ids) plus raw and mutated bytes on every
method. Every answer must be a status other than UNKNOWN or INTERNAL, with a message, and an
edge generating alongside the whole time must keep getting the target's exact greedy output.

Run with `-s` to see the figures (requests tried, statuses seen).
"""
from __future__ import annotations

import asyncio
import collections
import resource
import threading

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloud_verifier.backends.synthetic import SyntheticBackend
from cloud_verifier.engine import Limits
from cloud_verifier.server import VerifierServer
from edge_client import EdgeClient
from edge_client.drafters import SyntheticDrafter
from edge_client.text import SyntheticTokenizer
from helpers import edge_options
from spec_core.proto import verifier_pb2 as pb
from spec_core.proto import verifier_pb2_grpc as pb_grpc
from spec_core.crossvocab import Vocabulary
from spec_core.synthetic import SyntheticLM, synthetic_fingerprint
from xvocab_pair import longest_match_tokenizer
from spec_core.warping import SamplingSettings

VOCAB, N_CTX = 32, 256
FP = synthetic_fingerprint(VOCAB)
U32, U64 = 2**32 - 1, 2**64 - 1
BAD = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
METHODS = ["Verify", "Close", "GetServerInfo", "Generate", "GetVocabulary"]
# The fuzzed server has a vocabulary ('<tok0>', '<tok1>', ...: the synthetic fingerprint), so text
# prompts and GetVocabulary reach the tokenizer.
FUZZ_VOCAB = Vocabulary(tuple(f"<tok{i}>".encode() for i in range(VOCAB)), eog_ids=frozenset({1}), fingerprint=FP)


def fuzz(n: int) -> settings:
    """n examples, no deadline (a huge field takes a while), no example database between runs."""
    return settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))

# --- strategies over the messages -----------------------------------------------------------------

token_id = st.one_of(st.integers(0, VOCAB - 1), st.integers(0, VOCAB - 1), st.integers(VOCAB, U32),
                     st.sampled_from([VOCAB, U32]))
small_ids = st.lists(token_id, max_size=12)
huge_ids = st.builds(lambda n, v: [v] * n, st.sampled_from([5_000, 60_000]), token_id)
ids = st.one_of(small_ids, small_ids, small_ids, huge_ids)
any_float = st.floats(width=32, allow_nan=True, allow_infinity=True)
prob = st.one_of(st.floats(0, 1, width=32), any_float)
u32 = st.one_of(st.integers(0, 64), st.integers(0, U32), st.sampled_from([0, 1, U32]))


@st.composite
def sampling(draw):
    sp = pb.SamplingParams(temperature=draw(st.one_of(st.floats(0, 2, width=32), any_float)),
                           top_k=draw(u32), top_p=draw(prob), max_new_tokens=draw(u32),
                           stop_token_ids=draw(st.one_of(small_ids, st.lists(token_id, min_size=60, max_size=200))),
                           ignore_eos=draw(st.booleans()))
    if draw(st.booleans()):
        sp.seed = draw(st.integers(0, U64))
    return sp


@st.composite
def draft_dist(draw):
    return pb.DraftDist(token_ids=draw(small_ids), weights=draw(st.lists(u32, max_size=12)),
                        probs=draw(st.one_of(st.lists(prob, max_size=12),
                                             st.builds(lambda n, p: [p] * n, st.sampled_from([VOCAB, 70_000]), prob))))


@st.composite
def q_payload(draw, n_drafts):
    fmt = draw(st.sampled_from([0, 1, 2, 2, 1, 7, 1000]))       # 7 and 1000: unknown enum values
    n = draw(st.sampled_from([n_drafts, n_drafts, max(0, n_drafts - 1), n_drafts + 1, 0]))
    return pb.QPayload(format=fmt, scale_bits=draw(st.one_of(st.integers(0, 40), u32)),
                       positions=[draw(draft_dist()) for _ in range(min(n, 20))])


OPEN_KEYS = [b"A" * 16, b"B" * 16, b"C" * 16]   # reused across requests with different prompts


prompt_text = st.one_of(st.text(max_size=40), st.sampled_from(["<tok3><tok4>", "<tok1>" * 400, "\x00<tok",
                                                               "x" * ((1 << 20) + 1)]))
role = st.one_of(st.sampled_from(["user", "system", "assistant"]), st.text(max_size=40))


@st.composite
def chat_messages(draw):
    n = draw(st.sampled_from([0, 1, 3, 300]))
    return [pb.ChatMessage(role=draw(role), content=draw(prompt_text)) for _ in range(min(n, 3))] * (1 + n // 3)


@st.composite
def text_prompt(draw, msg):
    """Maybe set prompt_text / prompt_messages on a message (alone, together, or with ids)."""
    kind = draw(st.integers(0, 5))
    if kind in (1, 3):
        msg.prompt_text = draw(prompt_text)
    if kind in (2, 3):
        msg.prompt_messages.extend(draw(chat_messages()))
    if kind == 4:
        msg.ClearField("prompt_token_ids")
        msg.prompt_text = draw(prompt_text)
    return msg


@st.composite
def open_session(draw):
    o = pb.OpenSession(prompt_token_ids=draw(ids), resume_token_ids=draw(small_ids),
                       tokenizer_fingerprint=draw(st.sampled_from([FP, FP, "", "ab" * 32, "zz"])),
                       open_key=draw(st.one_of(st.sampled_from(OPEN_KEYS), st.binary(max_size=20))),
                       draft_tokenizer_fingerprint=draw(st.sampled_from(["", "ab" * 32, "\u00e9" * 500])))
    draw(text_prompt(o))
    if draw(st.integers(0, 4)):
        o.sampling.CopyFrom(draw(sampling()))
    return o


@st.composite
def continuation(draw):
    drafts = draw(ids)
    c = pb.Continuation(assumed_tokens=draw(small_ids), draft_token_ids=drafts)
    if draw(st.booleans()):
        c.draft_parents.extend(draw(st.lists(st.integers(-3, 14), max_size=14)))
    if draw(st.booleans()):
        c.q.CopyFrom(draw(q_payload(len(drafts))))
    return c


@st.composite
def verify_request(draw, session_ids=()):
    drafts = draw(ids)
    req = pb.VerifyRequest(round=draw(st.one_of(st.integers(0, 4), st.integers(0, U64))),
                           committed_length=draw(u32), draft_token_ids=drafts)
    if draw(st.booleans()):
        req.q.CopyFrom(draw(q_payload(len(drafts))))
    if draw(st.booleans()):
        req.open.CopyFrom(draw(open_session()))
        req.committed_length = draw(st.sampled_from([len(req.open.prompt_token_ids), req.committed_length]))
    if draw(st.integers(0, 3)) == 0:  # a pipelined round, with alternatives (continuations)
        req.assumed_tokens.extend(draw(small_ids))
        req.continuations.extend(draw(st.one_of(st.lists(continuation(), max_size=4),
                                                st.lists(continuation(), min_size=15, max_size=20))))
    if draw(st.integers(0, 2)) == 0:
        req.session_id = draw(st.one_of(st.text(max_size=40), st.sampled_from(list(session_ids) or [""])))
    return req


@st.composite
def generate_request(draw):
    req = pb.GenerateRequest(prompt_token_ids=draw(ids))
    draw(text_prompt(req))
    if draw(st.integers(0, 4)):
        req.sampling.CopyFrom(draw(sampling()))
    return req


# --- the server, and an edge alongside it ---------------------------------------------------------

class ServerThread:
    """A VerifierServer on its own event loop in a thread, so hypothesis can drive it with sync calls."""

    def __init__(self, **limits):
        self.loop = asyncio.new_event_loop()
        backend = SyntheticBackend(vocab=VOCAB, n_ctx=N_CTX, vocabulary=FUZZ_VOCAB,
                                   tokenize=longest_match_tokenizer(FUZZ_VOCAB))
        self.server = VerifierServer(backend, "127.0.0.1", 0,
                                     Limits(**limits), grace_s=1.0)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)
        self.address = f"127.0.0.1:{self.server.port}"

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def greedy_reference(prompt, n):
    lm, seq = SyntheticLM(VOCAB, 0), list(prompt)
    for _ in range(n):
        seq.append(int(np.argmax(lm.logits(seq))))
    return seq[len(prompt):]


class EdgeAlongside(threading.Thread):
    """Generates greedily, again and again, until told to stop; every output must be the target's own."""

    def __init__(self, address: str):
        super().__init__(daemon=True)
        self.address, self.done, self.failures = address, threading.Event(), []
        self.completed = 0
        self.replays = 0

    def run(self):
        asyncio.run(self._loop())

    async def _loop(self):
        settings_ = SamplingSettings(temperature=0.0, max_new_tokens=40, ignore_eos=True)
        async with EdgeClient(edge_options(self.address, gamma=4, deadline_s=20, max_replays=1000),
                              SyntheticDrafter(VOCAB, noise=1.0), SyntheticTokenizer(VOCAB)) as c:
            while not self.done.is_set() or self.completed == 0:
                k = self.completed % 7
                gen = c.generate(f"3 {k} 9", settings_)
                try:
                    await gen.text()
                except Exception as e:  # noqa: BLE001 - recorded, asserted by the test
                    self.failures.append(repr(e))
                    return
                if gen.stats.token_ids != greedy_reference([0, 3, k, 9], 40):
                    self.failures.append(f"output {k} differs from the target's greedy output")
                self.completed += 1
                self.replays += gen.stats.replays


# --- the fuzz run ---------------------------------------------------------------------------------

def test_fuzz_every_request_gets_a_fitting_status_and_the_server_keeps_serving():
    srv = ServerThread(max_gamma=8, max_sessions=16, max_new_tokens_cap=64)
    alongside = EdgeAlongside(srv.address)
    statuses: collections.Counter[str] = collections.Counter()
    problems: list[str] = []
    live_sessions: list[str] = []
    channel = grpc.insecure_channel(srv.address, options=[("grpc.max_send_message_length", 64 << 20)])
    stub = pb_grpc.VerifierStub(channel)
    raw = {m: (channel.unary_stream if m == "Generate" else channel.unary_unary)(
        f"/hybridspec.v1.Verifier/{m}", request_serializer=None, response_deserializer=None) for m in METHODS}

    def record(what: str, call):
        try:
            reply = call()
            if what.endswith("Generate"):
                list(reply)
            statuses["OK"] += 1
            return reply
        except grpc.RpcError as e:
            statuses[e.code().name] += 1
            if e.code() in BAD or not e.details():
                problems.append(f"{what}: {e.code().name} {e.details()!r}")
        return None

    def verify(req):
        reply = record("Verify", lambda: stub.Verify(req, timeout=20))
        if reply is not None and reply.session_id not in live_sessions:
            live_sessions.append(reply.session_id)

    @fuzz(350)
    @given(verify_request())
    def fuzz_verify(req):
        verify(req)

    @fuzz(250)
    @given(st.data())
    def fuzz_rounds_on_live_sessions(data):
        # Rounds out of step, wrong committed lengths, retried rounds with other drafts. Every
        # value is drawn whatever the live sessions are (hypothesis replays draws), then used.
        fresh = data.draw(st.integers(0, 9)) == 0
        key = data.draw(st.binary(min_size=16, max_size=16))
        temperature = data.draw(st.sampled_from([0.0, 1.0]))
        pick = data.draw(st.integers(0, 2**16))
        drafts = data.draw(small_ids)
        req = pb.VerifyRequest(round=data.draw(st.integers(0, 8)), committed_length=data.draw(st.integers(0, 40)),
                               draft_token_ids=drafts)
        if data.draw(st.booleans()):
            req.q.CopyFrom(data.draw(q_payload(len(drafts))))
        if fresh or not live_sessions:
            o = pb.OpenSession(prompt_token_ids=[0, 4], tokenizer_fingerprint=FP, open_key=key,
                               sampling=pb.SamplingParams(temperature=temperature, max_new_tokens=60, ignore_eos=True))
            verify(pb.VerifyRequest(round=1, committed_length=2, open=o))
            return
        req.session_id = live_sessions[pick % len(live_sessions)]
        verify(req)

    @fuzz(120)
    @given(generate_request())
    def fuzz_generate(req):
        record("Generate", lambda: stub.Generate(req, timeout=20))

    @fuzz(60)
    @given(st.one_of(st.text(max_size=80), st.sampled_from([FP, "0" * 64, "../" * 30, "F" * 64, "x" * 100_000])))
    def fuzz_vocabulary(fingerprint):
        reply = record("GetVocabulary", lambda: stub.GetVocabulary(pb.VocabularyRequest(fingerprint=fingerprint),
                                                                    timeout=20))
        if reply is not None and reply.fingerprint != FP:
            problems.append(f"GetVocabulary({fingerprint[:20]!r}) answered another fingerprint")

    @fuzz(80)
    @given(st.data())
    def fuzz_close(data):
        text, pick = data.draw(st.text(max_size=60)), data.draw(st.integers(0, 2**16))
        session_id = live_sessions[pick % len(live_sessions)] if live_sessions and pick % 2 else text
        record("Close", lambda: stub.Close(pb.CloseRequest(session_id=session_id), timeout=20))

    @fuzz(300)
    @given(st.sampled_from(METHODS), st.one_of(st.binary(max_size=300), st.builds(
        lambda req, cut, flip: _mutate(req.SerializeToString(), cut, flip), verify_request(),
        st.integers(0, 1000), st.integers(0, 255))))
    def fuzz_raw_bytes(method, data):
        record(f"raw {method}", lambda: raw[method](data, timeout=20))

    alongside.start()
    try:
        fuzz_verify()
        fuzz_rounds_on_live_sessions()
        fuzz_generate()
        fuzz_vocabulary()
        fuzz_raw_bytes()
        fuzz_close()
    finally:
        alongside.done.set()
        alongside.join(120)
        channel.close()
        srv.stop()
    total = sum(statuses.values())
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # server + client + hypothesis
    print(f"\nfuzz: {total} requests, statuses {dict(statuses.most_common())}; "
          f"alongside: {alongside.completed} generations, {alongside.replays} replays; "
          f"peak RSS of the test process (server included) {peak_mb:.0f} MB")
    assert not problems, problems[:10]
    assert total >= 1000
    assert alongside.completed >= 1 and not alongside.failures, alongside.failures
    assert not alongside.is_alive()
    assert statuses["INVALID_ARGUMENT"] > 100 and statuses["OK"] > 50   # the strategies reach both sides


def _mutate(data: bytes, cut: int, flip: int) -> bytes:
    """A valid encoding, truncated and with one byte changed: the bytes a broken client sends."""
    if not data:
        return bytes([flip])
    data = bytearray(data[: max(1, cut % (len(data) + 1))])
    data[cut % len(data)] ^= flip or 0x80
    return bytes(data)


@pytest.mark.parametrize("method", METHODS)
def test_raw_garbage_is_invalid_argument(method):
    srv = ServerThread()
    try:
        with grpc.insecure_channel(srv.address) as ch:
            call = (ch.unary_stream if method == "Generate" else ch.unary_unary)(
                f"/hybridspec.v1.Verifier/{method}", request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as e:
                reply = call(b"\xff\xfe\xfd", timeout=10)
                if method == "Generate":
                    list(reply)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith("the request is not a valid protobuf message")
    finally:
        srv.stop()

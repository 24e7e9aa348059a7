"""Bad input: each a clear gRPC status and message, and the server keeps serving everyone else."""
from __future__ import annotations

import grpc
import pytest

from cloud_verifier.backends.synthetic import SyntheticBackend
from helpers import running_server, stub_for
from spec_core import qcodec
from spec_core.proto import verifier_pb2 as pb
from spec_core.synthetic import synthetic_fingerprint

VOCAB = 32
FP = synthetic_fingerprint(VOCAB)


def open_req(prompt=(0, 5, 6), drafts=(), q=None, fingerprint=FP, round=1, committed=None, **sampling):
    # ignore_eos: the synthetic target may sample its EOS, which would end the session mid-test.
    sp = pb.SamplingParams(temperature=sampling.pop("temperature", 1.0), max_new_tokens=sampling.pop("max_new_tokens", 20),
                           ignore_eos=sampling.pop("ignore_eos", True), **sampling)
    return pb.VerifyRequest(round=round, committed_length=len(prompt) if committed is None else committed,
                            open=pb.OpenSession(prompt_token_ids=list(prompt), sampling=sp,
                                                tokenizer_fingerprint=fingerprint, open_key=b"k" * 16),
                            draft_token_ids=list(drafts), q=q or pb.QPayload())


@pytest.fixture
async def stub():
    async with running_server(SyntheticBackend(vocab=VOCAB, n_ctx=64), max_gamma=8) as server:
        async with stub_for(server) as s:
            yield s


async def expect(stub, req, code, message):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Verify(req, timeout=5)
    assert e.value.code() == code, e.value.details()
    assert message in e.value.details(), e.value.details()
    # ... and the server still serves a good request.
    good = open_req()
    good.open.open_key = bytes(16)
    ok = await stub.Verify(good, timeout=5)
    await stub.Close(pb.CloseRequest(session_id=ok.session_id), timeout=5)
    return e.value.details()


def fixed_q(rows):
    return pb.QPayload(format=pb.QPayload.FIXED, scale_bits=16,
                       positions=[pb.DraftDist(token_ids=ids, weights=w) for ids, w in rows])


def float_q(rows):
    return pb.QPayload(format=pb.QPayload.FLOAT32,
                       positions=[pb.DraftDist(token_ids=ids, probs=p) for ids, p in rows])


INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECOND = grpc.StatusCode.FAILED_PRECONDITION
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize("req, code, message", [
    (open_req(prompt=(0, 99)), INVALID, "open.prompt_token_ids[1] = 99 is outside the vocabulary"),
    (open_req(drafts=(3, 40)), INVALID, "draft_token_ids[1] = 40 is outside the vocabulary"),
    (open_req(drafts=(3,), q=float_q([([3, 4], [float("nan"), 0.5])])), INVALID, "NaN"),
    (open_req(drafts=(3,), q=float_q([([3, 4], [-0.2, 0.5])])), INVALID, "outside [0, 1]"),
    (open_req(drafts=(3,), q=float_q([([3, 4], [0.8, 0.7])])), INVALID, "sum to 1.5"),
    (open_req(drafts=(3, 4), q=fixed_q([([3], [100])])), INVALID, "1 positions but there are 2 draft tokens"),
    (open_req(drafts=(3,), q=fixed_q([([3, 4], [100])])), INVALID, "2 token_ids but 1 values"),
    (open_req(drafts=tuple(range(9))), EXHAUSTED, "above this server's limit of 8"),
    (open_req(prompt=tuple(range(2, 32)) * 3), EXHAUSTED, "do not fit the context window of 64"),
    (open_req(fingerprint="ab" * 32), PRECOND, "tokenizer mismatch"),
    (pb.VerifyRequest(round=1, committed_length=3), INVALID, "`open` is missing"),
    (open_req(prompt=()), INVALID, "prompt_token_ids is empty"),
    (open_req(temperature=-1.0), INVALID, "temperature must be finite and >= 0"),
    (open_req(top_p=1.5), INVALID, "top_p must be in [0, 1]"),
    (open_req(round=0), INVALID, "round must be >= 1"),
    (open_req(round=2), PRECOND, "must be round 1"),
    (open_req(committed=7), PRECOND, "does not match the prompt"),
    (pb.VerifyRequest(session_id="nope", round=2, committed_length=3), grpc.StatusCode.NOT_FOUND,
     "resend the round with `open`"),
], ids=lambda v: v if isinstance(v, str) else None)
async def test_bad_request_gets_status_and_server_goes_on(stub, req, code, message):
    await expect(stub, req, code, message)


async def test_missing_sampling_settings(stub):
    req = open_req()
    req.open.ClearField("sampling")
    await expect(stub, req, INVALID, "open.sampling is missing")


async def test_wrong_round_and_committed_length(stub):
    first = await stub.Verify(open_req(drafts=(3,)), timeout=5)
    sid, n = first.session_id, first.committed_length
    await expect(stub, pb.VerifyRequest(session_id=sid, round=5, committed_length=n), PRECOND,
                 "round 5 is out of step: this session expects round 2")
    details = await expect(stub, pb.VerifyRequest(session_id=sid, round=2, committed_length=n + 3), PRECOND,
                           f"does not match the server's {n}")
    assert "resync" in details
    # The session itself is unharmed: the right round goes through.
    ok = await stub.Verify(pb.VerifyRequest(session_id=sid, round=2, committed_length=n), timeout=5)
    assert ok.committed_length == n + 1


async def test_retried_round_returns_the_same_reply_and_commits_once(stub):
    first = await stub.Verify(open_req(drafts=(3, 4, 5)), timeout=5)
    again = await stub.Verify(open_req(drafts=(3, 4, 5)), timeout=5)  # same open_key: a retried first round
    assert again == first
    req = pb.VerifyRequest(session_id=first.session_id, round=2, committed_length=first.committed_length,
                           draft_token_ids=[7, 8])
    r1 = await stub.Verify(req, timeout=5)
    r2 = await stub.Verify(req, timeout=5)
    assert r1 == r2
    nxt = await stub.Verify(pb.VerifyRequest(session_id=first.session_id, round=3,
                                             committed_length=r1.committed_length), timeout=5)
    assert nxt.committed_length == r1.committed_length + 1  # the retry did not commit twice
    changed = pb.VerifyRequest(session_id=first.session_id, round=3, committed_length=r1.committed_length,
                               draft_token_ids=[9])
    await expect(stub, changed, PRECOND, "already verified with different drafts")


async def test_sessions_are_bounded_and_evicted_lru():
    async with running_server(SyntheticBackend(vocab=VOCAB), max_sessions=2) as server:
        async with stub_for(server) as stub:
            ids = []
            for k in range(3):
                r = open_req()
                r.open.open_key = bytes([k]) * 16
                ids.append((await stub.Verify(r, timeout=5)).session_id)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Verify(pb.VerifyRequest(session_id=ids[0], round=2, committed_length=4), timeout=5)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            ok = await stub.Verify(pb.VerifyRequest(session_id=ids[2], round=2, committed_length=4), timeout=5)
            assert ok.round == 2
    assert len({len(i) for i in ids}) == 1 and len(ids[0]) >= 20  # 128-bit url-safe ids


async def test_finished_session_refuses_more_rounds(stub):
    r = await stub.Verify(open_req(max_new_tokens=1), timeout=5)
    assert r.finish_reason == pb.LENGTH
    await expect(stub, pb.VerifyRequest(session_id=r.session_id, round=2, committed_length=r.committed_length),
                 PRECOND, "already finished (LENGTH)")


async def test_generate_validates_too(stub):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in stub.Generate(pb.GenerateRequest(prompt_token_ids=[0, 77],
                                                        sampling=pb.SamplingParams(temperature=1)), timeout=5):
            pass
    assert e.value.code() == INVALID and "outside the vocabulary" in e.value.details()


# --- one rule for sampling settings (spec_core.warping), used by both ends and every CLI ----------

@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.1}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"seed": -1}, "seed"),
    ({"seed": 2 ** 64}, "seed"),
    ({"stop_token_ids": (3, -1)}, "stop_token_ids"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_sampling_settings_refuse_bad_values_naming_the_field(kwargs, field):
    from spec_core.warping import SamplingError, SamplingSettings
    with pytest.raises(SamplingError) as e:
        SamplingSettings(**kwargs)
    assert e.value.field == field and str(e.value).startswith(field)


def test_sampling_settings_spell_top_p_off_once_and_greedy_once():
    from spec_core.warping import SamplingSettings, is_greedy
    assert SamplingSettings(top_p=0.0).top_p == SamplingSettings(top_p=1.0).top_p == 1.0  # both mean off
    assert SamplingSettings(top_p=0.9).top_p == 0.9
    assert SamplingSettings(temperature=0.0).greedy and is_greedy(0.0)
    assert not SamplingSettings(temperature=0.1).greedy and not is_greedy(0.1)


# --- text prompts (drafting across tokenizers) and the vocabulary ---------------------------------

@pytest.fixture
async def text_stub():
    from xvocab_pair import TARGET, longest_match_tokenizer
    backend = SyntheticBackend(vocab=TARGET.n_vocab, n_ctx=64, vocabulary=TARGET, tokenize=longest_match_tokenizer(TARGET))
    async with running_server(backend, max_gamma=8) as server:
        async with stub_for(server) as s:
            yield s


def text_open(committed=0, **fields):
    sp = pb.SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    return pb.VerifyRequest(round=1, committed_length=committed,
                            open=pb.OpenSession(sampling=sp, open_key=b"t" * 16, **fields))


@pytest.mark.parametrize("req, code, message", [
    (text_open(prompt_text="ab", prompt_token_ids=[2]), INVALID, "both set"),
    (text_open(prompt_text="ab", prompt_messages=[pb.ChatMessage(role="user", content="a")]), INVALID, "both set"),
    (text_open(prompt_messages=[pb.ChatMessage(role="User; DROP", content="a")]), INVALID, "is not a role"),
    (text_open(prompt_messages=[pb.ChatMessage(role="user", content="a")] * 257), INVALID, "at most 256"),
    (text_open(prompt_text="a" * ((1 << 20) + 1)), EXHAUSTED, "at most 1048576"),
    (text_open(prompt_text="ab" * 40), EXHAUSTED, "do not fit the context window"),
    (text_open(prompt_text=""), INVALID, "prompt_token_ids is empty"),
    (text_open(committed=3, prompt_text="ab"), PRECOND, "counts the tokens after the prompt only"),
], ids=["ids-and-text", "text-and-messages", "bad-role", "too-many-messages", "too-long", "over-context",
        "empty", "committed-length"])
async def test_bad_text_prompts(text_stub, req, code, message):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await text_stub.Verify(req, timeout=5)
    assert e.value.code() == code and message in e.value.details(), e.value.details()
    ok = await text_stub.Verify(text_open(prompt_text="ab"), timeout=5)   # and the server still serves
    assert list(ok.prompt_token_ids) == [0, 2, 3] and ok.committed_length == 4


async def test_text_prompts_and_vocabulary_on_a_backend_without_one(stub):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Verify(text_open(prompt_text="hello"), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED and "token ids only" in e.value.details()
    for fp, code in [("", grpc.StatusCode.UNIMPLEMENTED), ("x" * 64, INVALID), ("ab" * 40, INVALID)]:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.GetVocabulary(pb.VocabularyRequest(fingerprint=fp), timeout=5)
        assert e.value.code() == code, (fp, e.value.details())
    info = await stub.GetServerInfo(pb.ServerInfoRequest(), timeout=5)
    assert not info.text_prompts and not info.chat_prompts


# --- continuations (pipelined rounds with alternatives) -----------------------------------------

async def _after_one_round(stub):
    """A session whose round 2 committed one token: (session id, committed length, that token)."""
    first = await stub.Verify(open_req(), timeout=5)
    second = await stub.Verify(pb.VerifyRequest(session_id=first.session_id, round=2,
                                                committed_length=first.committed_length), timeout=5)
    return first.session_id, first.committed_length, second.next_token_id


def pipelined(sid, base_len, assumed, conts, drafts=(5,)):
    """Round 3 sent as if round 2 (base_len tokens before it) were still in flight."""
    return pb.VerifyRequest(session_id=sid, round=3, committed_length=base_len + len(assumed),
                            assumed_tokens=list(assumed), draft_token_ids=list(drafts), continuations=conts)


async def test_the_continuation_whose_tokens_were_committed_is_verified_and_retries_repeat_it(stub):
    sid, base_len, t = await _after_one_round(stub)
    other = (t + 1) % VOCAB
    conts = [pb.Continuation(assumed_tokens=[other, 2], draft_token_ids=[7]),  # another outcome
             pb.Continuation(assumed_tokens=[t], draft_token_ids=[8, 9])]      # the one committed
    req = pipelined(sid, base_len, [other], conts)
    reply = await stub.Verify(req, timeout=5)
    assert not reply.base_mismatch and reply.continuation == 2
    assert reply.committed_length == base_len + 1 + reply.num_accepted + 1
    assert await stub.Verify(req, timeout=5) == reply      # a retry: the cached reply, nothing committed twice
    nxt = await stub.Verify(pb.VerifyRequest(session_id=sid, round=4, committed_length=reply.committed_length),
                            timeout=5)
    assert nxt.committed_length == reply.committed_length + 1


async def test_no_matching_continuation_costs_nothing_and_frees_the_round(stub):
    sid, base_len, t = await _after_one_round(stub)
    other = (t + 1) % VOCAB
    reply = await stub.Verify(pipelined(sid, base_len, [other], [pb.Continuation(assumed_tokens=[other, 3],
                                                                                  draft_token_ids=[4])]), timeout=5)
    assert reply.base_mismatch and reply.num_accepted == 0 and reply.committed_length == base_len + 1
    fresh = await stub.Verify(pb.VerifyRequest(session_id=sid, round=3, committed_length=base_len + 1), timeout=5)
    assert fresh.committed_length == base_len + 2 and not fresh.base_mismatch


def _cont(assumed=(6,), drafts=(7,), **kw):
    return pb.Continuation(assumed_tokens=list(assumed), draft_token_ids=list(drafts), **kw)


@pytest.mark.parametrize("assumed, conts, message", [
    ((), [_cont()], "continuations ride on a pipelined round"),
    ((3,), [_cont(assumed=(i, i)) for i in range(17)], "17 continuations; this server takes at most 16"),
    ((3,), [_cont(assumed=(3,))], "continuations[0].assumed_tokens [3] repeats another alternative's"),
    ((3,), [_cont(), _cont()], "continuations[1].assumed_tokens [6] repeats"),
    ((3,), [_cont(assumed=())], "continuations[0].assumed_tokens has 0 ids; it needs 1 to (max_window - 1) x (max_gamma + 1) = 27"),
    ((3,), [_cont(assumed=(2,) * 28)], "continuations[0].assumed_tokens has 28 ids"),
    ((3,), [_cont(assumed=(99,))], "continuations[0].assumed_tokens[0] = 99 is outside the vocabulary"),
    ((3,), [_cont(drafts=(40,))], "continuations[0].draft_token_ids[0] = 40 is outside the vocabulary"),
    ((3,), [_cont(drafts=tuple(range(9)))], "continuations[0].draft_token_ids has 9 tokens; at most max_gamma = 8"),
    ((3,), [_cont(q=float_q([([7, 4], [float("nan"), 0.5])]))], "continuations[0]."),
    ((3,), [_cont(q=fixed_q([([7], [100]), ([4], [100])]))], "2 positions but there are 1 draft tokens"),
    ((3,), [_cont(drafts=(7, 8), draft_parents=[-1, 1])], "continuations[0].draft_parents[1] = 1 is not before"),
    ((3,), [_cont(drafts=(7, 7), draft_parents=[-1, -1])], "continuations[0].nodes 0 and 1 are siblings"),
], ids=lambda v: v if isinstance(v, str) else None)
async def test_bad_continuations_are_refused_clearly(stub, assumed, conts, message):
    first = await stub.Verify(open_req(), timeout=5)
    req = pipelined(first.session_id, first.committed_length, assumed, conts)
    await expect(stub, req, INVALID, message)


async def test_continuations_are_bounded_in_total_size():
    async with running_server(SyntheticBackend(vocab=VOCAB, n_ctx=64), max_gamma=8,
                              max_continuation_nodes=4) as server:
        async with stub_for(server) as stub:
            first = await stub.Verify(open_req(), timeout=5)
            conts = [_cont(assumed=(6,), drafts=(7, 8, 9)), _cont(assumed=(5,), drafts=(7, 8))]
            await expect(stub, pipelined(first.session_id, first.committed_length, (3,), conts), INVALID,
                         "the continuations carry 5 draft tokens in all; this server takes at most 4")

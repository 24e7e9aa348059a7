"""Wire hygiene (issue 24): messages quote client input by a bounded prefix, and a round's content
is validated before admission control looks at the load."""
from __future__ import annotations

import dataclasses

import grpc
import pytest

from cloud_verifier.admission import ServerPolicy
from cloud_verifier.backends.synthetic import SyntheticBackend
from cloud_verifier.validation import QUOTE_CHARS, Limits, quoted
from cloud_verifier.server import VerifierServer
from helpers import running_server, stub_for
from spec_core.proto import verifier_pb2 as pb
from test_bad_input import VOCAB, open_req


def test_quoted_keeps_short_text_and_cuts_long_text():
    assert quoted("abc") == "'abc'"
    long = "x" * 20_000
    assert quoted(long) == f"{'x' * QUOTE_CHARS!r}… (20000 characters)"


@pytest.mark.parametrize("what", ["Verify", "pipelined Verify"])
async def test_a_huge_unknown_session_id_is_not_found_with_a_short_message(what):
    """An id of 20,000 characters: echoed whole, the status would exceed the client's 16 KiB of
    metadata and arrive as RESOURCE_EXHAUSTED "Stream removed"."""
    session_id = "s" * 20_000
    req = pb.VerifyRequest(session_id=session_id, round=2, committed_length=3)
    if what == "pipelined Verify":
        req.round, req.assumed_tokens[:] = 3, [1]
    async with running_server(SyntheticBackend(vocab=VOCAB)) as server:
        async with stub_for(server) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Verify(req, timeout=5)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value.details()
    assert len(e.value.details()) < 400 and "20000 characters" in e.value.details()


async def test_a_long_chat_role_is_quoted_by_a_prefix():
    backend = SyntheticBackend(vocab=VOCAB, vocabulary=None)
    backend.caps = dataclasses.replace(backend.caps, vocabulary=True)   # text prompts reach the role check (the synthetic stand-in template)
    req = open_req(prompt=())
    req.open.prompt_messages.add(role="R" * 5000, content="hi")
    async with running_server(backend) as server:
        async with stub_for(server) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Verify(req, timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "is not a role" in e.value.details()
    assert len(e.value.details()) < 400, e.value.details()


@pytest.mark.parametrize("bad, message", [
    (open_req(prompt=(0, 99)), "open.prompt_token_ids[1] = 99 is outside the vocabulary"),
    (open_req(temperature=-1.0), "temperature must be finite and >= 0"),
    (open_req(drafts=(3, 40)), "draft_token_ids[1] = 40 is outside the vocabulary"),
])
async def test_when_every_slot_is_full_a_malformed_open_is_invalid_not_refused_for_load(bad, message):
    async with VerifierServer(SyntheticBackend(vocab=VOCAB), "127.0.0.1", 0, Limits(max_sessions=1),
                              policy=ServerPolicy(evict_idle_after_s=60)) as server:
        async with stub_for(server) as stub:
            await stub.Verify(open_req(), timeout=5)       # the only slot, busy (used just now)
            full = open_req()
            full.open.open_key = b"f" * 16
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Verify(full, timeout=5)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED   # a good open: refused for load
            bad.open.open_key = b"b" * 16
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Verify(bad, timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            assert message in e.value.details()

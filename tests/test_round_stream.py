"""The edge's round stream (edge_client.stream.RoundStream) against fake calls: a send that fails in
gRPC core (a broken connection under the call: grpc aio says INTERNAL "Internal error from Core")
is a lost round, retried like UNAVAILABLE; a verifier's own INTERNAL for a round is not."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from edge_client.stream import RoundStream
from spec_core.proto import verifier_pb2 as pb


def _core_failure() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                details="Internal error from Core")


class _FakeCall:
    """A VerifyStream call: `write` fails as told, or its replies are the given messages."""

    def __init__(self, fail_write: bool, replies: list):
        self.fail_write, self.replies, self.cancelled = fail_write, replies, False
        self.written: list = []
        self._go = asyncio.Event()

    async def write(self, msg):
        if self.fail_write:
            raise _core_failure()
        self.written.append(msg)
        self._go.set()

    async def done_writing(self):
        self.cancel()

    def cancel(self):
        self.cancelled = True
        self._go.set()

    def __aiter__(self):
        return self._replies()

    async def _replies(self):
        await self._go.wait()
        for r in self.replies:
            yield r(self.written[-1].tag) if callable(r) else r
        await asyncio.sleep(3600)


class _FakeStub:
    def __init__(self, calls):
        self.calls = list(calls)
        self.opened = 0

    def VerifyStream(self, metadata=None, wait_for_ready=False):  # noqa: N802 - the gRPC method's name
        self.opened += 1
        return self.calls.pop(0)


def _verifier_internal(tag: int) -> pb.StreamReply:
    return pb.StreamReply(tag=tag, error=pb.StreamError(code=grpc.StatusCode.INTERNAL.value[0], message="a bug"))


@pytest.mark.asyncio
async def test_a_send_that_fails_in_core_is_a_lost_round_and_the_next_opens_a_new_call():
    stub = _FakeStub([_FakeCall(fail_write=True, replies=[]),
                      _FakeCall(fail_write=False, replies=[lambda tag: pb.StreamReply(tag=tag, reply=pb.VerifyReply(round=3))])])
    rs = RoundStream(stub, None, deadline_s=5.0)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await rs.verify(pb.VerifyRequest(round=3))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE   # what Verifier.call retries
    reply = await rs.verify(pb.VerifyRequest(round=3))    # the retry: a new call
    assert reply.round == 3 and stub.opened == 2
    await rs.close()


@pytest.mark.asyncio
async def test_control_a_verifiers_internal_for_a_round_stays_internal():
    stub = _FakeStub([_FakeCall(fail_write=False, replies=[_verifier_internal])])
    rs = RoundStream(stub, None, deadline_s=5.0)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await rs.verify(pb.VerifyRequest(round=1))
    assert e.value.code() == grpc.StatusCode.INTERNAL
    await rs.close()

"""The edge's round stream (edge_client.stream.RoundStream) against fake calls: a send that fails in
gRPC core (a broken connection under the call: grpc aio says INTERNAL "Internal error from Core")
is a lost round, retried like UNAVAILABLE; a verifier's own INTERNAL for a round is not. A round
cancelled as its reply arrives is cancelled (and no package awaits with `asyncio.wait_for`, which
drops such a cancellation on Python 3.11)."""
from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import grpc
import pytest

from edge_client.stream import RoundStream
from safe_ast import parse
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


class _GatedCall(_FakeCall):
    """A call whose one reply comes when the test opens the gate."""

    def __init__(self):
        super().__init__(fail_write=False, replies=[])
        self.gate, self.ended = asyncio.Event(), asyncio.Event()

    async def done_writing(self):
        self.ended.set()   # the verifier ends the call once the edge has written all it will

    async def _replies(self):
        await self._go.wait()
        await self.gate.wait()
        yield pb.StreamReply(tag=self.written[-1].tag, reply=pb.VerifyReply(round=1))
        await self.ended.wait()


@pytest.mark.asyncio
async def test_a_round_cancelled_as_its_reply_arrives_is_cancelled_not_answered():
    """The caller is cancelled (its HTTP client went away) in each of the loop steps around the
    reply's arrival. Whenever the round had not returned yet, the cancellation must reach the caller:
    Python 3.11's `asyncio.wait_for` drops it when the awaited reply is already there, and the
    generation then goes on, its session never closed."""
    outcomes = {"answered": 0, "cancelled": 0}
    for steps in range(12):
        call = _GatedCall()
        rs = RoundStream(_FakeStub([call]), None, deadline_s=5.0)
        task = asyncio.ensure_future(rs.verify(pb.VerifyRequest(round=1)))
        while not call.written:
            await asyncio.sleep(0)
        call.gate.set()
        for _ in range(steps):
            await asyncio.sleep(0)
        if task.done():
            outcomes["answered"] += 1
            assert task.result().round == 1
        else:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            outcomes["cancelled"] += 1
        await rs.close()
    assert outcomes["answered"] and outcomes["cancelled"], outcomes   # both sides of the race were reached


# --- the rule, read from the source -------------------------------------------------------------

PACKAGES = ("spec_core", "edge_client", "cloud_verifier", "netsim", "llama_runtime", "hybridspec", "bench")


def wait_for_calls(source: str, filename: str) -> list[str]:
    """`asyncio.wait_for(...)` calls (and a bare `wait_for` imported from asyncio) as file:line."""
    tree = parse(source, filename)
    bare = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "asyncio"
            for a in n.names if a.name == "wait_for"}
    return [f"{filename}:{n.lineno}" for n in ast.walk(tree) if isinstance(n, ast.Call) and (
        (isinstance(n.func, ast.Attribute) and n.func.attr == "wait_for"
         and isinstance(n.func.value, ast.Name) and n.func.value.id == "asyncio")
        or (isinstance(n.func, ast.Name) and n.func.id in bare))]


def test_the_rule_sees_wait_for_called_either_way():
    assert wait_for_calls("import asyncio\nasync def f(x):\n    await asyncio.wait_for(x, 1)\n", "a.py") == ["a.py:3"]
    assert wait_for_calls("from asyncio import wait_for as w\nasync def f(x):\n    await w(x, 1)\n", "b.py") == ["b.py:3"]
    assert not wait_for_calls("async def f(c):\n    await c.wait_for(lambda: True)\n", "c.py")  # a Condition's


def test_no_package_awaits_with_asyncio_wait_for():
    """`asyncio.timeout` instead: Python 3.11 (our floor) loses a cancellation with wait_for (above)."""
    root = Path(__file__).resolve().parents[1]
    found = [hit for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))
             for hit in wait_for_calls(p.read_text(), str(p.relative_to(root)))]
    assert not found, found

"""A session's rounds over one VerifyStream call: send a round, get its reply when it comes.

`RoundStream.verify(req)` has unary Verify's contract: it returns the round's VerifyReply or raises
grpc.aio.AioRpcError with the status (and the `retry-after-ms` hint) Verify would have ended with,
so `edge_client.transport.Verifier.call` retries and backs off through it as through Verify. Rounds
are tagged; their replies come back as the verifier finishes them, in any order. A broken stream
fails every unanswered round with its status (UNAVAILABLE when the server went away): each is
retried, as a lost reply is, on a new stream opened for the first retry (the verifier answers a
round it already committed from its reply cache).
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging

import grpc

from edge_client.transport import GRPC_FRAME_BYTES
from spec_core.proto import verifier_pb2 as pb
from spec_core.wire import RETRY_AFTER_KEY

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 1.0   # how long closing waits for the verifier to end the stream on its own


# What grpc aio reports when an operation on a call fails in gRPC core (a broken connection
# under a streaming call), as status INTERNAL; a verifier's own errors come in StreamError.
_CORE_FAILURE = "Internal error from Core"


def _status_error(code: int, message: str, retry_after_ms: int = 0) -> grpc.aio.AioRpcError:
    """A round's StreamError as the AioRpcError unary Verify would raise (Verifier.call reads both)."""
    status = next((s for s in grpc.StatusCode if s.value[0] == code), grpc.StatusCode.UNKNOWN)
    trailing = grpc.aio.Metadata(*(((RETRY_AFTER_KEY, str(retry_after_ms)),) if retry_after_ms else ()))
    return grpc.aio.AioRpcError(status, grpc.aio.Metadata(), trailing, details=message)


class _Call:
    """One VerifyStream call and the rounds waiting for their replies on it."""

    def __init__(self, call):
        self.call = call
        self.pending: dict[int, asyncio.Future] = {}
        self.reader: asyncio.Task | None = None
        self.ended = False
        self.writing = asyncio.Lock()   # one write at a time on a call (grpc.aio fails concurrent ones)


class RoundStream:
    """One open VerifyStream call (opened on the first round, again after it broke) and the rounds
    waiting for their replies on it. `close()` ends the call (the verifier finishes what it has)."""

    def __init__(self, stub, metadata, deadline_s: float):
        self._stub, self._metadata, self._deadline_s = stub, metadata, deadline_s
        self._open_call: _Call | None = None
        self._tags = itertools.count(1)

    async def verify(self, req: pb.VerifyRequest, wait_for_ready: bool = False) -> pb.VerifyReply:
        """The round's reply; AioRpcError with the round's status, or the stream's when it broke."""
        c = self._open(wait_for_ready)
        tag = next(self._tags)
        fut = asyncio.get_running_loop().create_future()
        c.pending[tag] = fut
        written = False

        async def round_trip() -> pb.VerifyReply:
            nonlocal written
            async with c.writing:
                await c.call.write(pb.StreamRound(tag=tag, request=req))
            written = True
            return await asyncio.shield(fut)
        try:
            # The deadline covers the write too: a call waiting for a verifier that went away (wait
            # for ready) would otherwise hold the write forever. asyncio.timeout, not wait_for:
            # on Python 3.11 wait_for drops a cancellation that comes as the reply arrives.
            async with asyncio.timeout(self._deadline_s):
                return await round_trip()
        except asyncio.TimeoutError:
            if not written:
                self._end(c)   # a write cut short leaves the call unusable: the retry opens a new one
            raise _status_error(grpc.StatusCode.DEADLINE_EXCEEDED.value[0],
                                f"no reply to round {req.round} on the stream within {self._deadline_s:g} s") from None
        except grpc.aio.AioRpcError as e:
            if written or e.code() != grpc.StatusCode.INTERNAL:
                raise   # the verifier's status for the whole call (a refused token, ...), or the round's
            # The write failed: the connection under the call broke (grpc aio reports a failed
            # send as INTERNAL "Internal error from Core", not UNAVAILABLE). The round may or may
            # not have reached the verifier; either way its retry is answered once (the reply cache).
            self._end(c)
            raise _status_error(grpc.StatusCode.UNAVAILABLE.value[0],
                                f"the round stream broke while sending round {req.round}: "
                                f"{e.code().name} {e.details()}") from None
        except (grpc.aio.UsageError, asyncio.InvalidStateError, ConnectionError) as e:
            # The call ended under us before the round was written: it is unanswered.
            self._end(c)
            raise _status_error(grpc.StatusCode.UNAVAILABLE.value[0], f"the round stream ended: {e}") from None
        finally:
            c.pending.pop(tag, None)

    def follow(self, stub) -> None:
        """Open the next call on `stub`: the verifier's stub after it moved to another replica (a
        draining one handed the session back); a call still open on the old one is ended."""
        if stub is not self._stub:
            self._stub = stub
            self.reset()

    def reset(self) -> None:
        """End the open call: the next round opens a new one. After a replay, the open call may still
        be on the replica that lost the session (a draining one keeps its calls for its grace)."""
        if self._open_call is not None and not self._open_call.ended:
            self._end(self._open_call)
        self._open_call = None

    def _open(self, wait_for_ready: bool) -> _Call:
        if self._open_call is None or self._open_call.ended:
            c = _Call(self._stub.VerifyStream(metadata=self._metadata, wait_for_ready=wait_for_ready))
            c.reader = asyncio.ensure_future(self._read(c))
            self._open_call = c
        return self._open_call

    async def _read(self, c: _Call) -> None:
        """Hand each reply to its round; when the call ends, fail the rounds still waiting with its status."""
        error: grpc.aio.AioRpcError | None = None
        try:
            async for msg in c.call:
                fut = c.pending.get(msg.tag)
                if fut is None or fut.done():
                    continue   # a round that gave up waiting (its retry goes on its own)
                if msg.HasField("error"):
                    fut.set_exception(_status_error(msg.error.code, msg.error.message, msg.error.retry_after_ms))
                else:
                    fut.set_result(msg.reply)
        except grpc.aio.AioRpcError as e:
            error = e
            if e.code() == grpc.StatusCode.INTERNAL and e.details() == _CORE_FAILURE:
                # The transport failed under the call (not a verifier's answer: those come per round).
                error = _status_error(grpc.StatusCode.UNAVAILABLE.value[0], f"the round stream broke: {e.details()}")
        except asyncio.CancelledError:
            pass
        if error is None:
            error = _status_error(grpc.StatusCode.UNAVAILABLE.value[0], "the round stream ended before the reply")
        log.debug("round stream ended: %s", error.code().name)
        c.ended = True   # the next round opens a new stream
        for fut in list(c.pending.values()):
            if not fut.done():
                fut.set_exception(error)

    def _end(self, c: _Call) -> None:
        c.ended = True
        c.call.cancel()

    async def close(self) -> None:
        c, self._open_call = self._open_call, None
        if c is None or c.ended:
            return
        try:
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError,
                                     asyncio.TimeoutError):
                async with c.writing, asyncio.timeout(CLOSE_WAIT_S):
                    await c.call.done_writing()
            # The verifier ends the stream once it has answered what it holds; rounds waiting there
            # for a predecessor that will not come (the generation ended) would hold it up to its
            # pipeline wait, and their answers are not needed: give it a moment, then cancel.
            with contextlib.suppress(asyncio.TimeoutError):
                async with asyncio.timeout(CLOSE_WAIT_S):
                    await asyncio.shield(c.reader)
        finally:   # also when the closer is cancelled: the call does not outlive the session
            c.call.cancel()
            c.reader.cancel()


async def verify_on_stream(verifier, stream: RoundStream, req: pb.VerifyRequest, st) -> pb.VerifyReply:
    """One round on `stream`, retried and waited out as `verifier.call` does every call (a broken
    stream's rounds are retried on a new one); bytes counted as they travel on the stream."""
    async def attempt() -> pb.VerifyReply:
        # A retry goes where the verifier's calls go now: after a move, not back to the channel of
        # the replica that handed the session back (its reconnect could land on another replica).
        stream.follow(verifier.stub)
        st.bytes_up += pb.StreamRound(tag=1 << 20, request=req).ByteSize() + GRPC_FRAME_BYTES
        reply = await stream.verify(req, wait_for_ready=verifier.wait_for_ready)
        st.bytes_down += pb.StreamReply(tag=1 << 20, reply=reply).ByteSize() + GRPC_FRAME_BYTES
        return reply
    return await verifier.call(attempt, st, f"round {req.round}")

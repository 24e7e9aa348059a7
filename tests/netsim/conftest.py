"""Servers and helpers for the netsim tests: everything binds to 127.0.0.1 only."""
from __future__ import annotations

import asyncio
import socketserver
import threading

import pytest


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except ConnectionError:
        pass
    finally:
        writer.close()


@pytest.fixture
async def echo_port():
    """An asyncio echo server on 127.0.0.1; yields its port."""
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


class _EchoHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def threaded_echo_port():
    """A thread-based echo server on 127.0.0.1, for tests without an event loop; yields its port."""
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _EchoHandler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()

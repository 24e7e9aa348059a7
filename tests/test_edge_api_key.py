"""`edge-client serve --api-key`: the /v1 routes answer only `Authorization: Bearer KEY` (401 in
OpenAI's shape otherwise), /health stays open, and a bind beyond loopback needs a key. Driven
in-process through the ASGI app (no model, no verifier: the service is a stand-in)."""
from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from edge_client.metrics import EdgeMetrics
from edge_client.options import OptionError
from edge_client.serve import api_key_from_args, create_app
from spec_core.proto import verifier_pb2 as pb

KEY = "sk-edge-0123456789"


class Service:
    """What the routes read of EdgeService for /v1/models."""

    server, started, served_model_name = "127.0.0.1:1", 0, None
    metrics = EdgeMetrics()

    async def server_info(self, fresh=False, timeout_s=None):
        return pb.ServerInfo(model="target.gguf", backend="llama.cpp", n_ctx=512)

    def model_name(self, info):
        return info.model


def get(app, path: str, authorization: str | None = None) -> tuple[int, dict]:
    """One GET through the ASGI app (no lifespan): (status, JSON body)."""
    headers = [(b"authorization", authorization.encode())] if authorization is not None else []
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
             "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8080), "app": app}
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body)


def test_the_v1_routes_want_the_key_and_health_stays_open():
    app = create_app(Service(), api_key=KEY)
    for auth in (None, "Bearer wrong", f"Basic {KEY}", KEY, "Bearer "):
        status, body = get(app, "/v1/models", auth)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", (auth, body)
    status, body = get(app, "/v1/models", f"Bearer {KEY}")
    assert status == 200 and body["data"][0]["id"] == "target.gguf"
    assert get(app, "/v1/models", f"bearer {KEY}")[0] == 200        # the scheme is case-insensitive
    # Control: without a key the same routes answer anyone.
    assert get(create_app(Service()), "/v1/models")[0] == 200


def args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"host": "127.0.0.1", "api_key": None, "api_key_file": None, **kw})


def test_a_bind_beyond_loopback_needs_a_key(tmp_path):
    assert api_key_from_args(args()) is None
    assert api_key_from_args(args(host="::1")) is None
    with pytest.raises(OptionError, match="--host"):
        api_key_from_args(args(host="0.0.0.0"))
    assert api_key_from_args(args(host="0.0.0.0", api_key=KEY)) == KEY
    key_file = tmp_path / "key"
    key_file.write_text(f"{KEY}\nignored\n")
    assert api_key_from_args(args(host="0.0.0.0", api_key_file=str(key_file))) == KEY
    for bad, flag in ((dict(api_key=KEY, api_key_file=str(key_file)), "--api-key"), (dict(api_key=" "), "--api-key"),
                      (dict(api_key_file=str(tmp_path / "missing")), "--api-key-file")):
        with pytest.raises(OptionError, match=flag):
            api_key_from_args(args(**bad))


def test_the_command_line_refuses_a_keyless_public_bind_before_loading_a_model(capsys, tmp_path):
    from edge_client.cli import main
    with pytest.raises(SystemExit) as e:
        main(["serve", "--host", "0.0.0.0", "--draft", str(tmp_path / "missing.gguf"), "--server", "127.0.0.1:1"])
    assert e.value.code == 2 and "argument --host:" in capsys.readouterr().err

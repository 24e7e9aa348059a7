"""Security: TLS and mutual TLS, plain text only on loopback, bearer tokens (hashed at rest,
reloadable), sessions bound to their tenant, per-tenant limits and admission control with retry
hints, undecodable bytes, graceful drain."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from certs import CA
from cloud_verifier.admission import RETRY_AFTER_KEY, ServerPolicy, TokenBucket
from cloud_verifier.auth import TokenFile, TokenFileError, bearer_token, hash_token, new_token, parse_token_file
from cloud_verifier.backends.synthetic import SyntheticBackend
from cloud_verifier.engine import Limits
from cloud_verifier.process import READY
from cloud_verifier.server import SERVICE_NAME, InsecureBindError, ServerTLS, VerifierServer
from edge_client import EdgeClient
from edge_client.client import EdgeError, open_channel
from edge_client.drafters import SyntheticDrafter
from edge_client.text import SyntheticTokenizer
from helpers import edge_options
from spec_core.proto import verifier_pb2 as pb
from spec_core.proto import verifier_pb2_grpc as pb_grpc
from spec_core.synthetic import SyntheticLM, synthetic_fingerprint
from spec_core.warping import SamplingSettings

VOCAB = 40
FP = synthetic_fingerprint(VOCAB)
TOKEN_A, TOKEN_B = "tok-a-" + "a" * 30, "tok-b-" + "b" * 30
UNAUTH, DENIED = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def greedy_reference(prompt, n):
    lm, seq = SyntheticLM(VOCAB, 0), list(prompt)
    for _ in range(n):
        seq.append(int(np.argmax(lm.logits(seq))))
    return seq[len(prompt):]


def open_req(key=b"k" * 16, prompt=(0, 5, 6), max_new_tokens=20):
    return pb.VerifyRequest(round=1, committed_length=len(prompt), open=pb.OpenSession(
        prompt_token_ids=list(prompt), tokenizer_fingerprint=FP, open_key=key,
        sampling=pb.SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, ignore_eos=True)))


def bearer(token):
    return (("authorization", f"Bearer {token}"),)


def counter(name, **labels) -> float:
    return REGISTRY.get_sample_value(name + "_total", labels or None) or 0.0


@pytest.fixture(scope="module")
def pki():
    ca, rogue = CA(), CA("rogue CA")
    return {"ca": ca, "server": ca.issue("localhost", server=True), "client": ca.issue("edge-1", server=False),
            "rogue_client": rogue.issue("edge-x", server=False)}


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "tokens"
    # Tenant a's token hashed at rest, tenant b's in plain text: both forms work.
    path.write_text(f"# tenant token\na {hash_token(TOKEN_A)}\nb {TOKEN_B}  # plain\n")
    return path


def server(tokens=None, tls=None, policy=ServerPolicy(), backend=None, **limits):
    return VerifierServer(backend or SyntheticBackend(vocab=VOCAB), "127.0.0.1", 0, Limits(**limits), grace_s=2.0,
                          tls=tls, tokens=tokens, policy=policy)


def edge(addr, **kw):
    return EdgeClient(edge_options(addr, gamma=3, deadline_s=10, **kw), SyntheticDrafter(VOCAB, noise=1.0),
                      SyntheticTokenizer(VOCAB))


GREEDY = SamplingSettings(temperature=0.0, max_new_tokens=24, ignore_eos=True)


# --- transport ----------------------------------------------------------------------------------

async def test_tls_round_trip_and_plain_text_client_is_refused(pki):
    tls = ServerTLS(pki["server"].cert, pki["server"].key)
    async with server(tls=tls) as s:
        async with edge(f"127.0.0.1:{s.port}", tls_ca=pki["ca"].pem) as c:
            gen = c.generate("5 6", GREEDY)
            await gen.text()
        assert gen.stats.token_ids == greedy_reference([0, 5, 6], 24)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await pb_grpc.VerifierStub(ch).GetServerInfo(pb.ServerInfoRequest(), timeout=3)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        # A client that trusts another CA does not accept this server.
        async with open_channel(f"127.0.0.1:{s.port}", tls_ca=CA("other").pem) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await pb_grpc.VerifierStub(ch).GetServerInfo(pb.ServerInfoRequest(), timeout=3)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_mutual_tls_needs_a_client_certificate_from_the_trusted_ca(pki):
    tls = ServerTLS(pki["server"].cert, pki["server"].key, client_ca=pki["ca"].pem)
    async with server(tls=tls) as s:
        addr = f"127.0.0.1:{s.port}"
        for client in (None, pki["rogue_client"]):
            kw = dict(tls_cert=client.cert, tls_key=client.key) if client else {}
            async with open_channel(addr, tls_ca=pki["ca"].pem, **kw) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await pb_grpc.VerifierStub(ch).GetServerInfo(pb.ServerInfoRequest(), timeout=3)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        good = pki["client"]
        async with edge(addr, tls_ca=pki["ca"].pem, tls_cert=good.cert, tls_key=good.key) as c:
            gen = c.generate("5 6", GREEDY)
            await gen.text()
        assert gen.stats.token_ids == greedy_reference([0, 5, 6], 24)


def test_plain_text_binds_loopback_only_unless_insecure(pki):
    for host in ("0.0.0.0", "10.1.2.3", "::", "example.com"):
        with pytest.raises(InsecureBindError, match="--insecure"):
            VerifierServer(SyntheticBackend(vocab=8), host, 0)
    for host in ("127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"):
        VerifierServer(SyntheticBackend(vocab=8), host, 0)
    VerifierServer(SyntheticBackend(vocab=8), "0.0.0.0", 0, insecure=True)
    VerifierServer(SyntheticBackend(vocab=8), "0.0.0.0", 0, tls=ServerTLS(pki["server"].cert, pki["server"].key))
    from cloud_verifier.cli import main
    with pytest.raises(SystemExit, match="refusing plain text on 0.0.0.0"):
        main(["serve", "--backend", "synthetic", "--host", "0.0.0.0"])
    with pytest.raises(SystemExit, match="go together"):
        main(["serve", "--backend", "synthetic", "--tls-cert", "x.pem"])


# --- tokens -------------------------------------------------------------------------------------

def test_token_file_format():
    entries = parse_token_file(f"a {hash_token('x' * 20)}\n\n# comment\nb {'y' * 20} # trailing\n")
    assert [e.tenant for e in entries] == ["a", "b"]
    for bad, why in [("a short", "shorter than"), ("a sha256:abc", "64 hex digits"), ("a b c", "fields"),
                     ("# only comments", "no tokens"), ("bad/name " + "z" * 20, "tenant")]:
        with pytest.raises(TokenFileError, match=why):
            parse_token_file(bad)
    assert bearer_token([("authorization", "Bearer abc")]) == "abc"
    assert bearer_token([("authorization", "Basic abc")]) is None and bearer_token([]) is None
    assert len(new_token()) >= 40 and new_token() != new_token()


async def test_tokens_tenants_and_health(token_file):
    async with server(tokens=TokenFile(token_file)) as s:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as ch:
            stub = pb_grpc.VerifierStub(ch)
            before = counter("hybridspec_auth_failures", reason="invalid")
            for md, why in [(None, "a valid bearer token is required"), (bearer("nope" * 8), "not valid"),
                            (bearer(hash_token(TOKEN_A)), "not valid")]:  # the at-rest form is not a token
                for call in (stub.Verify(open_req(), timeout=3, metadata=md),
                             stub.GetServerInfo(pb.ServerInfoRequest(), timeout=3, metadata=md)):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await call
                    assert e.value.code() == UNAUTH and why in e.value.details()
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in stub.Generate(pb.GenerateRequest(prompt_token_ids=[0]), timeout=3, metadata=md):
                        pass
                assert e.value.code() == UNAUTH
            assert counter("hybridspec_auth_failures", reason="invalid") == before + 6
            # Probes carry no token: health answers anyway.
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                                               timeout=3)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING

            # Tenant a opens a session; tenant b cannot use it, close it, or take it over by its open key.
            a = await stub.Verify(open_req(), timeout=3, metadata=bearer(TOKEN_A))
            nxt = pb.VerifyRequest(session_id=a.session_id, round=2, committed_length=a.committed_length)
            denied_before = counter("hybridspec_permission_denied")
            for call in (stub.Verify(nxt, timeout=3, metadata=bearer(TOKEN_B)),
                         stub.Close(pb.CloseRequest(session_id=a.session_id), timeout=3, metadata=bearer(TOKEN_B))):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call
                assert e.value.code() == DENIED and "another tenant" in e.value.details()
            assert counter("hybridspec_permission_denied") == denied_before + 2
            b = await stub.Verify(open_req(), timeout=3, metadata=bearer(TOKEN_B))  # same open key, other tenant
            assert b.session_id != a.session_id
            again = await stub.Verify(open_req(), timeout=3, metadata=bearer(TOKEN_A))  # a's retried first round
            assert again == a
            ok = await stub.Verify(nxt, timeout=3, metadata=bearer(TOKEN_A))
            assert ok.round == 2 and ok.committed_length == a.committed_length + 1
            assert {x.tenant for x in s.engine.sessions.sessions()} == {"a", "b"}
            closed = await stub.Close(pb.CloseRequest(session_id=a.session_id), timeout=3, metadata=bearer(TOKEN_A))
            assert closed.closed


async def test_edge_sends_the_token_from_the_environment(token_file, monkeypatch):
    async with server(tokens=TokenFile(token_file)) as s:
        addr = f"127.0.0.1:{s.port}"
        monkeypatch.delenv("HYBRIDSPEC_TOKEN", raising=False)
        async with edge(addr) as c:
            with pytest.raises(EdgeError) as e:
                await c.generate("5 6", GREEDY).text()
            assert e.value.code == UNAUTH
        monkeypatch.setenv("HYBRIDSPEC_TOKEN", TOKEN_B)
        async with edge(addr) as c:
            gen = c.generate("5 6", GREEDY)
            await gen.text()
        assert gen.stats.token_ids == greedy_reference([0, 5, 6], 24)
        assert {x.tenant for x in s.engine.sessions.sessions()} == {"b"}


async def test_token_file_reloads_without_restart(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"a {TOKEN_A}\n")
    tokens = TokenFile(path, check_interval_s=0.0)
    async with server(tokens=tokens) as s:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as ch:
            stub = pb_grpc.VerifierStub(ch)
            info = pb.ServerInfoRequest()
            await stub.GetServerInfo(info, timeout=3, metadata=bearer(TOKEN_A))
            # Rotate: a's token is revoked, b's added (hashed).
            path.write_text(f"b {hash_token(TOKEN_B)}\n")
            os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # a new mtime even on coarse clocks
            await stub.GetServerInfo(info, timeout=3, metadata=bearer(TOKEN_B))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.GetServerInfo(info, timeout=3, metadata=bearer(TOKEN_A))
            assert e.value.code() == UNAUTH
            # A broken file keeps the last good table.
            path.write_text("b short\n")
            os.utime(path, ns=(time.time_ns(), time.time_ns() + 2 * 10**9))
            await stub.GetServerInfo(info, timeout=3, metadata=bearer(TOKEN_B))
    assert tokens.reloads == 2


def test_sighup_reloads_the_token_file_of_a_running_server(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"a {TOKEN_A}\n")
    proc = subprocess.Popen([sys.executable, "-m", "cloud_verifier", "serve", "--backend", "synthetic", "--port", "0",
                             "--auth-tokens", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith(READY), proc.stderr.read()
        addr = line[len(READY):].strip()
        with grpc.insecure_channel(addr) as ch:
            stub = pb_grpc.VerifierStub(ch)
            stub.GetServerInfo(pb.ServerInfoRequest(), timeout=5, metadata=bearer(TOKEN_A))
            path.write_text(f"b {TOKEN_B}\n")
            proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 20
            while True:
                try:
                    stub.GetServerInfo(pb.ServerInfoRequest(), timeout=5, metadata=bearer(TOKEN_B))
                    break
                except grpc.RpcError as e:
                    assert e.code() == UNAUTH and time.monotonic() < deadline
                    time.sleep(0.1)
            assert proc.poll() is None  # reloaded, not restarted
    finally:
        proc.terminate()
        proc.wait(20)
        err = proc.stderr.read()
    assert "auth tokens loaded" in err and err.count("auth tokens loaded") == 2, err


# --- limits and admission -----------------------------------------------------------------------

def retry_after_ms(e: grpc.aio.AioRpcError) -> int:
    return int(dict(e.trailing_metadata())[RETRY_AFTER_KEY])


def test_token_bucket():
    now = [0.0]
    b = TokenBucket(rate=2.0, burst=2, clock=lambda: now[0])
    assert b.take() == 0 and b.take() == 0
    assert b.take() == pytest.approx(0.5)
    now[0] = 0.5
    assert b.take() == 0 and b.take() == pytest.approx(0.5)


async def test_per_tenant_session_cap_and_round_rate(token_file):
    policy = ServerPolicy(tenant_max_sessions=1, tenant_rounds_per_s=5, tenant_burst=4)
    async with server(tokens=TokenFile(token_file), policy=policy) as s:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as ch:
            stub = pb_grpc.VerifierStub(ch)
            a = await stub.Verify(open_req(b"1" * 16), timeout=3, metadata=bearer(TOKEN_A))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Verify(open_req(b"2" * 16), timeout=3, metadata=bearer(TOKEN_A))
            assert e.value.code() == EXHAUSTED and "1 unfinished sessions" in e.value.details()
            assert retry_after_ms(e.value) > 0 and "retry after" in e.value.details()
            b = await stub.Verify(open_req(b"2" * 16), timeout=3, metadata=bearer(TOKEN_B))  # b is not starved
            # a's burst: 4 calls (the open and the refused open count), then refused with the wait for the next.
            nxt = pb.VerifyRequest(session_id=a.session_id, round=2, committed_length=a.committed_length)
            await stub.Verify(nxt, timeout=3, metadata=bearer(TOKEN_A))
            await stub.Verify(nxt, timeout=3, metadata=bearer(TOKEN_A))  # a retry counts too
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Verify(nxt, timeout=3, metadata=bearer(TOKEN_A))
            assert e.value.code() == EXHAUSTED and "5 rounds/s" in e.value.details()
            assert 0 < retry_after_ms(e.value) <= 200
            await stub.Verify(pb.VerifyRequest(session_id=b.session_id, round=2, committed_length=b.committed_length),
                              timeout=3, metadata=bearer(TOKEN_B))  # b has a bucket of its own


async def test_edge_backs_off_under_a_rate_limit_and_finishes(token_file):
    policy = ServerPolicy(tenant_rounds_per_s=40, tenant_burst=2)
    async with server(tokens=TokenFile(token_file), policy=policy) as s:
        async with edge(f"127.0.0.1:{s.port}", token=TOKEN_A) as c:
            gens = [c.generate(f"5 {k}", GREEDY) for k in range(3)]
            await asyncio.gather(*(g.text() for g in gens))
    for k, g in enumerate(gens):
        assert g.stats.token_ids == greedy_reference([0, 5, k], 24)
    assert sum(g.stats.backoffs for g in gens) > 0 and all(g.stats.replays == 0 for g in gens)


async def test_full_server_refuses_newcomers_instead_of_evicting_busy_sessions():
    async with server(policy=ServerPolicy(evict_idle_after_s=60), max_sessions=2) as s:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as ch:
            stub = pb_grpc.VerifierStub(ch)
            first = [await stub.Verify(open_req(bytes([k]) * 16, max_new_tokens=2), timeout=3) for k in range(2)]
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Verify(open_req(b"x" * 16), timeout=3)
            assert e.value.code() == EXHAUSTED and "session slots" in e.value.details() and retry_after_ms(e.value)
            # Both sessions are still served; the first one finishes (max_new_tokens) and frees its slot.
            for r in first:
                await stub.Verify(pb.VerifyRequest(session_id=r.session_id, round=2,
                                                   committed_length=r.committed_length), timeout=3)
            assert (await stub.Verify(open_req(b"x" * 16), timeout=3)).round == 1


async def test_a_refusal_says_whether_retrying_can_help():
    """EdgeError carries the verifier's retry hint: set when it refused for load (no session slot),
    None when it refused what the request asks (above a cap): `edge-client serve` answers only the
    first with HTTP 429, which OpenAI clients retry."""
    async with server(policy=ServerPolicy(evict_idle_after_s=60), max_sessions=1, max_new_tokens_cap=50) as s:
        async with edge(f"127.0.0.1:{s.port}", max_wait_s=0) as c:
            with pytest.raises(EdgeError) as too_long:
                await c.generate("5 1", SamplingSettings(temperature=0.0, max_new_tokens=100)).text()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as ch:
                await pb_grpc.VerifierStub(ch).Verify(open_req(b"1" * 16), timeout=3)  # takes the one slot
            with pytest.raises(EdgeError) as busy:
                await c.generate("5 1", GREEDY).text()
    assert busy.value.code == too_long.value.code == EXHAUSTED
    assert busy.value.retry_after_s > 0 and too_long.value.retry_after_s is None


async def test_a_session_whose_round_queued_long_is_not_idle_when_it_ends():
    """evict_idle_after 0.2 s, one slot, and a round that takes 0.4 s: right after its reply the
    session was just used, so a newcomer is refused (with a retry hint) rather than evicting it
    (it used to count as idle since the round *arrived*, and got evicted)."""
    backend = SyntheticBackend(vocab=VOCAB, step_ms=400)
    async with server(policy=ServerPolicy(evict_idle_after_s=0.2), max_sessions=1, backend=backend) as s:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as ch:
            stub = pb_grpc.VerifierStub(ch)
            first = await stub.Verify(open_req(b"1" * 16, max_new_tokens=8), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Verify(open_req(b"2" * 16), timeout=5)
            assert e.value.code() == EXHAUSTED and retry_after_ms(e.value)
            reply = await stub.Verify(pb.VerifyRequest(session_id=first.session_id, round=2,
                                                       committed_length=first.committed_length), timeout=5)
            assert reply.round == 2


async def test_rounds_in_flight_are_capped():
    backend = SyntheticBackend(vocab=VOCAB, step_ms=300)
    async with server(policy=ServerPolicy(max_inflight_rounds=1), backend=backend) as s:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as ch:
            stub = pb_grpc.VerifierStub(ch)
            slow = asyncio.ensure_future(stub.Verify(open_req(b"1" * 16), timeout=5))
            while not s.servicer.inflight.inflight:
                await asyncio.sleep(0.005)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Verify(open_req(b"2" * 16), timeout=5)
            assert e.value.code() == EXHAUSTED and "rounds in flight" in e.value.details()
            assert (await slow).round == 1


# --- bytes that do not decode -------------------------------------------------------------------

async def test_undecodable_bytes_get_invalid_argument_a_metric_and_few_log_lines(caplog):
    garbage = [b"\xff" * n for n in range(1, 6)] + [b"\x0a\x02\xff\xfe", b"\x08" + b"\xff" * 11, b"\x22\x05\x0a"]
    methods = ["Verify", "Close", "GetServerInfo"]
    before = sum(counter("hybridspec_undecodable_requests", method=f"/hybridspec.v1.Verifier/{m}")
                 for m in methods + ["Generate"])
    caplog.set_level(logging.INFO)
    async with server() as s:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as ch:
            refused = 0
            for m in methods:
                call = ch.unary_unary(f"/hybridspec.v1.Verifier/{m}", request_serializer=None,
                                      response_deserializer=None)
                for raw in garbage * 5:
                    try:
                        await call(raw, timeout=3)
                    except grpc.aio.AioRpcError as e:
                        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (m, raw, e.code(), e.details())
                        assert "not a valid protobuf message" in e.details() and "\n" not in e.details()
                        refused += 1
            stream = ch.unary_stream("/hybridspec.v1.Verifier/Generate", request_serializer=None,
                                     response_deserializer=None)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stream(b"\xff\xff", timeout=3):
                    pass
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # ... and the server goes on serving.
            assert (await pb_grpc.VerifierStub(ch).Verify(open_req(), timeout=3)).round == 1
    after = sum(counter("hybridspec_undecodable_requests", method=f"/hybridspec.v1.Verifier/{m}")
                for m in methods + ["Generate"])
    assert refused >= 80 and after - before == refused + 1
    lines = [r for r in caplog.records if r.name == "cloud_verifier.guard"]
    assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]   # one line per 10 s, not one per request
    assert not any(r.exc_info for r in caplog.records)              # no stack traces


# --- drain --------------------------------------------------------------------------------------

async def test_drain_finishes_rounds_in_flight_and_refuses_new_sessions():
    backend = SyntheticBackend(vocab=VOCAB, step_ms=400)
    s = await server(backend=backend).start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as ch:
        stub = pb_grpc.VerifierStub(ch)
        in_flight = asyncio.ensure_future(stub.Verify(open_req(b"1" * 16), timeout=5))
        while not s.servicer.inflight.inflight:
            await asyncio.sleep(0.005)
        stopping = asyncio.ensure_future(s.stop())
        await asyncio.sleep(0.05)
        health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                                            timeout=3)
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Verify(open_req(b"2" * 16), timeout=3)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
        assert retry_after_ms(e.value) > 0
        reply = await in_flight   # the round in flight was finished, not cut
        assert reply.round == 1 and reply.committed_length == 4
        await stopping


def test_cli_says_what_is_wrong_with_tls_and_token_files(tmp_path, pki):
    from cloud_verifier.cli import main
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    cert, key = pki["server"].write(tmp_path, "server")
    with pytest.raises(SystemExit, match="not in PEM format"):
        main(["serve", "--backend", "synthetic", "--tls-cert", str(junk), "--tls-key", key])
    with pytest.raises(SystemExit, match="No such file"):
        main(["serve", "--backend", "synthetic", "--tls-cert", cert, "--tls-key", str(tmp_path / "missing.key")])
    tokens = tmp_path / "tokens"
    tokens.write_text("acme short\n")
    with pytest.raises(SystemExit, match="shorter than"):
        main(["serve", "--backend", "synthetic", "--auth-tokens", str(tokens)])


def test_hash_token_cli(capsys, monkeypatch):
    import io
    from cloud_verifier.cli import main
    monkeypatch.setattr(sys, "stdin", io.StringIO(TOKEN_A + "\n"))
    assert main(["hash-token", "--tenant", "acme"]) == 0
    line = capsys.readouterr().out.strip()
    assert line == f"acme {hash_token(TOKEN_A)}"
    assert parse_token_file(line)[0].tenant == "acme"


async def test_concurrent_opens_cannot_overrun_the_tenant_cap():
    backend = SyntheticBackend(vocab=VOCAB, step_ms=100)   # slow enough that the opens overlap
    async with server(policy=ServerPolicy(tenant_max_sessions=2), backend=backend, max_sessions=16) as s:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as ch:
            stub = pb_grpc.VerifierStub(ch)
            results = await asyncio.gather(*(stub.Verify(open_req(bytes([k]) * 16), timeout=10) for k in range(6)),
                                           return_exceptions=True)
            held = len(s.engine.sessions)
    ok = [r for r in results if not isinstance(r, Exception)]
    assert len(ok) == 2 and all(r.code() == EXHAUSTED for r in results if isinstance(r, Exception))
    assert held == 2 and not any(s.servicer._opening.values())


async def test_a_handler_bug_is_internal_with_one_line_and_a_quiet_log(caplog, monkeypatch):
    async with server() as s:
        def broken():
            raise ZeroDivisionError("a bug")
        monkeypatch.setattr(s.engine, "server_info", broken)
        caplog.set_level(logging.ERROR, logger="cloud_verifier.guard")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as ch:
            stub = pb_grpc.VerifierStub(ch)
            for _ in range(20):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.GetServerInfo(pb.ServerInfoRequest(), timeout=3)
                assert e.value.code() == grpc.StatusCode.INTERNAL and "\n" not in e.value.details()
            assert (await stub.Verify(open_req(), timeout=3)).round == 1   # the rest still works
    traces = [r for r in caplog.records if r.name == "cloud_verifier.guard" and r.exc_info]
    assert len(traces) == 1   # one stack trace, not twenty


async def test_edge_cli_with_tls_and_a_token_file(pki, token_file, tmp_path, capsys):
    from edge_client.cli import main as edge_main
    (tmp_path / "ca.crt").write_bytes(pki["ca"].pem)
    (tmp_path / "edge.token").write_text(TOKEN_A + "\n")
    async with server(tls=ServerTLS(pki["server"].cert, pki["server"].key), tokens=TokenFile(token_file)) as s:
        base = ["info", "--server", f"localhost:{s.port}", "--tls-ca", str(tmp_path / "ca.crt")]
        assert await asyncio.to_thread(edge_main, [*base, "--token-file", str(tmp_path / "edge.token")]) == 0
        assert '"backend": "synthetic"' in capsys.readouterr().out
        assert await asyncio.to_thread(edge_main, [*base, "--token", "wrong-token-" + "z" * 20]) == 2
        assert "UNAUTHENTICATED: the bearer token is not valid here" in capsys.readouterr().err


async def test_a_renewed_certificate_is_served_without_a_restart(pki, tmp_path):
    cert, key = pki["server"].write(tmp_path, "server")
    tls = ServerTLS.from_files(cert, key)
    new_ca = CA("renewed CA")

    async def info_with(ca_pem):
        async with open_channel(f"127.0.0.1:{s.port}", tls_ca=ca_pem) as ch:
            return await pb_grpc.VerifierStub(ch).GetServerInfo(pb.ServerInfoRequest(), timeout=3)

    async with server(tls=tls) as s:
        assert (await info_with(pki["ca"].pem)).n_vocab == VOCAB
        new_ca.issue("localhost", server=True).write(tmp_path, "server")   # the files change in place
        assert (await info_with(new_ca.pem)).n_vocab == VOCAB              # a new connection: the new one
        with pytest.raises(grpc.aio.AioRpcError):
            await info_with(pki["ca"].pem)
        (tmp_path / "server.crt").write_text("half-written")               # broken files: keep serving
        assert (await info_with(new_ca.pem)).n_vocab == VOCAB
        final = CA("final CA")
        final.issue("localhost", server=True).write(tmp_path, "server")    # fixed: taken up again
        assert (await info_with(final.pem)).n_vocab == VOCAB


async def test_vocabulary_rpc_needs_a_token_and_counts_against_the_tenant_rate(token_file):
    from xvocab_pair import TARGET, longest_match_tokenizer
    backend = SyntheticBackend(vocab=TARGET.n_vocab, vocabulary=TARGET, tokenize=longest_match_tokenizer(TARGET))
    policy = ServerPolicy(tenant_rounds_per_s=1, tenant_burst=2)
    async with server(tokens=TokenFile(token_file), policy=policy, backend=backend) as s:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as ch:
            stub = pb_grpc.VerifierStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.GetVocabulary(pb.VocabularyRequest(), timeout=3)
            assert e.value.code() == UNAUTH
            v = await stub.GetVocabulary(pb.VocabularyRequest(), timeout=3, metadata=bearer(TOKEN_A))
            assert v.n_vocab == TARGET.n_vocab and v.fingerprint == TARGET.fingerprint
            # A text open counts like any round; the burst of 2 is spent, so the third call waits.
            o = pb.OpenSession(prompt_text="ab", open_key=b"t" * 16,
                               sampling=pb.SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
            await stub.Verify(pb.VerifyRequest(round=1, committed_length=0, open=o), timeout=3, metadata=bearer(TOKEN_A))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.GetVocabulary(pb.VocabularyRequest(), timeout=3, metadata=bearer(TOKEN_A))
            assert e.value.code() == EXHAUSTED and retry_after_ms(e.value) > 0

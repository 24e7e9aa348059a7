"""`edge-client serve` as an app sees it: the real `openai` package as the client, the server as its
own process, in front of a real verifier (gRPC on 127.0.0.1, tiny GGUF models on llama.cpp).

The verifier runs in this process, in a thread with its own event loop, so the tests can look at
its sessions (a client that disconnects must free its session on the verifier).
"""
from __future__ import annotations

import asyncio
import codecs
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.client import HTTPConnection

import openai
import pytest

from cloud_verifier.backends.llama_cpp import LlamaCppBackend
from cloud_verifier.engine import Limits
from cloud_verifier.server import VerifierServer
from hybridspec.launch import spawn_edge_server
from edge_client.stopstrings import StopStrings, tokens_covering
from llama_runtime import GGUFModel
from spec_core.proto import verifier_pb2 as pb

GAMMA = "4"
N_CTX = 512


class SlowableBackend(LlamaCppBackend):
    """The tiny target, with an optional pause per round, so a long generation is still running
    when a test disconnects."""

    round_delay_s = 0.0

    def verify(self, *args, **kwargs):
        if self.round_delay_s:
            time.sleep(self.round_delay_s)
        return super().verify(*args, **kwargs)


class VerifierThread:
    """A VerifierServer on its own event loop in a thread (the tests' client code is synchronous)."""

    def __init__(self, backend):
        self.backend = backend
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = VerifierServer(backend, "127.0.0.1", 0, Limits(max_sessions=32), grace_s=0.5)
        self._call(self.server.start())
        self.address = f"127.0.0.1:{self.server.port}"

    def _call(self, coro, timeout=30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def sessions(self) -> dict[str, int]:
        """Session id -> finish reason, read on the server's own loop."""
        async def read():
            return {s.id: s.finish_reason for s in self.server.engine.sessions.sessions()}
        return self._call(read())

    def stop(self):
        self._call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def verifier(tiny_models):
    v = VerifierThread(SlowableBackend(str(tiny_models["target"]), n_ctx=N_CTX, n_threads=1))
    yield v
    v.stop()


def spawn_edge(server: str, draft, *extra: str) -> tuple[subprocess.Popen, str, str | None]:
    """`edge-client serve` as its own process; returns (process, base url .../v1, metrics url)."""
    return spawn_edge_server(["--server", server, "--draft", str(draft), "--threads", "1", "--gamma", GAMMA, *extra])


def serve_once(server: str, draft, *extra: str, prompt: str = "hello world, the list", max_tokens: int = 24):
    """One greedy completion from a fresh `edge-client serve` started with `extra`, which then stops."""
    proc, url, _ = spawn_edge(server, draft, *extra)
    try:
        c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        return c.completions.create(model="any", prompt=prompt, max_tokens=max_tokens, temperature=0)
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def edge(verifier, tiny_models):
    proc, url, metrics = spawn_edge(verifier.address, tiny_models["draft"], "--metrics-port", "0")
    yield {"url": url, "metrics": metrics}
    proc.terminate()
    assert proc.wait(30) == 0, proc.stderr.read()[-3000:]  # graceful shutdown on SIGTERM


@pytest.fixture(scope="module")
def client(edge):
    return openai.OpenAI(base_url=edge["url"], api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def vocab(tiny_models):
    return GGUFModel(str(tiny_models["draft"]), vocab_only=True)


def edge_generate(verifier, tiny_models, prompt: str, max_tokens: int, *extra: str) -> dict:
    """`edge-client generate` on the same verifier, greedy: the reference output."""
    r = subprocess.run([sys.executable, "-m", "edge_client", "generate", "--server", verifier.address,
                        "--draft", str(tiny_models["draft"]), "--threads", "1", "--gamma", GAMMA, "--prompt", prompt,
                        "--max-tokens", str(max_tokens), "--temperature", "0", "--json", *extra],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.rstrip("\n").split("\n")[-1])


def http(method: str, url: str, body: bytes | dict | None = None, timeout: float = 30) -> tuple[int, dict]:
    """A raw HTTP call (for what the openai client will not send): (status, JSON body)."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stream_text(stream, chat: bool) -> tuple[str, list]:
    chunks = list(stream)
    pieces = [(c.choices[0].delta.content if chat else c.choices[0].text) or "" for c in chunks if c.choices]
    return "".join(pieces), chunks


# --- the same text as `edge-client generate` -----------------------------------------------------

def test_completions_greedy_equals_edge_client_generate(client, verifier, tiny_models):
    ref = edge_generate(verifier, tiny_models, "hello world, the list", 24)
    r = client.completions.create(model="any", prompt="hello world, the list", max_tokens=24, temperature=0)
    assert r.object == "text_completion" and r.model == "target.gguf"
    assert r.choices[0].text == ref["text"]
    assert r.choices[0].finish_reason == ("length" if ref["finish_reason"] == "length" else "stop")
    assert r.usage.completion_tokens == ref["tokens"] and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    hs = r.model_extra["hybridspec"]
    assert hs["rounds"] >= 1 and 0 <= hs["accepted"] <= hs["drafted"] and hs["committed_tokens"] == ref["tokens"]
    assert hs["bytes_up"] > 0 and hs["bytes_down"] > 0 and hs["round_trip_s_mean"] >= 0

    text, chunks = stream_text(client.completions.create(model="any", prompt="hello world, the list", max_tokens=24,
                                                         temperature=0, stream=True), chat=False)
    assert text == ref["text"]
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_greedy_equals_edge_client_generate_chat(client, verifier, tiny_models):
    ref = edge_generate(verifier, tiny_models, "hello world", 20, "--chat")
    messages = [{"role": "user", "content": "hello world"}]
    r = client.chat.completions.create(model="any", messages=messages, max_tokens=20, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref["text"]
    assert r.usage.completion_tokens == ref["tokens"]

    stream = client.chat.completions.create(model="any", messages=messages, max_completion_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    text, chunks = stream_text(stream, chat=True)
    assert text == ref["text"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ref["tokens"]  # the usage chunk
    assert all(c.usage is None for c in chunks[:-1])
    final = chunks[-2]
    assert final.choices[0].finish_reason in ("stop", "length") and final.model_extra["hybridspec"]["rounds"] >= 1


def test_system_message_changes_the_prompt(client):
    plain = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4, temperature=0)
    with_system = client.chat.completions.create(
        model="any", messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_tokens=4, temperature=0)
    assert with_system.usage.prompt_tokens > plain.usage.prompt_tokens


def test_same_seed_same_sample(client):
    """The same seed, streamed and not: the same text, with the gumbel coupling (the text is the
    target's own sampling at the seed). With rejection sampling the text also depends on every round's
    shape, which the planner chooses from measured times (docs/usage.md: a seeded run need not
    repeat), so that mode is not asked to repeat here."""
    kw = dict(model="any", prompt="the list of", max_tokens=24, temperature=0.9, top_p=0.95, seed=7,
              extra_body={"top_k": 40, "ignore_eos": True, "coupling": "gumbel"})
    a = client.completions.create(**kw).choices[0].text
    b, _ = stream_text(client.completions.create(stream=True, **kw), chat=False)
    assert a == b


def test_a_request_may_ask_for_the_gumbel_coupling(client):
    """`coupling` (our extension): the same seed gives the same text, and the statistics say which
    coupling and seed ran; an unknown one is a 400 naming it."""
    kw = dict(model="any", prompt="the list of", max_tokens=16, temperature=0.9, top_p=0.95, seed=5,
              extra_body={"coupling": "gumbel", "ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    hs = a.model_extra["hybridspec"]
    assert (hs["coupling"], hs["seed"]) == ("gumbel", 5)
    with pytest.raises(openai.BadRequestError, match="coupling"):
        client.completions.create(**{**kw, "extra_body": {"coupling": "minhash"}})


# --- stop strings --------------------------------------------------------------------------------

def test_stop_strings_cut_exactly_across_token_boundaries(client, verifier, tiny_models, vocab):
    prompt = "def return the list of a"
    ref = edge_generate(verifier, tiny_models, prompt, 32)
    text, ids = ref["text"], ref["token_ids"]
    # A stop string that straddles the boundary between two tokens, at its first occurrence.
    ends, decoder, length = [], codecs.getincrementaldecoder("utf-8")(errors="replace"), 0
    for t in ids:
        if t not in vocab.eog_ids:
            length += len(decoder.decode(vocab.token_bytes(t)))
        ends.append(length)
    stop = next(s for b in ends[2:-2] if 2 <= b <= len(text) - 2
                for s in [text[b - 2: b + 2]] if text.find(s) == b - 2 and "\ufffd" not in s)
    cut = text.find(stop)
    before = _unfinished(verifier)
    for stream in (False, True):
        kw = dict(model="any", prompt=prompt, max_tokens=32, temperature=0, stop=["never-there", stop])
        if stream:
            got, chunks = stream_text(client.completions.create(stream=True, **kw), chat=False)
            finish, usage = chunks[-1].choices[0].finish_reason, None
        else:
            r = client.completions.create(**kw)
            got, finish, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
        assert got == text[:cut], (stop, got, text)
        assert finish == "stop"
        if usage is not None:  # the tokens it took to complete the stop string, not the whole round
            n = usage.completion_tokens
            assert stop in vocab.detokenize(ids[:n]) and stop not in vocab.detokenize(ids[:n - 1])
        # Generation stopped early: the verifier's session was closed before the answer came.
        assert not (_unfinished(verifier) - before)
    # Of two stop strings, the one complete first in the text wins.
    later = text[cut + 2: cut + 6]
    r = client.completions.create(model="any", prompt=prompt, max_tokens=32, temperature=0, stop=[later, stop])
    assert r.choices[0].text == text[: min(cut, text.find(later))]


def test_stop_string_split_over_pieces_is_never_emitted():
    s = StopStrings(["</answer>", "STOP"])
    out = [s.feed(p) for p in ["The ans", "wer is 4</an", "swer> and more"]]
    assert "".join(out) == "The answer is 4" and s.stopped and s.end == len("The answer is 4</answer>")
    assert out[1] == "wer is 4"  # "</an" was held back, not sent
    assert s.feed("more text") == "" and s.flush() == ""


def test_stop_strings_hold_back_only_possible_starts():
    s = StopStrings(["ab"])
    assert s.feed("xxa") == "xx"      # "a" might start "ab"
    assert s.feed("c") == "ac"        # it did not
    assert s.feed("a") == "" and s.flush() == "a" and not s.stopped


def test_first_completed_stop_string_wins():
    s = StopStrings(["abcd", "bc"])   # checked token by token, "bc" completes first
    assert s.feed("xabcdef") == "xa" and s.end == 4


def test_tokens_covering_counts_tokens_up_to_the_stop():
    pieces = {1: b"ab", 2: b"cd", 3: b"\xc3", 4: b"\xa9", 5: b"ef", 9: b"<eos>"}
    assert tokens_covering([1, 2, 5], pieces.get, frozenset(), 3) == 2
    assert tokens_covering([1, 3, 4, 5], pieces.get, frozenset(), 3) == 3   # é needs both bytes
    assert tokens_covering([9, 1], pieces.get, frozenset({9}), 1) == 2      # hidden tokens print nothing


# --- the EdgeClient hooks the server uses ---------------------------------------------------------

async def test_edge_client_hooks_executor_on_round_and_close_when_left_early(tiny_models):
    from concurrent.futures import ThreadPoolExecutor

    from edge_client import EdgeClient
    from edge_client.drafters import GGUFDrafter
    from helpers import edge_options, running_server
    from spec_core.warping import SamplingSettings

    drafter = GGUFDrafter(str(tiny_models["draft"]), n_threads=1, n_ctx=N_CTX)
    events, executor = [], ThreadPoolExecutor(1)
    try:
        async with running_server(LlamaCppBackend(str(tiny_models["target"]), n_ctx=N_CTX, n_threads=1)) as server:
            async with EdgeClient(edge_options(f"127.0.0.1:{server.port}", gamma=2), drafter, drafter.model,
                                  draft_executor=executor, on_round=events.append) as c:
                gen = c.generate("hello", SamplingSettings(temperature=0, max_new_tokens=200, ignore_eos=True))
                async for _ in gen:
                    break
                assert len(server.engine.sessions) == 1
                await gen.aclose()  # the app stops reading: the session is closed on the verifier
                assert len(server.engine.sessions) == 0
        st = gen.stats  # complete although generation stopped early
        assert 1 <= st.tokens < 200 and st.finish_reason == "" and st.rounds == len(events) >= 1
        assert sum(e.tokens for e in events) == st.tokens and sum(e.accepted for e in events) == st.accepted
        assert all(e.rpc_s >= e.server_s >= 0 for e in events)
    finally:
        executor.shutdown()
        drafter.close()


# --- refusals and errors -------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, param", [
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, "messages[0].content[1]"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"temperature": -1.0}, "temperature"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
])
def test_unsupported_parameters_get_400_naming_them(client, kwargs, param):
    body = {"model": "any", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**body)
    assert e.value.status_code == 400
    assert e.value.param == param and e.value.type == "invalid_request_error"
    assert param.split("[")[0] in e.value.message


def test_the_hybridspec_field_reports_every_statistic_generate_does():
    """serve's per-response statistics are GenerationStats' own fields (one list of names), so the
    fused-round and window counters that `generate --json` reports are there too, with their values."""
    import dataclasses

    from edge_client.serve import Outcome
    from edge_client.stats import GenerationStats, RoundEvent
    st = GenerationStats(text="out", tokens=7, token_ids=[1] * 7, finish_reason="length", fused_rounds=3,
                         fused_hits=2, window_depth=2.5, continuation_hits=4)
    rounds = [RoundEvent(gamma=4, accepted=2, tokens=3, draft_s=0.01, rpc_s=0.30, server_s=0.05)]
    hs = Outcome(prompt_tokens=5, stats=st, rounds=rounds).hybridspec()["hybridspec"]
    statistics = {f.name for f in dataclasses.fields(GenerationStats)} - {"text", "token_ids", "finish_reason"}
    assert set(hs) == statistics - {"tokens"} | {"committed_tokens", "round_trip_s_mean", "verify_rpc_s_mean"}
    assert (hs["fused_rounds"], hs["fused_hits"], hs["window_depth"], hs["committed_tokens"]) == (3, 2, 2.5, 7)
    assert hs["round_trip_s_mean"] == pytest.approx(0.25)
    json.dumps(hs)  # it travels as JSON


def test_only_a_refusal_with_a_retry_hint_is_a_429():
    """A 429 tells an OpenAI client to retry (the SDK does, by itself); a refusal without a retry
    hint is about the request (a limit), and retrying it never helps: 400, saying so."""
    import grpc

    from edge_client.client import EdgeError
    from edge_client.serve import api_error_from_edge
    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
    limit = api_error_from_edge(EdgeError(exhausted, "gamma = 12 draft tokens is above this server's limit of 8"), "v")
    assert limit.status == 400 and limit.type == "invalid_request_error" and "limit of 8" in limit.message
    assert "retrying will not help" in limit.message
    busy = api_error_from_edge(EdgeError(exhausted, "all 8 session slots are in use", retry_after_s=1.5), "v")
    assert busy.status == 429 and busy.type == "rate_limit_error" and busy.headers == {"retry-after": "2"}


def test_bad_sampling_values_get_400_naming_them(client):
    for kwargs, param in (({"temperature": -0.5}, "temperature"), ({"top_p": 1.5}, "top_p"),
                          ({"max_tokens": 0}, "max_tokens"), ({"extra_body": {"top_k": -3}}, "top_k")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="any", prompt="hi", **kwargs)
        assert e.value.param == param and param in e.value.message


def test_serve_with_trees_and_pipelining_reports_them(verifier, tiny_models):
    """--tree and --pipeline reach each request's generation (they were dropped), and the
    response's hybridspec field says how the rounds went."""
    r = serve_once(verifier.address, tiny_models["draft"], "--tree", "budget=8,depth=3", "--pipeline")
    hs = r.model_extra["hybridspec"]
    assert hs["tree_rounds"] > 0 and hs["nodes_per_round"] > 1
    assert {"pipelined_rounds", "discarded_rounds", "reused_drafts", "plans", "continuations_sent",
            "continuation_hits", "window_depth", "fused_rounds", "fused_hits"} <= set(hs)
    reference = edge_generate(verifier, tiny_models, "hello world, the list", 24)  # greedy: the same text
    assert r.choices[0].text == reference["text"]


def test_serve_sends_its_rounds_on_the_round_stream(tiny_models, monkeypatch):
    """Each request's session opens with a unary Verify and sends its later rounds on VerifyStream,
    as `generate` does; the control `--no-stream` sends none there (so the count can fail), and the
    greedy text is the same both ways."""
    import cloud_verifier.server as server_module
    calls = {"unary": 0, "stream": 0}

    class Counting(server_module.VerifierServicer):
        async def Verify(self, request, context):
            calls["unary"] += 1
            return await super().Verify(request, context)

        async def VerifyStream(self, request_iterator, context):
            async def counted():
                async for msg in request_iterator:
                    calls["stream"] += 1
                    yield msg
            async for reply in super().VerifyStream(counted(), context):
                yield reply

    monkeypatch.setattr(server_module, "VerifierServicer", Counting)
    verifier = VerifierThread(SlowableBackend(str(tiny_models["target"]), n_ctx=N_CTX, n_threads=1))
    texts, counts = [], []
    try:
        # The planner pinned off: a fused continuation that hits commits a round that sent no message
        # of its own, so with the planner the rounds committed outnumber the messages by the hits.
        for extra in (("--plan", "off"), ("--plan", "off", "--no-stream")):
            calls.update(unary=0, stream=0)
            r = serve_once(verifier.address, tiny_models["draft"], *extra)
            texts.append(r.choices[0].text)
            counts.append((dict(calls), r.model_extra["hybridspec"]["rounds"]))
    finally:
        verifier.stop()
    (streamed, rounds), (control, control_rounds) = counts
    assert rounds > 1 and streamed == {"unary": 1, "stream": rounds - 1}, counts
    assert control == {"unary": control_rounds, "stream": 0}, counts
    assert texts[0] == texts[1]


def test_bad_json_and_batch_prompts_get_400(edge, client):
    status, body = http("POST", edge["url"] + "/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="any", prompt=["one", "two"], max_tokens=4)
    assert e.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="any", prompt="hi", max_tokens=N_CTX)
    assert e.value.code == "context_length_exceeded"


def test_models_and_health(edge, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["target.gguf"]  # the verifier's model, from GetServerInfo
    status, body = http("GET", edge["url"].removesuffix("/v1") + "/health")
    assert status == 200 and body["model"] == "target.gguf"


def test_verifier_down_gives_503_with_the_reason(tiny_models):
    with socket.socket() as s:  # a port with nothing behind it
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    proc, url, _ = spawn_edge(dead, tiny_models["draft"], "--retries", "1")
    try:
        c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        for call in (lambda: c.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}]),
                     lambda: c.completions.create(model="any", prompt="hi", stream=True),
                     lambda: c.models.list()):
            with pytest.raises(openai.APIStatusError) as e:
                call()
            assert e.value.status_code == 503
            assert dead in e.value.message and "UNAVAILABLE" in e.value.message
        status, body = http("GET", url.removesuffix("/v1") + "/health")
        assert status == 503 and dead in body["reason"]
    finally:
        proc.terminate()
        proc.wait(30)


def test_verifier_lost_mid_stream_is_reported_in_the_stream(tiny_models):
    v = VerifierThread(SlowableBackend(str(tiny_models["target"]), n_ctx=N_CTX, n_threads=1))
    v.backend.round_delay_s = 0.05
    proc, url, _ = spawn_edge(v.address, tiny_models["draft"], "--deadline", "1", "--retries", "0")
    try:
        c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        chunks = iter(c.chat.completions.create(model="any", messages=[{"role": "user", "content": "hello"}],
                                                max_tokens=400, stream=True, extra_body={"ignore_eos": True}))
        next(chunks)
        v.stop()  # the verifier goes away mid-generation and does not come back
        with pytest.raises(openai.APIError) as e:
            for _ in chunks:
                pass
        assert "unavailable" in e.value.message and e.value.body["code"] == "verifier_unavailable"
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


# --- sessions on the verifier --------------------------------------------------------------------

def _unfinished(verifier) -> set[str]:
    return {sid for sid, reason in verifier.sessions().items() if reason == pb.NOT_FINISHED}


def _wait_until(check, timeout_s=20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def test_disconnect_mid_stream_closes_the_verifier_session(client, verifier):
    before = set(verifier.sessions())
    verifier.backend.round_delay_s = 0.05  # ~100 rounds would take > 5 s: still running when we leave
    try:
        stream = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hello"}],
                                                max_tokens=400, temperature=0.8, stream=True,
                                                extra_body={"ignore_eos": True})
        next(iter(stream))
        assert _wait_until(lambda: _unfinished(verifier) - before), "no session opened on the verifier"
        (sid,) = _unfinished(verifier) - before
        stream.close()  # the app goes away mid-stream
        assert _wait_until(lambda: sid not in verifier.sessions()), "the session was not closed"
    finally:
        verifier.backend.round_delay_s = 0.0


def test_disconnect_during_a_non_streamed_request_closes_the_session(edge, verifier):
    before = set(verifier.sessions())
    verifier.backend.round_delay_s = 0.05
    host, port = edge["url"].removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
    conn = HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", "/v1/completions", json.dumps({"model": "any", "prompt": "hello", "max_tokens": 400,
                                                            "ignore_eos": True}), {"content-type": "application/json"})
        assert _wait_until(lambda: _unfinished(verifier) - before), "no session opened on the verifier"
        (sid,) = _unfinished(verifier) - before
        conn.sock.shutdown(socket.SHUT_RDWR)  # the app gives up before the answer
        conn.close()
        # The request was cut during the round that opened the session: its reply is awaited and
        # the session closed all the same.
        assert _wait_until(lambda: sid not in verifier.sessions()), "the session was not closed"
    finally:
        verifier.backend.round_delay_s = 0.0


async def test_eight_concurrent_streams_all_complete_with_their_own_output(edge):
    prompts = ["hello world", "the list of", "def return", "a world that"] * 2
    c = openai.AsyncOpenAI(base_url=edge["url"], api_key="unused", max_retries=0, timeout=120)

    async def one(prompt: str) -> tuple[str, str]:
        stream = await c.chat.completions.create(model="any", messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=32, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True})
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    alone = {p: await one(p) for p in prompts[:4]}
    together = await asyncio.gather(*(one(p) for p in prompts))
    assert all(reason == "length" for _, reason in together)
    # Each session has its own draft KV cache and verifier session: greedy output as when alone.
    assert [t for t, _ in together] == [alone[p][0] for p in prompts]
    await c.close()


def test_edge_metrics(edge, client):
    client.completions.create(model="any", prompt="hello", max_tokens=8, temperature=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="any", prompt="hello", n=3)
    text = urllib.request.urlopen(edge["metrics"], timeout=10).read().decode()

    def value(name: str) -> float:
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))

    assert value('hybridspec_edge_requests_total{endpoint="completions",stream="false"}') >= 1
    assert value("hybridspec_edge_rounds_total") >= 1
    assert value("hybridspec_edge_tokens_per_round_count") == value("hybridspec_edge_rounds_total")
    assert value("hybridspec_edge_accepted_tokens_total") <= value("hybridspec_edge_draft_tokens_total")
    assert value("hybridspec_edge_round_trip_seconds_count") >= 1 and value("hybridspec_edge_draft_seconds_count") >= 1
    assert value('hybridspec_edge_request_errors_total{status="400"}') >= 1
    assert value("hybridspec_edge_requests_in_flight") == 0
    for name in ("hybridspec_edge_retries_total", "hybridspec_edge_replays_total"):
        assert name in text


# --- the verifier asks for a token ---------------------------------------------------------------

def test_serve_passes_its_token_to_a_verifier_that_asks_for_one(tiny_models, tmp_path):
    """`edge-client serve --token-file` reaches a verifier with --auth-tokens; without it the app gets 502
    (the upstream refused this edge) with the verifier's reason."""
    from cloud_verifier.process import spawn_verifier
    tokens, secret = tmp_path / "tokens", tmp_path / "edge-token"
    tokens.write_text("app s3cret-token-for-the-edge\n")
    secret.write_text("s3cret-token-for-the-edge\n")
    vproc, address = spawn_verifier(["--model", str(tiny_models["target"]), "--n-ctx", str(N_CTX), "--threads", "1",
                                     "--auth-tokens", str(tokens)])
    try:
        good, good_url, _ = spawn_edge(address, tiny_models["draft"], "--token-file", str(secret))
        bad, bad_url, _ = spawn_edge(address, tiny_models["draft"])
        try:
            body = {"model": "any", "prompt": "hello", "max_tokens": 6, "temperature": 0}
            status, r = http("POST", good_url + "/completions", body, timeout=120)
            assert status == 200 and r["usage"]["completion_tokens"] == 6, r
            status, r = http("POST", bad_url + "/completions", body, timeout=120)
            assert status == 502 and "UNAUTHENTICATED" in r["error"]["message"], r
        finally:
            for p in (good, bad):
                p.terminate()
                p.wait(30)
    finally:
        vproc.terminate()
        vproc.wait(30)

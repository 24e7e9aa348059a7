"""`edge-client serve`: the OpenAI HTTP API on the edge (FastAPI on uvicorn).

An app points its OpenAI client at http://127.0.0.1:8080/v1 and gets the target's exact output,
drafted here and verified on the cloud verifier. Each request is one `EdgeClient` generation:

- its own verifier session and its own draft KV cache (a pool of llama.cpp contexts on the one
  loaded draft model; a context is reused by later requests, so a shared prefix such as a system
  prompt is not drafted again);
- drafting runs in one worker thread, so the sessions' drafting is serialised on the CPU while
  their Verify round trips overlap on the event loop;
- stop strings are cut on the decoded text (`stopstrings`); the verifier session of a request
  that ends early (stop string, client gone) is closed, so it frees its KV cache at once;
- with an API key (`--api-key`, `--api-key-file`, as vLLM's and llama.cpp's servers take one) the
  /v1 routes answer only requests with `Authorization: Bearer KEY` (401 otherwise); /health stays
  open for probes. Without a key the endpoint binds loopback addresses only.

The request and response shapes live in `openai_protocol`, the Prometheus metrics in `metrics`.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import grpc
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from edge_client.client import EdgeClient, EdgeError, GenerationStats, RoundEvent
from edge_client.crossvocab import Chat, draft_prompt_ids
from edge_client.drafters import Drafter, GGUFDrafter
from edge_client.metrics import EdgeMetrics
from edge_client.openai_protocol import (APIError, ChatRequest, CompletionRequest, ResponseShape, SamplingRequest,
                                         Usage, parse)
from edge_client.options import EdgeOptions, OptionError, build_drafter, draft_path, options_from_args
from edge_client.stopstrings import StopStrings, tokens_covering
from spec_core.proto import verifier_pb2 as pb
from spec_core.warping import REJECTION, SamplingError, SamplingSettings
from spec_core.wire import is_loopback

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0
# The verifier's finish reasons in OpenAI's words: a full context window is a length limit.
FINISH_REASONS = {"stop": "stop", "length": "length", "context": "length"}


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


def api_error_from_edge(e: EdgeError, server: str) -> APIError:
    """A gRPC status from the verifier as the HTTP status an OpenAI client understands. Only a
    refusal for load (one with a retry hint) is a 429: OpenAI clients retry a 429, and retrying
    a request the verifier refuses for what it asks (a limit, the context window) never helps."""
    c = grpc.StatusCode
    if e.code in (c.UNAVAILABLE, c.DEADLINE_EXCEEDED, c.CANCELLED):
        return APIError(503, f"the verifier at {server} is unavailable: {e}", code="verifier_unavailable")
    if e.code == c.RESOURCE_EXHAUSTED and e.retry_after_s is not None:
        return APIError(429, f"the verifier is busy; retry in {e.retry_after_s:g} s or later: {e}",
                        code="verifier_busy", type="rate_limit_error",
                        headers={"retry-after": str(max(1, math.ceil(e.retry_after_s)))})
    if e.code == c.RESOURCE_EXHAUSTED:
        return APIError(400, f"the request is beyond the verifier's limits (retrying will not help; ask for "
                             f"less): {e}", code="verifier_limit")
    if e.code in (c.INVALID_ARGUMENT, c.OUT_OF_RANGE):
        return APIError(400, f"the verifier refused the request: {e}")
    # Credentials, a tokenizer mismatch, an internal fault: nothing the app can change.
    return APIError(502, f"the verifier refused this edge: {e}", code="verifier_error")


class DraftPool:
    """Drafters for the sessions in flight, at most `size` at once (later requests wait).

    With a GGUF draft model each drafter is a KV cache on the one shared model, created and used
    only in the draft worker thread; idle ones are kept for the next request. Stateless drafters
    (prompt lookup, synthetic) are shared by every session."""

    def __init__(self, size: int, executor: ThreadPoolExecutor, model=None, shared: Drafter | None = None,
                 tree_nodes: int = 0):
        assert (model is None) != (shared is None)
        self.model, self.shared, self.executor = model, shared, executor
        self.tree_nodes = tree_nodes  # nodes each drafter's KV cache holds for a tree (0: chains only)
        self._slots = asyncio.Semaphore(size)
        self._idle: list[GGUFDrafter] = []

    @contextlib.asynccontextmanager
    async def drafter(self, n_ctx: int) -> AsyncIterator[Drafter]:
        async with self._slots:
            if self.shared is not None:
                yield self.shared
                return
            d = self._idle.pop() if self._idle else await asyncio.get_running_loop().run_in_executor(
                self.executor, lambda: GGUFDrafter(self.model, n_ctx=n_ctx, max_tree_nodes=self.tree_nodes))
            try:
                yield d
            finally:
                # Work the worker thread still has queued for this drafter (a cancelled round) runs
                # before any later request's, as the executor has one thread.
                self._idle.append(d)

    def close(self) -> None:
        for d in self._idle:
            self.executor.submit(d.close)
        self._idle.clear()


@dataclass
class Outcome:
    """What one generation ended with (filled in when it ends, also when it ends early)."""

    prompt_tokens: int
    finish_reason: str | None = None
    completion_tokens: int = 0
    stats: GenerationStats = field(default_factory=GenerationStats)
    rounds: list[RoundEvent] = field(default_factory=list)

    @property
    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.completion_tokens)

    def hybridspec(self) -> dict:
        """Our round statistics, as an extra field of the response."""
        st, n = self.stats, len(self.rounds)
        rtt = [max(0.0, r.rpc_s - r.server_s) for r in self.rounds]
        return {"hybridspec": {
            **st.round_stats(),
            "round_trip_s_mean": sum(rtt) / n if n else 0.0,
            "verify_rpc_s_mean": sum(r.rpc_s for r in self.rounds) / n if n else 0.0,
        }}


class EdgeService:
    """One loaded draft, one gRPC channel to the verifier, the drafting thread; what the HTTP
    handlers call. Start and stop it inside the event loop that serves (`async with`)."""

    def __init__(self, options: EdgeOptions, tokenizer, pool: DraftPool, metrics: EdgeMetrics,
                 served_model_name: str | None = None, on_close: Callable[[], None] | None = None,
                 coupling: str = REJECTION):
        self.options, self.tokenizer, self.pool, self.metrics = options, tokenizer, pool, metrics
        self.coupling = coupling   # how drafts are checked, unless a request says (its `coupling` field)
        self.server = options.transport.server
        self.served_model_name = served_model_name
        self._on_close = on_close
        self._info: pb.ServerInfo | None = None
        self._parent: EdgeClient | None = None
        self.started = int(time.time())

    async def __aenter__(self) -> "EdgeService":
        # The parent client owns the channel (and whatever credentials EdgeClient puts on it);
        # each request's EdgeClient shares it.
        channel_only = EdgeOptions(self.options.transport, security=self.options.security)
        self._parent = EdgeClient(channel_only, _NoDrafter(), self.tokenizer)
        await self._parent.__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        if self._parent is not None:
            await self._parent.__aexit__(*exc)
        self.pool.close()
        self.pool.executor.shutdown(wait=True)
        if self._on_close is not None:
            self._on_close()

    # --- the verifier ---------------------------------------------------------------------------

    async def server_info(self, fresh: bool = False, timeout_s: float | None = None) -> pb.ServerInfo:
        """The verifier's model, context and limits (asked once, then cached), or APIError(503)."""
        if self._info is None or fresh:
            try:
                async with asyncio.timeout(timeout_s):
                    self._info = await self._parent.server_info()
            except grpc.aio.AioRpcError as e:
                raise api_error_from_edge(EdgeError(e.code(), e.details() or ""), self.server) from None
            except asyncio.TimeoutError:
                raise api_error_from_edge(EdgeError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                                    f"no answer within {timeout_s} s"), self.server) from None
        return self._info

    def model_name(self, info: pb.ServerInfo) -> str:
        return self.served_model_name or info.model

    # --- one generation ---------------------------------------------------------------------------

    def cross_vocabulary(self, info: pb.ServerInfo) -> bool:
        """Whether the draft's tokenizer differs from the target's (the client then drafts across
        vocabularies and the prompt goes to the verifier as text)."""
        fp = getattr(self.tokenizer, "fingerprint", None)
        return bool(info.tokenizer_fingerprint) and fp is not None and fp != info.tokenizer_fingerprint \
            and not self.options.speculation.strict_tokenizer

    def prompt(self, req: SamplingRequest, info: pb.ServerInfo) -> tuple["list[int] | str | Chat", int]:
        """(the prompt for EdgeClient.generate, its length in tokens). Across vocabularies a text or
        chat prompt stays text (the verifier tokenizes it for the target) and the length is the
        draft's count, an estimate until the verifier answers with the target's ids."""
        if not self.cross_vocabulary(info):
            ids = self.prompt_ids(req)
            return ids, len(ids)
        if isinstance(req, ChatRequest):
            if not info.chat_prompts:
                raise APIError(400, "the verifier's model has no chat template; use /v1/completions", param="messages")
            chat = Chat(tuple(req.conversation()))
            return chat, len(draft_prompt_ids(self.tokenizer, chat))
        prompt = req.prompt_value()  # type: ignore[attr-defined]
        if isinstance(prompt, str):
            return prompt, len(self.tokenizer.tokenize(prompt))
        if any(not 0 <= t < info.n_vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be in 0..{info.n_vocab - 1}", param="prompt")
        return list(prompt), len(prompt)

    def prompt_ids(self, req: SamplingRequest) -> list[int]:
        if isinstance(req, ChatRequest):
            import jinja2
            from edge_client.text import render_messages
            if not hasattr(self.tokenizer, "chat_template"):
                raise APIError(400, "this edge's tokenizer has no chat template; use /v1/completions",
                               param="messages")
            try:
                return render_messages(self.tokenizer, req.conversation())
            except (ValueError, jinja2.TemplateError) as e:  # no template, or the template refused the messages
                raise APIError(400, f"the chat template could not render these messages: {e}",
                               param="messages") from None
        prompt = req.prompt_value()  # type: ignore[attr-defined]
        if isinstance(prompt, str):
            return self.tokenizer.tokenize(prompt)
        n_vocab = getattr(self.tokenizer, "n_vocab", None) or getattr(self.tokenizer, "vocab", None)
        if n_vocab and any(not 0 <= t < n_vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be in 0..{n_vocab - 1}", param="prompt")
        return prompt

    def settings(self, req: SamplingRequest, n_prompt: int, info: pb.ServerInfo) -> SamplingSettings:
        n_ctx = info.n_ctx
        if n_prompt + 1 > n_ctx:
            raise APIError(400, f"this model's maximum context length is {n_ctx} tokens; the prompt has "
                                f"{n_prompt}", param="messages" if isinstance(req, ChatRequest) else "prompt",
                           code="context_length_exceeded")
        max_new = req.max_new_tokens()
        if max_new is not None and n_prompt + max_new > n_ctx:
            raise APIError(400, f"this model's maximum context length is {n_ctx} tokens; {n_prompt + max_new} "
                                f"were requested ({n_prompt} in the prompt, {max_new} to generate)",
                           param="max_tokens", code="context_length_exceeded")
        try:
            return SamplingSettings(
                temperature=1.0 if req.temperature is None else req.temperature,  # OpenAI's default
                top_k=0 if req.top_k in (None, -1) else req.top_k,  # vLLM's -1 = off
                top_p=1.0 if req.top_p is None else req.top_p,
                max_new_tokens=max_new if max_new is not None else n_ctx - n_prompt,
                seed=req.seed, ignore_eos=req.ignore_eos, coupling=req.coupling or self.coupling)
        except SamplingError as e:
            param = req.max_tokens_param() if e.field == "max_new_tokens" else e.field
            raise APIError(400, f"{param}: {e.problem}", param=param) from None

    async def generate(self, prompt_ids: "list[int] | str | Chat", settings: SamplingSettings, stops: list[str],
                       n_ctx: int, out: Outcome) -> AsyncIterator[str]:
        """Text as it is committed, stop strings cut; `out` is complete once this ends."""
        def on_round(ev: RoundEvent) -> None:
            out.rounds.append(ev)
            self.metrics.observe_round(ev)

        self.metrics.in_flight.inc()
        try:
            # Every request's client shares the parent's channel (one HTTP/2 connection to the verifier).
            async with self.pool.drafter(n_ctx) as drafter, \
                    EdgeClient(self.options, drafter, self.tokenizer, channel=self._parent._channel,
                               draft_executor=self.pool.executor, on_round=on_round) as client:
                gen = client.generate(prompt_ids, settings)
                stop = StopStrings(stops)
                try:
                    async for piece in gen:
                        text = stop.feed(piece)
                        if text:
                            yield text
                        if stop.stopped:
                            break
                    else:
                        text = stop.flush()
                        if text:
                            yield text
                except EdgeError as e:
                    raise api_error_from_edge(e, self.server) from None
                finally:
                    try:
                        await gen.aclose()  # closes the verifier session if it is unfinished
                    finally:  # also when a cancelled HTTP request is cancelled again meanwhile
                        if gen.prompt_ids:   # the target's count (a text prompt's ids come from the verifier)
                            out.prompt_tokens = len(gen.prompt_ids)
                        self._record(out, gen.stats, stop, client.hidden_ids, client.tokenizer.token_bytes)
        finally:
            self.metrics.in_flight.dec()


    def _record(self, out: Outcome, st: GenerationStats, stop: StopStrings, hidden_ids: frozenset[int],
                token_bytes) -> None:
        out.stats = st
        if stop.stopped:
            out.finish_reason = "stop"
            out.completion_tokens = tokens_covering(st.token_ids, token_bytes, hidden_ids, stop.end)
        else:
            out.finish_reason = FINISH_REASONS.get(st.finish_reason)
            out.completion_tokens = st.tokens
        self.metrics.observe_request(st, out.prompt_tokens, out.completion_tokens)


class _NoDrafter(Drafter):
    """The parent client only owns the channel; it never drafts."""

    def propose(self, committed, gamma, settings, qmode, rng):
        raise AssertionError("the parent EdgeClient does not generate")


# --- HTTP ----------------------------------------------------------------------------------------

def sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n".encode()


async def unless_disconnected(request: Request, awaitable):
    """Await `awaitable`, cancelling it if the HTTP client disconnects meanwhile (ClientGone)."""
    task = asyncio.ensure_future(awaitable)
    gone = False

    async def watch():
        nonlocal gone
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                gone = True
                task.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if gone:
            raise ClientGone() from None
        raise
    finally:
        watcher.cancel()


def create_app(service: EdgeService, api_key: str | None = None) -> FastAPI:
    """The OpenAI API on `service`, which the app starts and stops with itself (its lifespan);
    with `api_key`, its /v1 routes want `Authorization: Bearer <api_key>`."""
    app = FastAPI(title="hybridspec edge", summary="OpenAI-compatible API: drafted here, verified in the cloud",
                  lifespan=_lifespan)
    # The handlers are module-level functions that find the service here, so that one router
    # serves every app and each handler reads (and tests) on its own.
    app.state.service = service
    app.state.api_key = api_key
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(ClientGone, _client_gone)
    app.include_router(router)
    return app


router = APIRouter()


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    async with app.state.service:
        yield


def _service(request: Request) -> EdgeService:
    return request.app.state.service


async def _authorized(request: Request) -> None:
    """With an API key set, a /v1 request must carry it as `Authorization: Bearer KEY` (compared in
    constant time); 401 in OpenAI's shape otherwise, as OpenAI's own API answers a wrong key."""
    key = request.app.state.api_key
    if key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise APIError(401, "a valid API key is required: send the key this server was started with (--api-key) "
                            "as `Authorization: Bearer KEY` (OpenAI clients: api_key=KEY)",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


async def _api_error(request: Request, e: APIError):
    _service(request).metrics.errors.labels(str(e.status)).inc()
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _client_gone(request: Request, _e: ClientGone):
    _service(request).metrics.disconnects.inc()
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


@router.get("/health")
async def health(request: Request):
    service = _service(request)
    try:
        info = await service.server_info(fresh=True, timeout_s=HEALTH_TIMEOUT_S)
    except APIError as e:
        return JSONResponse({"status": "unavailable", "verifier": service.server, "reason": e.message},
                            status_code=503)
    return {"status": "ok", "verifier": service.server, "model": service.model_name(info)}


@router.get("/v1/models", dependencies=[Depends(_authorized)])
async def models(request: Request):
    service = _service(request)
    info = await service.server_info()
    return {"object": "list", "data": [{
        "id": service.model_name(info), "object": "model", "created": service.started, "owned_by": "hybridspec",
        "root": info.model, "max_model_len": info.n_ctx, "backend": info.backend}]}


@router.post("/v1/chat/completions", dependencies=[Depends(_authorized)])
async def chat_completions(request: Request):
    req = parse(ChatRequest, await _body_of(request))
    return await _respond(_service(request), request, req, chat=True)


@router.post("/v1/completions", dependencies=[Depends(_authorized)])
async def completions(request: Request):
    req = parse(CompletionRequest, await _body_of(request))
    return await _respond(_service(request), request, req, chat=False)


async def _body_of(request: Request) -> object:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None


async def _respond(service: EdgeService, request: Request, req: SamplingRequest, chat: bool):
    service.metrics.requests.labels("chat" if chat else "completions", str(req.stream).lower()).inc()
    info = await service.server_info()
    ids, n_prompt = service.prompt(req, info)
    settings = service.settings(req, n_prompt, info)
    out = Outcome(prompt_tokens=n_prompt)
    shape = ResponseShape(chat, service.model_name(info))
    pieces = service.generate(ids, settings, req.stops, info.n_ctx, out)
    if not req.stream:
        async def collect() -> str:
            async with contextlib.aclosing(pieces):
                return "".join([p async for p in pieces])
        text = await unless_disconnected(request, collect())
        return JSONResponse(shape.full(text, out.finish_reason, out.usage, out.hybridspec()))
    # Wait for the first text before answering, so a verifier that is down or refuses the
    # request gets its HTTP status (503, 4xx) instead of a 200 with an error inside the stream.
    try:
        first = await unless_disconnected(request, anext(pieces, None))
    except BaseException:
        await pieces.aclose()
        raise
    return StreamingResponse(_stream(service.metrics, shape, pieces, first, out, req.include_usage),
                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _stream(metrics: EdgeMetrics, shape: ResponseShape, pieces, first: str | None, out: Outcome,
                  include_usage: bool):
    ended = False
    try:
        async with contextlib.aclosing(pieces):
            if shape.chat:
                yield sse(shape.chunk("", first=True, with_usage_field=include_usage))
            if first is not None:
                yield sse(shape.chunk(first, with_usage_field=include_usage))
            async for piece in pieces:
                yield sse(shape.chunk(piece, with_usage_field=include_usage))
        yield sse(shape.chunk(None, out.finish_reason, with_usage_field=include_usage, extra=out.hybridspec()))
        if include_usage:
            yield sse(shape.usage_chunk(out.usage))
        ended = True
    except APIError as e:  # the verifier failed mid-stream: say so in the stream, as OpenAI does
        metrics.errors.labels(str(e.status)).inc()
        yield sse(e.body())
        ended = True
    finally:
        if not ended:
            metrics.disconnects.inc()
    yield sse("[DONE]")


# --- process ------------------------------------------------------------------------------------

def api_key_from_args(args) -> str | None:
    """The key of --api-key or --api-key-file (its first line); OptionError for both, an empty key or
    an unreadable file, and for a bind beyond loopback without a key (anyone who reaches the port
    would spend the verifier's tenant and the device's CPU)."""
    key, path = getattr(args, "api_key", None), getattr(args, "api_key_file", None)
    if key is not None and path is not None:
        raise OptionError("argument --api-key", "give --api-key or --api-key-file, not both")
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                key = f.readline().strip()
        except OSError as e:
            raise OptionError("argument --api-key-file", f"cannot read {path}: {e.strerror}") from None
        if not key:
            raise OptionError("argument --api-key-file", f"{path} is empty: its first line is the key")
    elif key is not None and not key.strip():
        raise OptionError("argument --api-key", "the key is empty")
    key = key.strip() if key is not None else None
    if key is None and not is_loopback(args.host):
        raise OptionError("argument --host", f"{args.host} is beyond loopback: give --api-key (or --api-key-file) so "
                          "that only callers with the key reach the endpoint, or bind 127.0.0.1")
    return key


def service_from_args(args) -> EdgeService:
    """Load the draft (once) and build the service from `edge-client serve` arguments (OptionError
    for a bad one, before anything loads)."""
    options = options_from_args(args)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft")
    if args.drafter == "gguf":
        from llama_runtime import GGUFModel
        model = GGUFModel(draft_path(args), n_threads=args.threads)
        pool = DraftPool(args.max_concurrent, executor, model=model, tree_nodes=options.speculation.draft_tree_nodes)
        tokenizer, on_close = model, model.close
    else:
        drafter, tokenizer = build_drafter(args, options.speculation)
        pool = DraftPool(args.max_concurrent, executor, shared=drafter)
        on_close = drafter.close
    return EdgeService(options, tokenizer, pool, EdgeMetrics(), args.served_model_name, on_close=on_close,
                       coupling=getattr(args, "coupling", REJECTION))


async def serve(app: FastAPI, host: str, port: int, on_ready: Callable[[int], None] | None = None) -> None:
    """Run uvicorn on host:port (0 picks a free port) until SIGINT/SIGTERM; `on_ready(port)` once
    it accepts requests."""
    import uvicorn
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"edge-client serve: could not bind {host}:{port}: {e.strerror} (the port is in use, or "
                         "the address is not this machine's); pick another --port (0: a free one)") from None
    # uvicorn logs through the root logger as configured by the CLI (-v shows the access log).
    config = uvicorn.Config(app, loop="asyncio", log_config=None, log_level=logging.getLogger().getEffectiveLevel(),
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)

    async def announce():
        while not server.started:
            await asyncio.sleep(0.02)
        if on_ready is not None:
            on_ready(sock.getsockname()[1])

    # uvicorn shuts down gracefully on SIGINT/SIGTERM and then raises the signal again, so that the
    # process ends "killed by SIGTERM"; with these no-op handlers in place it ends with 0 instead,
    # like `cloud-verifier serve`.
    ignored = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)} \
        if threading.current_thread() is threading.main_thread() else {}
    announcer = asyncio.create_task(announce())
    try:
        await server.serve(sockets=[sock])
    finally:
        announcer.cancel()
        sock.close()
        for sig, handler in ignored.items():
            signal.signal(sig, handler)


def run(args, on_ready: Callable[[int, int | None], None] | None = None) -> int:
    """`edge-client serve`: returns the exit code."""
    api_key = api_key_from_args(args)
    service = service_from_args(args)
    metrics_port = service.metrics.serve(args.metrics_port, args.host) if args.metrics_port is not None else None
    if metrics_port is not None:
        log.info("edge metrics on http://%s:%d/metrics", args.host, metrics_port)
    app = create_app(service, api_key)
    asyncio.run(serve(app, args.host, args.port,
                      on_ready=(lambda port: on_ready(port, metrics_port)) if on_ready else None))
    return 0

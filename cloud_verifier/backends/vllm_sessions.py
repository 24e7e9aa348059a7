"""A verifier session as one vLLM request that keeps its KV across rounds (the backend's side).

Each session is one streaming-input request (`AsyncLLM.generate` fed `StreamingInput` chunks);
a round is one chunk: the committed tokens the engine does not hold yet (the round's corrected or
bonus token, usually one) and the round's drafts, `max_tokens=1`, prompt logprobs for the draft
rows. Before the chunk is appended, vllm_engine_ext.RollbackScheduler cuts the session back to
`keep`, the longest common prefix of the tokens the engine holds (last round's committed + drafts)
and this round's committed ones, so rejected drafts and their KV are dropped and the accepted ones
kept: a round computes gamma + 1 tokens (plus the sampled one) instead of re-prefilling the block
tail. `keep` is capped at len(committed) - 1 so that the row after the last committed token is
computed in the chunk (prompt-logprob rows are filled from the chunk's first token on).

A session's first round sends the committed tokens alone first (no prompt logprobs, so it reads
the prefix cache: sessions share a common prompt's blocks), then the round's chunk with
`keep = len(committed) - 1`. Each chunk names the rows it wants (vllm_engine_ext.ROWS_ARG), so only
they cross to this process, whatever the context length. A session whose stream failed starts over
with a new request on its next round. `release` ends the request, which frees its KV.

Lives on the backend's event loop; a session's rounds run one at a time (its lock).
"""
from __future__ import annotations

import asyncio
import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import numpy as np

from spec_core.qcodec import EncodedQ
from spec_core.tree import DraftTree, TreeResult
from spec_core.warping import GUMBEL, SamplingSettings

log = logging.getLogger(__name__)

_EXT = "cloud_verifier.backends.vllm_engine_ext"
# Engine arguments that install the hooks (vllm_engine_ext): requests without KEEP_ARG are untouched.
ENGINE_ARGS = {"scheduler_cls": f"{_EXT}.RollbackScheduler", "worker_extension_cls": f"{_EXT}.SessionWorkerExtension"}
KEEP_ARG = "hybridspec_keep"   # = vllm_engine_ext.KEEP_ARG (that module imports vLLM's scheduler)
ROWS_ARG = "hybridspec_rows"   # = vllm_engine_ext.ROWS_ARG
WIDTH_ARG = "hybridspec_width"  # = vllm_engine_ext.WIDTH_ARG
ACCEPT_ARG = "hybridspec_accept"  # ... the round's rows this chunk gives, and the round (accept_spec)


def session_engine_args() -> dict:
    """The engine arguments that install the hooks. Streaming sessions live in vLLM's V1 model runner
    (0.32's V2 runner, its default where Triton is present, has none), so the V1 runner is chosen
    unless VLLM_USE_V2_MODEL_RUNNER says otherwise (then sessions are off, with a warning)."""
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    return dict(ENGINE_ARGS)


@dataclass
class VllmSession:
    """The backend's per-session state: its streaming request, and the tokens the engine holds."""
    tokens: list[int] = field(default_factory=list)   # prompt of the last chunk, as the engine holds it
    chunks: asyncio.Queue | None = None                # StreamingInput chunks; None ends the stream
    outputs: object | None = None                      # the request's output stream (async generator)
    lock: asyncio.Lock | None = None
    rounds: int = 0                                    # chunks sent (for tests and figures)
    on_prefill: Callable[[object, int], None] | None = None   # (first output, context tokens): its prefill

    @property
    def live(self) -> bool:
        return self.outputs is not None


class FlatRow(NamedTuple):
    """A prompt-logprob row as arrays, for requests with `flat_logprobs` (whole rows): vLLM's FlatLogprobs
    keeps a chunk's rows in flat lists, and a row here is two arrays, not a dict of vocabulary size."""
    token_ids: np.ndarray   # [entries] int64: the prompt token first, then by rank
    logprobs: np.ndarray    # [entries] float32


def flat_rows(flat, need: int) -> list[FlatRow]:
    """The last `need` positions of a FlatLogprobs as FlatRows."""
    n = len(flat.start_indices)
    lo, hi = flat.start_indices[n - need], flat.end_indices[n - 1]
    ids = np.asarray(flat.token_ids[lo:hi], dtype=np.int64)
    vals = np.asarray(flat.logprobs[lo:hi], dtype=np.float32)
    return [FlatRow(ids[a - lo:b - lo], vals[a - lo:b - lo])
            for a, b in zip(flat.start_indices[n - need:], flat.end_indices[n - need:])]


def _holds(row, token: int) -> bool:
    if isinstance(row, FlatRow):
        return len(row.token_ids) > 0 and int(row.token_ids[0]) == token
    return row is not None and token in row


def raw_row(row: dict | FlatRow, k: int, vocab: int) -> np.ndarray:
    """A prompt-logprob row {token id: Logprob} (or a whole FlatRow) as raw logprobs  # [vocab]: its top-k
    (k < 0: all), else -inf."""
    if isinstance(row, FlatRow):
        assert k < 0, "flat rows are whole rows"
        ids, vals = row.token_ids, row.logprobs
    else:
        ids = np.fromiter((t for t, lp in row.items() if k < 0 or lp.rank <= k), dtype=np.int64)
        vals = np.fromiter((lp.logprob for lp in row.values() if k < 0 or lp.rank <= k), dtype=np.float32)
    out = np.full(vocab, -np.inf, dtype=np.float32)
    out[ids[ids < vocab]] = vals[ids < vocab]   # ids past the vocabulary dropped
    return out


class SessionRows:
    """The rows a round reads from its chunk: `rows[i]` the prompt-logprob row ({token id: Logprob}, or a
    FlatRow with `flat_logprobs`) at draft i's position (predicting draft i), `sample` the token vLLM
    drew after the last draft."""

    def __init__(self, rows: list[dict], sample: int):
        self.rows, self.sample = rows, sample


def pack_q(q: EncodedQ | None):
    """An EncodedQ as plain values for SamplingParams.extra_args (msgpack between vLLM's processes)."""
    if q is None:
        return None
    ids = None if q.token_ids is None else np.asarray(q.token_ids, dtype="<u4").tobytes()
    return [ids, np.ascontiguousarray(q.weights).tobytes(), q.weights.dtype.str, bool(q.fixed)]


def unpack_q(packed) -> EncodedQ | None:
    if packed is None:
        return None
    ids, weights, dtype, fixed = packed
    return EncodedQ(None if ids is None else np.frombuffer(ids, dtype="<u4"), np.frombuffer(weights, dtype=dtype),
                    bool(fixed))


def accept_spec(rows: Sequence[int], tree: DraftTree | None = None, draft_probs=None,
                settings: SamplingSettings | None = None, uniforms: np.ndarray | None = None,
                position: int | None = None) -> dict:
    """extra_args[ACCEPT_ARG] of a chunk whose decision runs in the engine (vllm_engine_ext.accept_step):
    the chunk's last len(rows) prompt positions give its round's rows `rows` (0: after the committed
    tokens, i + 1: after node i; the last position is the one vLLM samples after); the chunk that
    completes the round also carries it (the tree, q, settings and round_uniforms; with the gumbel
    coupling the seed, as text: a uint64, and `position`, the absolute position row 0 predicts), plain
    values."""
    spec: dict = {"rows": [int(r) for r in rows]}
    if tree is not None:
        spec["round"] = {"tokens": [int(t) for t in tree.tokens], "parents": [int(p) for p in tree.parents],
                         "q": None if draft_probs is None else [pack_q(q) for q in draft_probs],
                         "settings": [float(settings.temperature if not settings.greedy else 0.0),
                                      int(settings.top_k), float(settings.top_p)],
                         "u": [float(u) for u in uniforms],
                         "gumbel": [str(settings.seed), int(position)] if settings.gumbel else None}
    return spec


def spec_round(rd: dict) -> tuple[DraftTree, list | None, SamplingSettings, np.ndarray, int | None]:
    """accept_spec's round back: (tree, q, settings, uniforms, position)."""
    temperature, top_k, top_p = rd["settings"]
    gumbel = rd.get("gumbel")
    settings = SamplingSettings(temperature=temperature, top_k=top_k, top_p=top_p,
                                **(dict(seed=int(gumbel[0]), coupling=GUMBEL) if gumbel else {}))
    return (DraftTree(tuple(rd["tokens"]), tuple(rd["parents"])),
            None if rd["q"] is None else [unpack_q(q) for q in rd["q"]], settings,
            np.asarray(rd["u"], dtype=np.float64), int(gumbel[1]) if gumbel else None)


def accept_params(spec: dict):
    """The SamplingParams of a chunk decided in the engine: greedy (vLLM's own sample is not used, and
    greedy is its cheapest), prompt logprobs on (so the worker sees the chunk's positions), `spec`."""
    from vllm import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, skip_reading_prefix_cache=False,
                          ignore_eos=True, detokenize=False, skip_clone=True, extra_args={ACCEPT_ARG: spec})


def read_verdict(out) -> TreeResult:
    """The round's verdict from a chunk's output: its prompt-logprob rows are the ids of the kept path,
    then the corrected or bonus token (vllm_engine_ext.accept_step)."""
    got = out.prompt_logprobs
    ids = list(got.token_ids) if hasattr(got, "start_indices") else [next(iter(row)) for row in got or [] if row]
    assert ids, "a session chunk came back without its round's verdict"
    return TreeResult([int(i) for i in ids[:-1]], int(ids[-1]))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


async def _chunk_stream(queue: asyncio.Queue):
    while (chunk := await queue.get()) is not None:
        yield chunk


async def session_round(llm, session: VllmSession, committed: list[int], drafts: list[int], params,
                        reuse: int = 0) -> SessionRows:
    """One round as one chunk of the session's request. `params`: the round's SamplingParams with
    prompt logprobs (cloned here, KEEP_ARG put into the clone's extra_args). Returns the draft rows and
    the sample after the last draft; with `reuse`, the rows of the first `reuse` drafts are not needed
    (an earlier chunk of this round read them): the session keeps their KV and they come back as
    None. Raises what the engine raised; the session then starts over."""
    if session.lock is None:
        session.lock = asyncio.Lock()
    async with session.lock:
        try:
            out = await _session_chunk(llm, session, committed, drafts, params, reuse)
            need = len(drafts) - reuse
            got = out.prompt_logprobs
            if hasattr(got, "start_indices"):   # vLLM's FlatLogprobs (flat_logprobs): arrays, no dicts
                rows = flat_rows(got, need) if need and len(got) >= need else []
            else:
                rows = list(got or [])[-need:] if need else []
            assert len(rows) == need and all(_holds(r, x) for r, x in zip(rows, drafts[-need:])), \
                "a session chunk came back without its draft rows"
            return SessionRows([None] * (len(drafts) - need) + rows, int(out.outputs[0].token_ids[0]))
        except BaseException:
            await close_session(session)
            raise


async def _session_chunk(llm, session: VllmSession, committed: list[int], drafts: list[int], params, reuse: int):
    """Send committed + drafts as the session's next chunk (its context first when it has no request);
    the chunk's output. Under the session's lock."""
    from vllm.engine.protocol import StreamingInput
    from vllm.sampling_params import RequestOutputKind

    assert committed and (drafts or ACCEPT_ARG in (params.extra_args or {})), \
        "a session round needs committed tokens, and drafts unless it is decided in the engine"
    n = len(committed)
    if not session.live:   # the context first, reading the prefix cache, one row back
        session.chunks = asyncio.Queue()
        base = params.clone()
        base.output_kind = RequestOutputKind.DELTA
        # vLLM's frontend gives a request a prompt-logprob reader, of a fixed width, only when
        # its first chunk asks for prompt logprobs: -1 reads rows of any width (the chunks'
        # top-1, top-k or whole rows, or a verdict); the engine computes none but each token's own (WIDTH_ARG).
        base.prompt_logprobs, base.skip_reading_prefix_cache = -1, False
        base.extra_args = {ROWS_ARG: 1, WIDTH_ARG: 0}
        session.outputs = llm.generate(_chunk_stream(session.chunks), base,
                                       request_id="session-" + uuid.uuid4().hex).__aiter__()
        first = await _send(session, committed, base, None, 1, StreamingInput)
        if session.on_prefill is not None:   # the context's prefill, timed by the engine (vllm_prefill)
            session.on_prefill(first, len(committed))
        session.tokens = list(committed)
    keep = min(common_prefix(session.tokens, committed + drafts), n - 1 + reuse)
    out = await _send(session, (committed + drafts)[keep:], params, keep, len(drafts) - reuse, StreamingInput)
    session.tokens = committed + drafts
    return out


async def session_verdict(llm, session: VllmSession, committed: list[int], paths: list[list[int]], tree: DraftTree,
                          draft_probs, settings: SamplingSettings, uniforms: np.ndarray) -> TreeResult:
    """A round decided in the engine (vllm_engine_ext.accept_step): a chunk per path of node indices
    (a chain: one path, every node; a round without drafts, a Generate step of the gumbel coupling:
    one empty path, the chunk being the last committed token), in turn, each cut back to where it
    leaves the ones before, each naming the tree rows its positions give; the last carries the round
    (row 0 predicts position len(committed)). Returns its verdict."""
    if session.lock is None:
        session.lock = asyncio.Lock()
    async with session.lock:
        try:
            for k, path in enumerate(paths):
                reuse = max(0, min(max((common_prefix(path, p) for p in paths[:k]), default=0), len(path) - 1))
                rows = [0 if j == 0 else path[j - 1] + 1 for j in range(reuse, len(path) + 1)]
                last = k == len(paths) - 1
                spec = accept_spec(rows, *((tree, draft_probs, settings, uniforms, len(committed)) if last else ()))
                out = await _session_chunk(llm, session, committed, [tree.tokens[i] for i in path],
                                           accept_params(spec), reuse)
            return read_verdict(out)
        except BaseException:
            await close_session(session)
            raise


async def session_leaves(llm, session: VllmSession, committed: list[int], paths: list[list[int]],
                         params) -> list[SessionRows]:
    """A tree round: one chunk per leaf's path (tokens after committed), in turn; each chunk cuts back
    to where its path leaves the ones before (the engine computes every node once, plus, per leaf
    whose path leaves at the root, the last committed token again). Returns each path's rows (None
    for nodes an earlier path's chunk read) and sample, in order."""
    out = []
    for k, path in enumerate(paths):
        reuse = max((common_prefix(path, p) for p in paths[:k]), default=0)
        out.append(await session_round(llm, session, committed, path, params, min(reuse, len(path) - 1)))
    return out


async def _send(session: VllmSession, chunk: list[int], params, keep: int | None, rows: int, streaming_input):
    from vllm.sampling_params import RequestOutputKind
    p = params.clone()
    p.output_kind = RequestOutputKind.DELTA
    if keep is not None:
        p.extra_args = {**(p.extra_args or {}), KEEP_ARG: int(keep), ROWS_ARG: int(rows)}
    session.rounds += 1
    await session.chunks.put(streaming_input({"prompt_token_ids": [int(t) for t in chunk]}, p))
    return await session.outputs.__anext__()


async def close_session(session: VllmSession) -> None:
    """End the session's request (vLLM aborts it and frees its KV); the session may start over."""
    outputs, session.outputs, session.chunks, session.tokens = session.outputs, None, None, []
    if outputs is not None:
        try:
            await outputs.aclose()
        except Exception:   # the engine already failed the request: nothing left to free
            log.debug("closing a vLLM session", exc_info=True)

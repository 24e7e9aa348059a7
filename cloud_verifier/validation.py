"""What a request may be refused for before its session is touched: the round (drafts, q, tree,
continuations, assumed tokens), the first round's `open` (prompt, settings, SLO, fingerprint),
the cloud-only baseline's prompt. `Validator.round` turns a VerifyRequest into a `ValidRound` (with a
`ValidOpen` for a first round); every refusal is a `RequestError` carrying a gRPC status code and a
message that says what to fix.
"""
from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import grpc
import numpy as np

from cloud_verifier.backends.base import Backend, Capabilities, NoChatTemplate
from cloud_verifier.rounds import Alternative, alternative
from cloud_verifier.workers import run_in_thread
from spec_core import qcodec
from spec_core.continuations import MAX_CONTINUATION_NODES, MAX_CONTINUATIONS
from spec_core.proto import couplings, qpayload
from spec_core.proto import verifier_pb2 as pb
from spec_core.slo import Slo
from spec_core.tree import DraftTree, TreeError, validate_tree
from spec_core.warping import SamplingError, SamplingSettings
from spec_core.wire import OPEN_KEY_BYTES


class RequestError(Exception):
    """`retry_after_s`: set when the request was refused for load, not for its content, so that
    the same request may succeed later (the server sends it as a retry hint)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.code, self.message, self.retry_after_s = code, message, retry_after_s


@dataclass(frozen=True)
class Limits:
    max_gamma: int = 16
    max_sessions: int = 8
    session_ttl_s: float = 600.0
    default_max_new_tokens: int = 256
    max_new_tokens_cap: int = 4096
    max_tree_nodes: int = 64       # nodes in one tree round (its depth is bounded by max_gamma)
    max_tree_branching: int = 8    # children of one tree node
    pipeline_wait_s: float = 30.0  # longest a pipelined round waits for its predecessor
    steer: bool = True             # tell edges the draft budget at this load (VerifyReply.budget)
    slo_tpot_ms: float = 0.0       # the latency target of sessions that state none (0: none);
    slo_ttft_ms: float = 0.0       # a batching backend with schedule "slack" orders work by it
    max_continuations: int = MAX_CONTINUATIONS            # alternatives beyond a pipelined round's own draft
    max_continuation_nodes: int = MAX_CONTINUATION_NODES  # draft tokens (nodes) over all of them
    max_window: int = 4            # rounds of one session in flight at once (ServerInfo.max_window)

    @property
    def max_assumed(self) -> int:
        """Most assumed_tokens of one alternative: the outcomes of the max_window - 1 unanswered
        rounds before it, each at most max_gamma + 1 tokens."""
        return max(1, self.max_window - 1) * (self.max_gamma + 1)


MAX_SLO_MS = 3_600_000.0

MAX_STOP_IDS = 64
# Text prompts (edges whose draft has another tokenizer): bounded before they are tokenized.
MAX_PROMPT_TEXT_BYTES = 1 << 20
MAX_PROMPT_MESSAGES = 256
_ROLE = re.compile(r"[a-z_]{1,32}")
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")


def bad(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


QUOTE_CHARS = 48


def quoted(text: str, limit: int = QUOTE_CHARS) -> str:
    """Client input as a message quotes it: at most `limit` characters (then its length). A field
    echoed whole could make the status bigger than a client takes (gRPC's default 16 KiB of
    metadata): the client would see RESOURCE_EXHAUSTED instead of the status we meant."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… ({len(text)} characters)"


@dataclass
class ValidOpen:
    """A first round's `open`, validated; a text prompt is tokenized before its first token is admitted
    (SessionLifecycle.tokenize: admission counts its tokens)."""

    prompt: list[int]                       # the prompt's ids (empty for a text prompt)
    text: str | None                        # a text prompt, or
    messages: list[dict[str, str]] | None   # a conversation (chat template), or neither
    resume: list[int]                       # tokens committed earlier (a replay)
    settings: SamplingSettings
    slo: Slo | None


class ValidGenerate(NamedTuple):
    """A GenerateRequest (the cloud-only baseline), validated, its text prompt tokenized."""

    prompt: list[int]
    settings: SamplingSettings
    text_prompt: bool       # the prompt came as text: the first chunk carries its ids


@dataclass
class ValidRound:
    """A VerifyRequest that passed `Validator.round`."""

    req: pb.VerifyRequest
    alternatives: list[Alternative]   # 0: the round's own draft; then its continuations
    open: ValidOpen | None             # the first round's `open` (None when the round names a session)
    following: list[Alternative]       # next_continuations: round + 1 after this round's outcomes (fused)


class Validator:
    """The checks of every field from the wire, against the target (`info`), the server's limits and
    what its backend can take (trees, text prompts)."""

    def __init__(self, backend: Backend, caps: Capabilities, limits: Limits):
        self.backend, self.caps, self.limits, self.info = backend, caps, limits, backend.info
        self.default_slo = (Slo(limits.slo_tpot_ms / 1e3, limits.slo_ttft_ms / 1e3)
                            if limits.slo_tpot_ms or limits.slo_ttft_ms else None)

    def fingerprint(self, fingerprint: str) -> None:
        """A GetVocabulary request's fingerprint: empty, or this server's."""
        if fingerprint and not _FINGERPRINT.fullmatch(fingerprint):
            raise bad("fingerprint must be 64 lower-case hex digits (ServerInfo.tokenizer_fingerprint) or empty")
        if fingerprint and fingerprint != self.info.fingerprint:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"this server's tokenizer is {self.info.fingerprint[:16]}…, not {fingerprint[:16]}… "
                               f"({self.info.model}); ask GetServerInfo again")

    def round(self, req: pb.VerifyRequest) -> ValidRound:
        """Everything a round can be refused for without its session: checked before a session is
        created, admitted or touched (a malformed open is INVALID_ARGUMENT even when every slot is full)."""
        drafts = list(req.draft_token_ids)
        tree = self.tree(req, drafts)
        if tree is None and len(drafts) > self.limits.max_gamma:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"gamma = {len(drafts)} draft tokens is above this server's limit of "
                               f"{self.limits.max_gamma}")
        self.check_ids(drafts, "draft_token_ids")
        if req.round < 1:
            raise bad("round must be >= 1 (1 is the first round of a session)")
        try:
            qs = qpayload.from_proto(req.q, drafts, self.info.n_vocab)
        except qcodec.QError as e:
            raise bad(str(e)) from None
        if not req.session_id and not req.HasField("open"):
            raise bad("session_id is empty and `open` is missing: the first round must carry `open`")
        assumed = list(req.assumed_tokens)
        if len(assumed) > self.limits.max_assumed:
            raise bad(f"assumed_tokens has {len(assumed)} ids; at most (max_window - 1) x (max_gamma + 1) = "
                       f"{self.limits.max_assumed}")
        self.check_ids(assumed, "assumed_tokens")
        alternatives = self.continuations(req, alternative(assumed, drafts, tree, qs))
        following = self.alternatives(req.next_continuations, "next_continuations", set())
        return ValidRound(req, alternatives, None if req.session_id else self.open(req), following)

    def open(self, req: pb.VerifyRequest) -> ValidOpen:
        """The first round's `open`, checked as far as it can be without tokenizing a text prompt."""
        o = req.open
        if o.open_key and len(o.open_key) != OPEN_KEY_BYTES:
            raise bad(f"open.open_key must be {OPEN_KEY_BYTES} random bytes, got {len(o.open_key)}")
        prompt, resume = list(o.prompt_token_ids), list(o.resume_token_ids)
        text, messages = self.text_prompt(o.prompt_text, o.prompt_messages, "open.")
        text_prompt = text is not None or messages is not None
        if prompt and text_prompt:
            raise bad("open.prompt_token_ids and a text prompt are both set: send one")
        if not prompt and not text_prompt:
            raise bad("open.prompt_token_ids is empty: send at least one token (e.g. BOS)")
        if not text_prompt:
            self.check_context(len(prompt) + len(resume))
        self.check_ids(prompt, "open.prompt_token_ids")
        self.check_ids(resume, "open.resume_token_ids")
        if o.tokenizer_fingerprint and o.tokenizer_fingerprint != self.info.fingerprint:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"tokenizer mismatch: the draft's fingerprint {o.tokenizer_fingerprint[:16]}… differs "
                               f"from the target's {self.info.fingerprint[:16]}… ({self.info.model}); draft and "
                               "target must share a tokenizer")
        settings = self.settings(o.sampling, o.HasField("sampling"))
        slo = self.slo(o)
        if req.round != 1:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"a round with `open` must be round 1, got {req.round}")
        expected = len(resume) if text_prompt else len(prompt) + len(resume)
        if req.committed_length != expected:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"committed_length {req.committed_length} does not match the "
                               + (f"resumed tokens sent ({expected}; a text open counts the tokens after the prompt only)"
                                  if text_prompt else f"prompt + resumed tokens sent ({expected})"))
        return ValidOpen(prompt, text, messages, resume, settings, slo)

    def tree(self, req: pb.VerifyRequest | pb.Continuation, drafts: list[int], what: str = "") -> DraftTree | None:
        """The round's tree, validated; None for a chain (no draft_parents)."""
        if not req.draft_parents:
            return None
        if not self.caps.trees or self.limits.max_tree_nodes == 0:
            raise bad(f"this server ({self.info.name}) verifies chains only: send the drafts without draft_parents")
        try:
            return validate_tree(drafts, list(req.draft_parents), self.info.n_vocab, self.limits.max_tree_nodes,
                                 self.limits.max_gamma, self.limits.max_tree_branching)
        except TreeError as e:
            raise bad(f"{what}{e}") from None

    def continuations(self, req: pb.VerifyRequest, own: Alternative) -> list[Alternative]:
        """A pipelined round's alternatives, validated: its own draft (0), then `continuations`."""
        if not req.continuations:
            return [own]
        if not own.assumed:
            raise bad("continuations ride on a pipelined round: set assumed_tokens (alternative 0's key) too")
        return [own] + self.alternatives(req.continuations, "continuations", {tuple(own.assumed)})

    def alternatives(self, conts, field: str, keys: set) -> list[Alternative]:
        """`continuations` or `next_continuations`, validated (keys distinct, also from `keys`)."""
        if len(conts) > self.limits.max_continuations:
            raise bad(f"{len(conts)} {field}; this server takes at most {self.limits.max_continuations}")
        nodes = sum(len(c.draft_token_ids) for c in conts)
        if nodes > self.limits.max_continuation_nodes:
            raise bad(f"the {field} carry {nodes} draft tokens in all; this server takes at most "
                       f"{self.limits.max_continuation_nodes}")
        out = []
        for i, c in enumerate(conts):
            what = f"{field}[{i}]."
            assumed, drafts = list(c.assumed_tokens), list(c.draft_token_ids)
            if not assumed or len(assumed) > self.limits.max_assumed:
                raise bad(f"{what}assumed_tokens has {len(assumed)} ids; it needs 1 to (max_window - 1) x "
                           f"(max_gamma + 1) = {self.limits.max_assumed}")
            self.check_ids(assumed, f"{what}assumed_tokens")
            if tuple(assumed) in keys:
                raise bad(f"{what}assumed_tokens {assumed} repeats another alternative's: each outcome once")
            keys.add(tuple(assumed))
            tree = self.tree(c, drafts, what)
            if tree is None and len(drafts) > self.limits.max_gamma:
                raise bad(f"{what}draft_token_ids has {len(drafts)} tokens; at most max_gamma = "
                           f"{self.limits.max_gamma}")
            self.check_ids(drafts, f"{what}draft_token_ids")
            try:
                qs = qpayload.from_proto(c.q, drafts, self.info.n_vocab)
            except qcodec.QError as e:
                raise bad(f"{what}{e}") from None
            out.append(alternative(assumed, drafts, tree, qs))
        return out

    def check_ids(self, ids: Sequence[int], what: str) -> None:
        if not len(ids):
            return
        arr = np.asarray(ids, dtype=np.int64)
        outside = np.flatnonzero(arr >= self.info.n_vocab)
        if len(outside):
            i = int(outside[0])
            raise bad(f"{what}[{i}] = {int(arr[i])} is outside the vocabulary (n_vocab = {self.info.n_vocab})")

    def settings(self, sp: pb.SamplingParams, has_sampling: bool) -> SamplingSettings:
        if not has_sampling:
            raise bad("open.sampling is missing: set temperature (0 for greedy), top_k, top_p, max_new_tokens")
        try:  # the one rule for valid settings (spec_core.warping); the wire's top_p 0 means off
            settings = SamplingSettings(
                temperature=float(sp.temperature), top_k=int(sp.top_k), top_p=float(sp.top_p),
                max_new_tokens=int(sp.max_new_tokens or self.limits.default_max_new_tokens),
                stop_token_ids=tuple(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
                seed=sp.seed if sp.HasField("seed") else None, coupling=self.coupling(sp.coupling))
        except SamplingError as e:
            raise bad(f"sampling.{e}") from None
        if sp.max_new_tokens > self.limits.max_new_tokens_cap:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"sampling.max_new_tokens = {sp.max_new_tokens} is above this server's cap of "
                               f"{self.limits.max_new_tokens_cap}")
        if len(sp.stop_token_ids) > MAX_STOP_IDS:
            raise bad(f"sampling.stop_token_ids has {len(sp.stop_token_ids)} ids; at most {MAX_STOP_IDS} are allowed")
        self.check_ids(sp.stop_token_ids, "sampling.stop_token_ids")
        return settings

    def coupling(self, value: int) -> str:
        """sampling.coupling: one this build knows and this backend verifies with."""
        name = couplings.from_wire(value)
        if name is None:
            raise bad(f"sampling.coupling = {value} is not a coupling this server knows "
                      f"({', '.join(f'{int(v)} ({k})' for k, v in couplings.TO_WIRE.items())})")
        if name not in self.caps.couplings:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"sampling.coupling {name} is not available with the {self.info.name} backend "
                               f"(it verifies with: {', '.join(self.caps.couplings)}); use --coupling rejection "
                               f"or a verifier that lists {name} in ServerInfo.couplings")
        return name

    def slo(self, o: pb.OpenSession) -> Slo | None:
        if not o.HasField("slo"):
            return self.default_slo
        for name in ("tpot_ms", "ttft_ms"):
            value = getattr(o.slo, name)
            if not (math.isfinite(value) and 0 <= value <= MAX_SLO_MS):
                raise bad(f"open.slo.{name} = {value} must be finite and in [0, {MAX_SLO_MS:.0f}] milliseconds "
                           "(0: no target)")
        return Slo(o.slo.tpot_ms / 1e3, o.slo.ttft_ms / 1e3)

    def stop_ids(self, s: SamplingSettings) -> frozenset[int]:
        return frozenset(s.stop_token_ids) | (frozenset() if s.ignore_eos else self.info.eos_token_ids)

    def check_context(self, n_tokens: int) -> None:
        """Room for the prompt (+ replayed tokens) and one generated token; drafts that do not fit
        later are cut by the round itself."""
        if n_tokens + 1 > self.info.n_ctx:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{n_tokens} prompt tokens + 1 do not fit the context window of {self.info.n_ctx} "
                               "tokens; shorten the prompt")

    def text_prompt(self, text: str, messages, what: str) -> tuple[str | None, list[dict[str, str]] | None]:
        """(text, messages) of a text prompt, validated; (None, None) when the prompt is ids."""
        if not text and not len(messages):
            return None, None
        if not self.caps.vocabulary:
            raise RequestError(grpc.StatusCode.UNIMPLEMENTED,
                               f"this server ({self.info.name}) takes prompts as token ids only: send "
                               f"{what}prompt_token_ids")
        if text and len(messages):
            raise bad(f"{what}prompt_text and {what}prompt_messages are both set: send one")
        if len(messages) > MAX_PROMPT_MESSAGES:
            raise bad(f"{what}prompt_messages has {len(messages)} messages; at most {MAX_PROMPT_MESSAGES}")
        size = len(text.encode()) + sum(len(m.content.encode()) for m in messages)
        if size > MAX_PROMPT_TEXT_BYTES:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"the prompt text is {size} bytes; this server takes at most {MAX_PROMPT_TEXT_BYTES}")
        for i, m in enumerate(messages):
            if not _ROLE.fullmatch(m.role):
                raise bad(f"{what}prompt_messages[{i}].role {quoted(m.role)} is not a role (system, user, "
                           "assistant: lower-case letters and '_', at most 32)")
        if not len(messages):
            return text, None
        if not self.backend.chat_prompts():
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"{self.info.model} has no chat template: send {what}prompt_text instead of messages")
        return None, [{"role": m.role, "content": m.content} for m in messages]

    async def tokenize_prompt(self, text: str | None, messages: list[dict[str, str]] | None, what: str) -> list[int]:
        try:
            ids = await run_in_thread(self.backend.prompt_ids, text, messages)
        except NoChatTemplate as e:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
        except ValueError as e:
            raise bad(f"{what}prompt_messages: {e}") from None
        if not ids:
            raise bad(f"{what}prompt_text tokenizes to no tokens: send some text")
        return ids

    async def generate(self, req: pb.GenerateRequest) -> ValidGenerate:
        """The cloud-only baseline's request: prompt (ids or text, tokenized here), settings, context."""
        prompt = list(req.prompt_token_ids)
        text, messages = self.text_prompt(req.prompt_text, req.prompt_messages, "")
        if prompt and (text is not None or messages is not None):
            raise bad("prompt_token_ids and a text prompt are both set: send one")
        text_prompt = text is not None or messages is not None
        if text_prompt:
            prompt = await self.tokenize_prompt(text, messages, "")
        if not prompt:
            raise bad("prompt_token_ids is empty")
        self.check_ids(prompt, "prompt_token_ids")
        settings = self.settings(req.sampling, req.HasField("sampling"))
        self.check_context(len(prompt))
        return ValidGenerate(prompt, settings, text_prompt)


def text_open(o: pb.OpenSession) -> bool:
    return bool(o.prompt_text) or len(o.prompt_messages) > 0


def open_digest(o: pb.OpenSession) -> bytes:
    return hashlib.sha256(o.SerializeToString(deterministic=True)).digest()

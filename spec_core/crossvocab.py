"""Drafting across tokenizers: token-level intersection (TLI) and the draft's view of the text.

Glossary (adds to spec_core/verify.py's):
  vocabulary     a tokenizer's tokens as the bytes they stand for in text, in id order, with its
                 special (control, unknown, unused) and end-of-generation ids (`Vocabulary`).
  intersection   the draft tokens whose bytes are exactly the bytes of one target token (neither
                 of them special). `TokenMap` maps them one to one: draft id <-> target id.
  restricted q   the draft's distribution with every token outside the intersection removed and
                 the rest renormalised (`restrict_logits`: their logits set to -inf before
                 temperature / top-k / top-p, so the draft's own warping runs on the restriction).
  draft view     the draft's own tokenization of the committed text: the committed target ids ->
                 their bytes -> draft ids (`DraftView`), kept incrementally.
  stable boundary  the draft-token boundary from which a sync re-tokenizes: `window` draft tokens
                 before the end of the bytes the previous view and the new text share.
  re-drafted     draft tokens of the previous view a sync drops (the draft's KV cache rolls back
                 over them) and the new ones it tokenizes in their place.

Why TLI is exact (Timor et al., ICML 2025, "token-level intersection"; HF transformers' universal
assisted generation; vLLM). The verifier's round (spec_core.verify, spec_core.tree) is exact for
ANY proposal q over the TARGET's ids, as long as the draft token was drawn from exactly the q
that is shipped, independently of the verifier's uniforms: accept x with min(1, p(x)/q(x)), else
draw from norm(max(0, p - q)), and the token out is distributed as p. TLI only chooses that q:
  1. q_d = the draft's processed distribution over the intersection (restricted, renormalised);
  2. the edge samples d ~ q_d (quantize first, then sample: spec_core.drafting.draft_step);
  3. it ships t = map(d) with q_t(map(x)) = q_d(x) (`to_target_q`).
Because the map is injective, t ~ q_t exactly and q_t is a distribution over target ids. So the
round's output follows p, the target's processed distribution, at every temperature, top-k and
top-p, for chains and trees (node by node, with the same translation of each node's q; siblings
drawn without replacement stay without replacement, since distinct draft ids map to distinct
target ids), with batching, pipelining and replay (none of which looks at where q came from).
Greedy (T = 0): p is one-hot, a draft is kept iff it is the target's argmax: the output is the
target's greedy text. What the map gets wrong costs acceptance, never exactness: mapping d to a
target token with other bytes (the negative control in tests/test_crossvocab.py) still yields
the target's distribution over ids; the text the DRAFT meant differs, so α drops. Shipping the
UNRESTRICTED q is what breaks exactness: q then puts mass on ids that were never drawn (or the
drawn token's q is wrong), and the accept probability min(1, p/q) is computed from the wrong q.

Beyond TLI (`TargetPieces`): point-mass drafts may be any tokens chosen without the verifier's
draws, so the draft's own argmax outside the intersection can be spelled in target tokens; see
the class's docstring.

The draft view does not touch exactness at all: it only decides which context the draft model
sees. It is kept close to the draft's own tokenization of the text so that the draft predicts well.
"""
from __future__ import annotations

import struct
import zlib
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import numpy as np

from spec_core.qcodec import EncodedQ

# A vocabulary on the wire: zlib of (n little-endian uint32 lengths, then the bytes). The
# decompressed size is bounded, so a hostile blob cannot balloon in memory.
MAX_VOCAB_TOKENS = 1 << 20
MAX_TOKEN_BYTES = 1 << 10
MAX_VOCAB_BLOB_BYTES = 64 << 20


class VocabularyError(ValueError):
    """A vocabulary blob that does not decode (corrupt, truncated, too large)."""


@dataclass(frozen=True)
class Vocabulary:
    token_bytes: tuple[bytes, ...]                 # [n_vocab] the bytes each token stands for in text
    special_ids: frozenset[int] = frozenset()      # control / unknown / unused: never drafted, hidden in text
    eog_ids: frozenset[int] = frozenset()          # end-of-generation ids
    fingerprint: str = ""                          # spec_core.fingerprint of the tokenizer
    byte_ids: frozenset[int] = frozenset()         # byte-fallback tokens ('<0x41>'), second choice in the map

    @property
    def n_vocab(self) -> int:
        return len(self.token_bytes)

    def text_bytes(self, ids: Sequence[int]) -> bytes:
        """The bytes of `ids` as text (special tokens stand for nothing)."""
        tb, special = self.token_bytes, self.special_ids
        return b"".join(tb[i] for i in ids if i not in special)


def pack_token_bytes(token_bytes: Sequence[bytes], level: int = 9) -> bytes:
    lengths = np.fromiter((len(b) for b in token_bytes), dtype="<u4", count=len(token_bytes))
    return zlib.compress(lengths.tobytes() + b"".join(token_bytes), level)


def unpack_token_bytes(blob: bytes, n_vocab: int) -> tuple[bytes, ...]:
    """The inverse of pack_token_bytes; VocabularyError for anything malformed."""
    if not 0 < n_vocab <= MAX_VOCAB_TOKENS:
        raise VocabularyError(f"n_vocab {n_vocab} is outside 1..{MAX_VOCAB_TOKENS}")
    d = zlib.decompressobj()
    try:
        raw = d.decompress(blob, MAX_VOCAB_BLOB_BYTES)
    except zlib.error as e:
        raise VocabularyError(f"the token bytes do not decompress: {e}") from None
    if d.unconsumed_tail or not d.eof:
        raise VocabularyError("the token bytes are truncated or larger than "
                              f"{MAX_VOCAB_BLOB_BYTES >> 20} MiB decompressed")
    head = 4 * n_vocab
    if len(raw) < head:
        raise VocabularyError(f"the token bytes hold fewer than {n_vocab} lengths")
    lengths = np.frombuffer(raw[:head], dtype="<u4").astype(np.int64)
    if lengths.max(initial=0) > MAX_TOKEN_BYTES or head + int(lengths.sum()) != len(raw):
        raise VocabularyError("the token lengths do not add up to the bytes sent")
    ends = head + np.cumsum(lengths)
    starts = ends - lengths
    return tuple(raw[s:e] for s, e in zip(starts.tolist(), ends.tolist()))


@dataclass(frozen=True)
class TokenMap:
    """The intersection of two vocabularies, one to one."""

    draft_to_target: np.ndarray   # [draft_vocab] int64, -1 outside the intersection
    target_to_draft: np.ndarray   # [target_vocab] int64, -1 outside the intersection
    draft_vocab: int
    target_vocab: int

    @property
    def n_mapped(self) -> int:
        return int(np.count_nonzero(self.draft_to_target >= 0))

    @property
    def draft_mask(self) -> np.ndarray:
        return self.draft_to_target >= 0   # [draft_vocab] bool

    def describe(self) -> str:
        return (f"{self.n_mapped} of the draft's {self.draft_vocab} tokens "
                f"({100 * self.n_mapped / max(1, self.draft_vocab):.1f}%) are exactly one of the target's "
                f"{self.target_vocab}")


def intersection_map(draft: Vocabulary, target: Vocabulary) -> TokenMap:
    """Draft id -> target id where the draft token's bytes are exactly one target token's.

    Special tokens of either side and empty tokens are left out. When several target tokens have
    the same bytes (a byte-fallback '<0x41>' beside 'A'), the ordinary one is kept, then the lowest
    id; when several draft tokens do, the lowest draft id is kept: the map stays one to one."""
    by_bytes: dict[bytes, int] = {}
    for t, b in enumerate(target.token_bytes):
        if not b or t in target.special_ids:
            continue
        have = by_bytes.get(b)
        if have is None or (have in target.byte_ids and t not in target.byte_ids):
            by_bytes[b] = t
    d2t = np.full(draft.n_vocab, -1, dtype=np.int64)
    t2d = np.full(target.n_vocab, -1, dtype=np.int64)
    for d, b in enumerate(draft.token_bytes):
        if not b or d in draft.special_ids:
            continue
        t = by_bytes.get(b)
        if t is not None and t2d[t] < 0:
            d2t[d], t2d[t] = t, d
    return TokenMap(d2t, t2d, draft.n_vocab, target.n_vocab)


def restrict_logits(draft_logits: np.ndarray, token_map: TokenMap) -> np.ndarray:
    """draft_logits  # [..., draft_vocab] -> a copy with -inf outside the intersection. Softmax of
    the result at any temperature is the draft's distribution restricted and renormalised."""
    out = np.array(draft_logits, dtype=np.float32 if draft_logits.dtype == np.float32 else np.float64)
    out[..., ~token_map.draft_mask] = -np.inf
    return out


def restrict_probs(draft_probs: np.ndarray, token_map: TokenMap) -> np.ndarray | None:
    """draft_probs  # [draft_vocab] -> restricted and renormalised; None when no mass is left."""
    out = np.where(token_map.draft_mask, np.asarray(draft_probs, dtype=np.float64), 0.0)
    total = out.sum()
    return out / total if total > 0 else None


def to_target_q(q: EncodedQ, token_map: TokenMap) -> EncodedQ:
    """The same weights on the target's ids (sparse). Every id with positive weight must be mapped:
    q must have been made from restricted logits or probabilities.

    A sparse encoding may keep zero-weight ids (encode_float's top-k support is wider than what
    top-k / top-p / the restriction left, so some are outside the intersection): they are never
    drawn and add nothing to the sum, so leaving them out keeps the distribution bit for bit the one
    the token was drawn from."""
    if q.token_ids is None:
        ids = np.flatnonzero(q.weights)
        weights = q.weights[ids]
    else:
        positive = q.weights > 0
        ids, weights = q.token_ids[positive].astype(np.int64), q.weights[positive]
    target_ids = token_map.draft_to_target[ids]
    if np.any(target_ids < 0):
        raise ValueError("q puts weight on draft tokens outside the intersection: restrict it before sampling")
    return EncodedQ(target_ids.astype(np.uint32), weights, q.fixed)


# --- beyond TLI: point-mass drafts spelled in target tokens --------------------------------------------

class TargetPieces:
    """Greedy longest-match spelling of bytes in the target's (non-special) tokens.

    Beyond TLI, for point-mass drafts (greedy, or q 'none'): the draft's own argmax is taken even
    when it is outside the intersection, and its bytes are spelled as target tokens ('▁hello' ->
    '▁hel' + 'lo' when the target has no '▁hello'). Exact for the reason every point-mass draft is
    (spec_core.verify): a draft without q is accepted with p(x) and otherwise replaced by a draw from
    p without x, whatever x is, as long as x does not depend on the verifier's draws. What the
    spelling gets wrong (the target would split the text otherwise) costs acceptance only. At T = 0
    this is string-level exact matching (SLEM, Timor et al. 2025) one token at a time: a draft
    token spanning several target tokens is kept iff each is the target's argmax."""

    def __init__(self, target: Vocabulary):
        self.table: dict[bytes, int] = {}
        for t, b in enumerate(target.token_bytes):
            if b and t not in target.special_ids and (b not in self.table or self.table[b] in target.byte_ids):
                self.table[b] = t
        self.longest = max((len(b) for b in self.table), default=0)

    def spell(self, data: bytes) -> list[int]:
        """Target ids whose bytes concatenate to `data`; [] when some byte has no token."""
        out, pos = [], 0
        while pos < len(data):
            for n in range(min(self.longest, len(data) - pos), 0, -1):
                t = self.table.get(data[pos: pos + n])
                if t is not None:
                    out.append(t)
                    pos += n
                    break
            else:
                return []
        return out


# --- the draft's view of the committed text -------------------------------------------------------

class Sync(NamedTuple):
    """What one `DraftView.sync` did."""

    draft_ids: list[int]   # the draft's tokens for the committed text (prompt anchor included)
    rolled_back: int       # draft tokens of the previous view dropped (their KV is recomputed)
    retokenized: int       # new draft tokens put in their place and after them


@dataclass
class ViewStats:
    syncs: int = 0
    rolled_back: int = 0
    retokenized: int = 0
    byte_tokens: int = 0   # bytes that went in as single-byte draft tokens (incomplete UTF-8)

    def rolled_back_per_sync(self) -> float:
        return self.rolled_back / self.syncs if self.syncs else 0.0


def _utf8_runs(data: bytes):
    """(chunk, valid) pieces of `data`: valid UTF-8 runs and the bytes between or after them that
    are not (an incomplete character at the end, or invalid bytes)."""
    pos = 0
    while pos < len(data):
        try:
            data[pos:].decode("utf-8")
        except UnicodeDecodeError as e:
            if e.start:
                yield data[pos: pos + e.start], True
            yield data[pos + e.start: pos + e.end], False
            pos += e.end
            continue
        yield data[pos:], True
        return


@dataclass
class _Anchor:
    target: list[int]
    draft: list[int]


class DraftView:
    """The draft's tokenization of the committed target text, updated incrementally.

    `tokenize(data)` is the draft tokenizer on raw UTF-8 bytes (no BOS, special tokens not parsed).
    `anchor(target_prompt, draft_prompt)` says that the target's prompt ids stand for the draft's
    own rendering of the same prompt (its chat template): a committed sequence that starts with
    the target prompt is viewed as the draft prompt + the draft tokens of the generated bytes.
    Without an anchor (or when the committed ids do not start with it) all of it is converted.

    A sync keeps the previous view's draft tokens up to the stable boundary: `window` draft tokens
    before the end of the bytes both texts share (GPT-2-style pre-tokenizers never merge across
    word boundaries, so a change at the end re-tokenizes at most the last word or two, which the
    window covers), and tokenizes the bytes after it. Bytes that are not complete UTF-8 (a character
    split across target tokens) go in as single-byte draft tokens and are redone next time."""

    def __init__(self, target: Vocabulary, draft: Vocabulary, tokenize: Callable[[bytes], list[int]],
                 window: int = 4):
        self.target, self.draft, self.tokenize, self.window = target, draft, tokenize, max(1, window)
        self._target_len = np.array([0 if i in target.special_ids else len(b)
                                     for i, b in enumerate(target.token_bytes)], dtype=np.int64)
        self._byte_token: dict[int, int] = {}
        for d, b in enumerate(draft.token_bytes):
            if len(b) == 1 and d not in draft.special_ids and (b[0] not in self._byte_token or d in draft.byte_ids):
                self._byte_token.setdefault(b[0], d)
        self._anchor = _Anchor([], [])
        self._head: list[int] = []     # the draft ids the current view follows (an anchor's draft prompt)
        self.stats = ViewStats()
        self._reset()

    def _reset(self) -> None:
        self._gen: list[int] = []      # generated target ids the view was made from
        self._gen_ends: list[int] = []  # [len(_gen)] byte offset after each
        self._text = b""               # their bytes
        self._draft: list[int] = []    # draft ids for _text
        self._ends: list[int] = []     # [len(_draft)] byte offset after each draft token
        self._solid = 0                # leading draft tokens that came from the tokenizer (not byte tokens)

    def anchor(self, target_prompt: Sequence[int], draft_prompt: Sequence[int]) -> None:
        self._anchor = _Anchor(list(target_prompt), list(draft_prompt))

    def sync(self, committed: Sequence[int]) -> Sync:
        committed = list(committed)
        a = self._anchor
        if committed[: len(a.target)] == a.target:
            head, gen = a.draft, committed[len(a.target):]
        else:
            head, gen = [], committed
        if head != self._head:   # the view was made after another head: start again
            self._reset()
            self._head = list(head)
        # The target ids both views share, and the bytes they make.
        k = 0
        for old, new in zip(self._gen, gen):
            if old != new:
                break
            k += 1
        shared = self._gen_ends[k - 1] if k else 0
        lens = self._target_len[np.asarray(gen[k:], dtype=np.int64)] if len(gen) > k else np.zeros(0, np.int64)
        text = self._text[:shared] + self.target.text_bytes(gen[k:])
        gen_ends = self._gen_ends[:k] + (shared + np.cumsum(lens)).tolist()
        # The stable boundary: `window` draft tokens before the end of the shared bytes, and never
        # after a byte token (an incomplete character is always redone).
        n_inside = bisect_right(self._ends, shared)
        i0 = max(0, min(n_inside - self.window, self._solid))
        b0 = self._ends[i0 - 1] if i0 else 0
        tail_ids, tail_ends, solid_tail = self._tokenize_tail(text[b0:], b0)
        j = 0  # how much of the old tail the new one repeats (the KV cache keeps those)
        old_ids, old_ends = self._draft[i0:], self._ends[i0:]
        while j < min(len(old_ids), len(tail_ids)) and old_ids[j] == tail_ids[j] and old_ends[j] == tail_ends[j]:
            j += 1
        rolled_back, retokenized = len(old_ids) - j, len(tail_ids) - j
        self._gen, self._gen_ends, self._text = gen, gen_ends, text
        self._draft = self._draft[:i0] + tail_ids
        self._ends = self._ends[:i0] + tail_ends
        self._solid = i0 + solid_tail
        st = self.stats
        st.syncs += 1
        st.rolled_back += rolled_back
        st.retokenized += retokenized
        return Sync(list(head) + self._draft, rolled_back, retokenized)

    def _tokenize_tail(self, data: bytes, offset: int) -> tuple[list[int], list[int], int]:
        """Draft ids for `data`, their end offsets (from `offset`), and how many leading ones came
        from the tokenizer before the first byte token."""
        ids: list[int] = []
        ends: list[int] = []
        solid, pos = None, offset
        for chunk, valid in _utf8_runs(data):
            pieces = self.tokenize(chunk) if valid else None
            if pieces is not None and b"".join(self.draft.token_bytes[i] for i in pieces) == chunk:
                for i in pieces:
                    pos += len(self.draft.token_bytes[i])
                    ids.append(int(i))
                    ends.append(pos)
                continue
            # Not complete UTF-8, or the tokenizer changed the bytes (a dummy-prefix space): byte tokens.
            if solid is None:
                solid = len(ids)
            for byte in chunk:
                pos += 1
                d = self._byte_token.get(byte)
                if d is not None:
                    ids.append(d)
                    ends.append(pos)
                    self.stats.byte_tokens += 1
        return ids, ends, len(ids) if solid is None else solid

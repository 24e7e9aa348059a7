"""A synthetic pair of vocabularies for the cross-tokenizer tests (built in code, no model files).

    target: <s>  <eos>  a  b  c  é  abc  bb  \\xc3(byte)      draft: <d>  a  b  c  é  ab  ca  bb
Multi-byte tokens: 'é' (2 bytes, in both). Outside the intersection: the draft's 'ab' and 'ca', the
target's 'abc' and its byte token. One token equal to two of the other: the draft's 'ab' is the
target's 'a' + 'b'; the target's 'abc' is the draft's 'ab' + 'c'.
"""
from __future__ import annotations

from spec_core.crossvocab import Vocabulary
from spec_core.fingerprint import tokenizer_fingerprint

TARGET_TOKENS = [b"", b"", b"a", b"b", b"c", "é".encode(), b"abc", b"bb", b"\xc3"]
DRAFT_TOKENS = [b"", b"a", b"b", b"c", "é".encode(), b"ab", b"ca", b"bb"]


def _fp(tokens, tag: bytes) -> str:
    return tokenizer_fingerprint([tag + t for t in tokens], 0, 1)


TARGET = Vocabulary(tuple(TARGET_TOKENS), special_ids=frozenset({0, 1}), eog_ids=frozenset({1}),
                    fingerprint=_fp(TARGET_TOKENS, b"t"), byte_ids=frozenset({8}))
DRAFT = Vocabulary(tuple(DRAFT_TOKENS), special_ids=frozenset({0}), eog_ids=frozenset(),
                   fingerprint=_fp(DRAFT_TOKENS, b"d"))


def longest_match_tokenizer(vocab: Vocabulary):
    """Greedy longest-match tokenization over `vocab`'s non-special tokens (bytes in, ids out)."""
    table = {b: i for i, b in enumerate(vocab.token_bytes) if b and i not in vocab.special_ids}
    longest = max(len(b) for b in table)

    def tokenize(data: bytes) -> list[int]:
        out, pos = [], 0
        while pos < len(data):
            for n in range(min(longest, len(data) - pos), 0, -1):
                tok = table.get(data[pos: pos + n])
                if tok is not None:
                    out.append(tok)
                    pos += n
                    break
            else:
                pos += 1   # a byte no token covers: dropped (the draft's context only)
        return out
    return tokenize


class DraftTokenizer:
    """The synthetic draft's tokenizer (edge_client.crossvocab.DraftTokenizer)."""

    def __init__(self, fingerprint: str):
        self.fingerprint = fingerprint
        self.vocabulary = DRAFT
        self.eog_ids = frozenset()
        self._tok = longest_match_tokenizer(DRAFT)

    def tokenize(self, text, add_special=True, parse_special=True):
        return ([0] if add_special else []) + self._tok(text.encode())

    def tokenize_bytes(self, data, add_special=False, parse_special=False):
        return self._tok(data)

    def token_bytes(self, token, special=False):
        return DRAFT.token_bytes[token]

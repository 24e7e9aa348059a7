"""The interfaces the edge client works against, declared once.

- Tokenizer: the text shown to the user (and the prompt's ids when the draft has the target's
  tokenizer). DraftTokenizer: what drafting across vocabularies also needs of the draft's own.
- The drafter's contract is the base class edge_client.drafters.Drafter: propose, observe, and the
  optional capabilities (propose_tree with supports_trees, next_logits with supports_cross_vocab)
  declared there.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from spec_core.crossvocab import Vocabulary


class Tokenizer(Protocol):
    fingerprint: str
    eog_ids: frozenset[int]

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]: ...
    def token_bytes(self, token: int, special: bool = False) -> bytes: ...


@runtime_checkable
class DraftTokenizer(Protocol):
    """What drafting across vocabularies needs of the draft's tokenizer (llama_runtime.GGUFModel has
    it): its vocabulary, and tokenizing raw bytes (the tail of the committed text, re-tokenized)."""

    fingerprint: str
    vocabulary: Vocabulary

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]: ...
    def tokenize_bytes(self, data: bytes, add_special: bool = False, parse_special: bool = False) -> list[int]: ...

"""The interfaces the edge client works against."""
from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    fingerprint: str
    eog_ids: frozenset[int]

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]: ...
    def token_bytes(self, token: int, special: bool = False) -> bytes: ...

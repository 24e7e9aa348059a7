"""The edge's side of drafting across tokenizers: the target's vocabulary (asked once, cached on
disk by fingerprint), the wrapper drafter, the target's text, and prompts the edge cannot tokenize.

When the verifier's tokenizer fingerprint differs from the draft's (and the user did not ask for
the strict check), EdgeClient negotiates this mode by itself:
  1. the target's vocabulary comes from a file given by the caller, the disk cache
     ($HYBRIDSPEC_CACHE or ~/.cache/hybridspec, then vocab/<fingerprint>.pb), or GetVocabulary;
  2. the drafter is wrapped in edge_client.drafters.CrossVocabDrafter (TLI: exact);
  3. a text or chat prompt travels as text (OpenSession.prompt_text / prompt_messages); the verifier
     tokenizes it for the target and answers with the ids, while the draft starts from its own
     rendering of the same prompt (its own chat template), anchored to those ids;
  4. the text shown to the user is decoded with the target's token bytes (`TargetText`).
"""
from __future__ import annotations

import logging
import os
import re
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from edge_client.protocols import DraftTokenizer
from spec_core.crossvocab import TokenMap, Vocabulary, VocabularyError, intersection_map, unpack_token_bytes
from spec_core.proto import verifier_pb2 as pb
from spec_core.wire import MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)

_FINGERPRINT = re.compile(r"[0-9a-f]{64}")
# GetVocabulary's answer for Gemma 3 is ~1.4 MB; allow well above gRPC's 4 MiB default.
VOCABULARY_MAX_BYTES = MAX_MESSAGE_BYTES


@dataclass(frozen=True)
class Chat:
    """A prompt as a conversation: ({"role": ..., "content": ...}, ...), rendered with each model's
    own chat template (the draft's here, the target's on the verifier)."""

    messages: tuple[dict, ...]

    @classmethod
    def of(cls, prompt: str, system: str | None = None) -> "Chat":
        return cls(tuple(([{"role": "system", "content": system}] if system else [])
                         + [{"role": "user", "content": prompt}]))


class TargetText:
    """The target's token bytes for the text shown to the user (the Tokenizer protocol of
    edge_client.client, without tokenize: prompts go to the verifier as text)."""

    def __init__(self, vocab: Vocabulary):
        self.vocab = vocab
        self.fingerprint = vocab.fingerprint
        self.eog_ids = vocab.eog_ids
        self.n_vocab = vocab.n_vocab

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        return self.vocab.token_bytes[token] if 0 <= token < self.vocab.n_vocab else b""

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        raise TypeError("the target's tokenizer is on the verifier: send the prompt as text")


# --- the vocabulary --------------------------------------------------------------------------------

def vocabulary_from_proto(msg: pb.Vocabulary) -> Vocabulary:
    """VocabularyError when the message is malformed."""
    if not _FINGERPRINT.fullmatch(msg.fingerprint):
        raise VocabularyError("the vocabulary's fingerprint is not 64 hex digits")
    n = msg.n_vocab
    tokens = unpack_token_bytes(msg.token_bytes_zlib, n)
    ids = [*msg.special_token_ids, *msg.eog_token_ids, *msg.byte_token_ids]
    if any(i >= n for i in ids):
        raise VocabularyError("the vocabulary names token ids outside 0..n_vocab-1")
    return Vocabulary(tokens, frozenset(msg.special_token_ids), frozenset(msg.eog_token_ids), msg.fingerprint,
                      frozenset(msg.byte_token_ids))


def vocabulary_to_proto(v: Vocabulary) -> pb.Vocabulary:
    from spec_core.crossvocab import pack_token_bytes
    return pb.Vocabulary(fingerprint=v.fingerprint, n_vocab=v.n_vocab, token_bytes_zlib=pack_token_bytes(v.token_bytes),
                         special_token_ids=sorted(v.special_ids), eog_token_ids=sorted(v.eog_ids),
                         byte_token_ids=sorted(v.byte_ids))


def cache_dir() -> Path:
    from spec_core.paths import cache_root
    return cache_root() / "vocab"


def cached_vocabulary(fingerprint: str, directory: Path | None = None) -> Vocabulary | None:
    """The vocabulary cached for this fingerprint, or None (none, unreadable, or not that fingerprint)."""
    if not _FINGERPRINT.fullmatch(fingerprint):
        return None   # never a path built from a malformed (hostile) fingerprint
    path = (directory or cache_dir()) / f"{fingerprint}.pb"
    try:
        msg = pb.Vocabulary.FromString(path.read_bytes())
        vocab = vocabulary_from_proto(msg)
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - a corrupt cache file is only a miss
        log.warning("ignoring the cached vocabulary %s: %s", path, e)
        return None
    return vocab if vocab.fingerprint == fingerprint else None


def store_vocabulary(msg: pb.Vocabulary, directory: Path | None = None) -> Path | None:
    """Write the vocabulary into the cache (atomically); None when the cache is not writable."""
    if not _FINGERPRINT.fullmatch(msg.fingerprint):
        return None
    directory = directory or cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, delete=False, suffix=".tmp") as f:
            f.write(msg.SerializeToString())
        path = directory / f"{msg.fingerprint}.pb"
        os.replace(f.name, path)
        return path
    except OSError as e:
        log.warning("cannot cache the target's vocabulary in %s: %s", directory, e)
        return None


def load_vocabulary_file(path: str | os.PathLike) -> Vocabulary:
    """A target vocabulary from a local file: a GGUF model (read vocabulary-only) or a saved
    Vocabulary message (.pb, as in the cache)."""
    path = Path(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        from llama_runtime import GGUFModel
        model = GGUFModel(path, vocab_only=True)
        try:
            return model.vocabulary
        finally:
            model.close()
    return vocabulary_from_proto(pb.Vocabulary.FromString(path.read_bytes()))


_VOCABS: dict[str, Vocabulary] = {}                        # by fingerprint, this process
_MAPS: dict[tuple[str, str], TokenMap] = {}                # by (draft, target) fingerprint
_WRAPPERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # inner drafter -> its CrossVocabDrafter


def remember_vocabulary(v: Vocabulary) -> None:
    _VOCABS[v.fingerprint] = v


def known_vocabulary(fingerprint: str) -> Vocabulary | None:
    """This process's copy, else the disk cache's."""
    v = _VOCABS.get(fingerprint)
    if v is None:
        v = cached_vocabulary(fingerprint)
        if v is not None:
            _VOCABS[fingerprint] = v
    return v


def token_map(draft: Vocabulary, target: Vocabulary) -> TokenMap:
    key = (draft.fingerprint, target.fingerprint)
    m = _MAPS.get(key)
    if m is None:
        m = _MAPS[key] = intersection_map(draft, target)
        log.info("drafting across vocabularies: %s", m.describe())
    return m


def wrap(drafter, draft_tokenizer: DraftTokenizer, target: Vocabulary):
    """The CrossVocabDrafter for `drafter` (one per inner drafter and target, reused)."""
    from edge_client.drafters import CrossVocabDrafter
    have = _WRAPPERS.get(drafter)
    if have is not None and have.fingerprint == target.fingerprint:
        return have
    draft_vocab = draft_tokenizer.vocabulary
    w = CrossVocabDrafter(drafter, draft_vocab, target, draft_tokenizer.tokenize_bytes,
                          token_map=token_map(draft_vocab, target))
    _WRAPPERS[drafter] = w
    return w


def draft_prompt_ids(tokenizer: DraftTokenizer, prompt: "str | Chat") -> list[int]:
    """The draft's own rendering of a prompt: its tokenizer, its chat template (plain text of the
    messages when it has none). Only the draft's context: exactness does not depend on it."""
    if isinstance(prompt, str):
        return tokenizer.tokenize(prompt)
    if hasattr(tokenizer, "chat_template"):
        try:
            from edge_client.text import render_messages
            return render_messages(tokenizer, list(prompt.messages))
        except Exception as e:  # noqa: BLE001 - no template, or it refused: fall back to the text
            log.info("the draft's chat template did not render the prompt (%s); drafting from its text", e)
    return tokenizer.tokenize("\n\n".join(m["content"] for m in prompt.messages))


def open_fields(prompt: "str | Chat") -> pb.OpenSession:
    """The text open for a prompt (OpenSession.prompt_text / prompt_messages)."""
    if isinstance(prompt, str):
        return pb.OpenSession(prompt_text=prompt)
    return pb.OpenSession(prompt_messages=[pb.ChatMessage(role=m["role"], content=m["content"])
                                           for m in prompt.messages])


@dataclass
class PromptPlan:
    """A generation's prompt as the session loop needs it."""

    ids: list[int]                       # the target's prompt ids ([] until a text open's reply)
    text_open: pb.OpenSession | None     # prompt_text / prompt_messages to open with, or None
    draft_ids: Sequence[int] = ()        # the draft's own rendering (anchored to the target ids)

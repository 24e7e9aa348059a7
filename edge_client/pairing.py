"""Whether the draft drafts in the target's own token ids or across vocabularies: decided once per
client, before its first round, from what the verifier said of itself (its tokenizer fingerprint).

Across vocabularies (edge_client.crossvocab), the set-up is done then too: the target's vocabulary
(this process's copy, the disk cache, `--target-vocab`, or GetVocabulary), the drafter wrapped in a
CrossVocabDrafter, and the target's token bytes for the text shown. A pair that cannot work
together is refused there with a message that says why, before any round is sent.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

import grpc

from edge_client import crossvocab
from edge_client.crossvocab import Chat, PromptPlan
from edge_client.drafters import Drafter
from edge_client.options import Speculation
from edge_client.protocols import DraftTokenizer, Tokenizer
from edge_client.stats import GenerationStats
from edge_client.transport import EdgeError, Verifier

log = logging.getLogger(__name__)

InDrafter = Callable[..., Awaitable]   # EdgeClient.run_drafting: drafting work where drafting runs


@dataclass(frozen=True)
class Pairing:
    """How a client's drafts reach the target, for every generation it runs."""

    drafter: Drafter                         # what drafts: the client's own drafter, or its CrossVocabDrafter
    tokenizer: Tokenizer                     # the target's text: the client's tokenizer, or the target's bytes
    hidden_ids: frozenset[int]               # tokens that end generation and are not shown
    draft_tokenizer: DraftTokenizer | None = None   # across vocabularies: the draft's own; None: the same ids
    draft_fingerprint: str = ""              # across vocabularies: the draft's tokenizer, announced at the open

    @property
    def cross(self) -> bool:
        return self.draft_tokenizer is not None


async def pair(drafter: Drafter, tokenizer: Tokenizer, speculation: Speculation, verifier: Verifier,
               st: GenerationStats, in_drafter: InDrafter) -> Pairing:
    """The pairing for this drafter and the verifier (whose ServerInfo the client has asked)."""
    same = Pairing(drafter, tokenizer, tokenizer.eog_ids)
    info = verifier.known_info()
    target_fp = info.tokenizer_fingerprint if info is not None else ""
    if not target_fp or drafter.fingerprint in (None, target_fp) or speculation.strict_tokenizer:
        return same   # same tokenizer, a drafter without one, or the strict check (the verifier's)
    # (isinstance reads the tokenizer's vocabulary, which a GGUF model builds on first use: where drafting runs)
    if not drafter.supports_cross_vocab or not await in_drafter(isinstance, tokenizer, DraftTokenizer, thread=True):
        raise EdgeError(grpc.StatusCode.FAILED_PRECONDITION,
                        f"the target ({info.model}) has another tokenizer and the {drafter.name} drafter "
                        "cannot draft across vocabularies; use a GGUF draft model or one with the target's tokenizer")
    target = crossvocab.known_vocabulary(target_fp)
    if target is None and speculation.target_vocab:
        target = await asyncio.to_thread(crossvocab.load_vocabulary_file, speculation.target_vocab)
        if target.fingerprint != target_fp:
            raise EdgeError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"{speculation.target_vocab} is not the verifier's tokenizer ({info.model})")
        crossvocab.remember_vocabulary(target)
    if target is None:
        if not info.text_prompts:
            raise EdgeError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"the draft's tokenizer differs from the target's ({info.model}) and this verifier "
                            "does not serve its vocabulary or take text prompts; use a draft with the target's "
                            "tokenizer")
        target = await _fetch_vocabulary(verifier, target_fp, st)
    try:
        wrapper = await in_drafter(crossvocab.wrap, drafter, tokenizer, target, thread=True)
    except ValueError as e:   # vocabularies with nothing in common
        raise EdgeError(grpc.StatusCode.FAILED_PRECONDITION, f"cannot draft for {info.model}: {e}") from None
    log.info("the target's tokenizer differs from the draft's: drafting across vocabularies (%s)",
             wrapper.token_map.describe())
    return Pairing(wrapper, crossvocab.TargetText(target), target.eog_ids, draft_tokenizer=tokenizer,
                   draft_fingerprint=drafter.fingerprint or "")


async def _fetch_vocabulary(verifier: Verifier, fingerprint: str, st: GenerationStats):
    msg = await verifier.vocabulary(fingerprint, st)
    try:
        vocab = await asyncio.to_thread(crossvocab.vocabulary_from_proto, msg)
    except ValueError as e:
        raise EdgeError(grpc.StatusCode.INTERNAL, f"the verifier's vocabulary does not decode: {e}") from None
    if vocab.fingerprint != fingerprint:
        raise EdgeError(grpc.StatusCode.FAILED_PRECONDITION, "the verifier sent the vocabulary of another tokenizer")
    await asyncio.to_thread(crossvocab.store_vocabulary, msg)
    crossvocab.remember_vocabulary(vocab)
    return vocab


async def plan_prompt(pairing: Pairing, prompt: "str | Chat | Sequence[int]", in_drafter: InDrafter) -> PromptPlan:
    """The prompt as target ids, or as a text open when the draft has another tokenizer."""
    if not pairing.cross:
        if isinstance(prompt, str):
            return PromptPlan(pairing.tokenizer.tokenize(prompt), None)
        if isinstance(prompt, Chat):
            from edge_client.text import render_messages
            return PromptPlan(render_messages(pairing.tokenizer, list(prompt.messages)), None)
        return PromptPlan(list(prompt), None)
    if isinstance(prompt, (str, Chat)):
        draft_ids = await in_drafter(crossvocab.draft_prompt_ids, pairing.draft_tokenizer, prompt)
        pairing.drafter.anchor_prompt([], draft_ids)
        return PromptPlan([], crossvocab.open_fields(prompt), draft_ids)
    pairing.drafter.anchor_prompt([], [])   # target ids: the draft sees their text
    return PromptPlan(list(prompt), None)

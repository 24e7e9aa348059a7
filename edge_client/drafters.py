"""Drafters: the two-method contract (propose a draft; learn from the round's result).

A drafter proposes γ tokens after the committed sequence and, per token, the q it was sampled
from (spec_core.drafting.draft_step does the encode-then-sample), or None for point masses.
"""
from __future__ import annotations

import abc
import dataclasses
import os
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from spec_core.crossvocab import DraftView, TargetPieces, TokenMap, ViewStats, Vocabulary, intersection_map, restrict_logits, to_target_q
from spec_core.drafting import QMode, draft_step
from spec_core.gumbel import draft_noise
from spec_core.qcodec import EncodedQ
from spec_core.tree import ROOT, DraftTree, TreeShape, grow_tree, tree_sampling
from spec_core.warping import SamplingSettings

# Where scripts/setup.sh puts the default draft (built from the bundled target; never committed).
DEFAULT_DRAFT = Path(os.environ.get("HYBRIDSPEC_MODELS", "models")) / "smollm2-draft.gguf"


@dataclass
class Draft:
    tokens: list[int]                   # [gamma]
    qs: list[EncodedQ] | None           # [gamma], or None: point-mass drafts (no q on the wire)
    seconds: float                      # time spent drafting


@dataclass
class TreeDraft:
    tokens: list[int]                   # [n] node tokens
    parents: list[int]                  # [n] parent index, -1 = after the committed sequence
    qs: list[EncodedQ] | None           # [n] each node's shipped q, or None: point masses
    seconds: float                      # time spent drafting
    rows: int                           # draft forward rows computed (expanded nodes, root included)
    path_probs: list[float]             # [n] the draft's probability of reaching each node


class Drafter(abc.ABC):
    name: str = "drafter"
    fingerprint: str | None = None      # tokenizer fingerprint, checked by the verifier
    supports_trees: bool = False        # whether propose_tree works
    supports_cross_vocab: bool = False  # whether next_logits works (CrossVocabDrafter can wrap it)

    @abc.abstractmethod
    def propose(self, committed: Sequence[int], gamma: int, settings: SamplingSettings, qmode: QMode,
                rng: np.random.Generator) -> Draft:
        """Up to `gamma` draft tokens following `committed`."""

    def propose_tree(self, committed: Sequence[int], shape: TreeShape, settings: SamplingSettings, qmode: QMode,
                     rng: np.random.Generator) -> TreeDraft:
        """A draft tree after `committed` (spec_core.tree.grow_tree: most probable frontier first)."""
        t0 = time.perf_counter()
        to_probs, encode = tree_sampling(settings, qmode)
        expand = self._tree_expander(committed)
        base = len(committed)

        def next_probs(nodes, tokens, parents):
            return np.stack([to_probs(row) for row in expand(nodes, tokens, parents)])

        def noise(depth: int):   # the gumbel coupling: children ranked by log q + g at their position
            return draft_noise(settings, base + depth, self._noise_ids())
        try:
            grown = grow_tree(next_probs, shape, rng, encode, noise if settings.gumbel else None)
        finally:
            self._tree_done()
        return TreeDraft(list(grown.tree.tokens), list(grown.tree.parents), grown.qs, time.perf_counter() - t0,
                         grown.draft_rows, grown.path_probs)

    def _tree_expander(self, committed: Sequence[int]):
        """(nodes, tokens, parents) -> raw draft logits after each node  # [len(nodes), vocab]."""
        raise NotImplementedError(f"the {self.name} drafter does not build trees; use --tree off")

    def _tree_done(self) -> None:
        pass

    def _noise_ids(self) -> np.ndarray | None:
        """This drafter's ids -> the target's, for the gumbel coupling's noise (None: the same ids)."""
        return None

    def next_logits(self, seq: Sequence[int]) -> np.ndarray:
        """Raw draft logits after `seq`  # [vocab]; what CrossVocabDrafter drafts from."""
        raise NotImplementedError(f"the {self.name} drafter cannot draft across vocabularies")

    def anchor_prompt(self, target_prompt: Sequence[int], draft_prompt: Sequence[int]) -> None:
        """The target's prompt ids stand for these draft ids (CrossVocabDrafter; others ignore it)."""

    def retokenization(self) -> ViewStats | None:
        """Across tokenizers: a copy of the draft view's counters (CrossVocabDrafter); None otherwise."""
        return None

    def observe(self, committed: Sequence[int], num_accepted: int) -> None:
        """Learn from a round's result (committed now holds the round's tokens)."""

    def close(self) -> None:
        pass


def _collect(tokens: list[int], qs: list[EncodedQ | None]) -> list[EncodedQ] | None:
    # A round's q payload is all-or-nothing: point masses everywhere or q everywhere.
    return None if not qs or any(q is None for q in qs) else qs  # type: ignore[return-value]


class GGUFDrafter(Drafter):
    """A small GGUF model on llama.cpp. Its KV cache is reused across rounds and rolled back to
    the committed prefix; only the last row's logits are computed per step (no logits_all)."""

    name = "gguf"

    supports_trees = True
    supports_cross_vocab = True

    def __init__(self, path, n_threads: int | None = None, n_ctx: int = 2048, max_tree_nodes: int = 0):
        """`path`: a GGUF file, or a GGUFModel already loaded that several drafters share (each
        has its own KV cache; the caller keeps the model and closes it)."""
        from llama_runtime import GGUFModel
        self._owns_model = not isinstance(path, GGUFModel)
        self.model = GGUFModel(path, n_threads=n_threads) if self._owns_model else path
        # Trees decode each expanded node once, in one batch per level, on scratch sequence ids.
        self.ctx = self.model.new_context(n_ctx, n_seq_max=max_tree_nodes + 1)
        self.max_tree_nodes = max_tree_nodes
        self.supports_trees = max_tree_nodes > 0   # made without scratch sequences: chains only
        self.fingerprint = self.model.fingerprint
        self.tokens_decoded = 0

    def next_logits(self, seq) -> np.ndarray:
        return self.ctx.logits(seq, 1)[0]

    def propose(self, committed, gamma, settings, qmode, rng) -> Draft:
        t0 = time.perf_counter()
        seq = list(committed)
        gamma = min(gamma, self.ctx.n_ctx - len(seq))
        tokens, qs = [], []
        for _ in range(gamma):
            logits = self.ctx.logits(seq, 1)[0]
            tok, q = draft_step(logits, settings, qmode, rng, draft_noise(settings, len(seq)))
            tokens.append(tok)
            qs.append(q)
            seq.append(tok)
        return Draft(tokens, _collect(tokens, qs), time.perf_counter() - t0)

    def _tree_expander(self, committed):
        if self.max_tree_nodes <= 0:
            raise ValueError("this GGUF drafter was made without tree support: pass max_tree_nodes")
        committed = list(committed)

        def expand(nodes, tokens, parents):
            out = []
            if ROOT in nodes:
                out.append(self.ctx.draft_tree_begin(committed))
            rest = [(n, parents[n], tokens[n]) for n in nodes if n != ROOT]
            if rest:
                out.extend(self.ctx.draft_tree_extend(rest))
            return out
        return expand

    def _tree_done(self) -> None:
        self.ctx.draft_tree_end()

    def close(self) -> None:
        self.ctx.close()
        if self._owns_model:
            self.model.close()


class PromptLookupDrafter(Drafter):
    """No model: propose the tokens that followed the latest earlier occurrence of the longest
    suffix n-gram (prompt lookup decoding). Drafts are point masses, which is exact."""

    name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, fingerprint: str | None = None):
        self.max_ngram, self.min_ngram, self.fingerprint = max_ngram, min_ngram, fingerprint

    def propose(self, committed, gamma, settings, qmode, rng) -> Draft:
        t0 = time.perf_counter()
        seq = list(committed)
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            tail = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):
                if seq[start: start + n] == tail:
                    follow = seq[start + n: start + n + gamma]
                    return Draft(follow, None, time.perf_counter() - t0)
        return Draft([], None, time.perf_counter() - t0)


class SyntheticDrafter(Drafter):
    """The draft half of spec_core.synthetic's pair, with an optional per-token cost (sleep)."""

    name = "synthetic"
    supports_cross_vocab = True

    def __init__(self, vocab: int = 64, seed: int = 0, noise: float = 1.0, order: int = 1,
                 per_token_ms: float = 0.0):
        from spec_core.synthetic import synthetic_fingerprint, synthetic_pair
        _, self.lm = synthetic_pair(vocab, seed, noise, order)
        self.per_token_s = per_token_ms / 1000
        self.fingerprint = synthetic_fingerprint(vocab)

    def next_logits(self, seq) -> np.ndarray:
        return self.lm.logits(seq)

    def propose(self, committed, gamma, settings, qmode, rng) -> Draft:
        t0 = time.perf_counter()
        seq = list(committed)
        tokens, qs = [], []
        for _ in range(gamma):
            tok, q = draft_step(self.lm.logits(seq), settings, qmode, rng, draft_noise(settings, len(seq)))
            tokens.append(tok)
            qs.append(q)
            seq.append(tok)
        if self.per_token_s:
            time.sleep(self.per_token_s * gamma)
        return Draft(tokens, _collect(tokens, qs), time.perf_counter() - t0)

    supports_trees = True

    def _tree_expander(self, committed):
        committed = list(committed)

        def expand(nodes, tokens, parents):
            tree = DraftTree(tuple(tokens), tuple(parents))
            rows = [self.lm.logits(committed + ([] if n == ROOT else [tokens[j] for j in tree.path_to(n)]))
                    for n in nodes]
            if self.per_token_s:
                time.sleep(self.per_token_s * len(nodes))  # a row costs what a chain token does
            return rows
        return expand


class CrossVocabDrafter(Drafter):
    """Drafts for a target with another tokenizer (token-level intersection, spec_core.crossvocab).

    Takes the committed TARGET ids, drafts with `inner` on the draft's own tokenization of the
    same text (DraftView: re-tokenizing only the tail from the last stable boundary; `inner`'s KV
    cache keeps the common prefix and rolls the rest back), restricts each step's logits to the
    draft tokens that are exactly one target token, and returns target ids with the q they were
    drawn from (translated to target ids). The verifier's round is unchanged, so the output is the
    target's distribution; chains, trees (propose_tree), point masses and pipelining go through.

    `tokenize_draft(data)`: the draft tokenizer on raw bytes (no BOS, special tokens not parsed).
    `token_map`: share one between wrappers of the same pair (building it takes a fraction of a second).
    One generation at a time per wrapper, like the draft's KV cache (a second one is still exact:
    its committed ids then do not start with the anchored prompt and are converted whole)."""

    name = "cross-vocab"
    spell_point_masses = True   # point-mass chains: the draft's argmax, spelled in target tokens (beyond TLI)

    def __init__(self, inner: Drafter, draft_vocab: Vocabulary, target_vocab: Vocabulary,
                 tokenize_draft: Callable[[bytes], list[int]], token_map: TokenMap | None = None, window: int = 4):
        self.inner = inner
        self.token_map = token_map or intersection_map(draft_vocab, target_vocab)
        if self.token_map.n_mapped == 0:
            raise ValueError("no draft token is exactly one target token: these vocabularies share nothing to draft")
        self.view = DraftView(target_vocab, draft_vocab, tokenize_draft, window)
        self.pieces = TargetPieces(target_vocab)
        self.fingerprint = target_vocab.fingerprint   # the ids it sends are the target's
        self.draft_fingerprint = inner.fingerprint
        self.supports_trees = inner.supports_trees

    def anchor_prompt(self, target_prompt, draft_prompt) -> None:
        self.view.anchor(target_prompt, draft_prompt)

    def retokenization(self) -> ViewStats:
        return dataclasses.replace(self.view.stats)

    def propose(self, committed, gamma, settings, qmode, rng) -> Draft:
        if self.spell_point_masses and (qmode.kind == "none" or settings.greedy):
            return self._propose_spelled(committed, gamma)
        t0 = time.perf_counter()
        seq = self.view.sync(committed).draft_ids
        tokens, qs = [], []
        for j in range(gamma):
            # The gumbel coupling's noise lives on target ids and target positions.
            noise = draft_noise(settings, len(committed) + j, self.token_map.draft_to_target)
            d, q = draft_step(restrict_logits(self.inner.next_logits(seq), self.token_map), settings, qmode, rng, noise)
            tokens.append(int(self.token_map.draft_to_target[d]))
            qs.append(None if q is None else to_target_q(q, self.token_map))
            seq.append(d)
        return Draft(tokens, _collect(tokens, qs), time.perf_counter() - t0)

    def _propose_spelled(self, committed, gamma) -> Draft:
        """Point masses beyond TLI: the draft's own argmax, spelled in target tokens when it is not
        one (spec_core.crossvocab.TargetPieces); a draft token with no spelling ends the draft."""
        t0 = time.perf_counter()
        seq = self.view.sync(committed).draft_ids
        tokens: list[int] = []
        while len(tokens) < gamma:
            d = int(np.argmax(self.inner.next_logits(seq)))
            t = int(self.token_map.draft_to_target[d])
            pieces = [t] if t >= 0 else self.pieces.spell(self.view.draft.token_bytes[d])
            if not pieces:
                break
            tokens.extend(pieces)
            seq.append(d)
        return Draft(tokens[:gamma], None, time.perf_counter() - t0)

    def propose_tree(self, committed, shape, settings, qmode, rng) -> TreeDraft:
        """The inner drafter's tree on restricted logits (draft ids), then translated node by node."""
        tree = super().propose_tree(committed, shape, settings, qmode, rng)
        m = self.token_map
        tree.tokens = [int(m.draft_to_target[d]) for d in tree.tokens]
        tree.qs = None if tree.qs is None else [to_target_q(q, m) for q in tree.qs]
        return tree

    def _tree_expander(self, committed):
        expand = self.inner._tree_expander(self.view.sync(committed).draft_ids)

        def restricted(nodes, tokens, parents):   # tokens: draft ids (grow_tree samples in the draft's space)
            return [restrict_logits(row, self.token_map) for row in expand(nodes, tokens, parents)]
        return restricted

    def _tree_done(self) -> None:
        self.inner._tree_done()

    def _noise_ids(self) -> np.ndarray:
        return self.token_map.draft_to_target

    def observe(self, committed, num_accepted) -> None:
        self.inner.observe(self.view.sync(committed).draft_ids, num_accepted)

    def close(self) -> None:
        self.inner.close()

"""The backend interface: what the engine asks of a target model for a round, and the base of the
backends that hand over raw logits.

`Backend` is the interface (a Protocol): open and release a session's state, run a round on a
draft tree (`verify_round`: the one entry for every round; a chain is a tree with one path),
sample one token (the cloud-only stream), and the vocabulary and prompts for text opens; plus
hooks with defaults for scheduling, steering and drains. What a backend can do is one value,
`Capabilities` (trees, batching, fusing, the vocabulary, limits), that the engine reads once.

`LogitsBackend` is the base of the backends that supply raw target logits (llama.cpp,
synthetic): its `verify_round` turns them into p with spec_core.warping and runs spec_core.tree's
one driver (`verify_tree_on_logits`, rows warped as the walk reaches them), so exactness lives in
one place (spec_core.acceptance); a round's fused continuations (spec_core.continuations) share its
pass. A backend whose maths work elsewhere (vLLM: from scores, or in its engine) implements
`verify_round` itself and says `fuses = False`: a continuation that hits runs as a second round
(`round_then_continuation`).
Methods are synchronous and called from a worker thread; a backend serialises its own model.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Protocol, Sequence

import numpy as np

from spec_core.continuations import fuse_tree, pick_continuation
from spec_core.crossvocab import Vocabulary
from spec_core.qcodec import EncodedQ
from spec_core.tree import DraftTree, TreeResult, verify_tree_on_logits
from spec_core.gumbel import target_token
from spec_core.warping import COUPLINGS, SamplingSettings, processed_probs, sample


# Nodes of one fused pass at most: a round's tree and its continuations (Limits: 64 + 16 keys +
# 256), below the llama.cpp backend's tree batch (n_batch, 512 by default).
MAX_FUSED_NODES = 400


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; the engine reads it once, at start."""

    trees: bool = True              # tree rounds (False: refused, the backend verifies chains only)
    batching: bool = False          # rounds of different sessions share target passes
    vocabulary: bool = False        # `vocabulary()` exports it and `prompt_ids` takes text prompts
    fuses: bool = True              # a round's continuations share its pass (else a hit runs as a second round)
    max_tree_leaves: int | None = None       # leaves one tree pass may hold (None: no limit here)
    max_fused_nodes: int = MAX_FUSED_NODES   # nodes one fused pass may hold
    max_states: int | None = None   # sessions + Generate streams held at once (None: only the engine's limits)
    # How it checks drafts (spec_core.warping.COUPLINGS; ServerInfo.couplings): LogitsBackend runs both
    # through spec_core.tree; a backend with its own verify_round lists what it implements.
    couplings: tuple[str, ...] = COUPLINGS


@dataclass(frozen=True)
class BackendInfo:
    name: str                 # "llama.cpp", "vllm", "synthetic"
    model: str                # file or folder name
    n_vocab: int
    n_ctx: int                # context window per session
    fingerprint: str          # spec_core.fingerprint of the target tokenizer
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)


class FusedContinuation(NamedTuple):
    """A next round drafted after one outcome of this round (spec_core.continuations)."""

    key: tuple[int, ...]               # what it assumes this round commits (kept path + one token)
    tree: DraftTree                    # its draft (a chain: one path), already cut to its context room
    draft_probs: Sequence[EncodedQ | None] | None   # [n] or None: point masses


class ContinuationRun(NamedTuple):
    """The continuation whose key this round committed, verified on the same pass's rows."""

    index: int                         # into the continuations given
    result: TreeResult


class BackendRound(NamedTuple):
    """A verified round and where its time went."""

    result: TreeResult                 # the kept path (a chain: its accepted prefix) and the next token
    queue_s: float                     # waiting for the model (its lock, or a batched pass)
    model_s: float                     # in the model
    following: ContinuationRun | None = None   # the next round, when a continuation hit


class BackendSample(NamedTuple):
    """One token sampled from the target (the cloud-only stream) and where its time went."""

    token: int
    queue_s: float
    model_s: float


class NoFreeState(Exception):
    """`new_state` found no room (every KV slot is held); the engine may evict an idle session."""


class NoChatTemplate(ValueError):
    """The target has no chat template (its own or a built-in one): chat messages cannot be rendered."""


class StateLost(Exception):
    """A session's state is gone and the backend cannot rebuild it now (e.g. its parked KV found no
    place in the cache in time): the engine drops the session and the edge replays (NOT_FOUND)."""


class Backend(Protocol):
    """What the engine asks of a target model. Backends subclass it for the hooks' defaults."""

    info: BackendInfo
    caps: Capabilities

    @abc.abstractmethod
    def new_state(self) -> object:
        """Per-session state (a KV cache); may be created lazily and is released with `release`.
        NoFreeState when the backend holds no more."""

    def release(self, state: object) -> None:
        """Free what `new_state` made."""

    @abc.abstractmethod
    def verify_round(self, state: object, committed: Sequence[int], tree: DraftTree,
                     draft_probs: Sequence[EncodedQ | None] | None, settings: SamplingSettings,
                     rng: np.random.Generator, continuations: Sequence[FusedContinuation] = (),
                     next_rng: Callable[[int], np.random.Generator] | None = None) -> BackendRound:
        """The one entry for every round: a draft tree (a chain is a tree with one path) after
        `committed`, each node with the q it was drawn from  # draft_probs: [n] or None.
        Returns BackendRound(TreeResult(kept path, corrected or bonus token), queue_s, model_s).

        With `continuations` (the next round drafted after outcomes of this one): when this round
        commits exactly one's key, that one is verified too, with next_rng(committed length after
        this round) for its draws (never `rng`), and returned as `following`: in this round's pass
        when the backend fuses (caps.fuses), else as a second round (round_then_continuation)."""

    @abc.abstractmethod
    def sample_next(self, state: object, tokens: Sequence[int], settings: SamplingSettings,
                    rng: np.random.Generator) -> BackendSample:
        """One token after `tokens`, drawn from the target's processed p (the cloud-only stream)."""

    # --- text prompts (edges whose draft has another tokenizer) -------------------------------------

    def vocabulary(self) -> Vocabulary | None:
        """The target's vocabulary for GetVocabulary; None: this backend cannot export it (then it
        takes no text prompts either)."""
        return None

    def chat_prompts(self) -> bool:
        """Whether `prompt_ids` can render chat messages."""
        return False

    def prompt_ids(self, text: str | None, messages: Sequence[dict[str, str]] | None) -> list[int]:
        """The target's ids for a text prompt (BOS as the model wants, special tokens parsed) or a
        conversation (chat template, assistant turn opened). NoChatTemplate, or ValueError for
        messages the template refuses."""
        raise NotImplementedError(f"the {self.info.name} backend takes token ids only")

    def set_deadline(self, state: object, deadline: float | None) -> None:
        """When this state's next request is due (time.perf_counter() seconds), for a batching
        backend that orders its passes by slack; others ignore it."""

    def note_open(self, state: object, replay: bool, tpot_s: float | None) -> None:
        """A session opens on `state` (live rounds first, cloud_verifier.backends.prefill_budget): a
        replay's prefill goes ahead of new sessions'; `tpot_s` (its SLO's time per output token, or
        None) paces the prefills that share passes with it. A backend without a batcher ignores it."""

    def prefill_rate(self) -> float | None:
        """Prefill tokens a second a new session gets here now, from the measured pass cost and the
        prefill budget (cloud_verifier.first_token predicts first tokens with it); None: not known."""
        return None

    def pass_cost(self) -> tuple[float, float] | None:
        """(base_s, per_token_s) of a shared target pass as measured lately, for the draft budget
        (spec_core.steering); None when this backend does not batch rounds."""
        return None

    def forward_tokens(self) -> int:
        """Tokens pushed through the target so far (for cost-per-token figures)."""
        return 0

    def close(self) -> None:
        """Free the model and everything the backend holds."""

    def release_frees_room(self, state: object) -> bool:
        """Whether releasing `state` would let `new_state` succeed where it found no room
        (NoFreeState): the engine evicts only such an idle session. False e.g. for a session whose
        KV cells are parked in host memory (cloud_verifier.backends.kvpark) while no place is free."""
        return True

    def checkpoint(self, state: object) -> None:
        """Write `state`'s KV checkpoint to the session KV store now, and keep it when the state is
        released (a drain hands the session to a replica that restores it). A backend without a
        store (`--kv-store`) does nothing."""

    def checkpoint_all(self, states: "Sequence[object] | None" = None) -> None:
        """`checkpoint` these sessions' states, or every live session's (a drain): their files stay
        after release."""


def round_then_continuation(verify_round, n_ctx: int, state, committed: list[int], tree: DraftTree, draft_probs,
                            settings: SamplingSettings, rng: np.random.Generator,
                            continuations: Sequence[FusedContinuation],
                            next_rng: Callable[[int], np.random.Generator]) -> BackendRound:
    """A round with continuations on a backend that does not fuse: the round, then the continuation
    whose key it committed (if any, and if it fits the context) as a second round on the same state."""
    out = verify_round(state, committed, tree, draft_probs, settings, rng)
    kept = [tree.tokens[i] for i in out.result.path] + [out.result.next_token]
    hit = pick_continuation(kept, 0, [c.key for c in continuations])
    if hit is None:
        return out
    c = continuations[hit]
    base = committed + list(c.key)
    if len(base) + 1 > n_ctx:
        return out
    nxt = verify_round(state, base, c.tree, c.draft_probs, settings, next_rng(len(base)))
    return BackendRound(out.result, out.queue_s + nxt.queue_s, out.model_s + nxt.model_s,
                        ContinuationRun(hit, nxt.result))


class LogitsBackend(Backend):
    """A backend that supplies raw target logits (`target_logits`, `tree_logits`); the round's maths
    run here on the host, with spec_core's numpy driver."""

    @abc.abstractmethod
    def target_logits(self, state: object, tokens: Sequence[int], rows: int) -> tuple[np.ndarray, float, float]:
        """Raw logits predicting tokens[-rows+1:] and the next one  # [rows, vocab].

        Returns (logits, queue_s, model_s): time spent waiting for the model and in it.
        """

    def tree_logits(self, state: object, committed: Sequence[int], tree: DraftTree) -> tuple[np.ndarray, float, float]:
        """Raw logits after the committed sequence and after every node  # [n + 1, vocab]: row 0 predicts
        the root's children, row i + 1 node i's. This default runs one chain per root-to-leaf path
        (correct, not fast); backends that can verify a tree in one pass override it."""
        rows = np.empty((len(tree) + 1, self.info.n_vocab), dtype=np.float32)
        queue_s = model_s = 0.0
        leaves = tree.leaves() or [None]
        for leaf in leaves:
            path = [] if leaf is None else tree.path_to(leaf)
            logits, q_s, m_s = self.target_logits(state, list(committed) + [tree.tokens[i] for i in path], len(path) + 1)
            queue_s, model_s = queue_s + q_s, model_s + m_s
            rows[0] = logits[0]
            for k, node in enumerate(path):
                rows[node + 1] = logits[k + 1]
        return rows, queue_s, model_s

    def keep_tree_path(self, state: object, committed: Sequence[int], tree: DraftTree, path: Sequence[int]) -> None:
        """After a tree round: leave only committed + the kept path's tokens in the state's cache."""

    def accept(self, logits: np.ndarray, tree: DraftTree, draft_probs: Sequence[EncodedQ | None] | None,
               settings: SamplingSettings, rng: np.random.Generator, position: int | None = None) -> TreeResult:
        """The round rule on raw target rows  # logits: [n + 1, vocab], row 0 after the committed
        sequence, row i + 1 after node i (spec_core.tree.verify_tree_on_logits); `position`: the
        committed length row 0 follows (the gumbel coupling's noise is keyed by it)."""
        return verify_tree_on_logits(logits, settings, tree, draft_probs, rng, position)

    def verify_round(self, state: object, committed: Sequence[int], tree: DraftTree,
                     draft_probs: Sequence[EncodedQ | None] | None, settings: SamplingSettings,
                     rng: np.random.Generator, continuations: Sequence[FusedContinuation] = (),
                     next_rng: Callable[[int], np.random.Generator] | None = None) -> BackendRound:
        """Backend.verify_round on this backend's logits: one pass over the tree (with the fused
        continuations' nodes), or for a chain without continuations its rows after committed +
        drafts (`target_logits`: no tree bookkeeping in the cache)."""
        committed = list(committed)
        if continuations and not self.caps.fuses:
            assert next_rng is not None
            return round_then_continuation(self.verify_round, self.info.n_ctx, state, committed, tree, draft_probs,
                                           settings, rng, continuations, next_rng)
        if not continuations and tree.is_chain:
            logits, queue_s, model_s = self.target_logits(state, committed + list(tree.tokens), len(tree) + 1)
            return BackendRound(self.accept(logits, tree, draft_probs, settings, rng, len(committed)), queue_s, model_s)
        fused = fuse_tree(tree, [c.key for c in continuations], [c.tree for c in continuations],
                          self._fits(len(committed))) if continuations else None
        logits, queue_s, model_s = self.tree_logits(state, committed, fused.tree if fused else tree)  # [n' + 1, vocab]
        result = self.accept(logits[: len(tree) + 1], tree, draft_probs, settings, rng, len(committed))
        path, following = list(result.path), None
        if fused is not None:
            kept = [tree.tokens[i] for i in result.path] + [result.next_token]
            placed = [c.key if at is not None else () for c, at in zip(continuations, fused.placements)]
            hit = pick_continuation(kept, 0, placed)
            if hit is not None:
                assert next_rng is not None
                c, at = continuations[hit], fused.placements[hit]
                rows = logits[fused.continuation_rows(hit, len(c.tree))]
                nxt = self.accept(rows, c.tree, c.draft_probs, settings, next_rng(len(committed) + len(c.key)),
                                  len(committed) + len(c.key))
                following = ContinuationRun(hit, nxt)
                path += [at.key_node] + [at.offset + i for i in nxt.path]
        self.keep_tree_path(state, committed, fused.tree if fused else tree, path)
        return BackendRound(result, queue_s, model_s, following)

    def _fits(self, n_committed: int) -> Callable[[DraftTree], bool]:
        """Whether a fused tree fits one pass: the context (a serial tree pass holds every node in
        it) and the caps' node and leaf limits."""
        room, caps = self.info.n_ctx - n_committed, self.caps

        def fits(t: DraftTree) -> bool:
            return len(t) < min(room, caps.max_fused_nodes) and \
                (caps.max_tree_leaves is None or len(t.leaves()) <= caps.max_tree_leaves)
        return fits

    def sample_next(self, state: object, tokens: Sequence[int], settings: SamplingSettings,
                    rng: np.random.Generator) -> BackendSample:
        logits, queue_s, model_s = self.target_logits(state, tokens, 1)
        probs = processed_probs(logits[0], settings.temperature, settings.top_k, settings.top_p)
        # The gumbel coupling: the target's own Gumbel-max token at this position (spec_core.gumbel).
        token = target_token(probs, settings.seed, len(tokens)) if settings.gumbel else sample(probs, rng)
        return BackendSample(token, queue_s, model_s)

"""The backend interface: per-session state and the target's logits at the rows a round needs.

A backend supplies raw target logits; `verify_round`, the one entry the engine calls for every
round (a chain is a tree with one path), turns them into p with spec_core.warping and runs the
chain or tree kernel of spec_core.verify / spec_core.tree, so exactness lives in one place
(spec_core.acceptance). A backend that cannot return full logits cheaply (vLLM) overrides the
kernels `verify` / `verify_tree` / `sample_next` and runs the same rule from scores
(spec_core.verify.verify_from_scores, spec_core.tree.verify_tree_from_scores), and says `fuses = False`:
a round's fused continuations (spec_core.continuations) otherwise share its pass through
`tree_logits` and the host kernels, bypassing overridden `verify` / `verify_tree`.
Methods are synchronous and called from a worker thread; a backend serialises its own model.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import numpy as np

from spec_core.continuations import fuse_tree, pick_continuation
from spec_core.crossvocab import Vocabulary
from spec_core.qcodec import EncodedQ
from spec_core.tree import DraftTree, TreeResult, verify_tree
from spec_core.verify import RoundResult, verify_round_on_logits
from spec_core.warping import SamplingSettings, processed_probs, sample


# Nodes of one fused pass at most: a round's tree and its continuations (Limits: 64 + 16 keys +
# 256), below the llama.cpp backend's tree batch (n_batch, 512 by default).
MAX_FUSED_NODES = 400


def rule_on_logits(logits: np.ndarray, tree: DraftTree, draft_probs: Sequence[EncodedQ | None] | None,
                   settings: SamplingSettings, rng: np.random.Generator) -> TreeResult:
    """The round rule on raw target rows  # logits: [n + 1, vocab], row 0 after the committed
    sequence, row i + 1 after node i. A chain takes the chain kernel (rows warped as the round
    reaches them), as `verify` does, so it draws exactly what an unfused round draws."""
    if tree.is_chain:
        r = verify_round_on_logits(logits, settings, list(tree.tokens), draft_probs, rng)
        return TreeResult(list(range(r.num_accepted)), r.next_token)
    return verify_tree(processed_probs(logits, settings.temperature, settings.top_k, settings.top_p), tree,
                       draft_probs, rng)


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

    result: RoundResult | TreeResult   # a chain's (verify) or a tree's (verify_tree)
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


class Backend(abc.ABC):
    info: BackendInfo
    # Sessions + Generate streams the backend can hold at once; None: only the engine's limits.
    max_states: int | None = None
    supports_trees: bool = True  # False: tree rounds are refused (the backend verifies chains only)
    batching: bool = False       # True: rounds of different sessions share target passes
    has_vocabulary: bool = False  # True: `vocabulary()` exports it and `prompt_ids` takes text prompts

    @abc.abstractmethod
    def new_state(self) -> object:
        """Per-session state (a KV cache); may be created lazily and is released with `release`."""

    def release(self, state: object) -> None:
        """Free what `new_state` made."""

    @abc.abstractmethod
    def target_logits(self, state: object, tokens: Sequence[int], rows: int) -> tuple[np.ndarray, float, float]:
        """Raw logits predicting tokens[-rows+1:] and the next one  # [rows, vocab].

        Returns (logits, queue_s, model_s): time spent waiting for the model and in it.
        """

    def verify_round(self, state: object, committed: Sequence[int], tree: DraftTree,
                     draft_probs: Sequence[EncodedQ | None] | None, settings: SamplingSettings,
                     rng: np.random.Generator, continuations: Sequence[FusedContinuation] = (),
                     next_rng: Callable[[int], np.random.Generator] | None = None) -> BackendRound:
        """The one entry the engine calls for every round: a draft tree (a chain is a tree with one
        path) after `committed`, each node with the q it was drawn from  # draft_probs: [n] or None.
        Returns BackendRound(TreeResult(kept path, corrected or bonus token), queue_s, model_s).
        A chain takes the chain kernel (`verify`: p warped only as far as the round reads it, one
        row per draft); anything else the tree kernel (`verify_tree`). Both run the same rule
        (spec_core.acceptance); backends override the kernels, not this.

        With `continuations` (the next round drafted after outcomes of this one): when this round
        commits exactly one's key, that one is verified too, with next_rng(committed length after
        this round) for its draws (never `rng`), and returned as `following`. A backend that
        `fuses` evaluates them in this round's pass (spec_core.continuations.fuse_tree); one that
        does not runs the one that hit as a second round right after."""
        if continuations:
            assert next_rng is not None
            run = self._fused_round if self.fuses else self._round_then_continuation
            return run(state, list(committed), tree, draft_probs, settings, rng, continuations, next_rng)
        if not tree.is_chain:
            return self.verify_tree(state, committed, tree, draft_probs, settings, rng)
        out = self.verify(state, committed, list(tree.tokens), draft_probs, settings, rng)
        return out._replace(result=TreeResult(list(range(out.result.num_accepted)), out.result.next_token))

    # True: continuations share this round's pass (tree_logits on the fused tree and the rules on
    # host rows). A backend whose kernels work from scores (vLLM) says False.
    fuses: bool = True
    max_tree_leaves: int | None = None   # leaves one tree pass may hold (None: no limit here)
    max_fused_nodes: int = MAX_FUSED_NODES   # nodes one fused pass may hold

    def _fused_round(self, state, committed: list[int], tree: DraftTree, draft_probs, settings: SamplingSettings,
                     rng: np.random.Generator, continuations: Sequence[FusedContinuation],
                     next_rng: Callable[[int], np.random.Generator]) -> BackendRound:
        room = self.info.n_ctx - len(committed)   # a serial tree pass holds every node in the context

        def fits(t: DraftTree) -> bool:
            return len(t) < min(room, self.max_fused_nodes) and \
                (self.max_tree_leaves is None or len(t.leaves()) <= self.max_tree_leaves)
        fused = fuse_tree(tree, [c.key for c in continuations], [c.tree for c in continuations], fits)
        logits, queue_s, model_s = self.tree_logits(state, committed, fused.tree)   # [n_fused + 1, vocab]
        result = rule_on_logits(logits[: len(tree) + 1], tree, draft_probs, settings, rng)
        kept = [tree.tokens[i] for i in result.path] + [result.next_token]
        placed = [c.key if at is not None else () for c, at in zip(continuations, fused.placements)]
        hit = pick_continuation(kept, 0, placed)
        path = list(result.path)
        following = None
        if hit is not None:
            c, at = continuations[hit], fused.placements[hit]
            rows = logits[fused.continuation_rows(hit, len(c.tree))]
            nxt = rule_on_logits(rows, c.tree, c.draft_probs, settings, next_rng(len(committed) + len(c.key)))
            following = ContinuationRun(hit, nxt)
            path += [at.key_node] + [at.offset + i for i in nxt.path]
        self.keep_tree_path(state, committed, fused.tree, path)
        return BackendRound(result, queue_s, model_s, following)

    def _round_then_continuation(self, state, committed: list[int], tree: DraftTree, draft_probs,
                                 settings: SamplingSettings, rng: np.random.Generator,
                                 continuations: Sequence[FusedContinuation],
                                 next_rng: Callable[[int], np.random.Generator]) -> BackendRound:
        out = self.verify_round(state, committed, tree, draft_probs, settings, rng)
        kept = [tree.tokens[i] for i in out.result.path] + [out.result.next_token]
        hit = pick_continuation(kept, 0, [c.key for c in continuations])
        if hit is None:
            return out
        c = continuations[hit]
        base = committed + list(c.key)
        if len(base) + 1 > self.info.n_ctx:
            return out
        nxt = self.verify_round(state, base, c.tree, c.draft_probs, settings, next_rng(len(base)))
        return BackendRound(out.result, out.queue_s + nxt.queue_s, out.model_s + nxt.model_s,
                            ContinuationRun(hit, nxt.result))

    def verify(self, state: object, committed: Sequence[int], draft_tokens: Sequence[int],
               draft_probs: Sequence[EncodedQ | None] | None, settings: SamplingSettings,
               rng: np.random.Generator) -> BackendRound:
        gamma = len(draft_tokens)
        logits, queue_s, model_s = self.target_logits(state, list(committed) + list(draft_tokens), gamma + 1)
        # p is warped row by row as the round reaches it (rows after a rejection are not needed).
        return BackendRound(verify_round_on_logits(logits, settings, draft_tokens, draft_probs, rng), queue_s, model_s)

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

    def verify_tree(self, state: object, committed: Sequence[int], tree: DraftTree,
                    draft_probs: Sequence[EncodedQ | None] | None, settings: SamplingSettings,
                    rng: np.random.Generator) -> BackendRound:
        logits, queue_s, model_s = self.tree_logits(state, committed, tree)
        target_probs = processed_probs(logits, settings.temperature, settings.top_k, settings.top_p)  # [n+1, V]
        result = verify_tree(target_probs, tree, draft_probs, rng)
        self.keep_tree_path(state, committed, tree, result.path)
        return BackendRound(result, queue_s, model_s)

    def sample_next(self, state: object, tokens: Sequence[int], settings: SamplingSettings,
                    rng: np.random.Generator) -> BackendSample:
        logits, queue_s, model_s = self.target_logits(state, tokens, 1)
        probs = processed_probs(logits[0], settings.temperature, settings.top_k, settings.top_p)
        return BackendSample(sample(probs, rng), queue_s, model_s)

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
        pass

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

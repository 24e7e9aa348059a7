"""eval-draft: how good a draft is for a target, and what it would buy on a weak link.

Glossary (used in names below):
  continuation   tokens the *target* generated after a prompt; drafts are scored on them.
  teacher-forced both models read prompt + continuation in one batch (one llama_decode call
                 per 512 tokens) and give logits for every continuation position; the draft
                 never sees its own mistakes, as in a real round after each correction.
  acceptance α_T mean over positions of sum_x min(p_T(x), q_T(x)), where p_T / q_T are the
                 target's / draft's processed distributions at temperature T
                 (spec_core.warping.processed_probs). It is the exact expected acceptance
                 probability of one speculative-sampling step (Leviathan et al. 2023, sec. 3),
                 computed from the distributions, not estimated by sampling. At T = 0 both are
                 point masses, so α_0 = greedy agreement (share of positions where the draft's
                 argmax equals the target's argmax).

How continuations are made (`continuation=`):
  "sampled" (default)  for T = 0 the target's greedy continuation; for T > 0 a continuation the
                       target sampled at that T (seeded). α_T is then measured on the contexts
                       that decoding at T actually visits.
  "greedy"             one greedy continuation, used for every T (a third of the target's
                       decoding work; slightly optimistic for T > 0, since greedy text is the
                       most predictable text).
A continuation stops early at an end-of-generation token (which is scored too).

Across tokenizers (a draft whose fingerprint differs from the target's, e.g. SmolLM2 drafting for
Gemma 3): token-level intersection (TLI; Timor et al., ICML 2025) with spec_core.crossvocab, as
the edge drafts. The draft reads the prompt in its own chat template and the target's continuation
through its DraftView (target ids -> bytes -> draft ids, re-tokenized from the stable boundary
after every token); its logits are restricted to the intersection before warping and the q moved
onto target ids (`CrossVocab.target_probs`); α_T = sum_x min(p_T(x), q_TLI(x)) as above, and at
T = 0 the restricted argmax against the target's. The report adds `vocabulary`:
  draft_strings    distinct non-empty token strings (bytes) of the draft, special tokens left out
  shared_strings   of those, the ones that are also a target token's string; share = their ratio
  mapped_tokens    draft ids in the one-to-one map (what TLI can propose)
  rolled_back_per_sync  draft tokens the view drops per sync (KV rolled back, re-tokenized)
  coverage{T}      share of the target's generated tokens (the scored positions) in the map: the
                   most TLI could ever accept, also per category

Speed: decode tokens/s is one token per llama_decode call after a prompt, as a drafter runs,
median of `speed_repeats` runs, for 1 and 2 threads, the target and the drafts taking turns in
each repeat. Verify cost is *measured*: the target's
time to check a round of k = γ+1 tokens (logits for all k rows, KV rolled back between runs)
with `verify_threads` threads, k = 1..max_gamma+1, median of repeats, then a least-squares line
t(k) = a + b·k gives RoundCosts(t_verify_base_s = a + b, t_verify_per_token_s = b).

Figure of merit (`hybrid`): expected hybrid tokens/s on a link (LinkFigures; default netsim's "3g":
300 ms RTT, 700 kbit/s uplink) at T = fom_temperature (0.7), maximised over γ with
spec_core.costmodel.best_gamma. Per round: γ·t_draft (1 thread: the demo's edge) + RTT + γ·bytes
per draft token / uplink rate + t_verify(γ). Bytes per draft token is the size of the q payload
(fixed-point top-16, the CLI default) encoded from the draft's own distributions plus the token
id. Loss and jitter are left out: the figure ranks drafts; netsim measures the real thing.

JSON report keys (`EvalReport.to_json()`):
  target, draft                {path, name, fingerprint}
  settings                     {max_new_tokens, continuation, temperatures, seed, threads, prompts_file}
  overall                      {prompts, positions{T}, alpha{T}, greedy_agreement[, coverage{T}]}
  categories                   {category: {prompts, positions{T}, alpha{T}[, coverage{T}]}}
  vocabulary                   null (same tokenizer), or {cross_vocabulary: true, method: "TLI",
                                target_tokens, draft_tokens, draft_strings, shared_strings,
                                share, mapped_tokens, rolled_back_per_sync}
  per_prompt                   [{category, prompt_tokens, positions{T}, alpha{T}}]
  expected_tokens_per_round    {T: {γ: (1 − α^(γ+1)) / (1 − α)} for γ = 1..8} (flat α: an estimate)
  chain                        {T: {reach: {γ: [P(accepted >= k)]}, tokens_per_step: {γ: τ}, committed_per_step}}:
                               the acceptance curve of a chain of γ drafts walked over the continuations
                               (edge_client/draftmaker/chain.py), pooled and per category (`chain_by_category`)
  ngram                        the same at T = 0 for vLLM's n-gram proposer (prompt lookup, n 2..4) on the
                               target's greedy text, with `proposed_share` (steps that found a match);
                               per category in `ngram_by_category`
  speed                        {draft: {threads: tok/s}, target: {threads: tok/s}, tokens, repeats} or null
  verify                       {threads, seconds_by_rows{k}, base_s, per_token_s, method} or null
  hybrid                       {link, rtt_s, uplink_bytes_per_s, bytes_per_draft_token, temperature,
                                alpha, draft_threads, t_draft_s, best_gamma, tokens_per_s,
                                tokens_per_s_by_gamma{γ}, cloud_only_tokens_per_s} or null
  elapsed_s
T keys are formatted with "%g" ("0", "0.7", "1"); γ and thread keys are strings.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import numpy as np

from edge_client.draftmaker.chain import ChainTally, score_chain, score_lookup
from spec_core.costmodel import RoundCosts, best_gamma, expected_tokens_per_round
from spec_core.warping import is_greedy, processed_probs, sample

log = logging.getLogger(__name__)

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "prompts"
DEFAULT_PROMPTS = PROMPTS_DIR / "eval.jsonl"
CALIBRATION_PROMPTS = PROMPTS_DIR / "calibration.jsonl"
DEFAULT_TEMPERATURES = (0.0, 0.7, 1.0)
GAMMAS = range(1, 9)
TOKEN_ID_BYTES = 3  # a draft token id as a protobuf varint (ids < 2^21)

Progress = Callable[[str], None]


def tkey(temperature: float) -> str:
    return f"{temperature:g}"


@dataclass(frozen=True)
class Prompt:
    category: str
    text: str
    system: str | None = None


def load_prompts(path: str | os.PathLike | None = None) -> list[Prompt]:
    """JSON lines: {"category": ..., "prompt": ..., "system": optional}."""
    path = Path(path) if path else DEFAULT_PROMPTS
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                out.append(Prompt(str(rec["category"]), str(rec["prompt"]), rec.get("system")))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: expected a JSON object with 'category' and 'prompt' ({e})") from e
    if not out:
        raise ValueError(f"{path} holds no prompts")
    return out


def prompt_ids(model, prompt: Prompt) -> list[int]:
    """The model's chat template when it has one (its GGUF's, else llama.cpp's built-in one for its
    architecture, as for Gemma 3), else the plain text."""
    from llama_runtime.chat import has_chat_template
    if has_chat_template(model):
        from edge_client.text import render_chat
        return render_chat(model, prompt.text, prompt.system)
    return model.tokenize(prompt.text, add_special=True)


def target_continuation(ctx, ids: Sequence[int], n_tokens: int, temperature: float,
                        rng: np.random.Generator, stop_ids: frozenset[int]) -> list[int]:
    """The target's own next `n_tokens` (greedy at T = 0, else sampled), one token per decode."""
    seq, out = list(ids), []
    for _ in range(n_tokens):
        logits = ctx.logits(seq, 1)[0]
        tok = int(np.argmax(logits)) if is_greedy(temperature) else sample(processed_probs(logits, temperature), rng)
        out.append(tok)
        seq.append(tok)
        if tok in stop_ids:
            break
    return out


def teacher_forced_logits(ctx, ids: Sequence[int], continuation: Sequence[int]) -> np.ndarray:
    """Logits predicting each continuation token, from one batched pass  # [len(cont), vocab]

    The cache is cleared first so that the draft and the target compute every position the same
    way (a model scored against itself then agrees exactly).
    """
    ctx.reset()
    return ctx.logits(list(ids) + list(continuation[:-1]), rows=len(continuation))


def acceptance(target_logits: np.ndarray, draft_logits: np.ndarray, temperature: float) -> np.ndarray:
    """sum_x min(p_T, q_T) per row  # [rows, vocab] x2 -> [rows]"""
    if is_greedy(temperature):
        return (np.argmax(target_logits, axis=-1) == np.argmax(draft_logits, axis=-1)).astype(np.float64)
    target_probs = processed_probs(target_logits, temperature)
    draft_probs = processed_probs(draft_logits, temperature)
    return np.minimum(target_probs, draft_probs).sum(axis=-1)


# --- across tokenizers ---------------------------------------------------------------------------

def token_strings(model) -> list[bytes]:
    """Every token's bytes as the text would hold them (b"" for control tokens)  # [vocab]"""
    return [model.token_bytes(i) for i in range(model.n_vocab)]


class VocabOverlap(NamedTuple):
    target_tokens: int
    draft_tokens: int
    draft_strings: int    # distinct non-empty draft token strings
    shared_strings: int   # of them, also a target token's string
    mapped_tokens: int    # draft ids whose string is exactly one target token (one to one in CrossVocab)

    @property
    def share(self) -> float:
        return self.shared_strings / self.draft_strings if self.draft_strings else 0.0

    def to_json(self) -> dict:
        return {"cross_vocabulary": True, "method": "TLI", **self._asdict(), "share": self.share}


def vocab_overlap(target_strings: Sequence[bytes], draft_strings: Sequence[bytes]) -> VocabOverlap:
    target_set = {b for b in target_strings if b}
    draft_set = {b for b in draft_strings if b}
    return VocabOverlap(len(target_strings), len(draft_strings), len(draft_set), len(draft_set & target_set),
                        sum(1 for b in draft_strings if b and b in target_set))


class CrossVocab:
    """What the edge does with a draft of another tokenizer, for scoring: spec_core.crossvocab's
    one-to-one TLI map (`token_map`), its restricted q moved onto target ids, and the draft's view
    of the committed text (`DraftView`: the target's prompt anchored to the draft's own rendering of
    it, generated target ids -> bytes -> draft ids, re-tokenized from the stable boundary)."""

    def __init__(self, target, draft):
        from spec_core.crossvocab import intersection_map
        self.target, self.draft = target, draft
        self.target_vocab, self.draft_vocab = target.vocabulary, draft.vocabulary
        self.token_map = intersection_map(self.draft_vocab, self.target_vocab)
        self.overlap = vocab_overlap(self.target_vocab.token_bytes, self.draft_vocab.token_bytes)._replace(
            mapped_tokens=self.token_map.n_mapped)
        self.mapped = np.flatnonzero(self.token_map.draft_mask)                 # [mapped] draft ids
        self.mapped_targets = self.token_map.draft_to_target[self.mapped]       # [mapped] their target ids
        self.target_has = self.token_map.target_to_draft >= 0                   # [target vocab] bool
        self.rolled_back = self.syncs = 0

    def view(self, target_prompt: Sequence[int], draft_prompt: Sequence[int]):
        from spec_core.crossvocab import DraftView
        tokenize = getattr(self.draft, "tokenize_bytes", None) or \
            (lambda data: self.draft.tokenize(data.decode("utf-8", "replace"), add_special=False, parse_special=False))
        view = DraftView(self.target_vocab, self.draft_vocab, tokenize)
        view.anchor(target_prompt, draft_prompt)
        return view

    def target_probs(self, draft_logits: np.ndarray, temperature: float) -> np.ndarray:
        """The draft's processed q on the intersection (its warping run on the restricted logits,
        as the edge does), on target ids  # [Vd] -> [Vt]"""
        from spec_core.crossvocab import restrict_logits
        out = np.zeros(self.target_vocab.n_vocab)
        if len(self.mapped):
            out[self.mapped_targets] = processed_probs(restrict_logits(draft_logits, self.token_map),
                                                       temperature)[self.mapped]
        return out

    def greedy(self, draft_logits: np.ndarray) -> int:
        """The draft's argmax among the mapped tokens, as a target id."""
        return int(self.mapped_targets[np.argmax(draft_logits[self.mapped])])


def cross_draft_logits(ctx, cross: CrossVocab, target_prompt: Sequence[int], draft_prompt: Sequence[int],
                       continuation: Sequence[int]) -> np.ndarray:
    """The draft's next-token logits before each continuation token, reading the committed text in
    its own tokens (the edge's DraftView, synced after every token as after a commit; the KV cache
    keeps the common prefix)  # [len(cont), draft vocab]"""
    view = cross.view(target_prompt, draft_prompt)
    rows = [ctx.logits(view.sync(list(target_prompt) + list(continuation[:i])).draft_ids, 1)[0]
            for i in range(len(continuation))]
    cross.rolled_back += view.stats.rolled_back
    cross.syncs += view.stats.syncs
    return np.stack(rows) if rows else np.zeros((0, cross.draft_vocab.n_vocab), dtype=np.float32)


def cross_acceptance(target_logits: np.ndarray, draft_logits: np.ndarray, temperature: float,
                     cross: CrossVocab, keep_q: int = 0) -> tuple[np.ndarray, np.ndarray | None]:
    """Per row: sum_x min(p_T, q_TLI); and q_TLI of the first `keep_q` rows (the payload's size)
    # [rows, Vt], [rows, Vd] -> [rows], [≤keep_q, Vt]"""
    if is_greedy(temperature):
        values = [float(cross.greedy(d) == int(np.argmax(t))) for t, d in zip(target_logits, draft_logits)]
        return np.array(values, dtype=np.float64), None
    values, kept = [], []
    for t_row, d_row in zip(target_logits, draft_logits):  # a row at a time: Gemma's rows are 262,144 wide
        q = cross.target_probs(d_row, temperature)
        values.append(float(np.minimum(processed_probs(t_row, temperature), q).sum()))
        if len(kept) < keep_q:
            kept.append(q)
    return np.array(values, dtype=np.float64), (np.stack(kept) if kept else None)


# --- speed ---------------------------------------------------------------------------------------

def decode_speeds(paths: Sequence[str | os.PathLike], n_threads: int, ids: Sequence[int] | Sequence[Sequence[int]],
                  n_tokens: int = 32, repeats: int = 3) -> list[float]:
    """Median tokens/s of each model decoding greedily one token per call after `ids` (one
    prompt for all, or one per model when their tokenizers differ).

    The models take turns within each repeat, so a burst of load from other jobs on a shared
    machine hits them all rather than whichever happened to run at that moment.
    """
    from llama_runtime import GGUFModel
    prompts = [list(p) for p in ids] if ids and not isinstance(ids[0], (int, np.integer)) else [list(ids)] * len(paths)
    models = [GGUFModel(p, n_threads=n_threads) for p in paths]
    ctxs = [m.new_context(n_ctx=len(prompt) + n_tokens + 8) for m, prompt in zip(models, prompts)]
    try:
        rates: list[list[float]] = [[] for _ in models]
        for ctx, prompt in zip(ctxs, prompts):
            ctx.logits(prompt, 1)  # prefill and warm-up, not timed
        for _ in range(repeats):
            for ctx, r, prompt in zip(ctxs, rates, prompts):
                seq = list(prompt)
                logits = ctx.logits(seq, 1)[0]
                t0 = time.perf_counter()
                for _ in range(n_tokens):
                    seq.append(int(np.argmax(logits)))
                    logits = ctx.logits(seq, 1)[0]
                r.append(n_tokens / (time.perf_counter() - t0))
        return [statistics.median(r) for r in rates]
    finally:
        for ctx in ctxs:
            ctx.close()
        for m in models:
            m.close()


def verify_cost(path: str | os.PathLike, n_threads: int, prefix: Sequence[int], draft_tokens: Sequence[int],
                max_rows: int = 13, repeats: int = 5) -> dict[int, float]:
    """Median seconds for the target to score k = 1..max_rows tokens after `prefix` (all rows' logits)."""
    from llama_runtime import GGUFModel
    model = GGUFModel(path, n_threads=n_threads)
    draft_tokens = list(draft_tokens)
    while len(draft_tokens) < max_rows:  # any tokens do; the cost does not depend on which
        draft_tokens += draft_tokens or [0]
    ctx = model.new_context(n_ctx=len(prefix) + max_rows + 8)
    try:
        ctx.logits(list(prefix), 1)
        times: dict[int, list[float]] = {k: [] for k in range(1, max_rows + 1)}
        for _ in range(repeats):
            for k in times:  # interleaved, so load from other jobs spreads over all k
                t0 = time.perf_counter()
                ctx.logits(list(prefix) + draft_tokens[:k], rows=k)  # rolls back to the prefix first
                times[k].append(time.perf_counter() - t0)
        return {k: statistics.median(v) for k, v in times.items()}
    finally:
        ctx.close()
        model.close()


def fit_verify(seconds_by_rows: dict[int, float]) -> tuple[float, float]:
    """Least-squares t(k) = a + b·k -> (t for a γ = 0 round, extra per draft token) = (a + b, b)."""
    ks = np.array(sorted(seconds_by_rows), dtype=np.float64)
    ts = np.array([seconds_by_rows[int(k)] for k in ks])
    if len(ks) > 1:
        b, a = np.polyfit(ks, ts, 1)
    else:
        b, a = 0.0, float(ts[0])
    b = max(float(b), 0.0)
    return max(float(a) + b, 1e-6), b


class LinkFigures(NamedTuple):
    """What the figure of merit needs of a link (the CLI reads them from a netsim profile)."""

    name: str
    rtt_s: float                # mean round trip
    uplink_bytes_per_s: float   # inf when the link does not limit the rate


# netsim's "3g" profile (tests/test_draftmaker.py checks that the two agree).
LINK_3G = LinkFigures("3g", rtt_s=0.3, uplink_bytes_per_s=700e3 / 8)


def q_payload_bytes(draft_probs: np.ndarray, top_k: int = 16) -> float:
    """Mean bytes on the wire per draft token: its id plus its fixed-point top-k q (CLI default),
    from the q rows shipped (the draft's processed probabilities, or TLI's on target ids)."""
    from spec_core.proto.qpayload import to_proto
    from spec_core.qcodec import encode_fixed
    probs = draft_probs[: min(len(draft_probs), 32)]
    sizes = [to_proto([encode_fixed(p, top_k)]).ByteSize() for p in probs]
    return float(np.mean(sizes)) + TOKEN_ID_BYTES


# --- the report ----------------------------------------------------------------------------------

@dataclass
class EvalReport:
    target: dict
    draft: dict
    settings: dict
    overall: dict
    categories: dict
    per_prompt: list
    expected_tokens_per_round: dict
    speed: dict | None = None
    verify: dict | None = None
    hybrid: dict | None = None
    vocabulary: dict | None = None
    chain: dict | None = None
    chain_by_category: dict | None = None
    ngram: dict | None = None
    ngram_by_category: dict | None = None
    elapsed_s: float = 0.0

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Tally:
    """Acceptance sums per temperature over a set of positions."""
    prompts: int = 0
    sums: dict = field(default_factory=dict)    # T key -> sum of per-position acceptance
    counts: dict = field(default_factory=dict)  # T key -> positions
    covered: dict = field(default_factory=dict)  # T key -> positions whose target token the draft has (across tokenizers)

    def add(self, t: str, values: np.ndarray, covered: int | None = None) -> None:
        self.sums[t] = self.sums.get(t, 0.0) + float(values.sum())
        self.counts[t] = self.counts.get(t, 0) + len(values)
        if covered is not None:
            self.covered[t] = self.covered.get(t, 0) + covered

    def summary(self) -> dict:
        out = {"prompts": self.prompts, "positions": dict(self.counts),
               "alpha": {t: self.sums[t] / self.counts[t] for t in self.sums if self.counts[t]}}
        if self.covered:
            out["coverage"] = {t: self.covered[t] / self.counts[t] for t in self.covered if self.counts[t]}
        return out


def evaluate_draft(target_path: str | os.PathLike, draft_path: str | os.PathLike,
                   prompts: Sequence[Prompt] | None = None, **kwargs) -> EvalReport:
    """Score `draft_path` against `target_path`; see the module docstring for what each figure means."""
    return evaluate_drafts(target_path, [draft_path], prompts, **kwargs)[0]


def evaluate_drafts(target_path: str | os.PathLike, draft_paths: Sequence[str | os.PathLike],
                    prompts: Sequence[Prompt] | None = None, *, max_new_tokens: int = 48,
                    temperatures: Sequence[float] = DEFAULT_TEMPERATURES, continuation: str = "sampled",
                    seed: int = 0, threads: int = 1, measure_speed: bool = True, speed_tokens: int = 32,
                    speed_repeats: int = 3, speed_threads: Sequence[int] = (1, 2), verify_threads: int = 1,
                    verify_repeats: int = 5, link: LinkFigures = LINK_3G, fom_temperature: float = 0.7,
                    draft_threads: int = 1, max_gamma: int = 12, prompts_file: str | None = None,
                    cross_vocab: bool = True, progress: Progress | None = None) -> list[EvalReport]:
    """One report per draft. The target's continuations, its logits and its speed are computed
    once and shared, so comparing several drafts costs little more than scoring one. A draft of
    another tokenizer is scored across vocabularies (TLI) unless `cross_vocab` is False."""
    if continuation not in ("sampled", "greedy"):
        raise ValueError(f"continuation must be 'sampled' or 'greedy', not {continuation!r}")
    if not draft_paths:
        raise ValueError("no draft to evaluate")
    plan = _Plan(max_new_tokens, sorted({float(t) for t in temperatures} | {0.0, float(fom_temperature)}),
                 continuation, seed, fom_temperature)
    note = progress or (lambda msg: log.info("%s", msg))
    t_start = time.perf_counter()
    if prompts is None:
        prompts_file = str(prompts_file or DEFAULT_PROMPTS)
        prompts = load_prompts(prompts_file)
    scored = _score_all(target_path, draft_paths, list(prompts), plan, threads, cross_vocab, note)

    settings = {"max_new_tokens": max_new_tokens, "continuation": continuation,
                "temperatures": [float(t) for t in plan.temperatures], "seed": seed, "threads": threads,
                "prompts_file": prompts_file}
    reports = [_report(target_path, scored.target_fingerprint, path, score, settings)
               for path, score in zip(draft_paths, scored.drafts)]
    for r in reports:
        r.ngram = scored.ngram[""].summary() if "" in scored.ngram else None
        r.ngram_by_category = {c: t.summary() for c, t in scored.ngram.items() if c}
    if measure_speed:
        _speed_and_merit(reports, target_path, draft_paths, scored.speed_prompt,
                         [s.payload_rows for s in scored.drafts], fom_temperature, speed_tokens, speed_repeats,
                         sorted(set(speed_threads) | {draft_threads}), verify_threads, verify_repeats, link,
                         draft_threads, max_gamma, note)
    for r in reports:
        r.elapsed_s = time.perf_counter() - t_start
    return reports


@dataclass(frozen=True)
class _Plan:
    """Which continuations are scored and at which temperatures (evaluate_drafts' arguments)."""
    max_new_tokens: int
    temperatures: list[float]   # sorted; always holds 0 and fom_temperature
    continuation: str           # "sampled" or "greedy"
    seed: int
    fom_temperature: float


class _Acceptance(NamedTuple):
    """One draft scored on one continuation at one temperature."""
    values: np.ndarray               # [positions] acceptance per position
    payload: np.ndarray | None       # [≤32, vocab] q rows shipped, for the payload size (only when asked)
    covered: int | None = None       # positions whose target token the draft has (across tokenizers)


@dataclass
class _DraftScore:
    """One draft's sums over the prompts scored so far."""
    fingerprint: str
    cross: CrossVocab | None                    # None: the target's tokenizer; else its TLI mapping
    overall: _Tally = field(default_factory=_Tally)
    by_category: dict[str, _Tally] = field(default_factory=dict)
    per_prompt: list[dict] = field(default_factory=list)
    payload_rows: np.ndarray | None = None      # q shipped at the figure of merit's T, for the payload size
    chain: dict = field(default_factory=dict)   # T key -> ChainTally (pooled)
    chain_by_category: dict = field(default_factory=dict)   # category -> T key -> ChainTally

    def record(self, category: str, row: dict, t: str, acc: _Acceptance) -> None:
        self.overall.add(t, acc.values, acc.covered)
        self.by_category[category].add(t, acc.values, acc.covered)
        score_chain(self.chain.setdefault(t, ChainTally()), acc.values)
        score_chain(self.chain_by_category.setdefault(category, {}).setdefault(t, ChainTally()), acc.values)
        row["positions"][t] = len(acc.values)
        row["alpha"][t] = float(acc.values.mean())
        if acc.payload is not None and len(acc.payload):
            self.payload_rows = acc.payload


class _SpeedPrompt(NamedTuple):
    """What decode speed and verify cost are measured on: the first prompt and its greedy continuation."""
    target_ids: list[int]
    continuation: list[int]
    draft_ids: list[list[int]]   # per draft: the prompt in its own tokens


class _Scored(NamedTuple):
    target_fingerprint: str
    drafts: list[_DraftScore]
    speed_prompt: _SpeedPrompt | None
    ngram: dict   # category ("" pooled) -> ChainTally of the n-gram proposer on the target's greedy text


def _score_all(target_path, draft_paths, prompts: list[Prompt], plan: _Plan, threads: int, cross_vocab: bool,
               note: Progress) -> _Scored:
    """Load the target and the drafts, score every prompt, close them all."""
    from llama_runtime import GGUFModel
    target = GGUFModel(target_path, n_threads=threads)
    drafts: list = []
    try:
        crosses = _open_drafts(target, draft_paths, threads, cross_vocab, note, drafts)
        scores = [_DraftScore(m.fingerprint, c) for m, c in zip(drafts, crosses)]
        target_ctx = target.new_context(n_ctx=2048)
        draft_ctxs = [d.new_context(n_ctx=2048) for d in drafts]
        speed_prompt = None
        ngram: dict[str, ChainTally] = {}
        for i, prompt in enumerate(prompts):
            note(f"prompt {i + 1}/{len(prompts)} ({prompt.category})")
            first = _score_prompt(i, prompt, target, target_ctx, drafts, draft_ctxs, scores, plan)
            if first is not None:   # the prompt and its greedy continuation: vLLM's n-gram proposer on it
                for key in ("", prompt.category):
                    score_lookup(ngram.setdefault(key, ChainTally()), first.target_ids, first.continuation)
            speed_prompt = speed_prompt or first
        target_ctx.close()
        for ctx in draft_ctxs:
            ctx.close()
        return _Scored(target.fingerprint, scores, speed_prompt, ngram)
    finally:
        target.close()
        for m in drafts:
            m.close()


def _open_drafts(target, draft_paths, threads: int, cross_vocab: bool, note: Progress,
                 opened: list) -> list[CrossVocab | None]:
    """Load each draft into `opened` (at once, so that the caller closes it should a later one
    fail) and map its vocabulary onto the target's where the tokenizers differ."""
    from llama_runtime import GGUFModel
    crosses: list[CrossVocab | None] = []
    for path in draft_paths:
        opened.append(GGUFModel(path, n_threads=threads))
        if opened[-1].fingerprint == target.fingerprint:
            crosses.append(None)
        elif not cross_vocab:
            raise ValueError(f"{opened[-1].name} and {target.name} do not share a tokenizer "
                             "(fingerprints differ) and cross-vocabulary scoring is off")
        else:
            note(f"{opened[-1].name}: another tokenizer; mapping vocabularies (TLI)")
            crosses.append(CrossVocab(target, opened[-1]))
    return crosses


def _score_prompt(i: int, prompt: Prompt, target, target_ctx, drafts, draft_ctxs, scores: list[_DraftScore],
                  plan: _Plan) -> _SpeedPrompt | None:
    """Score every draft on prompt `i` at every temperature; the prompt and its greedy
    continuation are returned for the speed measurements."""
    ids = prompt_ids(target, prompt)
    draft_prompts = [prompt_ids(m, prompt) if s.cross is not None else None for m, s in zip(drafts, scores)]
    # Across tokenizers the draft's logits depend on the continuation only, not on T: computed
    # once per continuation (greedy mode scores one continuation at every T).
    cross_rows: dict[tuple[int, float], np.ndarray] = {}   # (draft, continuation T) -> logits
    rows = [{"category": prompt.category, "prompt_tokens": len(ids), "positions": {}, "alpha": {}} for _ in drafts]
    for s in scores:
        s.by_category.setdefault(prompt.category, _Tally()).prompts += 1
        s.overall.prompts += 1
    conts: dict[float, list[int]] = {}
    speed_prompt = None
    for temp in plan.temperatures:
        sample_temp = 0.0 if plan.continuation == "greedy" else temp
        if sample_temp not in conts:
            rng = np.random.default_rng([plan.seed, i, int(round(sample_temp * 1000))])
            conts[sample_temp] = target_continuation(target_ctx, ids, plan.max_new_tokens, sample_temp, rng,
                                                     target.eog_ids)
        cont = conts[sample_temp]
        if speed_prompt is None and sample_temp == 0.0:   # (the first T = 0 continuation of this prompt)
            speed_prompt = _SpeedPrompt(ids, cont, [list(ids) if s.cross is None else list(p)
                                                    for s, p in zip(scores, draft_prompts)])
        target_logits = teacher_forced_logits(target_ctx, ids, cont)
        t = tkey(temp)
        for d, (ctx, score) in enumerate(zip(draft_ctxs, scores)):
            want_payload = score.payload_rows is None and temp == plan.fom_temperature
            if score.cross is None:
                acc = _same_vocab_acceptance(ctx, ids, cont, target_logits, temp, want_payload)
            else:
                key = (d, sample_temp)
                if key not in cross_rows:
                    cross_rows[key] = cross_draft_logits(ctx, score.cross, ids, draft_prompts[d], cont)
                acc = _cross_vocab_acceptance(score.cross, cross_rows[key], cont, target_logits, temp, want_payload)
                rows[d].setdefault("coverage", {})[t] = acc.covered / max(len(cont), 1)
            score.record(prompt.category, rows[d], t, acc)
    for s, row in zip(scores, rows):
        s.per_prompt.append(row)
    return speed_prompt


def _same_vocab_acceptance(ctx, ids, cont, target_logits: np.ndarray, temp: float, want_payload: bool) -> _Acceptance:
    draft_logits = teacher_forced_logits(ctx, ids, cont)
    return _Acceptance(acceptance(target_logits, draft_logits, temp),
                       processed_probs(draft_logits[:32], temp) if want_payload else None)


def _cross_vocab_acceptance(cross: CrossVocab, draft_logits: np.ndarray, cont, target_logits: np.ndarray,
                            temp: float, want_payload: bool) -> _Acceptance:
    values, payload = cross_acceptance(target_logits, draft_logits, temp, cross, keep_q=32 if want_payload else 0)
    covered = int(cross.target_has[np.asarray(cont, dtype=np.int64)].sum())
    return _Acceptance(values, payload, covered)


def _report(target_path, target_fingerprint: str, draft_path, score: _DraftScore, settings: dict) -> EvalReport:
    summary = score.overall.summary()
    summary["greedy_agreement"] = summary["alpha"][tkey(0.0)]
    return EvalReport(
        target={"path": str(target_path), "name": Path(target_path).name, "fingerprint": target_fingerprint},
        draft={"path": str(draft_path), "name": Path(draft_path).name, "fingerprint": score.fingerprint},
        settings=settings,
        overall=summary,
        categories={c: t.summary() for c, t in score.by_category.items()},
        per_prompt=score.per_prompt,
        expected_tokens_per_round={t: {str(g): expected_tokens_per_round(a, g) for g in GAMMAS}
                                   for t, a in summary["alpha"].items()},
        vocabulary=_vocabulary_json(score.cross),
        chain={t: c.summary() for t, c in score.chain.items()},
        chain_by_category={cat: {t: c.summary() for t, c in by_t.items()} for cat, by_t in score.chain_by_category.items()},
    )


def _vocabulary_json(cross: CrossVocab | None) -> dict | None:
    if cross is None:
        return None
    return {**cross.overlap.to_json(),
            "rolled_back_per_sync": cross.rolled_back / cross.syncs if cross.syncs else 0.0}


def _speed_and_merit(reports, target_path, draft_paths, speed_prompt: _SpeedPrompt, bytes_rows, fom_temperature,
                     speed_tokens, speed_repeats, speed_threads, verify_threads, verify_repeats, link, draft_threads,
                     max_gamma, note) -> None:
    ids, cont = speed_prompt.target_ids, speed_prompt.continuation
    speeds: dict[str, list[float]] = {}
    for threads in speed_threads:
        note(f"decode speed, {threads} thread(s): target and {len(draft_paths)} draft(s), interleaved")
        speeds[str(threads)] = decode_speeds([target_path, *draft_paths], threads, [list(ids), *speed_prompt.draft_ids],
                                             speed_tokens, speed_repeats)
    note(f"verify cost: target, {verify_threads} thread(s)")
    by_rows = verify_cost(target_path, verify_threads, list(ids) + list(cont), cont[::-1] or [0],
                          max_rows=max_gamma + 1, repeats=verify_repeats)
    base_s, per_token_s = fit_verify(by_rows)
    verify = {"threads": verify_threads, "seconds_by_rows": {str(k): v for k, v in by_rows.items()},
              "base_s": base_s, "per_token_s": per_token_s,
              "method": "measured: target logits for k = γ+1 rows after a rollback, median of "
                        f"{verify_repeats}; least-squares line t(k) = a + b·k"}
    rtt_s, up_bytes_per_s = link.rtt_s, link.uplink_bytes_per_s
    for d, report in enumerate(reports):
        report.speed = {"draft": {th: v[d + 1] for th, v in speeds.items()},
                        "target": {th: v[0] for th, v in speeds.items()},
                        "tokens": speed_tokens, "repeats": speed_repeats}
        report.verify = verify
        alpha = report.overall["alpha"][tkey(fom_temperature)]
        t_draft_s = 1.0 / report.speed["draft"][str(draft_threads)]
        bytes_per_token = q_payload_bytes(bytes_rows[d]) if bytes_rows[d] is not None else 0.0
        costs = RoundCosts(t_draft_s=t_draft_s, rtt_s=rtt_s, t_verify_base_s=base_s,
                           t_verify_per_token_s=per_token_s, bytes_per_draft_token=bytes_per_token,
                           bytes_per_s=up_bytes_per_s)
        by_gamma = {str(g): expected_tokens_per_round(alpha, g) / costs.round_time(g)
                    for g in range(1, max_gamma + 1)}
        g_best = best_gamma(alpha, costs, max_gamma)
        report.hybrid = {
            "link": link.name, "rtt_s": rtt_s, "uplink_bytes_per_s": up_bytes_per_s,
            "bytes_per_draft_token": bytes_per_token, "temperature": fom_temperature, "alpha": alpha,
            "draft_threads": draft_threads, "t_draft_s": t_draft_s, "best_gamma": g_best,
            "tokens_per_s": by_gamma[str(g_best)], "tokens_per_s_by_gamma": by_gamma,
            # What the same link gives without a draft: the verifier streams the target's own
            # decoding (one request; after the first token the RTT no longer matters).
            "cloud_only_tokens_per_s": 1.0 / by_rows[1]}

"""The exactness hunt's harness: many generations of a synthetic bigram pair through the real edge
loop (edge_client.EdgeClient), gRPC and the verifier (cloud_verifier.server.VerifierServer) in one
process, with replies lost and sessions evicted on a seeded schedule, and every token transition
checked against the target (hybridspec.testing.exactness.transition_fit).

A `HuntConfig` is one combination: the planner on or off, seeded or unseeded sampling, the faults,
batching (fair or least-slack passes), trees, rounds drafted ahead, top-k. Its `control` makes a
deliberately biased variant that the check must catch:

- "resample": on a rejection the verifier draws the corrected token from p instead of the residual
  norm(max(0, p - q)), in a share `control_rate` of rejections (a classic verifier bug);
- "outcome-faults": besides the schedule's faults, a share `control_rate` of the rounds that
  rejected a draft lose their reply with the session evicted (the fault depends on the outcome, so
  an unseeded redo redraws exactly the outcomes it dislikes); a session's first round (an open, as
  the redo after a replay is) is spared, so a round is redrawn at most once this way and the
  generation goes on at any rate (at rate 1 a draft that the target rejects every time would
  otherwise be evicted until the edge gives up);
- "redo-shape": an evicted round whose lost attempt rejected a draft is redone as a chain of the
  drafts that attempt kept (the redo's shape depends on the outcome it cannot have seen; with a
  seed the redo reuses the lost attempt's stream: candidate (b) of issue 42). It acts on the
  schedule's evictions only, so its bias scales with their rate.

Faults. A round's reply is lost (`lost`) or lost with its session evicted (`evicted`) after the
verifier committed it, as when the network drops the reply: the edge retries the same request and
gets the cached reply, or NOT_FOUND and replays its committed tokens in a new session. Whether an
attempt is faulted is drawn from a stream keyed by (run seed, generation seed, committed length,
round, attempt), never from the outcome (that is the "outcome-faults" control), so a replay faults
the same attempts.

Replay (`replay`): a seeded run again from its ReplayRecord: the same generation seeds, the same
fault schedule, and every fresh round planned as recorded (the plan per committed length). It does
not pin what timing decides beyond the plan of a fresh round: the window's depth, whether a round
travels ahead or fused, the length the continuations' cost model chooses for a round drafted ahead,
retry back-off, and which rounds share a target pass. Unseeded runs draw from the OS's entropy at
both ends: their record keeps the schedule but a replay cannot draw the same tokens.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import time
from dataclasses import dataclass, field

import grpc
import numpy as np

from cloud_verifier.backends.synthetic import SyntheticBackend
from cloud_verifier.engine import Limits
from cloud_verifier.server import VerifierServer
from cloud_verifier.validation import RequestError
from edge_client import EdgeClient
from edge_client import session as session_mod
from edge_client.drafters import SyntheticDrafter
from edge_client.planner import RoundPlan
from edge_client.options import EdgeOptions, Speculation, Transport
from edge_client.text import SyntheticTokenizer
from hybridspec.testing.exactness import PassLog, ReplayRecord, TransitionFit, transition_counts, transition_fit
from spec_core.synthetic import SyntheticLM
from spec_core.tree import ROOT, DraftTree, TreeShape
from spec_core.warping import SamplingSettings, processed_probs

CONTROLS = ("", "resample", "outcome-faults", "redo-shape")


@dataclass(frozen=True)
class HuntConfig:
    name: str
    vocab: int = 12
    target_seed: int = 0
    draft_noise: float = 1.0
    temperature: float = 1.0
    top_k: int = 0
    qmode: str = "fixed:6:12"
    plan: str = "auto"          # "auto": the default edge (γ up to max_gamma, window, fusing: the planner's)
    max_gamma: int = 12
    gamma: int | None = None    # plan "off": None keeps the fixed default chain
    tree: str | None = None
    proactive: bool | None = None
    max_continuations: int = 8
    seeded: bool = True
    lost: float = 0.0           # share of attempts whose reply is lost (the round committed)
    evicted: float = 0.0        # share of attempts whose reply is lost and whose session is evicted
    batching: bool = False
    schedule: str = "fair"      # batching: "fair" or "slack" (least slack first: sessions state an SLO)
    step_ms: float = 1.0        # the synthetic target pass's cost (a sleep): rounds queue and share passes
    tokens: int = 200           # per generation
    concurrency: int = 16
    control: str = ""
    control_rate: float = 1.0

    def __post_init__(self):
        if self.control not in CONTROLS:
            raise ValueError(f"control {self.control!r}: one of {CONTROLS}")

    def edge_options(self, port: int) -> EdgeOptions:
        spec = dict(plan=self.plan, max_gamma=self.max_gamma, qmode=self.qmode, max_continuations=self.max_continuations)
        for name in ("gamma", "tree", "proactive"):
            if getattr(self, name) is not None:
                spec[name] = getattr(self, name)
        if self.schedule == "slack":
            spec["slo_tpot_ms"] = 3.0
        return EdgeOptions(Transport(f"127.0.0.1:{port}", deadline_s=60, max_retries=100, max_replays=1000), Speculation(**spec))

    def settings(self, seed: int | None) -> SamplingSettings:
        return SamplingSettings(temperature=self.temperature, top_k=self.top_k, max_new_tokens=self.tokens,
                                ignore_eos=True, seed=seed)

    def target_probs(self) -> np.ndarray:
        """p(b | a)  # [V, V], the target's processed bigram distribution."""
        lm, s = SyntheticLM(self.vocab, self.target_seed), self.settings(None)
        return np.stack([processed_probs(lm.logits([a]), s.temperature, s.top_k, s.top_p) for a in range(self.vocab)])


# --- the verifier's side: a biased variant, faults, passes -------------------------------------------

class ResamplingBackend(SyntheticBackend):
    """Control "resample": a share of rejections take the corrected token from p, not the residual."""

    def __init__(self, rate: float, **kw):
        super().__init__(**kw)
        self.rate = rate

    def accept(self, logits, tree, draft_probs, settings, rng, position=None):
        out = super().accept(logits, tree, draft_probs, settings, rng, position)
        last = out.path[-1] if out.path else ROOT
        if tree.children().get(last) and rng.random() < self.rate:   # a rejection: some child was tested
            p = processed_probs(logits[last + 1], settings.temperature, settings.top_k, settings.top_p)
            return dataclasses.replace(out, next_token=int(rng.choice(len(p), p=p)))
        return out


class Faults:
    """Loses replies and evicts sessions on the seeded schedule (module docstring), by wrapping the
    engine's verify; counts what it did and, per generation seed, the faulted attempts."""

    def __init__(self, server: VerifierServer, config: HuntConfig, seed: int):
        self.engine, self.config, self.seed = server.engine, config, seed
        self.attempts: dict[tuple, int] = {}
        self.lost = self.evicted = 0
        self.refused: dict[str, int] = {}       # the verifier's refusals of rounds, by code and message
        self.log: dict[int, list] = {}          # generation seed -> [(committed length, round, attempt, kind)]
        self.lost_kept: dict[tuple, int] = {}   # redo-shape: (gen seed, committed length) -> drafts the lost attempt kept
        self._inner = self.engine.verify
        self.engine.verify = self.verify
        self._unseeded = np.random.default_rng([seed, 1])

    def _stale(self, valid) -> bool:
        """A pipelined round none of whose alternatives assumes what its session committed: it could
        never run (a fused continuation of the round before took its number after the edge had
        doomed it). The refusals that are not this would be retries that changed (candidate (a))."""
        req, s = valid.req, self.engine.session(valid.req.session_id)
        keys = [a.assumed for a in valid.alternatives]
        base = req.committed_length - len(keys[0])
        return s is not None and bool(keys[0]) and base >= 0 and \
            all(list(s.tokens[base: base + len(k)]) != list(k) for k in keys)

    def _generation(self, req, reply) -> int | None:
        s = self.engine.session(reply.session_id)
        return s.settings.seed if s is not None else None

    def _draw(self, gen: int | None, req) -> float:
        if gen is None:
            return float(self._unseeded.random())
        key = (gen, req.committed_length, req.round)
        n = self.attempts[key] = self.attempts.get(key, -1) + 1
        return float(np.random.default_rng([self.seed, gen, req.committed_length, req.round, n, 7]).random())

    async def verify(self, valid):
        try:
            reply = await self._inner(valid)
        except RequestError as e:
            # Candidate (a) of issue 42: a retry that is not byte-identical is refused "already
            # verified with different drafts"; any refusal is counted by its code and message head.
            key = f"{e.code.name}: {_message_kind(e.message)}"
            if "different drafts" in e.message:
                key += " (a stale pipelined round)" if self._stale(valid) else " (NOT a stale pipelined round)"
            self.refused[key] = self.refused.get(key, 0) + 1
            raise
        c, req = self.config, valid.req
        if not (c.lost or c.evicted) or reply.base_mismatch:
            return reply
        gen = self._generation(req, reply)
        u = self._draw(gen, req)
        nodes, tree = len(req.draft_token_ids), bool(req.draft_parents)
        depth = max(DraftTree(tuple(req.draft_token_ids), tuple(req.draft_parents)).depths(), default=0) \
            if tree else nodes
        kind = "evict" if u < c.evicted else "lost" if u < c.evicted + c.lost else None
        if c.control == "outcome-faults" and kind is None and reply.num_accepted < depth and req.session_id:
            kind = "evict" if self._unseeded.random() < c.control_rate else None
        if kind is None:
            return reply
        plain = reply.continuation == 0 and not req.assumed_tokens   # the round's own draft ran
        if gen is not None:
            # (committed length, round, attempt, kind, nodes, tree, kept): the lost attempt, for redo_table
            self.log.setdefault(gen, []).append((req.committed_length, req.round, self.attempts.get(
                (gen, req.committed_length, req.round), 0), kind, nodes if plain else 0, tree,
                reply.num_accepted if reply.num_accepted < depth else nodes))
        if kind == "evict":
            self.evicted += 1
            if c.control == "redo-shape" and plain and nodes and reply.num_accepted < depth:
                self.lost_kept[(gen, req.committed_length)] = reply.num_accepted
            self.engine.close(reply.session_id)
        else:
            self.lost += 1
        raise RequestError(grpc.StatusCode.UNAVAILABLE, f"reply lost (injected{', session evicted' if kind == 'evict' else ''})")


def _message_kind(message: str) -> str:
    """A refusal's message without its session id and numbers: one key per kind of refusal."""
    return re.sub(r"\d+", "N", re.sub(r"'[^']*'", "'…'", message.split(":")[0]))[:80]


# --- the edge's side: plans recorded, replayed or biased ---------------------------------------------

def _plan_to_list(plan) -> list:
    if plan is None:
        return []
    shape = plan.shape
    return [plan.arm, plan.gamma] + ([shape.budget, shape.depth, shape.branching, shape.width] if shape else [])


def _plan_from_list(x: list, chosen: RoundPlan) -> RoundPlan:
    """The recorded shape (arm, γ, tree shape) on the plan chosen now: its window depth, fusing and
    drafting ahead are not recorded (the docs: what a replay does not pin)."""
    shape = TreeShape(*x[2:6]) if len(x) > 2 else None
    return dataclasses.replace(chosen, arm=x[0], gamma=x[1], shape=shape)


class PlanHook:
    """Wraps each generation's planner (edge_client.session's RoundLoop) while a run lasts: in a
    replay, fresh rounds take the recorded plan for their committed length; under the "redo-shape"
    control, the redo of an evicted round takes the lost attempt's kept drafts as its γ."""

    def __init__(self, faults: Faults, config: HuntConfig, recorded: dict[int, dict[int, list]] | None):
        self.faults, self.config, self.recorded = faults, config, recorded
        self.pinned = 0

    @contextlib.contextmanager
    def installed(self):
        original = session_mod.RoundLoop
        hook = self

        class HookedLoop(original):
            def _plan(self, remaining: int) -> RoundPlan:
                chosen = super()._plan(remaining)
                # A fresh round's plan (the round drafted after what is committed); the plans of
                # continuations drafted behind a round in flight (fewer tokens remaining) are left alone.
                fresh = remaining == self._remaining(self.committed)
                return hook.choose(self, chosen) if fresh else chosen

            def _redo(self):
                # The redo-shape control is an edge that plans a failed round afresh (the edge sends
                # it again as drafted, RoundLoop._failed), here shaped by the lost outcome.
                return None if hook.config.control == "redo-shape" else super()._redo()
        session_mod.RoundLoop = HookedLoop
        try:
            yield self
        finally:
            session_mod.RoundLoop = original

    def choose(self, loop, chosen: RoundPlan) -> RoundPlan:
        gen, base = loop.remote.settings.seed, len(loop.committed)
        if self.recorded is not None and gen in self.recorded and base in self.recorded[gen]:
            self.pinned += 1
            return _plan_from_list(self.recorded[gen][base], chosen)
        kept = self.faults.lost_kept.pop((gen, base), None) if self.config.control == "redo-shape" else None
        return chosen if kept is None else dataclasses.replace(chosen, arm="chain", gamma=kept, shape=None)


# --- one run -----------------------------------------------------------------------------------------

@dataclass
class RunResult:
    config: HuntConfig
    seed: int
    fit: TransitionFit
    generations: int
    rounds: int
    retries: int
    replays: int
    lost: int
    evicted: int
    passes: int
    shared_passes: int
    plans: dict = field(default_factory=dict)   # arm gγ -> rounds
    refused: dict = field(default_factory=dict)   # the verifier's refusals, by code and message
    wall_s: float = 0.0
    record: ReplayRecord | None = None

    def summary(self) -> dict:
        out = {k: getattr(self, k) for k in ("seed", "generations", "rounds", "retries", "replays", "lost",
                                            "evicted", "passes", "shared_passes", "wall_s", "refused")}
        out.update(p=self.fit.p, bonferroni_p=self.fit.bonferroni_p, transitions=self.fit.transitions,
                   dof=self.fit.dof)
        return out


def make_backend(config: HuntConfig):
    kw = dict(vocab=config.vocab, seed=config.target_seed, step_ms=config.step_ms, batching=config.batching,
              schedule=config.schedule)
    if config.batching:
        kw["prefill_chunk"] = 1 if config.schedule == "slack" else None
    if config.control == "resample":
        return ResamplingBackend(config.control_rate, **kw)
    return SyntheticBackend(**kw)


async def run(config: HuntConfig, seed: int, transitions: int, record: ReplayRecord | None = None,
              recorded_plans: dict[int, dict[int, list]] | None = None,
              generation_seeds: list[int] | None = None) -> RunResult:
    """Generations of `config` until `transitions` tokens are generated (whole generations:
    a few more); `seed` keys the generation seeds, the prompts and the faults."""
    t0 = time.perf_counter()
    backend = make_backend(config)
    limits = Limits(max_sessions=config.concurrency * 4 + 8, slo_tpot_ms=3.0 if config.schedule == "slack" else 0.0)
    server = VerifierServer(backend, "127.0.0.1", 0, limits, grace_s=0.2)
    await server.start()
    faults = Faults(server, config, seed)
    passlog = PassLog(backend.batcher) if config.batching else None
    rng = np.random.default_rng([seed, 2])
    n_gen = -(-transitions // config.tokens)
    seeds = [int(x) for x in rng.integers(0, 2 ** 31, n_gen)]
    prompts = [[0, int(x)] for x in rng.integers(2, config.vocab, n_gen)]
    if generation_seeds is not None:
        seeds, prompts = list(generation_seeds), prompts[:len(generation_seeds)]
    record = record or ReplayRecord(test=f"hunt:{config.name}")
    record.config, record.seeds = dataclasses.asdict(config), {"run": seed, "generations": seeds}
    record.generations = [None] * len(seeds)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(seeds)):
        queue.put_nowait(i)
    totals = {"rounds": 0, "retries": 0, "replays": 0}
    plans: dict[str, int] = {}
    sequences: list[list[int]] = []

    async def worker():
        rounds: list = []

        def on_round(ev):
            rounds.append([ev.round, ev.base, ev.accepted, ev.tokens, _plan_to_list(ev.plan), ev.nodes])
        async with EdgeClient(config.edge_options(server.port), SyntheticDrafter(config.vocab, seed=config.target_seed,
                              noise=config.draft_noise), SyntheticTokenizer(config.vocab), on_round=on_round) as c:
            while not queue.empty():
                i = queue.get_nowait()
                rounds.clear()
                gen_seed = seeds[i] if config.seeded else None
                gen = c.generate(prompts[i], config.settings(gen_seed))
                await gen.text()
                st = gen.stats
                sequences.append(prompts[i][-1:] + list(st.token_ids))
                totals["rounds"] += st.rounds
                totals["retries"] += st.retries
                totals["replays"] += st.replays
                for r in rounds:
                    key = f"{r[4][0]} g{r[4][1]}" if r[4] else "?"
                    plans[key] = plans.get(key, 0) + 1
                record.generations[i] = {"seed": seeds[i], "seeded": config.seeded, "prompt": prompts[i],
                                         "rounds": list(rounds), "faults": faults.log.get(seeds[i], []),
                                         "ids": list(st.token_ids)}
    hook = PlanHook(faults, config, recorded_plans)
    try:
        with hook.installed():
            await asyncio.gather(*[worker() for _ in range(config.concurrency)])
    finally:
        await server.stop()
        backend.close()
    fit = transition_fit(transition_counts(sequences, config.vocab), config.target_probs())
    if passlog is not None:
        record.passes = passlog.passes
    record.results = {"p": fit.p, "bonferroni_p": fit.bonferroni_p, "transitions": fit.transitions,
                      "pinned_plans": hook.pinned}
    n_pass = len(passlog.passes) if passlog else 0
    shared = sum(1 for p in passlog.passes if len(p) > 1) if passlog else 0
    return RunResult(config, seed, fit, len(seeds), totals["rounds"], totals["retries"], totals["replays"],
                     faults.lost, faults.evicted, n_pass, shared, plans, faults.refused, time.perf_counter() - t0, record)


def recorded_plans(record: ReplayRecord) -> dict[int, dict[int, list]]:
    """Per generation seed, the plan each round had, by the committed length it started from."""
    return {g["seed"]: {r[1]: r[4] for r in g["rounds"] if r[4]} for g in record.generations if g}


async def replay(record: ReplayRecord) -> tuple[RunResult, float]:
    """Run a seeded record again (module docstring says what is pinned); returns the run and the
    share of its generations whose ids equal the recorded ones."""
    config = HuntConfig(**record.config)
    if not config.seeded:
        raise ValueError("an unseeded run draws from the OS's entropy: it cannot be replayed token for token")
    seeds = record.seeds["generations"]
    result = await run(config, record.seeds["run"], len(seeds) * config.tokens,
                       recorded_plans=recorded_plans(record), generation_seeds=seeds)
    same = sum(1 for a, b in zip(result.record.generations, record.generations) if a and b and a["ids"] == b["ids"])
    return result, same / max(1, len(seeds))


def redo_table(record: ReplayRecord) -> list[list[int]]:
    """Candidate (b) of issue 42, directly: [[full & same shape, full & other shape], [not full & same, not full & other]]
    over the evictions whose round was redone (the committed round at the evicted attempt's base):
    whether the redo's shape (chain or tree, nodes) differs from the lost attempt's, by whether the
    lost attempt kept all its drafts. With a seed the redo reuses the lost attempt's stream, so a
    shape that depends on the lost outcome biases the output (the "redo-shape" control)."""
    table = [[0, 0], [0, 0]]
    for g in record.generations:
        if not g:
            continue
        committed = {r[1]: r for r in g["rounds"]}
        for base, _round, _attempt, kind, nodes, tree, accepted in g["faults"]:
            redo = committed.get(base)
            if kind != "evict" or redo is None or not redo[4] or nodes == 0:
                continue
            plan = redo[4]
            # The nodes the redo carried (records before they were kept: its plan's size, which a
            # draft that stopped early, at a stop token or the length limit, falls short of).
            redo_nodes = redo[5] if len(redo) > 5 else plan[1] if len(plan) == 2 else plan[2]
            same = (len(plan) > 2) == tree and redo_nodes == nodes
            table[0 if accepted == nodes else 1][0 if same else 1] += 1
    return table

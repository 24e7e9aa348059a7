"""The experiment: every mode over every profile and workload, through the link proxy.

One verifier process serves the target (llama.cpp on the bundled model, or the synthetic pair);
for each profile a LinkProxy (in its own thread, so drafting on the edge's event loop never
stalls the link) sits between the edge and the verifier, and every mode runs every workload
prompt over a warmed-up gRPC channel. Bytes are the proxy's wire counts (HTTP/2 framing
included); round trips are Verify RPCs (retries included) or the one Generate request.

Modes: edge-only (the draft model alone, no network), cloud-only (the target streams its own
output: one request), cloud-stepwise (γ = 0: one Verify round trip per token, as a thin client of a
per-token cloud API), per-token (γ = 1), hybrid-gN (fixed γ), adaptive (γ from the cost model),
tree-gN (a token tree of depth N and 4N nodes every round, 2 children per node, the 2 most
probable frontier nodes expanded per level), proactive-gN (fixed γ; the next round is drafted
during the round trip from the most likely outcome), pipeline-gN (that round is also sent
before the reply; verified only on a committed base) and continuations-gN (the pipelined round
carries next rounds for several likely outcomes, as many as the cost model says pay; the
verifier runs the one whose base was committed: spec_core.continuations), window-gN (up to
WINDOW rounds in flight over VerifyStream, round r + 2 travelling while r and r + 1 are unanswered,
each keyed by the outcomes it assumes; the cost model picks the depth: edge_client.window) and
fused-gN (as continuations, and when the cost model says it pays the continuations leave with the
round itself: the verifier runs the matching one in that round's pass and answers both in one
reply; such a round counts no round trip and no pass of its own), and auto (the default edge, no
speculation option: the planner picks each round's shape, edge_client.planner).
"""
from __future__ import annotations

import asyncio
import json
import logging
import statistics
import subprocess
import time
import zlib
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import grpc
import numpy as np

from hybridspec.launch import spawn_verifier
from hybridspec.machine import describe as describe_machine
from netsim.effects import Delay
from netsim.link import Link
from netsim.profiles import Profile, get_profile
from netsim.proxy import LinkProxy
from spec_core import clock

log = logging.getLogger(__name__)

# Sampling per workload category: creative writing runs hot, structured output cold.
TEMPERATURE = {"code": 0.2, "json": 0.2, "summarisation": 0.7, "translation": 0.7, "chat": 0.7, "creative": 1.0}
ALL_MODES = ("edge-only", "cloud-only", "cloud-stepwise", "per-token", "hybrid", "adaptive", "tree", "proactive",
             "pipeline", "continuations", "window", "fused", "auto")
PER_GAMMA_MODES = ("hybrid", "tree", "proactive", "pipeline", "continuations", "window", "fused")
WINDOW = 4   # the window mode's most rounds in flight (the verifier's default max_window)  # one run per γ in --gammas (mode-gN)


@dataclass
class ExperimentConfig:
    profiles: list[str]
    modes: list[str]
    out: Path
    workloads: list[str] = field(default_factory=lambda: list(TEMPERATURE))
    prompts_per_workload: int = 1
    max_tokens: int = 48
    gammas: list[int] = field(default_factory=lambda: [4])
    target: str | None = None          # GGUF; default: bundled SmolLM2
    draft: str | None = None           # GGUF; default: models/smollm2-draft.gguf
    pair: str | None = None            # the named pair target and draft came from (netsim/pairs.py)
    qmode: str = "fixed:16:16"
    seed: int = 1
    coupling: str = "rejection"        # "gumbel": every mode commits the target's own sampling at the seed
    temperature: float | None = None   # every workload at this temperature (None: TEMPERATURE's per workload)
    verifier_threads: int = 1
    draft_threads: int = 1
    synthetic: bool = False            # use the synthetic pair instead of real models
    synthetic_alpha_noise: float = 1.0
    synthetic_draft_ms: float = 2.0
    synthetic_step_ms: float = 20.0
    synthetic_per_token_ms: float = 0.0  # verifier cost per token / tree node (0: flat, GPU-like)
    crossover: bool = True
    crossover_rtts_ms: list[float] = field(default_factory=lambda: [5, 50, 150, 300, 600])
    crossover_steps_ms: list[float] = field(default_factory=lambda: [5, 20, 60, 150])


@dataclass
class Row:
    profile: str
    mode: str
    workload: str
    prompt_index: int
    gamma: str
    tokens: int
    wall_s: float
    tokens_per_s: float
    ttft_s: float
    round_trips: int
    round_trips_per_token: float
    bytes_up: int
    bytes_down: int
    bytes_up_per_token: float
    bytes_down_per_token: float
    acceptance_rate: float | None      # accepted / drafted
    alpha: float | None                # per-token acceptance (geometric estimate), used by the theory
    tokens_per_round: float | None
    theory_tokens_per_round: float | None
    target_forward_passes: int
    forward_passes_per_token: float
    retries: int = 0
    replays: int = 0
    rtt_ms: float = 0.0
    nodes_per_round: float | None = None   # draft tokens or tree nodes sent per round
    reused_drafts: int = 0                 # proactive drafts reused (their draft time hidden in a round trip)
    pipelined_rounds: int = 0              # rounds sent before the previous reply and kept
    discarded_rounds: int = 0              # pipelined rounds dropped (base not committed)
    rolled_back_per_round: float | None = None  # two tokenizers: draft tokens re-tokenized per round (DraftView)
    continuation_rounds: int = 0           # rounds during whose flight continuations were drafted
    continuations_sent: int = 0            # alternatives shipped in pipelined rounds
    window_depth: float | None = None      # window mode: mean rounds in flight when one was sent
    continuation_hits: int = 0             # rounds whose outcome had a continuation (sent and kept, or reused)
    fused_rounds: int = 0                  # rounds sent with continuations for their own pass (fused mode)
    fused_hits: int = 0                    # rounds verified in the pass of the round before (no round trip)
    shapes: dict | None = None             # auto: rounds sent per shape the planner chose (GenerationStats.shapes)
    ids_digest: str = ""                   # BLAKE2b of the generated ids: with --coupling gumbel, equal across modes
    draft_s: float = 0.0                   # the edge's time drafting (hidden or not)
    server_model_s: float = 0.0            # the verifier's time in the target (its own timing)
    target_tokens: int = 0                 # tokens the target computed (prefill aside): cloud-only one per
                                           # generated token; a round its nodes + 1 (the last committed token)


def load_workloads(categories: list[str], per_category: int) -> list[tuple[str, int, str]]:
    text = resources.files("edge_client").joinpath("prompts/eval.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    out = []
    for cat in categories:
        prompts = [r["prompt"] for r in rows if r["category"] == cat][:per_category]
        if not prompts:
            raise ValueError(f"no prompts for workload {cat!r}; known: {sorted({r['category'] for r in rows})}")
        out += [(cat, i, p) for i, p in enumerate(prompts)]
    return out


def target_vocabulary(target: str | None):
    """The target's tokenizer and chat template (vocabulary only, no weights): prompts are the
    target's, also when the draft has another tokenizer."""
    from llama_runtime import GGUFModel, bundled_model_path
    return GGUFModel(target or bundled_model_path(), vocab_only=True)


def start_verifier(args: list[str]) -> tuple[subprocess.Popen, int]:
    proc, address = spawn_verifier(args)
    return proc, int(address.rsplit(":", 1)[-1])


class Runner:
    """Holds the edge-side models and runs one (profile, mode, prompt) measurement at a time."""

    def __init__(self, cfg: ExperimentConfig):
        from edge_client.drafters import GGUFDrafter, SyntheticDrafter
        from edge_client.text import SyntheticTokenizer
        self.cfg = cfg
        if cfg.synthetic:
            self.drafter = SyntheticDrafter(64, 0, cfg.synthetic_alpha_noise, per_token_ms=cfg.synthetic_draft_ms)
            self.tokenizer = SyntheticTokenizer(64)
        else:
            from edge_client.drafters import DEFAULT_DRAFT
            from llama_runtime import bundled_model_path
            self.target = cfg.target or str(bundled_model_path())
            draft = cfg.draft or str(DEFAULT_DRAFT)
            if not Path(draft).is_file():
                raise FileNotFoundError(f"no draft at {draft}: run scripts/setup.sh or edge-client make-draft")
            self.drafter = GGUFDrafter(draft, n_threads=cfg.draft_threads,
                                       max_tree_nodes=64 if "tree" in cfg.modes else 0)
            self.tokenizer = self.drafter.model
            self.target_vocab = target_vocabulary(self.target)
            self.cross_vocabulary = self.target_vocab.fingerprint != self.drafter.model.fingerprint

    def models(self) -> dict:
        """What ran: the pair's name, the files, and whether the draft has another tokenizer."""
        if self.cfg.synthetic:
            return {"pair": "synthetic", "cross_vocabulary": False}
        return {"pair": self.cfg.pair, "target": self.target, "draft": self.drafter.model.path.as_posix(),
                "cross_vocabulary": self.cross_vocabulary}

    def verifier_args(self, step_ms: float | None = None) -> list[str]:
        c = self.cfg
        if c.synthetic:
            return ["--backend", "synthetic", "--synthetic-vocab", "64",
                    "--synthetic-step-ms", str(c.synthetic_step_ms if step_ms is None else step_ms),
                    "--synthetic-per-token-ms", str(c.synthetic_per_token_ms)]
        # One edge at a time: the verifier's admission control (for fleets) would refuse a session on
        # a loaded machine instead of measuring it.
        return ["--model", self.target, "--threads", str(c.verifier_threads), "--admit-ttft-ms", "0"]

    def prompt_ids(self, prompt: str) -> list[int]:
        if self.cfg.synthetic:
            rng = np.random.default_rng(zlib.crc32(prompt.encode()))   # the same ids in every process
            return [0] + rng.integers(2, 64, size=12).tolist()
        from edge_client.text import render_chat
        return render_chat(self.target_vocab, prompt)

    def draft_prompt_ids(self, prompt: str) -> list[int]:
        """The prompt in the draft's own tokens and template (edge-only runs the draft alone)."""
        if self.cfg.synthetic or not self.cross_vocabulary:
            return self.prompt_ids(prompt)
        from edge_client.text import render_chat
        return render_chat(self.drafter.model, prompt)

    def settings(self, workload: str, max_tokens: int):
        from spec_core.warping import SamplingSettings
        return SamplingSettings(temperature=TEMPERATURE.get(workload, 0.7) if self.cfg.temperature is None
                                else self.cfg.temperature, top_p=0.95, max_new_tokens=max_tokens,
                                seed=self.cfg.seed, ignore_eos=self.cfg.synthetic, coupling=self.cfg.coupling)

    async def measure(self, proxy: LinkProxy | None, port: int, profile: Profile, mode: str, gamma: int | str,
                      workload: str, index: int, prompt_ids: list[int], max_tokens: int,
                      draft_prompt_ids: list[int] | None = None, chat: str | None = None) -> Row:
        """One run. `chat`: the prompt's text; with a draft of another tokenizer the edge sends it
        as a chat message (the verifier renders the target's template; the draft reads its own),
        as an edge without the target's tokenizer does. Cloud-only sends `prompt_ids`, the same
        rendering made here."""
        settings = self.settings(workload, max_tokens)
        if mode == "edge-only":
            return self._edge_only(profile, workload, index, draft_prompt_ids or prompt_ids, settings)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            from spec_core.proto import verifier_pb2 as pb, verifier_pb2_grpc as pb_grpc
            await pb_grpc.VerifierStub(channel).GetServerInfo(pb.ServerInfoRequest(), timeout=120)  # connect + warm up, not timed
            before = (proxy.stats.bytes_up, proxy.stats.bytes_down) if proxy else (0, 0)
            st, cross_rounds = await self.run_on(channel, f"127.0.0.1:{port}", mode, gamma, prompt_ids, settings, chat)
            await asyncio.sleep(0.05)  # let the proxy account the last bytes
            up = (proxy.stats.bytes_up - before[0]) if proxy else 0
            down = (proxy.stats.bytes_down - before[1]) if proxy else 0
        return make_row(profile, mode, gamma, workload, index, st, up, down, cross_rounds)

    async def run_on(self, channel, address: str, mode: str, gamma: int | str, prompt_ids: list[int], settings,
                     chat: str | None, client_class=None):
        """One mode's generation on an open channel (a gRPC channel, or the virtual clock's in-process
        one): its stats (CloudOnlyStats for cloud-only) and whether it drafted across vocabularies."""
        from edge_client.client import EdgeClient, stream_cloud_only
        from edge_client.options import EdgeOptions, Speculation, Transport
        from spec_core.proto import verifier_pb2_grpc as pb_grpc
        if mode == "cloud-only":
            return await stream_cloud_only(pb_grpc.VerifierStub(channel), prompt_ids, settings), False
        options = EdgeOptions(Transport(address, deadline_s=120),
                              Speculation(qmode=self.cfg.qmode, **mode_shape(mode, gamma)))
        async with (client_class or EdgeClient)(options, self.drafter, self.tokenizer, channel=channel) as client:
            from edge_client.crossvocab import Chat
            cross = not self.cfg.synthetic and self.cross_vocabulary and chat is not None
            gen = client.generate(Chat.of(chat) if cross else prompt_ids, settings)
            await gen.text()
            cross_rounds = getattr(client.drafter, "view", None) is not None   # drafted across vocabularies
        return gen.stats, cross_rounds

    def _edge_only(self, profile, workload, index, prompt_ids, settings) -> Row:
        from spec_core.drafting import QMode
        rng = np.random.default_rng(settings.seed)
        seq = list(prompt_ids)
        t0 = clock.now()
        draft = self.drafter.propose(seq, settings.max_new_tokens, settings, QMode("float", 0), rng)
        wall = clock.now() - t0
        n = len(draft.tokens)
        return Row(profile.name, "edge-only", workload, index, "-", n, wall, n / wall if wall else 0.0,
                   wall / max(n, 1), 0, 0.0, 0, 0, 0.0, 0.0, None, None, None, None, 0, 0.0, rtt_ms=profile.rtt_ms())


def mode_label(mode: str, gamma: int | str) -> str:
    return f"{mode}-g{gamma}" if mode in PER_GAMMA_MODES else mode


def mode_shape(mode: str, gamma: int | str) -> dict:
    """The Speculation fields a mode pins (every mode but auto pins its round's shape; auto is the
    default edge: the planner)."""
    if mode == "auto":
        return {"plan": "auto"}
    if mode == "auto-unsteered":   # the planner without the verifier's draft budget (netsim.virtual.heldout)
        return {"plan": "auto", "steer": False}
    g = {"per-token": 1, "cloud-stepwise": 0}.get(mode, gamma)
    extra = {"proactive": {"proactive": True}, "pipeline": {"pipeline": True, "max_continuations": 1},
             "continuations": {"pipeline": True}, "window": {"window": WINDOW},
             "fused": {"pipeline": True, "fuse": True}}.get(mode, {})
    if mode == "tree":
        extra = {"tree": f"budget={4 * int(gamma)},depth={gamma},branching=2,width=2"}
    return {"plan": "off", "gamma": g, **extra}


def expand_modes(modes: list[str], gammas: list[int]) -> list[tuple[str, int | str]]:
    """(mode, gamma) per run: one per γ in `gammas` for the modes that take one."""
    out: list[tuple[str, int | str]] = []
    for m in modes:
        if m in PER_GAMMA_MODES:
            out += [(m, g) for g in gammas]
        else:
            out.append((m, {"adaptive": "adaptive", "auto": "auto"}.get(m, 1)))
    return out


def make_row(profile: Profile, mode: str, gamma: int | str, workload: str, index: int, st, up: int, down: int,
             cross_rounds: bool) -> Row:
    """A run's row from its stats (edge_client GenerationStats, or CloudOnlyStats for cloud-only) and
    the bytes the link carried."""
    if mode == "cloud-only":
        tokens, wall, ttft = st.tokens, st.wall_s, st.ttft_s
        rounds, acc, alpha, tpr, theory, passes, retries, replays = 1, None, None, None, None, tokens, 0, 0
    else:
        tokens, wall, ttft = st.tokens, st.wall_s, st.ttft_s
        # A fused hit is a round answered with the one before: no round trip, no pass of its own.
        rounds = st.rounds - st.fused_hits + st.retries + st.discarded_rounds
        acc, alpha, tpr = st.acceptance_rate, st.alpha, st.tokens_per_round
        theory = st.expected_tokens_per_round
        passes, retries, replays = st.rounds - st.fused_hits, st.retries, st.replays
    n = max(tokens, 1)
    row = Row(profile.name, mode_label(mode, gamma), workload, index,
              str({"per-token": 1, "cloud-stepwise": 0}.get(mode, gamma)), tokens, wall,
              tokens / wall if wall else 0.0, ttft, rounds, rounds / n, up, down, up / n, down / n, acc,
              alpha, tpr, theory, passes, passes / n, retries, replays, profile.rtt_ms())
    row.ids_digest = ids_digest(st.token_ids)
    if mode != "cloud-only":
        row.nodes_per_round = st.nodes_per_round
        row.rolled_back_per_round = st.draft_rolled_back / max(st.rounds, 1) if cross_rounds else None
        row.reused_drafts, row.pipelined_rounds, row.discarded_rounds = (st.reused_drafts, st.pipelined_rounds,
                                                                         st.discarded_rounds)
        row.continuation_rounds, row.continuations_sent, row.continuation_hits = (
            st.continuation_rounds, st.continuations_sent, st.continuation_hits)
        row.window_depth = st.window_depth or None
        row.fused_rounds, row.fused_hits = st.fused_rounds, st.fused_hits
        row.shapes = st.shapes or None
        row.draft_s, row.server_model_s = st.draft_s, st.server_model_s
        row.target_tokens = round(st.nodes_per_round * st.rounds) + passes
    else:
        row.target_tokens = tokens
    return row


def ids_digest(ids) -> str:
    """A short digest of generated token ids (equal ids, equal digest)."""
    import hashlib
    return hashlib.blake2b(",".join(str(int(t)) for t in ids).encode(), digest_size=8).hexdigest()


def same_text(rows: list[dict]) -> dict:
    """Per prompt and profile: the modes whose ids differ from cloud-only's (edge-only, the draft alone,
    is left out). With --coupling gumbel every list is empty: the mode comparison carries no output
    variance. Returns {"compared": runs compared, "differ": ["profile/workload#i: mode, ...", ...]}."""
    groups: dict[tuple, dict[str, str]] = {}
    for r in rows:
        if r["mode"] != "edge-only" and r.get("ids_digest"):
            groups.setdefault((r["profile"], r["workload"], r["prompt_index"]), {})[r["mode"]] = r["ids_digest"]
    compared, differ = 0, []
    for (profile, workload, index), by in groups.items():
        ref = by.get("cloud-only")
        if ref is None:
            ref = next(iter(by.values()))
        others = [m for m, d in by.items() if d != ref]
        compared += len(by) - 1
        if others:
            differ.append(f"{profile}/{workload}#{index}: {', '.join(others)}")
    return {"compared": compared, "differ": differ}


def delay_profile(rtt_ms: float) -> Profile:
    half = Link((Delay(rtt_ms / 2),))
    return Profile(f"rtt{rtt_ms:g}", half, Link((Delay(rtt_ms / 2),)), description=f"pure delay, RTT {rtt_ms:g} ms",
                   source="synthetic grid (our own)")


def _say(progress, task, what: str) -> None:
    """What the run is doing now, on the progress bar (a step that moves no count, such as a start)."""
    if progress:
        progress.update(task, description=what)


async def run_experiment(cfg: ExperimentConfig, progress=None) -> dict:
    cfg.out.mkdir(parents=True, exist_ok=True)
    task = progress.add_task("setting up the synthetic pair" if cfg.synthetic else "loading the draft model",
                             total=None) if progress else None
    runner = Runner(cfg)
    workloads = load_workloads(cfg.workloads, cfg.prompts_per_workload)
    modes = expand_modes(cfg.modes, cfg.gammas)
    rows: list[Row] = []
    total = len(cfg.profiles) * len(modes) * len(workloads)
    crossover_points = (len(cfg.crossover_rtts_ms) * len(cfg.crossover_steps_ms) * 2) if cfg.crossover else 0
    if progress:
        progress.update(task, total=total + crossover_points)
    _say(progress, task, "starting the verifier" if cfg.synthetic else
         "starting the verifier (loads the target, ~1 min)")
    proc, vport = start_verifier(runner.verifier_args())
    try:
        for name in cfg.profiles:
            profile = get_profile(name)
            thread = LinkProxy(upstream=("127.0.0.1", vport), profile=profile, seed=cfg.seed).start_in_thread()
            try:
                for mode, gamma in modes:
                    for workload, index, prompt in workloads:
                        _say(progress, task, f"{name} {mode}{'' if mode not in PER_GAMMA_MODES else gamma} {workload}")
                        row = await runner.measure(thread.proxy, thread.port, profile, mode, gamma, workload, index,
                                                   runner.prompt_ids(prompt), cfg.max_tokens,
                                                   runner.draft_prompt_ids(prompt) if mode == "edge-only" else None,
                                                   chat=prompt)
                        rows.append(row)
                        if progress:
                            progress.advance(task)
            finally:
                thread.stop()
    finally:
        proc.terminate()
        proc.wait(30)
    crossover = await run_crossover(cfg, progress, task) if cfg.crossover else []
    result = {"clock": "wall", "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
              "profiles": {n: get_profile(n).to_dict() for n in cfg.profiles},
              "rows": [asdict(r) for r in rows], "crossover": crossover,
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": describe_machine(),
              "models": runner.models()}
    return result


async def run_crossover(cfg: ExperimentConfig, progress, task) -> list[dict]:
    """Synthetic pair over a grid of link RTT x cloud step time: hybrid (adaptive γ) vs cloud-only."""
    synth = ExperimentConfig(**{**asdict(cfg), "synthetic": True, "out": cfg.out})
    runner = Runner(synth)
    ids = runner.prompt_ids("crossover")
    points = []
    for step in cfg.crossover_steps_ms:
        _say(progress, task, f"crossover: starting a synthetic verifier, step {step:g} ms")
        proc, vport = start_verifier(runner.verifier_args(step_ms=step))
        try:
            for rtt in cfg.crossover_rtts_ms:
                profile = delay_profile(rtt)
                thread = LinkProxy(upstream=("127.0.0.1", vport), profile=profile, seed=cfg.seed).start_in_thread()
                try:
                    res = {}
                    for mode, gamma in (("cloud-only", 1), ("adaptive", "adaptive")):
                        _say(progress, task, f"crossover rtt {rtt:g} ms step {step:g} ms {mode}")
                        res[mode] = await runner.measure(thread.proxy, thread.port, profile, mode, gamma, "chat", 0,
                                                         ids, 32)
                        if progress:
                            progress.advance(task)
                finally:
                    thread.stop()
                h, c = res["adaptive"], res["cloud-only"]
                points.append({"rtt_ms": rtt, "step_ms": step, "hybrid_tokens_per_s": h.tokens_per_s,
                               "cloud_tokens_per_s": c.tokens_per_s, "speedup": h.tokens_per_s / c.tokens_per_s,
                               "hybrid_forward_passes_per_token": h.forward_passes_per_token,
                               "acceptance_rate": h.acceptance_rate, "tokens_per_round": h.tokens_per_round})
        finally:
            proc.terminate()
            proc.wait(30)
    return points


def summarise(rows: list[dict]) -> list[dict]:
    """One line per profile x mode over all workloads: totals, not means of ratios."""
    out = []
    keys = sorted({(r["profile"], r["mode"]) for r in rows}, key=lambda k: (k[0], _mode_order(k[1])))
    for profile, mode in keys:
        rs = [r for r in rows if r["profile"] == profile and r["mode"] == mode]
        tokens = sum(r["tokens"] for r in rs)
        wall = sum(r["wall_s"] for r in rs)
        acc = [r["acceptance_rate"] for r in rs if r["acceptance_rate"] is not None]
        alpha = [r["alpha"] for r in rs if r["alpha"] is not None]
        tpr = [r["tokens_per_round"] for r in rs if r["tokens_per_round"] is not None]
        theory = [r["theory_tokens_per_round"] for r in rs if r["theory_tokens_per_round"] is not None]
        out.append({
            "profile": profile, "mode": mode, "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall if wall else 0.0,
            "ttft_s": statistics.median(r["ttft_s"] for r in rs),
            "round_trips_per_token": sum(r["round_trips"] for r in rs) / max(tokens, 1),
            "bytes_up_per_token": sum(r["bytes_up"] for r in rs) / max(tokens, 1),
            "bytes_down_per_token": sum(r["bytes_down"] for r in rs) / max(tokens, 1),
            "acceptance_rate": statistics.mean(acc) if acc else None,
            "alpha": statistics.mean(alpha) if alpha else None,
            "tokens_per_round": statistics.mean(tpr) if tpr else None,
            "theory_tokens_per_round": statistics.mean(theory) if theory else None,
            "forward_passes_per_token": sum(r["target_forward_passes"] for r in rs) / max(tokens, 1),
            "target_tokens_per_token": sum(r.get("target_tokens", 0) for r in rs) / max(tokens, 1),
            "bytes_per_round": (sum(r["bytes_up"] + r["bytes_down"] for r in rs) / max(sum(r["round_trips"] for r in rs), 1)),
            "nodes_per_round": _mean([r.get("nodes_per_round") for r in rs]),
            "reused_drafts": sum(r.get("reused_drafts", 0) for r in rs),
            "pipelined_rounds": sum(r.get("pipelined_rounds", 0) for r in rs),
            "discarded_rounds": sum(r.get("discarded_rounds", 0) for r in rs),
            "rolled_back_per_round": _mean([r.get("rolled_back_per_round") for r in rs]),
            "continuation_rounds": sum(r.get("continuation_rounds", 0) for r in rs),
            "continuations_sent": sum(r.get("continuations_sent", 0) for r in rs),
            "continuation_hits": sum(r.get("continuation_hits", 0) for r in rs),
            "continuation_hit_rate": (sum(r.get("continuation_hits", 0) for r in rs)
                                      / max(sum(r.get("continuation_rounds", 0) for r in rs), 1)),
            "rounds_in_flight": _mean([r.get("window_depth") for r in rs]),
            "fused_rounds": sum(r.get("fused_rounds", 0) for r in rs),
            "fused_hits": sum(r.get("fused_hits", 0) for r in rs),
            "draft_s": sum(r.get("draft_s", 0.0) for r in rs),
            "server_model_s": sum(r.get("server_model_s", 0.0) for r in rs),
        })
    return out


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def _mode_order(mode: str) -> tuple[int, str]:
    for i, m in enumerate(ALL_MODES):
        if mode.startswith(m):
            return i, mode
    return len(ALL_MODES), mode

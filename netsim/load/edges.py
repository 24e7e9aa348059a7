"""The emulated edges: per-edge drafters (with the synthetic drafting cost owed to an
interceptor), prompts, requests and the measured window, and one edge's run of requests."""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from edge_client.drafters import Draft, Drafter, TreeDraft
from netsim.load.config import SYNTHETIC_VOCAB, LoadConfig
from spec_core.slo import meets_slo, window_tpot


class DraftCost(grpc.aio.UnaryUnaryClientInterceptor):
    """Before each Verify call, sleep the drafting time the synthetic drafter owes (see EmulatedDrafter)."""

    def __init__(self) -> None:
        self.owed_s = 0.0

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        if self.owed_s > 0:
            owed_s, self.owed_s = self.owed_s, 0.0
            await asyncio.sleep(owed_s)
        return await continuation(client_call_details, request)


class EmulatedDrafter(Drafter):
    """A drafter whose cost per token is owed to a DraftCost interceptor instead of slept on the loop.

    Every method of the drafter contract is passed to the inner drafter here, by name, so that no
    draft escapes the emulated cost: a chain owes per token, a tree per draft forward row
    (TreeDraft.rows). Drafting across vocabularies would draft through next_logits, around the
    cost, so it is refused (supports_cross_vocab False: the client says so before the first round)."""

    supports_cross_vocab = False

    def __init__(self, inner: Drafter, per_token_s: float, cost: DraftCost) -> None:
        self.inner, self.per_token_s, self.cost = inner, per_token_s, cost
        self.name, self.fingerprint = inner.name, inner.fingerprint
        self.supports_trees = inner.supports_trees

    def _owe(self, units: int) -> float:
        emulated_s = self.per_token_s * units
        self.cost.owed_s += emulated_s
        return emulated_s

    def propose(self, committed, gamma, settings, qmode, rng) -> Draft:
        draft = self.inner.propose(committed, gamma, settings, qmode, rng)
        draft.seconds += self._owe(len(draft.tokens))   # what the device would have measured: the adaptive γ uses it
        return draft

    def propose_tree(self, committed, shape, settings, qmode, rng) -> TreeDraft:
        tree = self.inner.propose_tree(committed, shape, settings, qmode, rng)
        tree.seconds += self._owe(tree.rows)
        return tree

    def anchor_prompt(self, target_prompt, draft_prompt) -> None:
        self.inner.anchor_prompt(target_prompt, draft_prompt)

    def retokenization(self):
        return self.inner.retokenization()

    def observe(self, committed, num_accepted) -> None:
        self.inner.observe(committed, num_accepted)

    def close(self) -> None:
        self.inner.close()


@dataclass
class Request:
    edge: int
    arrival_s: float
    start_s: float = 0.0
    token_times: list[tuple[float, int]] = field(default_factory=list)   # (time, tokens committed so far)
    done: bool = False
    replays: int = 0
    rounds: int = 0

    def tokens_by(self, t_s: float) -> int:
        counted = [n for when, n in self.token_times if when <= t_s]
        return counted[-1] if counted else 0

    def ttft_s(self) -> float | None:
        return self.token_times[0][0] - self.arrival_s if self.token_times else None

    def tpot_s(self, t_from: float, t_to: float) -> float | None:
        """Time per output token over the commits inside [t_from, t_to] (None with fewer than two)."""
        return window_tpot(self.token_times, t_from, t_to)

    def meets(self, t_from: float, t_to: float, slo_tpot_s: float, slo_ttft_s: float) -> bool | None:
        """Whether this request met the SLO, judged on what the window saw of it (spec_core.slo's
        verdict, the fleet simulator's too): its TPOT inside the window, and its TTFT if it arrived
        inside it. None: the window saw too little to say."""
        ttft = self.ttft_s() if t_from <= self.arrival_s <= t_to else None
        return meets_slo(self.tpot_s(t_from, t_to), ttft, slo_tpot_s, slo_ttft_s)


class Edges:
    """Builds per-edge drafters and prompts (real or synthetic) and runs one edge's requests."""

    def __init__(self, cfg: LoadConfig) -> None:
        from spec_core.warping import SamplingSettings
        self.cfg = cfg
        self.settings = SamplingSettings(temperature=0.7, top_p=0.95, max_new_tokens=cfg.max_tokens, seed=cfg.seed,
                                         ignore_eos=cfg.synthetic, coupling=cfg.coupling)
        if cfg.synthetic:
            from edge_client.text import SyntheticTokenizer
            self.tokenizer = SyntheticTokenizer(SYNTHETIC_VOCAB)
            self._gguf = None
        elif cfg.drafter == "lookup":
            from llama_runtime import GGUFModel, bundled_model_path
            self._gguf = None
            self.tokenizer = GGUFModel(cfg.target or bundled_model_path(), vocab_only=True)
        else:
            from edge_client.drafters import DEFAULT_DRAFT
            from edge_client.drafters import GGUFDrafter
            draft = cfg.draft or str(DEFAULT_DRAFT)
            if not Path(draft).is_file():
                raise FileNotFoundError(f"no draft at {draft}: run scripts/setup.sh or edge-client make-draft")
            self._draft_path = draft
            self._gguf = GGUFDrafter(draft, n_threads=1)   # edge 0's; the others get their own
            self._gguf_by_edge = {0: self._gguf}
            self.tokenizer = self._gguf.model
        if not cfg.synthetic:
            from edge_client.text import render_chat
            from netsim.experiment import load_workloads, target_vocabulary
            # The prompt is the target's (its tokens and chat template), whatever the draft's tokenizer.
            vocab = target_vocabulary(cfg.target)
            self._prompts = [render_chat(vocab, p) for _, _, p in load_workloads(["chat", "code"], 2)]

    def drafter(self, cost: DraftCost, edge: int = 0):
        if self._gguf is not None:
            # One model (and KV cache) per edge, as on separate devices; drafting runs on this
            # CPU, one edge at a time (propose is synchronous on the event loop).
            if edge not in self._gguf_by_edge:
                from edge_client.drafters import GGUFDrafter
                self._gguf_by_edge[edge] = GGUFDrafter(self._draft_path, n_threads=1)
            return self._gguf_by_edge[edge]
        if not self.cfg.synthetic:   # prompt lookup: no model on the edge
            from edge_client.drafters import PromptLookupDrafter
            inner = PromptLookupDrafter(fingerprint=self.tokenizer.fingerprint)
            return EmulatedDrafter(inner, self.cfg.draft_ms / 1000.0, cost)
        from edge_client.drafters import SyntheticDrafter
        inner = SyntheticDrafter(SYNTHETIC_VOCAB, 0, self.cfg.synthetic_alpha_noise)
        return EmulatedDrafter(inner, self.cfg.draft_ms / 1000.0, cost)

    def prompt(self, edge: int, number: int) -> list[int]:
        if not self.cfg.synthetic:
            return self._prompts[(edge + number) % len(self._prompts)]
        rng = np.random.default_rng([self.cfg.seed, edge, number])
        return [0] + rng.integers(2, SYNTHETIC_VOCAB, size=12).tolist()

    def settings_for(self, edge: int, number: int):
        from dataclasses import replace
        return replace(self.settings, seed=self.cfg.seed * 1_000_003 + edge * 1009 + number)


@dataclass
class Window:
    """The measured window: it opens after the warm-up once every edge has committed a token
    (a cold start of many sessions must not eat the window), and lasts duration_s."""

    edges: int
    warmup_s: float
    duration_s: float
    start_s: float = math.inf
    end_s: float = math.inf
    started: set = field(default_factory=set)   # edges that have committed a token
    all_started: asyncio.Event = field(default_factory=asyncio.Event)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    max_wait_s: float = 120.0                   # open the window anyway after warm-up + this

    def committed(self, edge: int) -> None:
        if edge not in self.started:
            self.started.add(edge)
            if len(self.started) == self.edges:
                self.all_started.set()


async def run_edge(edges: Edges, mode: str, edge: int, port: int, window: Window, requests: list[Request],
                   errors: dict[str, int], rng: np.random.Generator, cost: DraftCost, drafter) -> None:
    """One device: its own channel through its own link; requests until the window ends."""
    from edge_client.client import EdgeClient, EdgeError, sampling_proto
    from spec_core.proto import verifier_pb2 as pb, verifier_pb2_grpc as pb_grpc
    cfg = edges.cfg
    loop = asyncio.get_running_loop()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=[cost]) as channel:
        stub = pb_grpc.VerifierStub(channel)
        await stub.GetServerInfo(pb.ServerInfoRequest(), timeout=60)   # connect before the clock starts
        next_arrival = loop.time()
        number = 0
        stop = asyncio.create_task(window.stop.wait())
        while not window.stop.is_set():
            if cfg.arrival_rate > 0:
                next_arrival += rng.exponential(1.0 / cfg.arrival_rate)
                if next_arrival >= window.end_s:
                    break
                await asyncio.wait([stop], timeout=max(0.0, next_arrival - loop.time()))
                if window.stop.is_set():
                    break
                arrival = next_arrival
            else:
                arrival = loop.time()
            request = Request(edge, arrival, start_s=loop.time())
            requests.append(request)
            prompt, settings = edges.prompt(edge, number), edges.settings_for(edge, number)
            number += 1
            running = asyncio.create_task(_one_request(mode, stub, channel, drafter, edges, prompt, settings,
                                                       request, window, EdgeClient, sampling_proto, pb))
            await asyncio.wait([running, stop], return_when=asyncio.FIRST_COMPLETED)
            if not running.done():
                running.cancel()   # cut off at the end of the run
                await asyncio.gather(running, return_exceptions=True)
                break
            try:
                running.result()
                request.done = True
            except EdgeError as exc:
                errors[exc.code.name] = errors.get(exc.code.name, 0) + 1
                await asyncio.sleep(0.1)
            except grpc.aio.AioRpcError as exc:
                errors[exc.code().name] = errors.get(exc.code().name, 0) + 1
                await asyncio.sleep(0.1)
        stop.cancel()


async def _one_request(mode, stub, channel, drafter, edges, prompt, settings, request, window, EdgeClient,
                       sampling_proto, pb):
    loop = asyncio.get_running_loop()

    def committed(tokens: int) -> None:
        request.token_times.append((loop.time(), tokens))
        window.committed(request.edge)
    if mode == "cloud-only":
        count = 0
        async for chunk in stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling_proto(settings)),
                                         timeout=600):
            count += len(chunk.token_ids)
            committed(count)
        return
    gamma = "adaptive" if mode == "adaptive" else edges.cfg.gamma
    from edge_client.options import EdgeOptions, Speculation, Transport
    # auto is the default edge (the planner); hybrid and adaptive pin a plain chain
    shape = {} if mode == "auto" else {"gamma": gamma, "plan": "off"}
    options = EdgeOptions(Transport("", deadline_s=120), Speculation(qmode=edges.cfg.qmode, **shape))
    async with EdgeClient(options, drafter, edges.tokenizer, channel=channel) as client:
        generation = client.generate(prompt, settings)
        try:
            async for _ in generation:
                stats = generation.stats
                committed(stats.accepted + stats.rounds)
        finally:
            # Cut off at the window's end, the generation closes its session itself (EdgeClient
            # waits for that Close before it lets the channel go).
            request.replays = generation.stats.replays
            request.rounds = generation.stats.rounds

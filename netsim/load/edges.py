"""The emulated edges: per-edge drafters (with the synthetic drafting cost owed and paid on the
edge's loop after each drafting call), prompts, requests and the measured window, one device (`Edge`: its channel through
its own link and its requests, one at a time) and one edge's run of requests (`run_edge`).

`Edge` is the one implementation of a device: `netsim load` runs every edge's `run_edge` on its
event loop, and a Locust worker's edge host (netsim.load.edgehost) runs the same `Edge` for each
Locust user, one request per Locust task."""
from __future__ import annotations

import asyncio
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc
import numpy as np

from edge_client.drafters import Draft, Drafter, TreeDraft
from netsim.load.config import SYNTHETIC_VOCAB, LoadConfig
from spec_core.slo import meets_slo, window_tpot


class DraftCost:
    """What one edge's emulated drafter owes: the drafting time it stands for (see EmulatedDrafter),
    paid on the edge's event loop right after the drafting call that ran up the debt (`pay`, called by
    `paying_client`'s run_drafting), so that every round, on a unary call or on the VerifyStream,
    waits for its own drafting as a device would, while the other edges on the loop go on."""

    def __init__(self) -> None:
        self.owed_s = 0.0

    async def pay(self) -> None:
        owed_s, self.owed_s = self.owed_s, 0.0
        if owed_s > 0:
            await asyncio.sleep(owed_s)


@functools.cache
def paying_client(client_class: type) -> type:
    """`client_class` (edge_client's EdgeClient) whose drafting pays the emulated drafter's cost: each
    drafting call (a round's draft, continuations during a round trip) is followed by the time its
    drafter owes, waited out on the loop (DraftCost.pay)."""

    class PayingClient(client_class):
        def __init__(self, *args, cost: DraftCost, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._cost = cost

        async def run_drafting(self, fn, *args, thread: bool = False):
            try:
                return await super().run_drafting(fn, *args, thread=thread)
            finally:
                await self._cost.pay()

    PayingClient.__name__ = PayingClient.__qualname__ = f"Paying{client_class.__name__}"
    return PayingClient


class EmulatedDrafter(Drafter):
    """A drafter whose cost per token is owed to the edge's DraftCost and paid on its loop after the
    drafting call (paying_client), not slept inside the call, which may run in a thread.

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


class Arrivals:
    """A device's requests: back to back (`rate` 0: each arrives as the last one ends), or a Poisson
    process of `rate` requests/s queued on the device while it is busy (their TTFT counts the wait)."""

    def __init__(self, rate: float, rng: np.random.Generator, start_s: float) -> None:
        self.rate, self.rng, self.next_s = rate, rng, start_s

    def next(self, now_s: float) -> float:
        """The next request's arrival time (on the clock `now_s` reads)."""
        if self.rate <= 0:
            return now_s
        self.next_s += self.rng.exponential(1.0 / self.rate)
        return self.next_s


RoundObserver = Callable[[float, int], None]   # (seconds the round took on the wire, tokens it committed)


class Edge:
    """One device: its drafter, its own gRPC channel through its own link (`port` on this machine:
    the link's proxy), and requests run one at a time by `request`. `connect` opens another channel
    instead (the virtual clock's, netsim.virtual.load), and `client_class` replaces EdgeClient."""

    def __init__(self, edges: Edges, mode: str, index: int, port: int, cost: DraftCost | None, drafter,
                 connect: Callable[[], object] | None = None, client_class: type | None = None) -> None:
        self.edges, self.mode, self.index, self.port, self.cost, self.drafter = edges, mode, index, port, cost, drafter
        self.connect = connect or (lambda: grpc.aio.insecure_channel(f"127.0.0.1:{self.port}"))
        self.client_class = client_class
        self.channel = self.stub = None

    async def __aenter__(self) -> Edge:
        from spec_core.proto import verifier_pb2 as pb, verifier_pb2_grpc as pb_grpc
        self.channel = self.connect()
        self.stub = pb_grpc.VerifierStub(self.channel)
        try:
            await self.stub.GetServerInfo(pb.ServerInfoRequest(), timeout=60)   # connect before the clock starts
        except BaseException:
            await self.channel.close()
            raise
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.channel.close()

    async def request(self, request: Request, number: int, window: Window | None = None,
                      on_round: RoundObserver | None = None) -> None:
        """Run request `number` (its prompt and seed are the edge's `number`-th), recording its commits
        in `request`; raises EdgeError or grpc.aio.AioRpcError when it fails. Cancelled (the end of a
        run), the generation closes its session first."""
        from edge_client.client import EdgeClient, sampling_proto
        from spec_core.proto import verifier_pb2 as pb
        edges = self.edges
        await _one_request(self.mode, self.stub, self.channel, self.drafter, edges, edges.prompt(self.index, number),
                           edges.settings_for(self.index, number), request, window, self.client_class or EdgeClient,
                           sampling_proto, pb, on_round=on_round, cost=self.cost)


def error_code(exc: BaseException) -> str | None:
    """The gRPC status name of a failed request (EdgeError or AioRpcError); None for anything else."""
    from edge_client.client import EdgeError
    if isinstance(exc, EdgeError):
        return exc.code.name
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code().name
    return None


async def run_edge(edges: Edges, mode: str, edge: int, port: int, window: Window, requests: list[Request],
                   errors: dict[str, int], rng: np.random.Generator, cost: DraftCost | None, drafter,
                   round_trips: list[tuple[float, float]] | None = None, connect: Callable[[], object] | None = None,
                   client_class: type | None = None) -> None:
    """One device: its own channel through its own link; requests until the window ends.
    `round_trips` gets (when, seconds on the wire) for each committed round; `connect` and
    `client_class` as Edge takes them."""
    cfg = edges.cfg
    loop = asyncio.get_running_loop()
    on_round = None if round_trips is None else lambda seconds, _: round_trips.append((loop.time(), seconds))
    async with Edge(edges, mode, edge, port, cost, drafter, connect, client_class) as device:
        arrivals = Arrivals(cfg.arrival_rate, rng, loop.time())
        number = 0
        stop = asyncio.create_task(window.stop.wait())
        while not window.stop.is_set():
            arrival = arrivals.next(loop.time())
            if cfg.arrival_rate > 0:
                if arrival >= window.end_s:
                    break
                await asyncio.wait([stop], timeout=max(0.0, arrival - loop.time()))
                if window.stop.is_set():
                    break
            request = Request(edge, arrival, start_s=loop.time())
            requests.append(request)
            running = asyncio.create_task(device.request(request, number, window, on_round))
            number += 1
            await asyncio.wait([running, stop], return_when=asyncio.FIRST_COMPLETED)
            if not running.done():
                running.cancel()   # cut off at the end of the run
                await asyncio.gather(running, return_exceptions=True)
                break
            try:
                running.result()
                request.done = True
            except Exception as exc:
                code = error_code(exc)
                if code is None:
                    raise
                errors[code] = errors.get(code, 0) + 1
                await asyncio.sleep(0.1)
        stop.cancel()


async def _one_request(mode, stub, channel, drafter, edges, prompt, settings, request, window, EdgeClient,
                       sampling_proto, pb, on_round: RoundObserver | None = None, cost: DraftCost | None = None):
    """One request of `mode` on an open channel, its commits recorded in `request` (and `window`, when
    given, told the edge committed); `on_round` is told each round's time on the wire and tokens (a
    Verify round: its call's time, the drafting `cost` being paid outside it; cloud-only: each
    streamed step, from the request's start or the step before)."""
    loop = asyncio.get_running_loop()

    def committed(tokens: int) -> None:
        request.token_times.append((loop.time(), tokens))
        if window is not None:
            window.committed(request.edge)
    if mode == "cloud-only":
        count, last = 0, loop.time()
        async for chunk in stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling_proto(settings)),
                                         timeout=600):
            count += len(chunk.token_ids)
            committed(count)
            if on_round is not None:
                now = loop.time()
                on_round(now - last, len(chunk.token_ids))
                last = now
        return
    gamma = "adaptive" if mode == "adaptive" else edges.cfg.gamma
    from edge_client.options import EdgeOptions, Speculation, Transport
    # auto is the default edge (the planner); hybrid and adaptive pin a plain chain
    shape = {} if mode == "auto" else {"gamma": gamma, "plan": "off"}
    options = EdgeOptions(Transport("", deadline_s=120), Speculation(qmode=edges.cfg.qmode, **shape))
    def round_done(event) -> None:
        on_round(event.rpc_s, event.tokens)
    client_class, paid = (paying_client(EdgeClient), {"cost": cost}) if cost is not None else (EdgeClient, {})
    async with client_class(options, drafter, edges.tokenizer, channel=channel,
                            on_round=round_done if on_round is not None else None, **paid) as client:
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

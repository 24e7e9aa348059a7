"""The edge's records of a generation: its stats (GenerationStats), each committed round
(RoundEvent, for metrics), and the cloud-only baseline's (CloudOnlyStats)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from spec_core.costmodel import expected_tokens_per_round


@dataclass
class GenerationStats:
    text: str = ""
    tokens: int = 0                 # generated tokens committed
    rounds: int = 0                 # Verify rounds that committed tokens
    drafted: int = 0
    accepted: int = 0
    acceptance_rate: float = 0.0    # accepted / drafted (vLLM's "draft acceptance rate")
    alpha: float = 0.0              # per-token acceptance α = accepted / (accepted + rejections): the
                                    # geometric model's estimate; drafts after a rejection are never tested
    rejections: int = 0             # rounds that ended with a corrected token
    tokens_per_round: float = 0.0   # 1 + accepted / rounds, as committed
    expected_tokens_per_round: float = 0.0  # (1 - α^(γ+1)) / (1 - α) at the measured α and mean γ
    wall_s: float = 0.0
    ttft_s: float = 0.0             # time to the first committed token
    tokens_per_s: float = 0.0
    bytes_up: int = 0               # protobuf payload + gRPC frame header, edge -> verifier
    bytes_down: int = 0
    gamma: int | str = 0
    mean_gamma: float = 0.0
    retries: int = 0
    replays: int = 0
    backoffs: int = 0               # refusals for load waited out (RESOURCE_EXHAUSTED / UNAVAILABLE + hint)
    backoff_s: float = 0.0          # total time spent waiting them out
    queued_s: float = 0.0           # the verifier queued the open past its first-token target: the first
                                    # token it predicted then, seconds (0: not queued)
    draft_s: float = 0.0            # total time drafting
    server_model_s: float = 0.0     # total time in the target model (server's own timing)
    finish_reason: str = ""
    nodes_per_round: float = 0.0    # draft tokens (chain) or tree nodes sent per round
    tree_rounds: int = 0            # rounds that carried a tree
    plans: str = ""                 # rounds sent per arm (chain, tree2x, tree4x, a fixed tree): `shapes` summed
    reused_drafts: int = 0          # drafted tokens reused from proactive drafting (--proactive)
    discarded_rounds: int = 0       # pipelined rounds dropped because their base was not committed
    redone_rounds: int = 0          # rounds sent again as drafted after their call failed (a replay, a miss)
    pipelined_rounds: int = 0       # pipelined rounds whose base was committed (verified, kept)
    draft_rolled_back: int = 0      # across tokenizers: draft tokens re-tokenized away (KV rolled back)
    draft_retokenized: int = 0      # across tokenizers: draft tokens tokenized anew from committed text
    continuation_rounds: int = 0    # rounds during whose flight continuations were drafted
    continuations_sent: int = 0     # continuations shipped (pipelined or fused), each drafted for one outcome
    continuation_hits: int = 0      # rounds whose outcome a continuation had been drafted for (sent or reused)
    window_depth: float = 0.0       # a window (Speculation.window > 1): mean rounds in flight when one was sent
    fused_rounds: int = 0           # rounds sent with continuations for their own pass (--fuse)
    fused_hits: int = 0             # rounds verified in the pass of the round before (no pass of their own)
    shapes: dict[str, int] = field(default_factory=dict)   # rounds sent per shape: "chain g5 alone", "tree2x g4
                                    # pipelined", "chain g3 fused", "chain g4 ahead" (drafted during the last trip)
    planned: list[str] = field(default_factory=list)   # the options the planner chose (those not pinned)
    coupling: str = "rejection"     # how drafts were checked (--coupling)
    seed: int | None = None         # the seed sent (with --coupling gumbel, drawn when none was given)
    plan_reasons: str = ""          # the planner's reasons for the last round's shape, one line
    token_ids: list[int] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)

    def add_round(self, drafted: int, accepted: int, rejected: bool, depth: int, tree: bool, draft_s: float,
                  model_s: float) -> None:
        """One committed round: `drafted` nodes, `depth` the deepest path (a chain's γ), `model_s` the
        target pass it did not share with a round counted before."""
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.rejections += rejected
        self.tree_rounds += tree
        self.draft_s += draft_s
        self.server_model_s += model_s
        self.mean_gamma += (depth - self.mean_gamma) / self.rounds
        self.nodes_per_round += (drafted - self.nodes_per_round) / self.rounds

    def complete(self, wall_s: float, text: str, token_ids: list[int], spec, window_depth: float,
                 retokenization: tuple[int, int] | None = None) -> None:
        """The generation's end: its output and the statistics derived from the counts. `spec`: the
        session's edge_client.options.Speculation; `retokenization`: across tokenizers, the draft
        tokens rolled back and tokenized anew during the generation."""
        self.wall_s, self.text, self.token_ids, self.tokens = wall_s, text, token_ids, len(token_ids)
        self.acceptance_rate = self.accepted / self.drafted if self.drafted else 0.0
        tested = self.accepted + self.rejections
        self.alpha = self.accepted / tested if tested else 0.0
        self.tokens_per_round = self.tokens / self.rounds if self.rounds else 0.0
        self.gamma = spec.gamma if isinstance(spec.gamma, int) else f"{spec.gamma}(mean {self.mean_gamma:.2f})"
        self.expected_tokens_per_round = expected_tokens_per_round(self.alpha, round(self.mean_gamma))
        self.tokens_per_s = self.tokens / wall_s if wall_s else 0.0
        if spec.window > 1:
            self.window_depth = window_depth
        self.shapes = dict(sorted(self.shapes.items(), key=lambda kv: -kv[1]))
        arms: dict[str, int] = {}
        for label, n in self.shapes.items():
            arms[label.split()[0]] = arms.get(label.split()[0], 0) + n
        self.plans = ", ".join(f"{k}×{v}" for k, v in sorted(arms.items()))
        self.planned = list(spec.planned or ())
        if retokenization is not None:
            self.draft_rolled_back, self.draft_retokenized = retokenization

    def round_stats(self) -> dict:
        """The statistics without the output itself: what `edge-client serve` puts in a response's
        `hybridspec` field (the response carries the text; `tokens` is named `committed_tokens` there,
        as a stop string can end the reply before the last committed token). So a field added to this
        record is reported by `generate --json` and by serve alike."""
        out = {k: v for k, v in asdict(self).items() if k not in _OUTPUT}
        out["committed_tokens"] = out.pop("tokens")
        return out


# GenerationStats' fields that are the output, not statistics: a response carries its text, and its
# finish_reason in OpenAI's terms.
_OUTPUT = ("text", "token_ids", "finish_reason")


@dataclass
class RoundEvent:
    """One committed round, as seen by the edge (for metrics: `EdgeClient(on_round=...)`)."""

    gamma: int          # the draft's depth: its tokens for a chain, the deepest path for a tree
    accepted: int       # of them accepted
    tokens: int         # committed this round: accepted + the corrected or bonus token
    draft_s: float      # time drafting
    rpc_s: float        # wall time of the Verify RPC, retries included (round trip + server)
    server_s: float     # the server's own time for the round
    round: int = 0      # the round number (within the verifier session)
    base: int = 0       # the committed length (prompt included) the round was drafted after
    plan: object = None  # its edge_client.planner.RoundPlan: chain or tree, depth, shape (replay records)
    nodes: int = 0      # draft nodes the round carried (its plan's size, or fewer where drafting stopped)



@dataclass
class CloudOnlyStats:
    """The cloud-only baseline: the target streams its own output (one request)."""

    tokens: int
    wall_s: float
    ttft_s: float
    token_ids: list[int]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

"""The edge's options, built once: how to speculate, how to reach the verifier, how to prove who
we are. `EdgeClient(options, drafter, tokenizer)` takes them.

    options = EdgeOptions(Transport("127.0.0.1:50051"), Speculation(gamma="adaptive", tree="auto"))

From a command line: `add_edge_options(parser)` adds the shared options (drafter, speculation,
network, security) and `options_from_args(args)` builds the object, raising OptionError that names
the option to change. Each record checks itself on construction, so a bad value is refused here,
before a model loads or a verifier is asked.

The verifier states its own limits (ServerInfo: largest γ, tree nodes, branching);
`Speculation.within(limits)` is what the edge actually sends against that verifier.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from dataclasses import dataclass, field

from spec_core.drafting import QMode
from spec_core.warping import REJECTION
from spec_core.tree import TreeShape

log = logging.getLogger(__name__)

TOKEN_ENV = "HYBRIDSPEC_TOKEN"   # the bearer token when none is given
DEFAULT_SERVER = "127.0.0.1:50051"
ADAPTIVE = "adaptive"
TREE_MODES = ("off", "auto")
PLAN_MODES = ("auto", "off")
AUTO_WINDOW = 4   # the planner's most rounds in flight (the verifier's default max_window caps it too)
# The shape options the planner chooses when they are left unset, its range for each, and what an
# unset option is with the planner off.
PLANNED = ("gamma", "tree", "window", "proactive", "pipeline", "fuse")
PLANNER_DEFAULTS = {"gamma": ADAPTIVE, "tree": "auto", "window": AUTO_WINDOW, "proactive": True, "pipeline": True,
                    "fuse": True}
FIXED_DEFAULTS = {"gamma": 5, "tree": "off", "window": 1, "proactive": False, "pipeline": False, "fuse": False}


class OptionError(ValueError):
    """A bad option value: `option` names it (a field, or on the command line the flag, e.g.
    'argument --gamma'), `problem` says what is wrong with it."""

    def __init__(self, option: str, problem: str):
        super().__init__(f"{option}: {problem}")
        self.option, self.problem = option, problem


class OptionConflict(OptionError):
    """Two options that cannot work together: `options` names both (fields, or on the command line
    the flags), `problem` says why and what to change."""

    def __init__(self, first: str, second: str, problem: str):
        super().__init__(f"{first} and {second}", problem)
        self.options = (first, second)
        self.args = (f"{first} conflicts with {second}: {problem}",)

    def __str__(self) -> str:
        return self.args[0]


def parse_gamma(value: str | int) -> int | str:
    """γ: draft tokens per round (an integer >= 0; 0 drafts nothing, the target steps alone), or
    'adaptive' (the cost model picks it each round). The one place γ is read from text."""
    if value == ADAPTIVE:
        return ADAPTIVE
    problem = f"must be an integer >= 0 or 'adaptive', got {value!r}"
    if isinstance(value, float) and not value.is_integer():
        raise OptionError("gamma", problem)
    try:
        gamma = int(value)
    except (TypeError, ValueError):
        raise OptionError("gamma", problem) from None
    if gamma < 0:
        raise OptionError("gamma", problem)
    return gamma


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise OptionError(name, f"must be >= {low}, got {value}")


@dataclass(frozen=True)
class ServerLimits:
    """What one verifier accepts in a round (its ServerInfo); None: not stated, nothing to cap by."""

    max_gamma: int | None = None           # largest chain (and tree depth)
    max_tree_nodes: int | None = None      # 0: chains only
    max_tree_branching: int | None = None  # children of one node
    max_window: int | None = None          # rounds of a session in flight at once (None: not stated)
    verify_stream: bool = False            # it answers VerifyStream
    couplings: tuple[str, ...] = (REJECTION,)   # how it can check drafts (ServerInfo.couplings)
    backend: str = ""                      # its backend's name, for messages

    @classmethod
    def from_info(cls, info) -> "ServerLimits":
        from spec_core.proto.couplings import offered
        # In ServerInfo 0 means "not stated" for γ and branching, "chains only" for tree nodes.
        return cls(info.max_gamma or None, info.max_tree_nodes, info.max_tree_branching or None,
                   info.max_window or None, info.verify_stream, offered(info), info.backend)

    def coupling_refusal(self, coupling: str) -> str | None:
        """Why this verifier cannot check drafts with `coupling` (None: it can). One from before
        couplings were negotiated lists none and would check by rejection sampling without a word:
        the edge refuses before the first round instead."""
        if coupling in self.couplings:
            return None
        what = f"the {self.backend} verifier" if self.backend else "this verifier"
        return (f"--coupling {coupling} is not offered by {what} (ServerInfo.couplings: "
                f"{', '.join(self.couplings)}; a verifier from before couplings were negotiated checks by rejection "
                "sampling only): use --coupling rejection, or a verifier that offers it")


@dataclass(frozen=True)
class PlanInputs:
    """The planner's measured inputs, pinned (`--plan-inputs 'rtt_ms=600,draft_ms=2,node_ms=0.5'`): the
    planner (edge_client.planner.plan_round) reads these instead of what the session measures, so it
    chooses the same shape every round and a seed pins the output as it does with fixed options."""

    rtt_ms: float = 50.0        # the network round trip
    draft_ms: float = 2.0       # drafting one row (one token of a chain)
    verify_ms: float = 20.0     # the verifier's time for a round, before its nodes
    node_ms: float = 0.5        # the verifier's time per draft node
    up_ms_per_kb: float = 0.0   # the uplink's time per request KiB
    alpha: float = 0.7          # per-token acceptance

    @classmethod
    def parse(cls, text: str) -> "PlanInputs":
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, eq, value = part.partition("=")
            if not eq or name not in fields:
                raise OptionError("plan_inputs", f"{part!r}: give name=value pairs of {', '.join(sorted(fields))}")
            try:
                values[name] = float(value)
            except ValueError:
                raise OptionError("plan_inputs", f"{part!r}: {value!r} is not a number") from None
        out = cls(**values)
        if min(values.values(), default=0.0) < 0 or not 0 < out.alpha < 1:
            raise OptionError("plan_inputs", f"{text!r}: times must be >= 0 and alpha in (0, 1)")
        return out


@dataclass(frozen=True)
class Speculation:
    """How the edge drafts. Strings are accepted where the command line has them
    (gamma '5' or 'adaptive', qmode 'fixed:16:16', tree 'budget=16,depth=4')."""

    gamma: int | str | None = None       # draft tokens per round, or "adaptive" (None: the planner's)
    max_gamma: int = 12                  # upper bound for adaptive γ
    qmode: QMode | str = field(default_factory=QMode)   # q on the wire (spec_core.drafting.QMode)
    tree: str | TreeShape | None = None  # "off" (chains), "auto" (cost model), or a TreeShape every round
    max_tree_nodes: int = 64             # largest tree "auto" may send
    proactive: bool | None = None        # draft the next round during the round trip
    pipeline: bool | None = None         # also send it before the reply (verified only on its base)
    strict_tokenizer: bool = False       # refuse a target with another tokenizer instead of drafting across vocabularies
    target_vocab: str | None = None      # the target's vocabulary from a file (its GGUF, or a cached .pb) instead of GetVocabulary
    steer: bool = True                   # adaptive γ / tree "auto": draft at most the verifier's budget
                                         # (VerifyReply.budget); a fixed γ or tree shape stays as asked
    slo_tpot_ms: float = 0.0             # the latency target stated to the verifier (0: none; its default)
    slo_ttft_ms: float = 0.0
    max_continuations: int = 8           # outcomes drafted for per round in flight (1: the most likely one)
    fuse: bool | None = None             # draft continuations before a round leaves, for its own target pass
                                         # (VerifyRequest.next_continuations), when the cost model says they pay
    window: int | None = None            # most rounds in flight at once (1: none; 2+: a window, pipeline
                                         # implied; the cost model picks the depth, edge_client.window)
    plan: str = "auto"                   # "auto": the planner picks every shape option left unset (None) each
                                         # round (edge_client.planner); "off": unset options keep fixed defaults
                                         # (a chain of 5, nothing in flight)
    plan_inputs: PlanInputs | str | None = None   # pin the planner's measured inputs: the same shape every round
    planned: tuple[str, ...] | None = None   # the options the planner chooses (set from the unset ones)

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        if self.plan not in PLAN_MODES:
            raise OptionError("plan", f"must be 'auto' or 'off', got {self.plan!r}")
        if isinstance(self.plan_inputs, str):
            set_("plan_inputs", PlanInputs.parse(self.plan_inputs))
        if self.planned is None:
            unset = tuple(n for n in PLANNED if getattr(self, n) is None)
            set_("planned", unset if self.plan == "auto" else ())
        for name in PLANNED:   # what an unset option is: the planner's range, or today's fixed default
            if getattr(self, name) is None:
                set_(name, (PLANNER_DEFAULTS if self.plan == "auto" else FIXED_DEFAULTS)[name])
        if "pipeline" in self.planned:
            set_("pipeline", self.window > 1)   # pipelined rounds are what a window holds beyond the first
        set_("gamma", parse_gamma(self.gamma))
        _at_least("max_gamma", self.max_gamma, 1)
        _at_least("max_tree_nodes", self.max_tree_nodes, 1)
        for name in ("slo_tpot_ms", "slo_ttft_ms"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value <= 3_600_000):
                raise OptionError(name, f"must be a number of milliseconds in [0, 3600000], got {value!r}")
        _at_least("max_continuations", self.max_continuations, 1)
        _at_least("window", self.window, 1)
        if self.window > 1 and not self.pipeline:
            set_("pipeline", True)   # a window sends rounds before the replies: pipelined rounds
        if isinstance(self.qmode, str):
            try:
                set_("qmode", QMode.parse(self.qmode))
            except (TypeError, ValueError) as e:
                raise OptionError("qmode", f"{self.qmode!r}: {e}") from None
        if isinstance(self.tree, str) and self.tree not in TREE_MODES:
            try:
                set_("tree", TreeShape.parse(self.tree))
            except (TypeError, ValueError) as e:
                raise OptionError("tree", f"'off', 'auto' or a shape such as 'budget=16,depth=4,branching=2,"
                                          f"width=4', got {self.tree!r}: {e}") from None
        refuse_conflicts(self)

    def timing_dependent(self) -> tuple[str, ...]:
        """The options whose choices follow measured timings (and the verifier's load), so that a
        seed does not pin the output: adaptive γ, tree 'auto', and pipelined or fused chains with
        continuations for more than one outcome (their length is chosen by the cost model,
        edge_client.planner.continuation_length). All of these stay exact. With none of them the
        same seed gives the same ids, with or without proactive or pipelined rounds and whichever
        outcomes got a continuation in time: a round's draft and the verifier's draws depend only on
        the seed and the committed tokens, and a continuation is drafted with the plan a fresh round
        after its outcome would have (RoundPlan.within). The planner ('plan') follows measured timings
        too, unless its inputs are pinned (plan_inputs): then it chooses once, from them. All of this
        is about the default coupling: with SamplingSettings.coupling "gumbel" a seed pins the output
        whatever these options do (spec_core.gumbel)."""
        out = []
        chosen_once = set(self.planned or ()) if self.plan_inputs is not None else set()
        if self.planned and self.plan_inputs is None:
            out.append("plan")
        if self.gamma == ADAPTIVE and "gamma" not in chosen_once:
            out.append("gamma")
        if self.tree == "auto" and "tree" not in chosen_once:
            out.append("tree")
        if (self.pipeline or self.fuse) and self.max_continuations > 1 and self.tree == "off" and \
                self.plan_inputs is None:
            out.append("max_continuations")
        return tuple(out)

    @property
    def draft_tree_nodes(self) -> int:
        """Tree nodes the drafter must hold at once (0: chains only)."""
        if self.tree == "off":
            return 0
        budget = self.tree.budget if isinstance(self.tree, TreeShape) else 0
        return max(self.max_tree_nodes, budget, 64)

    def within(self, limits: ServerLimits) -> "Speculation":
        """These options, capped by what one verifier accepts (a longer γ or a larger tree would be
        refused with RESOURCE_EXHAUSTED every round)."""
        out = self
        if limits.max_gamma is not None:
            if self.gamma != ADAPTIVE and self.gamma > limits.max_gamma:
                log.warning("gamma %d is above the verifier's limit; drafting %d", self.gamma, limits.max_gamma)
                out = dataclasses.replace(out, gamma=limits.max_gamma)
            out = dataclasses.replace(out, max_gamma=min(out.max_gamma, limits.max_gamma))
        if self.window > 2 and (limits.max_window or 2) < self.window:
            # A verifier that does not state a window takes one pipelined round behind another.
            log.warning("a window of %d rounds is above the verifier's limit; keeping %d in flight", self.window,
                        limits.max_window or 2)
            out = dataclasses.replace(out, window=limits.max_window or 2)
        if self.tree == "off":
            return out
        if limits.max_tree_nodes == 0:
            log.warning("the verifier verifies chains only; drafting chains instead of trees")
            return dataclasses.replace(out, tree="off")
        if limits.max_tree_nodes is not None:
            out = dataclasses.replace(out, max_tree_nodes=min(out.max_tree_nodes, limits.max_tree_nodes))
        if isinstance(self.tree, TreeShape):
            s = self.tree
            capped = TreeShape(budget=min(s.budget, limits.max_tree_nodes or s.budget),
                               depth=min(s.depth, limits.max_gamma or s.depth),
                               branching=min(s.branching, limits.max_tree_branching or s.branching), width=s.width)
            if capped != s:
                log.warning("tree %s is beyond the verifier's limits; drafting %s", s, capped)
                out = dataclasses.replace(out, tree=capped)
        return out


def refuse_conflicts(spec: Speculation, drafter: str | None = None, drafter_builds_trees: bool = True) -> None:
    """The one place two options are refused together: OptionConflict naming both and why, before
    any model loads or the first round. Every other combination of the speculation options (chain,
    tree or auto; proactive, pipeline, continuations, a window of rounds in flight; q none, fixed or
    float; greedy or sampled; same vocabulary or across) runs: tests/test_option_matrix.py checks it.
    `drafter` (its name, e.g. 'lookup') and whether it builds trees: checked when given."""
    if drafter is not None and spec.tree != "off" and not drafter_builds_trees and "tree" not in (spec.planned or ()):
        raise OptionConflict(f"tree={_shown(spec.tree)}", f"drafter={drafter}",
                             f"the {drafter} drafter here proposes chains only (prompt lookup has no model to rank "
                             "a tree's branches; a GGUF drafter made without tree drafting builds none); use tree "
                             "'off', or a drafter that builds trees (gguf, synthetic)")
    if spec.fuse and spec.window > 1 and not {"fuse", "window"} & set(spec.planned or ()):
        raise OptionConflict("fuse", f"window={spec.window}",
                             "a window sends the next rounds as rounds in flight (the verifier fuses one that waits "
                             "into its predecessor's pass by itself); --fuse sends them with the round: use one")
    if spec.strict_tokenizer and spec.target_vocab:
        raise OptionConflict("target_vocab", "strict_tokenizer",
                             "the target's vocabulary is only read to draft across vocabularies, which the strict "
                             "tokenizer check refuses; drop one of them")


def _shown(tree: str | TreeShape) -> str:
    if isinstance(tree, str):
        return tree
    return ",".join(f"{f.name}={getattr(tree, f.name)}" for f in dataclasses.fields(tree))


def refuse_drafter_conflicts(spec: Speculation, drafter) -> Speculation:
    """refuse_conflicts for a drafter already built (edge_client.drafters.Drafter); returns the options
    for it: trees left to the planner are chains for a drafter that builds none."""
    refuse_conflicts(spec, drafter.name, drafter.supports_trees)
    if "tree" in (spec.planned or ()) and not drafter.supports_trees:
        return dataclasses.replace(spec, tree="off")
    return spec


@dataclass(frozen=True)
class Transport:
    """Where the verifier is and how hard to try."""

    server: str = DEFAULT_SERVER         # host:port
    deadline_s: float = 30.0             # allowed per RPC before it is retried
    max_retries: int = 8                 # retries of one round on UNAVAILABLE / DEADLINE_EXCEEDED / CANCELLED
    max_replays: int = 8                 # replays in a row (nothing committed between) after NOT_FOUND / out of step
    max_wait_s: float = 300.0            # waiting out refusals for load (retry hints), per round
    stream: bool = True                  # a session's rounds after the first on one VerifyStream call when
                                         # the verifier offers it (ServerInfo.verify_stream); else unary Verify

    def __post_init__(self):
        if not self.deadline_s > 0:
            raise OptionError("deadline_s", f"must be > 0 seconds, got {self.deadline_s}")
        _at_least("max_retries", self.max_retries, 0)
        _at_least("max_replays", self.max_replays, 0)
        if not self.max_wait_s >= 0:
            raise OptionError("max_wait_s", f"must be >= 0 seconds, got {self.max_wait_s}")


@dataclass(frozen=True)
class Security:
    """TLS (mutual with a client certificate and key) and the bearer token. PEM values are bytes
    or paths to PEM files."""

    tls: bool = False                    # TLS trusting the system's CAs (implied by any tls_* below)
    tls_ca: str | bytes | None = None    # CA bundle to trust for the verifier's certificate
    tls_cert: str | bytes | None = None  # client certificate, for mutual TLS (with tls_key)
    tls_key: str | bytes | None = None
    tls_server_name: str | None = None   # name to check the certificate against, when not the address
    token: str | None = None             # bearer token; None: $HYBRIDSPEC_TOKEN

    def __post_init__(self):
        if bool(self.tls_cert) != bool(self.tls_key):
            raise OptionError("tls_cert", "give both tls_cert and tls_key, or neither (a client certificate and "
                                          "its key, for mutual TLS)")

    def bearer_token(self) -> str | None:
        return self.token if self.token is not None else os.environ.get(TOKEN_ENV) or None

    def channel_kwargs(self) -> dict:
        """open_channel's keyword arguments."""
        return dict(tls=self.tls, tls_ca=self.tls_ca, tls_cert=self.tls_cert, tls_key=self.tls_key,
                    tls_server_name=self.tls_server_name)


@dataclass(frozen=True)
class EdgeOptions:
    transport: Transport = field(default_factory=Transport)
    speculation: Speculation = field(default_factory=Speculation)
    security: Security = field(default_factory=Security)

    def at(self, server: str) -> "EdgeOptions":
        """The same options for the verifier at `server`."""
        return dataclasses.replace(self, transport=dataclasses.replace(self.transport, server=server))


# --- the command line ------------------------------------------------------------------------------

def add_edge_options(p: argparse.ArgumentParser, *, server: bool = True, drafting: bool = True,
                     security: bool = True) -> None:
    """The options every edge command shares: --server, the drafter and speculation (`drafting`),
    the network, and TLS and the token (`security`)."""
    if server:
        p.add_argument("--server", default=DEFAULT_SERVER, help="verifier address host:port")
    if drafting:
        _add_drafting(p)
    n = p.add_argument_group("network")
    n.add_argument("--deadline", type=float, default=30.0, help="seconds allowed per RPC before it is retried")
    if drafting:
        n.add_argument("--retries", type=int, default=8, help="retries of one round on UNAVAILABLE / DEADLINE_EXCEEDED")
        n.add_argument("--no-stream", action="store_false", dest="stream",
                       help="send every round as a unary Verify call, even to a verifier that offers VerifyStream")
    if security:
        _add_security(p)


def _add_drafting(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("speculation")
    s.add_argument("--plan", choices=PLAN_MODES, default="auto",
                   help="auto: before each round the planner picks every shape option not given here (gamma, tree, "
                        "window, proactive, pipeline, fuse) from the measured round trip, uplink, drafting and "
                        "verifier times and acceptance; off: options not given keep fixed defaults (a chain of 5, "
                        "nothing in flight)")
    s.add_argument("--plan-inputs", metavar="NAME=VALUE,...",
                   help="pin the planner's measured inputs (rtt_ms, draft_ms, verify_ms, node_ms, up_ms_per_kb, "
                        "alpha): it chooses once from them, so a --seed repeats the output")
    s.add_argument("--gamma", default=None, help="draft tokens per round, or 'adaptive' (default: the planner's; "
                                                 "5 with --plan off)")
    s.add_argument("--max-gamma", type=int, default=12, help="upper bound for adaptive gamma")
    s.add_argument("--q", default="fixed:16:16", dest="qmode",
                   help="q on the wire: none | fixed[:TOPK[:BITS]] | float[:TOPK] (TOPK 0 = whole vocabulary)")
    s.add_argument("--drafter", choices=["gguf", "lookup", "synthetic"], default="gguf",
                   help="gguf: a draft model (--draft); lookup: prompt lookup, no model; synthetic: test pair")
    s.add_argument("--draft", help="draft GGUF file, or a bundled model's name (smollm2, gemma); default: "
                                   "models/smollm2-draft.gguf (scripts/setup.sh makes it). One with another tokenizer "
                                   "than the target's drafts across vocabularies (docs/usage.md)")
    s.add_argument("--strict-tokenizer", action="store_true",
                   help="refuse a target whose tokenizer differs from the draft's instead of drafting across "
                        "vocabularies")
    s.add_argument("--target-vocab", help="the target's vocabulary from a local file (the target's GGUF or bundled "
                                          "name, or a saved .pb) instead of asking the verifier (GetVocabulary) the "
                                          "first time")
    s.add_argument("--tokenizer", help="GGUF file or bundled model's name (smollm2, gemma) whose vocabulary to use "
                                       "with --drafter lookup (default: smollm2)")
    s.add_argument("--threads", type=int, default=None, help="CPU threads for the draft model")
    s.add_argument("--tree", default=None,
                   help="token trees: 'off' (chains), 'auto' (the cost model picks chain or tree each round), or a "
                        "shape 'budget=16,depth=4,branching=2,width=4' (that tree every round); default: the "
                        "planner's ('auto'; 'off' with --plan off)")
    s.add_argument("--max-tree-nodes", type=int, default=64, help="largest tree --tree auto may send")
    s.add_argument("--proactive", action="store_true", default=None,
                   help="while a round is in flight, draft the next one from its most likely outcome; reuse it "
                        "when the reply matches")
    s.add_argument("--pipeline", action="store_true", default=None,
                   help="also send that next round before the reply (verified only if its base was committed, "
                        "discarded and counted otherwise)")
    s.add_argument("--window", type=int, default=None, metavar="K",
                   help="keep up to K rounds in flight (implies --pipeline): round r + 2 travels while r and r + 1 "
                        "are unanswered, each keyed by the outcomes it assumes; the cost model picks the depth "
                        "from the measured round trip, verifier, drafting and uplink times (1 = off; default: the "
                        f"planner's, up to {AUTO_WINDOW}; 1 with --plan off)")
    s.add_argument("--no-steer", action="store_false", dest="steer",
                   help="with --gamma adaptive / --tree auto, ignore the verifier's draft budget")
    s.add_argument("--slo-tpot-ms", type=float, default=0.0,
                   help="latency target stated to the verifier: time per output token, ms (0: none)")
    s.add_argument("--slo-ttft-ms", type=float, default=0.0, help="... and time to first token, ms (0: none)")
    s.add_argument("--continuations", type=int, default=8, metavar="N",
                   help="with --proactive / --pipeline: draft the next round for up to N likely outcomes of the "
                        "round in flight (the cost model picks how many pay; 1 = only 'every draft accepted')")
    s.add_argument("--fuse", action="store_true", default=None,
                   help="draft the next round for the likely outcomes of a round before sending it, so that the "
                        "verifier runs the one that comes true in the same target pass and answers both in one "
                        "reply (only while the cost model says the saved round outweighs the drafting delay)")
    s.add_argument("--synthetic-vocab", type=int, default=64,
                   help="(--drafter synthetic) vocabulary size, as the synthetic verifier's --synthetic-vocab")
    s.add_argument("--synthetic-seed", type=int, default=0,
                   help="(--drafter synthetic) the target's seed, as the synthetic verifier's --synthetic-seed")
    s.add_argument("--synthetic-noise", type=float, default=1.0,
                   help="(--drafter synthetic) how far the draft is blurred from the target (0: the target itself)")


def _add_security(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("security", "TLS to the verifier and the bearer token it asks for")
    t.add_argument("--tls", action="store_true", help="connect with TLS, trusting the system's CAs")
    t.add_argument("--tls-ca", help="PEM CA bundle to trust for the verifier's certificate (implies --tls)")
    t.add_argument("--tls-cert", help="PEM client certificate, for mutual TLS (with --tls-key)")
    t.add_argument("--tls-key", help="PEM private key of --tls-cert")
    t.add_argument("--tls-server-name", help="name to check the verifier's certificate against, when it differs "
                                             "from the address in --server")
    t.add_argument("--token", help=f"bearer token (default: ${TOKEN_ENV}); prefer --token-file or the "
                                   "environment: a command line is visible to other users of the machine")
    t.add_argument("--token-file", help="file holding the bearer token (e.g. a mounted secret)")


# The flag that sets each field, to name it when a record refuses a value.
FLAGS = {"gamma": "--gamma", "max_gamma": "--max-gamma", "qmode": "--q", "tree": "--tree",
         "max_tree_nodes": "--max-tree-nodes", "deadline_s": "--deadline", "max_retries": "--retries",
         "tls_cert": "--tls-cert/--tls-key", "slo_tpot_ms": "--slo-tpot-ms", "slo_ttft_ms": "--slo-ttft-ms",
         "max_continuations": "--continuations", "drafter": "--drafter", "target_vocab": "--target-vocab",
         "strict_tokenizer": "--strict-tokenizer", "window": "--window", "fuse": "--fuse", "plan": "--plan",
         "plan_inputs": "--plan-inputs"}


def _flag(option: str) -> str:
    """'tree=auto' -> '--tree auto'; 'gamma' -> '--gamma'."""
    name, eq, value = option.partition("=")
    flag = FLAGS.get(name, name)
    return f"{flag} {value}" if eq else flag


def _as_flag(build):
    try:
        return build()
    except OptionConflict as e:
        raise OptionConflict(*(f"argument {_flag(o)}" for o in e.options), e.problem) from None
    except OptionError as e:
        raise OptionError(f"argument {FLAGS.get(e.option, e.option)}", e.problem) from None


def options_from_args(args: argparse.Namespace) -> EdgeOptions:
    """The EdgeOptions of add_edge_options' arguments; OptionError names a bad one."""
    spec = Speculation()
    if hasattr(args, "gamma"):
        spec = _as_flag(lambda: Speculation(
            gamma=args.gamma, max_gamma=args.max_gamma, qmode=args.qmode, tree=args.tree,
            max_tree_nodes=args.max_tree_nodes, proactive=args.proactive, pipeline=args.pipeline,
            strict_tokenizer=getattr(args, "strict_tokenizer", False), target_vocab=getattr(args, "target_vocab", None),
            steer=getattr(args, "steer", True), slo_tpot_ms=getattr(args, "slo_tpot_ms", 0.0),
            slo_ttft_ms=getattr(args, "slo_ttft_ms", 0.0), max_continuations=args.continuations,
            window=getattr(args, "window", None), fuse=getattr(args, "fuse", None), plan=getattr(args, "plan", "auto"),
            plan_inputs=getattr(args, "plan_inputs", None)))
        if hasattr(args, "drafter"):
            _as_flag(lambda: refuse_conflicts(spec, args.drafter, _drafter_class(args.drafter).supports_trees))
    transport = _as_flag(lambda: Transport(
        server=getattr(args, "server", ""), deadline_s=args.deadline,
        max_retries=getattr(args, "retries", Transport.max_retries), stream=getattr(args, "stream", True)))
    security = Security()
    if hasattr(args, "token_file"):
        token = args.token
        if args.token_file:
            try:
                with open(args.token_file) as f:
                    token = f.read().strip()
            except OSError as e:
                raise OptionError("argument --token-file", f"cannot read {args.token_file}: {e.strerror}") from None
        security = _as_flag(lambda: Security(
            tls=args.tls, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
            tls_server_name=args.tls_server_name, token=token))
    return EdgeOptions(transport, spec, security)


def _drafter_class(name: str):
    """The class behind --drafter NAME (its capabilities, before anything loads)."""
    from edge_client.drafters import GGUFDrafter, PromptLookupDrafter, SyntheticDrafter
    return {"lookup": PromptLookupDrafter, "synthetic": SyntheticDrafter, "gguf": GGUFDrafter}[name]


def build_drafter(args: argparse.Namespace, spec: Speculation):
    """(drafter, tokenizer) from add_edge_options' drafter arguments (this loads the draft model;
    options_from_args has refused a drafter that conflicts with the speculation options)."""
    from edge_client.drafters import GGUFDrafter, PromptLookupDrafter, SyntheticDrafter
    if args.drafter == "synthetic":
        from edge_client.text import SyntheticTokenizer
        return (SyntheticDrafter(args.synthetic_vocab, args.synthetic_seed, args.synthetic_noise),
                SyntheticTokenizer(args.synthetic_vocab))
    if args.drafter == "lookup":
        from llama_runtime import GGUFModel, bundled_model_path
        tok = GGUFModel(args.tokenizer or bundled_model_path(), vocab_only=True)
        return PromptLookupDrafter(fingerprint=tok.fingerprint), tok
    d = GGUFDrafter(draft_path(args), n_threads=args.threads, max_tree_nodes=spec.draft_tree_nodes)
    return d, d.model


def draft_path(args: argparse.Namespace) -> str:
    """--draft, or the default draft when it exists; SystemExit saying how to make one otherwise."""
    from edge_client.drafters import DEFAULT_DRAFT
    if args.draft:
        return args.draft
    if DEFAULT_DRAFT.is_file():
        return str(DEFAULT_DRAFT)
    raise SystemExit("--draft DRAFT.gguf is required with --drafter gguf "
                     "(make one with: edge-client make-draft --target TARGET.gguf --out DRAFT.gguf)")

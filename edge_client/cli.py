"""edge-client: draft on this device, verify on a cloud verifier, stream the text."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

from spec_core.drafting import QMode
from spec_core.warping import SamplingSettings


def add_generation_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prompt and sampling")
    g.add_argument("--prompt", help="prompt text (default: read standard input)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template (GGUF metadata)")
    g.add_argument("--system", help="system message for --chat")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    g.add_argument("--seed", type=int, default=None, help="seed for the edge's and the verifier's samplers")
    s = p.add_argument_group("speculation")
    s.add_argument("--gamma", default="5", help="draft tokens per round, or 'adaptive'")
    s.add_argument("--max-gamma", type=int, default=12, help="upper bound for adaptive gamma")
    s.add_argument("--q", default="fixed:16:16", dest="qmode",
                   help="q on the wire: none | fixed[:TOPK[:BITS]] | float[:TOPK] (TOPK 0 = whole vocabulary)")
    s.add_argument("--drafter", choices=["gguf", "lookup", "synthetic"], default="gguf",
                   help="gguf: a draft model (--draft); lookup: prompt lookup, no model; synthetic: test pair")
    s.add_argument("--draft", help="draft GGUF file sharing the target's tokenizer (default: models/smollm2-draft.gguf "
                                   "when it exists)")
    s.add_argument("--tokenizer", help="GGUF file whose vocabulary to use with --drafter lookup (default: bundled)")
    s.add_argument("--threads", type=int, default=None, help="CPU threads for the draft model")
    s.add_argument("--tree", default="off",
                   help="token trees: 'off' (chains), 'auto' (the cost model picks chain or tree each round), or a "
                        "shape 'budget=16,depth=4,branching=2,width=4' (that tree every round)")
    s.add_argument("--max-tree-nodes", type=int, default=64, help="largest tree --tree auto may send")
    s.add_argument("--proactive", action="store_true",
                   help="while a round is in flight, draft the next one from its most likely outcome; reuse it "
                        "when the reply matches")
    s.add_argument("--pipeline", action="store_true",
                   help="also send that next round before the reply (verified only if its base was committed, "
                        "discarded and counted otherwise)")
    s.add_argument("--synthetic-vocab", type=int, default=64)
    s.add_argument("--synthetic-seed", type=int, default=0)
    s.add_argument("--synthetic-noise", type=float, default=1.0)
    n = p.add_argument_group("network")
    n.add_argument("--deadline", type=float, default=30.0, help="seconds allowed per RPC before it is retried")
    n.add_argument("--retries", type=int, default=8, help="retries of one round on UNAVAILABLE / DEADLINE_EXCEEDED")


def build_drafter(args):
    """(drafter, tokenizer) from the CLI arguments."""
    from edge_client.drafters import GGUFDrafter, PromptLookupDrafter, SyntheticDrafter
    if args.drafter == "synthetic":
        from edge_client.text import SyntheticTokenizer
        return (SyntheticDrafter(args.synthetic_vocab, args.synthetic_seed, args.synthetic_noise),
                SyntheticTokenizer(args.synthetic_vocab))
    if args.drafter == "lookup":
        from llama_runtime import GGUFModel, bundled_model_path
        tok = GGUFModel(args.tokenizer or bundled_model_path(), vocab_only=True)
        return PromptLookupDrafter(fingerprint=tok.fingerprint), tok
    if not args.draft:
        from edge_client.drafters import DEFAULT_DRAFT
        if DEFAULT_DRAFT.is_file():
            args.draft = str(DEFAULT_DRAFT)
    if not args.draft:
        raise SystemExit("--draft DRAFT.gguf is required with --drafter gguf "
                         "(make one with: edge-client make-draft --target TARGET.gguf --out DRAFT.gguf)")
    tree_nodes = 0 if getattr(args, "tree", "off") == "off" else max(args.max_tree_nodes, 64)
    d = GGUFDrafter(args.draft, n_threads=args.threads, max_tree_nodes=tree_nodes)
    return d, d.model


def settings_from_args(args) -> SamplingSettings:
    return SamplingSettings(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_new_tokens=args.max_tokens, seed=args.seed)


def prompt_ids(args, tokenizer) -> list[int] | str:
    text = args.prompt if args.prompt is not None else sys.stdin.read()
    if args.chat:
        from edge_client.text import render_chat
        return render_chat(tokenizer, text, args.system)
    return text


async def run_generate(args, server: str, out=sys.stdout, quiet: bool = False):
    from edge_client.client import EdgeClient
    drafter, tokenizer = build_drafter(args)
    gamma = args.gamma if args.gamma == "adaptive" else int(args.gamma)
    try:
        async with EdgeClient(server, drafter, tokenizer, gamma=gamma, qmode=QMode.parse(args.qmode),
                              deadline_s=args.deadline, max_retries=args.retries, max_gamma=args.max_gamma,
                              tree=getattr(args, "tree", "off"),
                              max_tree_nodes=getattr(args, "max_tree_nodes", 64),
                              proactive=getattr(args, "proactive", False),
                              pipeline=getattr(args, "pipeline", False)) as client:
            gen = client.generate(prompt_ids(args, tokenizer), settings_from_args(args))
            async for piece in gen:
                if not quiet:
                    out.write(piece)
                    out.flush()
            if not quiet:
                out.write("\n")
            return gen.stats
    finally:
        drafter.close()


def cmd_generate(args) -> int:
    from edge_client.client import EdgeError
    try:
        stats = asyncio.run(run_generate(args, args.server))
    except EdgeError as e:
        print(f"edge-client: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(stats.to_json()))
    else:
        print(f"[{stats.tokens} tokens in {stats.wall_s:.2f}s, {stats.rounds} rounds, "
              f"acceptance {stats.acceptance_rate:.2f}, {stats.tokens_per_round:.2f} tokens/round]", file=sys.stderr)
    return 0


def cmd_info(args) -> int:
    import grpc
    from spec_core.proto import verifier_pb2 as pb, verifier_pb2_grpc as pb_grpc
    from google.protobuf.json_format import MessageToDict

    async def go():
        async with grpc.aio.insecure_channel(args.server) as ch:
            return await pb_grpc.VerifierStub(ch).GetServerInfo(pb.ServerInfoRequest(), timeout=args.deadline)
    print(json.dumps(MessageToDict(asyncio.run(go()), preserving_proto_field_name=True), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edge-client", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate text with a draft here and the target on a verifier")
    p.add_argument("--server", default="127.0.0.1:50051", help="verifier address host:port")
    p.add_argument("--json", action="store_true", help="end with one JSON line of statistics")
    add_generation_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("info", help="print the verifier's model, fingerprint and limits")
    p.add_argument("--server", default="127.0.0.1:50051")
    p.add_argument("--deadline", type=float, default=10.0)
    p.set_defaults(func=cmd_info)

    from edge_client import draftcli
    draftcli.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

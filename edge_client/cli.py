"""edge-client: draft on this device, verify on a cloud verifier, stream the text."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

from spec_core.drafting import QMode
from spec_core.warping import SamplingSettings


def add_generation_args(p: argparse.ArgumentParser, prompt_and_sampling: bool = True) -> None:
    """The options of a generation; `serve` takes the prompt and sampling from each request."""
    if prompt_and_sampling:
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


def add_security_args(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("security", "TLS to the verifier and the bearer token it asks for")
    t.add_argument("--tls", action="store_true", help="connect with TLS, trusting the system's CAs")
    t.add_argument("--tls-ca", help="PEM CA bundle to trust for the verifier's certificate (implies --tls)")
    t.add_argument("--tls-cert", help="PEM client certificate, for mutual TLS (with --tls-key)")
    t.add_argument("--tls-key", help="PEM private key of --tls-cert")
    t.add_argument("--tls-server-name", help="name to check the verifier's certificate against, when it differs "
                                             "from the address in --server")
    t.add_argument("--token", help="bearer token (default: $HYBRIDSPEC_TOKEN); prefer --token-file or the "
                                   "environment: a command line is visible to other users of the machine")
    t.add_argument("--token-file", help="file holding the bearer token (e.g. a mounted secret)")


def security_kwargs(args) -> dict:
    """EdgeClient / open_channel keyword arguments from add_security_args' options."""
    token = args.token
    if args.token_file:
        with open(args.token_file) as f:
            token = f.read().strip()
    return dict(tls=args.tls, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
                tls_server_name=args.tls_server_name, token=token)


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
        security = security_kwargs(args) if hasattr(args, "token_file") else {}
        async with EdgeClient(server, drafter, tokenizer, gamma=gamma, qmode=QMode.parse(args.qmode),
                              deadline_s=args.deadline, max_retries=args.retries, max_gamma=args.max_gamma,
                              tree=getattr(args, "tree", "off"),
                              max_tree_nodes=getattr(args, "max_tree_nodes", 64),
                              proactive=getattr(args, "proactive", False),
                              pipeline=getattr(args, "pipeline", False),
                              **security) as client:
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

    from edge_client.client import TOKEN_ENV, auth_metadata, open_channel
    security = security_kwargs(args)
    token = security.pop("token") or os.environ.get(TOKEN_ENV)

    async def go():
        async with open_channel(args.server, **security) as ch:
            return await pb_grpc.VerifierStub(ch).GetServerInfo(pb.ServerInfoRequest(), timeout=args.deadline,
                                                                metadata=auth_metadata(token))
    try:
        info = asyncio.run(go())
    except grpc.aio.AioRpcError as e:   # e.g. UNAUTHENTICATED, UNAVAILABLE: one line, not a traceback
        print(f"edge-client: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2
    print(json.dumps(MessageToDict(info, preserving_proto_field_name=True), indent=2))
    return 0


SERVE_READY = "edge-client serving on"  # printed by `edge-client serve` once it accepts requests


def cmd_serve(args) -> int:
    # FastAPI, uvicorn and prometheus_client are imported only here: `generate` needs none of them.
    from edge_client import serve

    def ready(port: int, metrics_port: int | None) -> None:
        metrics = f" metrics http://{args.host}:{metrics_port}/metrics" if metrics_port is not None else ""
        print(f"{SERVE_READY} http://{args.host}:{port}/v1{metrics}", flush=True)
    return serve.run(args, on_ready=ready)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edge-client", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate text with a draft here and the target on a verifier")
    p.add_argument("--server", default="127.0.0.1:50051", help="verifier address host:port")
    p.add_argument("--json", action="store_true", help="end with one JSON line of statistics")
    add_generation_args(p)
    add_security_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("info", help="print the verifier's model, fingerprint and limits")
    p.add_argument("--server", default="127.0.0.1:50051")
    p.add_argument("--deadline", type=float, default=10.0)
    add_security_args(p)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP API (chat, completions) in front of a verifier",
                       description="Serve POST /v1/chat/completions, POST /v1/completions, GET /v1/models and "
                                   "GET /health. Each request is drafted here and verified on --server.")
    p.add_argument("--server", default="127.0.0.1:50051", help="verifier address host:port")
    p.add_argument("--host", default="127.0.0.1", help="HTTP address to bind")
    p.add_argument("--port", type=int, default=8080, help="HTTP port (0 picks a free one)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve the edge's Prometheus metrics on this port")
    p.add_argument("--max-concurrent", type=int, default=8,
                   help="requests generated at once, each with its own draft KV cache and verifier session; "
                        "more wait (keep it at most the verifier's --max-sessions)")
    p.add_argument("--served-model-name", help="model id in /v1/models and responses (default: the verifier's model)")
    add_generation_args(p, prompt_and_sampling=False)
    add_security_args(p)
    p.set_defaults(func=cmd_serve)

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

"""edge-client: draft on this device, verify on a cloud verifier, stream the text."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

from edge_client.options import OptionError, add_edge_options, build_drafter, options_from_args
from spec_core.warping import COUPLINGS, REJECTION, SamplingError, SamplingSettings

SERVE_READY = "edge-client serving on"  # printed by `edge-client serve` once it accepts requests


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """The prompt and how to sample it (`serve` takes these from each request instead)."""
    g = p.add_argument_group("prompt and sampling")
    g.add_argument("--prompt", help="prompt text (default: read standard input)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template (GGUF metadata)")
    g.add_argument("--system", help="system message for --chat")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    g.add_argument("--seed", type=int, default=None, help="seed for the edge's and the verifier's samplers")
    add_coupling_arg(g)


def add_coupling_arg(g) -> None:
    g.add_argument("--coupling", choices=COUPLINGS, default=REJECTION,
                   help="how drafts are checked. rejection (default): accept with min(1, p/q), the most tokens per "
                        "round; gumbel: drafter-invariant, the text is the target's own sampling at the seed (the "
                        "same ids as --cloud-only with that seed, whatever the draft, link or planner did), "
                        "fewer tokens accepted; without --seed one is drawn and reported (docs/exactness.md)")


SAMPLING_FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
                  "max_new_tokens": "--max-tokens", "seed": "--seed", "coupling": "--coupling"}


def settings_from_args(args) -> SamplingSettings:
    """The sampling settings of add_sampling_args' arguments; OptionError names a bad one."""
    try:
        return SamplingSettings(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                max_new_tokens=args.max_tokens, seed=args.seed,
                                coupling=getattr(args, "coupling", REJECTION))
    except SamplingError as e:
        flag = SAMPLING_FLAGS.get(e.field, e.field)
        raise OptionError(f"argument {flag}", e.problem) from None


def prompt_ids(args, tokenizer) -> list[int] | str:
    """The prompt for `tokenizer`: the text, or with --chat its chat template's ids."""
    prompt = prompt_of(args)
    if isinstance(prompt, str):
        return prompt
    from edge_client.text import render_messages
    return render_messages(tokenizer, list(prompt.messages))


def prompt_of(args):
    """The prompt text, or with --chat a conversation (edge_client.crossvocab.Chat) that the client
    renders with the model's chat template (the verifier renders the target's when the draft has
    another tokenizer)."""
    text = args.prompt if args.prompt is not None else sys.stdin.read()
    if args.chat:
        from edge_client.crossvocab import Chat
        return Chat.of(text, args.system)
    return text


async def run_generate(args, options, settings: SamplingSettings, out=sys.stdout, quiet: bool = False):
    """Load the drafter, generate, stream the text to `out`; returns the GenerationStats."""
    from edge_client.client import EdgeClient
    drafter, tokenizer = build_drafter(args, options.speculation)
    try:
        async with EdgeClient(options, drafter, tokenizer) as client:
            if not quiet:   # a verifier busy with other prompts queues this one and says how long
                client.verifier.on_queued = lambda s: print(f"queued: first token in about {s:.0f} s", file=sys.stderr,
                                                            flush=True)
            if getattr(args, "cloud_only", False):
                gen = client.generate_cloud_only(prompt_of(args), settings)
            else:
                gen = client.generate(prompt_of(args), settings)
            async for piece in gen:
                if not quiet:
                    out.write(piece)
                    out.flush()
            if not quiet:
                out.write("\n")
            return gen.stats
    finally:
        drafter.close()


# The arguments that name a model file: each takes a path or a bundled model's name.
MODEL_ARGS = ("draft", "tokenizer", "target_vocab")


def find_models(args) -> None:
    """Replace bundled names (smollm2, gemma) in the model arguments by their files, and the default
    draft by its path; a missing or unreadable file exits with one line saying how to get it."""
    if getattr(args, "drafter", None) == "gguf" and not args.draft:
        from edge_client.drafters import DEFAULT_DRAFT
        args.draft = str(DEFAULT_DRAFT)
    named = [name for name in MODEL_ARGS if getattr(args, name, None)]
    if not named:               # the synthetic drafter: llama.cpp is not needed
        return
    from llama_runtime import ModelMissing, find_model
    try:
        for name in named:
            setattr(args, name, str(find_model(getattr(args, name))))
    except ModelMissing as e:
        raise SystemExit(f"edge-client: {e}") from None


def cmd_generate(args) -> int:
    from edge_client.client import EdgeError
    from llama_runtime import ModelUnloadable
    settings = settings_from_args(args)
    options_from_args(args)       # a bad value is refused before a missing model is reported
    find_models(args)
    options = options_from_args(args)  # with the model files found
    try:
        stats = asyncio.run(run_generate(args, options, settings))
    except (EdgeError, ModelUnloadable) as e:
        print(f"edge-client: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(stats.to_json()))
    else:
        seed = f", {stats.coupling} coupling, seed {stats.seed}" if stats.coupling != REJECTION else ""
        if getattr(args, "cloud_only", False):
            print(f"[{stats.tokens} tokens in {stats.wall_s:.2f}s, cloud-only{seed}]", file=sys.stderr)
        else:
            print(f"[{stats.tokens} tokens in {stats.wall_s:.2f}s, {stats.rounds} rounds, "
                  f"acceptance {stats.acceptance_rate:.2f}, {stats.tokens_per_round:.2f} tokens/round{seed}]",
                  file=sys.stderr)
    return 0


def cmd_info(args) -> int:
    import grpc
    from spec_core.proto import verifier_pb2 as pb, verifier_pb2_grpc as pb_grpc
    from google.protobuf.json_format import MessageToDict

    from edge_client.client import auth_metadata, open_channel
    options = options_from_args(args)
    security = options.security

    async def go():
        async with open_channel(options.transport.server, **security.channel_kwargs()) as ch:
            return await pb_grpc.VerifierStub(ch).GetServerInfo(pb.ServerInfoRequest(),
                                                                timeout=options.transport.deadline_s,
                                                                metadata=auth_metadata(security.bearer_token()))
    try:
        info = asyncio.run(go())
    except grpc.aio.AioRpcError as e:   # e.g. UNAUTHENTICATED, UNAVAILABLE: one line, not a traceback
        print(f"edge-client: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2
    print(json.dumps(MessageToDict(info, preserving_proto_field_name=True), indent=2))
    return 0


def cmd_serve(args) -> int:
    # FastAPI, uvicorn and prometheus_client are imported only here: `generate` needs none of them.
    from edge_client import serve
    from llama_runtime import ModelUnloadable
    options_from_args(args)       # a bad value is refused before a missing model is reported
    serve.api_key_from_args(args)
    find_models(args)

    def ready(port: int, metrics_port: int | None) -> None:
        metrics = f" metrics http://{args.host}:{metrics_port}/metrics" if metrics_port is not None else ""
        print(f"{SERVE_READY} http://{args.host}:{port}/v1{metrics}", flush=True)
    try:
        return serve.run(args, on_ready=ready)
    except ModelUnloadable as e:
        print(f"edge-client: {e}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edge-client", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG (default: warnings only)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate text with a draft here and the target on a verifier")
    p.add_argument("--json", action="store_true", help="end with one JSON line of statistics")
    p.add_argument("--cloud-only", action="store_true",
                   help="no drafting: the verifier samples the target alone (its Generate stream), one token a "
                        "step; with --coupling gumbel and the same --seed, the ids a hybrid run commits")
    add_sampling_args(p)
    add_edge_options(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("info", help="print the verifier's model, fingerprint and limits")
    add_edge_options(p, drafting=False)
    p.set_defaults(func=cmd_info, deadline=10.0)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP API (chat, completions) in front of a verifier",
                       description="Serve POST /v1/chat/completions, POST /v1/completions, GET /v1/models and "
                                   "GET /health. Each request is drafted here and verified on --server.")
    p.add_argument("--host", default="127.0.0.1", help="HTTP address to bind")
    p.add_argument("--port", type=int, default=8080, help="HTTP port (0 picks a free one)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve the edge's Prometheus metrics on this port")
    p.add_argument("--max-concurrent", type=int, default=8,
                   help="requests generated at once, each with its own draft KV cache and verifier session; "
                        "more wait (keep it at most the verifier's --max-sessions)")
    p.add_argument("--served-model-name", help="model id in /v1/models and responses (default: the verifier's model)")
    add_coupling_arg(p)
    p.add_argument("--api-key", help="answer /v1 requests only with `Authorization: Bearer API_KEY` (401 otherwise; "
                                     "/health stays open); needed to bind beyond loopback")
    p.add_argument("--api-key-file", metavar="FILE", help="... the key read from the first line of FILE (not shown "
                                                         "in the process list)")
    add_edge_options(p)
    p.set_defaults(func=cmd_serve)

    from edge_client import draftcli
    draftcli.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except OptionError as e:  # a bad value, refused before any model loads: usage, and what to change
        parser.error(str(e))


if __name__ == "__main__":
    sys.exit(main())

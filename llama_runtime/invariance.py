"""Batch-invariant evaluation on llama.cpp's CPU backend: the rule (the note below), the padding
token it needs, and the per-model probe of the largest invariant decode (GGUFModel.invariant_ubatch)."""
from __future__ import annotations

import hashlib
import platform
import llama_cpp
import numpy as np

from llama_runtime.lowlevel import LoadedModel, context_params, ensure_backend, fill_batch
from spec_core.batchplan import PassItem


# Batch-invariant evaluation on ggml's CPU backend (bench/batch_invariance.py checks it; the sizes
# of the differences are on docs/benchmarks.md): a
# row's logits are bit-identical whatever else shares its llama_decode and however its KV cache
# was chunked, provided that
#   - flash attention is on: the non-flash path sums attention over KV cells in SIMD lanes, so a
#     row depends on where other sequences' cells sit in a shared cache;
#   - no decode holds a single token, nor asks for a single row of logits: for one row ggml
#     picks vec_dot instead of llamafile's tinyBLAS for matmuls (the output projection runs over
#     the wanted rows only), and a split-KV flash attention once the KV view reaches 512 cells;
#     such a decode gets a padding token in a scratch sequence, whose
#     row is computed too when one row is wanted;
#   - no decode holds 64 tokens or more (GGML_FA_TILE_Q): from there ggml-cpu switches to a tiled
#     flash attention; decodes are cut at INVARIANT_UBATCH tokens.
# The padding costs one extra token (and output row) per single-row decode; the cut only splits
# long prefills. Contexts are made one token larger than the cut, for the padding.
#
# Some models need a smaller cut. Gemma 3 270M Q4_K_M (same code, same contexts): a decode of up to
# 7 tokens gives rows bit-identical to token-by-token decodes; from 8 tokens on, every row from the
# third on moves, by up to 1.26 in max |logit difference| (measured on a 40-token prompt, 1 or 2
# threads, AVX2 Zen 3; unchanged by an F32 KV cache, swa_full or the thread count, so neither fp16
# KV precision, the sliding-window cache nor threading is the cause: some ggml-cpu kernel changes
# with the ubatch's row count at 8; not pinned down further). SmolLM2 Q4_1 is invariant up to 63.
# So the cut is per model: GGUFModel.invariant_ubatch probes it once (a short token-by-token
# reference against decodes of the candidate sizes, bit for bit), keeps the answer in the cache
# folder keyed by model file, llama.cpp build, threads and CPU features, and contexts use it.
INVARIANT_UBATCH = 32
PROBE_CUTS = (32, 16, 8, 6, 4, 2, 1)


def probe_key(model: LoadedModel) -> str:
    """What the probe's answer depends on: the model file (path, size, mtime), the llama.cpp build,
    the thread count and the CPU features llama.cpp dispatches on (another CPU may take other kernels)."""
    ensure_backend()
    st = model.path.stat()
    parts = [str(model.path.resolve()), str(st.st_size), str(st.st_mtime_ns), llama_cpp.__version__,
             str(model.n_threads), platform.machine(), llama_cpp.llama_print_system_info().decode()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def probe_invariant_ubatch(model: LoadedModel) -> int:
    """Largest cut in PROBE_CUTS whose decodes (cut tokens + a padding token) give logits
    bit-identical to padded one-token decodes, over a fixed 33-token sequence."""
    text = ("The quick brown fox jumps over the lazy dog. In the beginning of the history of "
            "computing, engineers built machines that filled whole rooms and consumed power.")
    toks = (model.tokenize(text) * 4)[:INVARIANT_UBATCH + 1]
    n = len(toks)
    params = context_params(model, n + 1, INVARIANT_UBATCH + 1, 2, True)
    ctx = llama_cpp.llama_init_from_model(model.handle, params)
    if not ctx:
        raise MemoryError("llama.cpp could not create the batch-invariance probe's context")
    mem = llama_cpp.llama_get_memory(ctx)
    batch = llama_cpp.llama_batch_init(INVARIANT_UBATCH + 1, 0, 1)

    def run(cut: int) -> np.ndarray:
        llama_cpp.llama_memory_clear(mem, True)
        rows = []
        for pos in range(0, n, cut):
            items = [PassItem(0, pos + i, t, True) for i, t in enumerate(toks[pos:pos + cut])]
            llama_cpp.llama_memory_seq_rm(mem, 1, 0, -1)
            items.append(PassItem(1, 0, 0, True))  # the padding token, as pad_decode adds it
            fill_batch(batch, items)
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed in the batch-invariance probe")
            for i in range(len(items) - 1):
                ptr = llama_cpp.llama_get_logits_ith(ctx, i)
                rows.append(np.ctypeslib.as_array(ptr, shape=(model.n_vocab,)).copy())
        return np.stack(rows)

    try:
        reference = run(1)
        for cut in PROBE_CUTS:
            if cut == 1 or np.array_equal(run(cut), reference):
                return cut
        return 1
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)


def pad_decode(items: list[PassItem], scratch: int) -> list[PassItem]:
    """Add a scratch-sequence token when a decode would hold one token or want one row."""
    wanted = sum(1 for it in items if it.want_logits)
    if len(items) == 1 or wanted == 1:
        return items + [PassItem(scratch, 0, 0, wanted == 1)]
    return items

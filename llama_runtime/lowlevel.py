"""The llama.cpp C-API plumbing every context shares: the backend set up once per process (its
log routed to logging), a context's parameters, filling a batch from PassItems, and what a context
needs of a loaded model (`LoadedModel`, which GGUFModel is). The bottom of llama_runtime: it
imports nothing of the package, so the modules above it never import each other in a circle."""
from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path
from typing import Any, Protocol, Sequence

import llama_cpp

from spec_core.batchplan import PassItem

log = logging.getLogger(__name__)



class LoadedModel(Protocol):
    """What contexts, caches and the invariance probe use of a loaded model (llama_runtime.model.GGUFModel)."""

    path: Path
    n_threads: int
    n_vocab: int

    @property
    def handle(self) -> Any: ...    # the llama_model pointer contexts are made from

    @property
    def invariant_ubatch(self) -> int: ...

    def tokenize(self, text: str, add_special: bool = ..., parse_special: bool = ...) -> list[int]: ...

    def metadata(self, key: str) -> str | None: ...


_init_lock = threading.Lock()
_initialised = False


@llama_cpp.llama_log_callback
def _llama_log(level, text, user_data):  # noqa: ARG001 - ctypes signature
    # llama.cpp is chatty on stderr; route it to logging at DEBUG.
    if log.isEnabledFor(logging.DEBUG):
        log.debug("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())


def ensure_backend() -> None:
    global _initialised
    with _init_lock:
        if not _initialised:
            llama_cpp.llama_log_set(_llama_log, ctypes.c_void_p(0))
            llama_cpp.llama_backend_init()
            _initialised = True


def context_params(model: LoadedModel, n_ctx: int, n_ubatch: int, n_seq_max: int, invariant: bool):
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


def fill_batch(batch, items: Sequence[PassItem]) -> None:
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

"""Session KV checkpoints outside the process (`--kv-store DIR`), so that a restarted verifier, or
the replica a drained session moves to, restores a replayed session's cells instead of prefilling
them again.

What a checkpoint is: a session's cells as llama.cpp copies them out (SharedKV.snapshot, the
bytes parking copies: llama_state_seq_get_data), the token ids they hold, and a fingerprint of
everything that decides those bytes (`store_fingerprint`). A file is one session's latest
checkpoint, named by a random key, in a folder per fingerprint and per tenant:

    DIR/<fingerprint[:16]>/<sha256(tenant)[:32]>/<key>.kv

Why the lookup is by tokens and not by session id: a replay opens a new session (the edge sends
the prompt and its committed tokens, never the lost session's id). So a replay looks among its
own tenant's checkpoints (no other tenant's folder is ever read: invariant 4) for the one that
holds the longest prefix of the replayed tokens, restores it, and prefills only the tail. The
cells of a token prefix are a function of those tokens and the fingerprint alone (the target is
evaluated batch-invariantly: llama_runtime.invariance), so the restored session's logits are
those it would have had uninterrupted, bit for bit. The restored session then owns that file
(its next checkpoints overwrite it), unless a live session of this process owns it already.

Files are written whole to a temporary name and renamed (atomic on one file system): a reader
sees the old file or the new one, never a torn one. Each file carries its length and a CRC-32,
checked before a byte of it reaches llama.cpp; a file that fails a check (or whose fingerprint
or tenant differs) is refused, counted, and the replay prefills as it would without a store.
File I/O runs on a writer thread and in the replaying call's worker thread; only the copy of the
cells takes the model (between passes).

Bounds: at most `max_bytes` of checkpoints in this fingerprint's folder (a write that would go
over is dropped, counted `full`); files not written for `max_age_s` (the session TTL: their edge
is gone) are swept. A session that ends normally deletes its file; a drain keeps them for the
replica the sessions move to.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np

from cloud_verifier import metrics
from llama_runtime import ParkedSeq
from spec_core import clock
from spec_core.kvreuse import reusable_prefix

log = logging.getLogger(__name__)

MAGIC = b"HSKV1\n"
_LEN = struct.Struct("<I")
MIN_RESTORE_TOKENS = 8          # a shorter prefix is cheaper to prefill than to read and check
DEFAULT_STORE_BYTES = 1 << 30
DEFAULT_EVERY_S = 2.0
GAP_WAIT_S = 30.0               # a chore queued between passes runs by then, unless the batcher closed
_SWEEP_EVERY_S = 30.0


def store_fingerprint(model, seq_ctx: int, n_ubatch: int, invariant: bool) -> str:
    """What decides a checkpoint's bytes: the model file (size and its first and last MiB: a
    changed file changes them), the session context, the decode size and invariance (they decide
    the batch shape every cell was computed in), the KV type (f16, llama_runtime's default), the
    llama.cpp build and the CPU features it uses (they change rounding), and the thread count
    (llama_runtime.invariance probes per thread count). Any difference: the file is not used."""
    import llama_cpp
    path = Path(model.path)
    size = path.stat().st_size
    h = hashlib.sha256()
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    parts = {"model_size": size, "model_sha256_ends": h.hexdigest(), "seq_ctx": seq_ctx, "n_ubatch": n_ubatch,
             "invariant": invariant, "kv_type": "f16", "llama_cpp": llama_cpp.__version__,
             "system": llama_cpp.llama_print_system_info().decode(errors="replace"), "threads": model.n_threads}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def tenant_folder(tenant: str) -> str:
    """A tenant's folder name: a hash, so that names never reach the file system's paths."""
    return hashlib.sha256(("hybridspec-tenant\0" + tenant).encode()).hexdigest()[:32]


def _digest(data: np.ndarray) -> str:
    """A checksum against torn and corrupt files (not against someone who can write the folder:
    they could write any cells). CRC-32: a 6 MB session in 4.5 ms here, blake2b 12.7 ms."""
    return f"crc32:{zlib.crc32(memoryview(data)):08x}"


class Found(NamedTuple):
    """A checkpoint that holds a prefix of a replay's tokens."""
    key: str
    parked: ParkedSeq
    reused: int            # leading tokens of the replay its cells hold


@dataclass
class _Header:
    tokens: list[int]
    nbytes: int
    digest: str
    fingerprint: str
    tenant: str


class KVStore:
    def __init__(self, root: str | os.PathLike, fingerprint: str, max_bytes: int = DEFAULT_STORE_BYTES,
                 max_age_s: float = 600.0):
        if max_bytes <= 0:
            raise ValueError(f"--kv-store-bytes must be positive, got {max_bytes}")
        self.fingerprint, self.max_bytes, self.max_age_s = fingerprint, max_bytes, max_age_s
        self.dir = Path(root) / fingerprint[:16]
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock = threading.Condition()
        self._pending: dict[Path, tuple[bytes, ParkedSeq] | None] = {}   # per file, not done yet: the latest
                                                                         # checkpoint, or None: delete it
        self._writing: Path | None = None
        self._headers: dict[Path, tuple[int, int, _Header]] = {}  # (mtime_ns, size, header) read before
        self.owned: set[str] = set()   # keys of this process's live sessions
        self._bytes = 0
        self._swept = 0.0
        self._closed = False
        self.sweep()
        self._thread = threading.Thread(target=self._writer, name="kv-store-writer", daemon=True)
        self._thread.start()

    @staticmethod
    def new_key() -> str:
        return secrets.token_hex(16)

    def path(self, tenant: str, key: str) -> Path:
        return self.dir / tenant_folder(tenant) / f"{key}.kv"

    # --- writing ----------------------------------------------------------------------------------

    def put(self, tenant: str, key: str, parked: ParkedSeq, first: bool = False) -> None:
        """Queue `parked` as the checkpoint `key` of `tenant` for the writer thread; a later
        checkpoint (or deletion) of the same key replaces one not yet written. `first`: ahead of
        the others queued (a drain's: an edge waits for it). Returns at once."""
        if not parked.tokens:
            return
        header = json.dumps({"fingerprint": self.fingerprint, "tenant": tenant_folder(tenant),
                             "tokens": [int(t) for t in parked.tokens], "nbytes": parked.nbytes}).encode()
        path = self.path(tenant, key)
        with self._lock:
            if first:
                self._pending.pop(path, None)
                self._pending = {path: (header, parked), **self._pending}
            else:
                self._pending[path] = (header, parked)
            self._lock.notify()

    def delete(self, tenant: str, key: str) -> None:
        """Queue the deletion of a checkpoint (after any write of it queued before). Returns at once."""
        with self._lock:
            self._pending[self.path(tenant, key)] = None
            self._lock.notify()

    def claim(self, key: str) -> bool:
        """Make `key` a live session's of this process; False when one owns it already."""
        with self._lock:
            if key in self.owned:
                return False
            self.owned.add(key)
            return True

    def disown(self, key: str) -> None:
        with self._lock:
            self.owned.discard(key)

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued checkpoint is written."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while (self._pending or self._writing is not None) and time.monotonic() < deadline:
                self._lock.wait(0.05)

    def written(self, tenant: str, key: str, timeout_s: float = 30.0) -> None:
        """Wait until the checkpoint `key` of `tenant` queued so far is written (not the others)."""
        path, deadline = self.path(tenant, key), time.monotonic() + timeout_s
        with self._lock:
            while (path in self._pending or self._writing == path) and time.monotonic() < deadline:
                self._lock.wait(0.05)

    def close(self) -> None:
        self.flush()
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(timeout=10)

    def _writer(self) -> None:
        while True:
            with self._lock:
                if not self._pending and not self._closed:
                    self._lock.wait(_SWEEP_EVERY_S)
                if self._closed and not self._pending:
                    return
                path = item = None
                if self._pending:
                    path = next(iter(self._pending))
                    item = self._pending.pop(path)
                    self._writing = path
            try:
                if path is not None:
                    self._write(path, *item) if item is not None else self._remove(path)
                elif time.monotonic() - self._swept > _SWEEP_EVERY_S:
                    self.sweep()
            except Exception:  # noqa: BLE001 - a lost checkpoint only costs a prefill later
                log.exception("writing a KV checkpoint failed")
            finally:
                with self._lock:
                    self._writing = None
                    self._lock.notify_all()

    def _write(self, path: Path, header: bytes, parked: ParkedSeq) -> None:
        header_doc = json.loads(header)
        header_doc["digest"] = _digest(parked.data)
        header = json.dumps(header_doc).encode()
        size = len(MAGIC) + _LEN.size + len(header) + parked.nbytes
        try:
            old = path.stat().st_size
        except FileNotFoundError:
            old = 0
        if self._bytes - old + size > self.max_bytes:
            self.sweep()
            if self._bytes - old + size > self.max_bytes:
                metrics.KV_CHECKPOINTS.labels("full").inc()
                log.warning("KV store %s is full (%d of %d bytes): a checkpoint of %d bytes is dropped", self.dir,
                            self._bytes, self.max_bytes, size)
                return
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)   # (someone may have emptied the store)
            with open(tmp, "wb") as f:
                f.write(MAGIC)
                f.write(_LEN.pack(len(header)))
                f.write(header)
                f.write(memoryview(parked.data))
            os.replace(tmp, path)   # atomic: a reader sees the old file or this one, never a torn one
        except OSError:
            metrics.KV_CHECKPOINTS.labels("failed").inc()
            log.exception("writing the KV checkpoint %s failed", path)
            with contextlib.suppress(OSError):
                tmp.unlink()
            return
        with self._lock:
            self._bytes += size - old
        metrics.KV_CHECKPOINTS.labels("written").inc()
        metrics.KV_CHECKPOINT_BYTES.inc(size)

    def _remove(self, path: Path) -> None:
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return
        with self._lock:
            self._bytes -= size
            self._headers.pop(path, None)

    def sweep(self) -> None:
        """Delete files not written for max_age_s (and temporary files of writers that died), and
        count the bytes of what is left (other processes write here too)."""
        now, total = time.time(), 0
        for p in self.dir.glob("*/*"):
            try:
                st = p.stat()
                if now - st.st_mtime > (self.max_age_s if p.suffix == ".kv" else max(60.0, self.max_age_s)):
                    p.unlink()
                    continue
            except FileNotFoundError:
                continue
            total += st.st_size
        with self._lock:
            self._bytes, self._swept = total, time.monotonic()

    # --- reading ----------------------------------------------------------------------------------

    def find(self, tenant: str, tokens: Sequence[int], rows: int) -> Found | None:
        """The checkpoint of `tenant` whose cells hold the longest prefix of `tokens` that a
        request for the logits of their last `rows` positions keeps (at least MIN_RESTORE_TOKENS),
        read and checked; None when there is none (counted), after refusing bad files (counted)."""
        folder = self.dir / tenant_folder(tenant)
        candidates = []
        for path in folder.glob("*.kv"):
            header = self._header(path)
            if header is None:
                continue
            if header.fingerprint != self.fingerprint or header.tenant != tenant_folder(tenant):
                self._refuse(path, "its fingerprint or tenant differs from this verifier's")
                continue
            reused = reusable_prefix(header.tokens, tokens, rows)
            if reused >= MIN_RESTORE_TOKENS:
                candidates.append((reused, path, header))
        with self._lock:   # of equal ones, a file no live session here writes (the replay may take it over)
            candidates.sort(key=lambda c: (-c[0], c[1].stem in self.owned))
        for reused, path, header in candidates:
            data = self._data(path, header)
            if data is not None:
                return Found(path.stem, ParkedSeq(header.tokens, data), reused)
        metrics.KV_CHECKPOINT_RESTORES.labels("none").inc()
        return None

    def _header(self, path: Path) -> _Header | None:
        try:
            st = path.stat()
            with self._lock:
                cached = self._headers.get(path)
            if cached is not None and cached[:2] == (st.st_mtime_ns, st.st_size):
                return cached[2]
            with open(path, "rb") as f:
                if f.read(len(MAGIC)) != MAGIC:
                    raise ValueError("not a KV checkpoint (bad magic)")
                (n,) = _LEN.unpack(f.read(_LEN.size))
                doc = json.loads(f.read(n))
            header = _Header([int(t) for t in doc["tokens"]], int(doc["nbytes"]), str(doc["digest"]),
                             str(doc["fingerprint"]), str(doc["tenant"]))
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError, struct.error, OSError) as e:
            self._refuse(path, str(e))
            return None
        with self._lock:
            self._headers[path] = (st.st_mtime_ns, st.st_size, header)
        return header

    def _data(self, path: Path, header: _Header) -> np.ndarray | None:
        try:
            with open(path, "rb") as f:
                f.read(len(MAGIC))
                (n,) = _LEN.unpack(f.read(_LEN.size))
                f.seek(n, os.SEEK_CUR)
                data = np.frombuffer(f.read(), dtype=np.uint8)
        except FileNotFoundError:
            return None
        except (OSError, struct.error) as e:
            self._refuse(path, str(e))
            return None
        if data.size != header.nbytes:
            self._refuse(path, f"{data.size} bytes of cells where its header says {header.nbytes} (torn)")
            return None
        if _digest(data) != header.digest:
            self._refuse(path, "its cells do not match their digest (corrupt)")
            return None
        return data.copy()   # writable and owned: llama.cpp reads it after the file is gone

    def _refuse(self, path: Path, why: str) -> None:
        metrics.KV_CHECKPOINT_RESTORES.labels("refused").inc()
        log.warning("KV checkpoint %s refused, the replay prefills instead: %s", path, why)


class Checkpoints:
    """A batching llama.cpp backend's sessions and the store: a new session's first round
    restores the longest stored prefix of its tokens (a replay), and every `every_s` seconds a
    session's cells are copied between passes (SharedKV.snapshot, on the batcher thread) and
    handed to the store's writer thread."""

    def __init__(self, store: KVStore, kv, batcher, book, every_s: float = DEFAULT_EVERY_S):
        if every_s < 0:
            raise ValueError(f"--kv-store-every must be >= 0, got {every_s}")
        self.store, self.kv, self.batcher, self.book, self.every_s = store, kv, batcher, book, every_s
        self.keep = False     # a drain began: released sessions keep their files

    def opened(self, state) -> None:
        """A new session's state: it belongs to the tenant of the call (set by the server's guard)."""
        from cloud_verifier.sessions import current_tenant
        state.tenant = current_tenant.get()

    def before_round(self, state, tokens: Sequence[int], rows: int):
        """A session's first round: read the stored checkpoint of the longest prefix of `tokens`
        it will keep (here, in the caller's thread), and return what restores it on the batcher
        thread as the round is prepared (Batcher.submit's `before`); None when there is nothing to
        restore. Any failure leaves the session empty: its tokens are prefilled as without a store."""
        if state.ckpt_looked:
            return None
        state.ckpt_looked = True
        if len(tokens) - rows < MIN_RESTORE_TOKENS:
            return None   # a new session, not a replay
        t0 = time.perf_counter()
        try:
            found = self.store.find(state.tenant, tokens, rows)
        except OSError:
            log.exception("reading the KV store failed; the replay prefills instead")
            metrics.KV_CHECKPOINT_RESTORES.labels("failed").inc()
            return None
        if found is None:
            return None
        read_s = time.perf_counter() - t0
        once: list[bool] = []

        def restore() -> None:
            """Between passes, before the round's tokens are listed (SharedKV.prepare keeps what
            the restored cells share with them). Once: a round submitted again does not restore again."""
            if once:
                return
            once.append(True)
            seq = state.seq
            try:
                restored = (not state.released and seq is not None and self.kv.held.get(seq) == []
                            and self.kv.restore(seq, found.parked))
            except (RuntimeError, ValueError):
                log.exception("llama.cpp refused a stored KV checkpoint; the replay prefills instead")
                restored = False
            if not restored:
                metrics.KV_CHECKPOINT_RESTORES.labels("failed").inc()
                return
            metrics.KV_CHECKPOINT_RESTORES.labels("restored").inc()
            metrics.KV_CHECKPOINT_TOKENS.inc(found.reused)
            if self.store.claim(found.key):   # else a live session here writes it: this one takes a new key
                state.ckpt_key = found.key
            state.ckpt_at = clock.now()
            log.info("replay restored %d of %d tokens from the KV store (%d bytes read in %.1f ms)", found.reused,
                     len(tokens), found.parked.nbytes, 1000 * read_s)
        return restore

    def after_round(self, state) -> None:
        """Queue a checkpoint when the last one is `every_s` old (copied at the next gap between passes)."""
        now = clock.now()
        if state.ckpt_queued or now - state.ckpt_at < self.every_s:
            return
        state.ckpt_queued, state.ckpt_at = True, now
        self.batcher.between(lambda: self._take(state))

    def checkpoint(self, state) -> None:
        """Checkpoint now (a drain hands the session back): copied at the next gap between passes,
        written before this returns; the file stays when the session is released."""
        self.keep = True
        self._in_next_gap(lambda: self._take(state, first=True))
        if state.ckpt_key is not None:
            self.store.written(state.tenant, state.ckpt_key)   # its own file: not behind the others queued

    def checkpoint_all(self, states=None) -> None:
        """These sessions' checkpoints, or every live session's (a drain), all copied in the next
        gap between passes (about 3 ms a 250-token session: 0.2 s for 64) and written before this
        returns."""
        self.keep = True
        if states is None:
            with self.book._lock:
                states = [s for s in self.book._by_seq.values() if not s.released]

        def take_all() -> None:
            for state in states:
                self._take(state)
        self._in_next_gap(take_all)
        self.store.flush()

    def _in_next_gap(self, chore) -> None:
        """Run `chore` in the next gap between passes and wait for it. Queued as a chore, which the
        batcher thread runs before its next pass, with the chores of other callers in the same gap:
        taking the model lock from this thread instead (Batcher.acquire) waits until the batcher
        idles, as it takes the lock again at once after each pass (not handed over in turn), and
        under load that was seconds per checkpoint: a 64-session drain took 27 s to hand back."""
        done = threading.Event()

        def run() -> None:
            try:
                chore()
            finally:
                done.set()
        self.batcher.between(run)
        if not done.wait(GAP_WAIT_S):   # the batcher is closing (its chores are dropped)
            self.batcher.acquire(run)

    def _take(self, state, first: bool = False) -> None:
        """Between passes (the model is ours): copy the session's cells, hand them to the store
        (`first`: ahead of the others queued)."""
        state.ckpt_queued = False
        with self.book._lock:
            if state.released or state.seq is None:
                return
            seq, parked = state.seq, state.parked
        t0 = time.perf_counter()
        parked = parked if parked is not None and parked.tokens else self.kv.snapshot(seq)
        metrics.KV_CHECKPOINT_COPY_SECONDS.inc(time.perf_counter() - t0)
        if not parked.tokens:
            return
        with self.book._lock:   # released() takes it too: no file outlives its session's release
            if state.released:
                return
            if state.ckpt_key is None:
                state.ckpt_key = self.store.new_key()
                self.store.claim(state.ckpt_key)
            self.store.put(state.tenant, state.ckpt_key, parked, first=first)

    def released(self, state) -> None:
        """A session ends: its file goes, unless a drain keeps it for the replica it moves to."""
        with self.book._lock:
            key, state.ckpt_key = state.ckpt_key, None
            if key is None:
                return
            self.store.disown(key)
            if not self.keep:
                self.store.delete(state.tenant, key)

    def flush(self) -> None:
        """Wait until every checkpoint asked for so far is copied and written."""
        self._in_next_gap(lambda: None)   # after the chores queued before it
        self.store.flush()

    def close(self) -> None:
        self.store.close()

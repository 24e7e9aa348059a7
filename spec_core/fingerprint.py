"""The tokenizer fingerprint: draft and target must agree on what every token id means.

sha256 over a version tag, the vocabulary size, every token's text (as stored in the model,
e.g. GPT-2 byte-level 'Ġhello' or SentencePiece '▁hello') in id order, and the BOS/EOS ids.
Runtimes supply the texts: llama_runtime reads them through llama.cpp's vocabulary API (a
vocab-only load, well under a second even for 262k tokens); a Hugging Face tokenizer gives the
same texts through convert_ids_to_tokens.
"""
from __future__ import annotations

import hashlib
from typing import Iterable

_TAG = b"hybridspec-tokenizer-v1\n"


def tokenizer_fingerprint(token_texts: Iterable[bytes], bos_id: int, eos_id: int) -> str:
    texts = list(token_texts)
    h = hashlib.sha256(_TAG)
    h.update(f"n_vocab={len(texts)} bos={bos_id} eos={eos_id}\n".encode())
    for t in texts:
        h.update(t)
        h.update(b"\0")
    return h.hexdigest()

"""Prompt text in, token ids out: chat templates from GGUF metadata, and the synthetic vocabulary."""
from __future__ import annotations

from spec_core.synthetic import synthetic_fingerprint


def render_chat(model, prompt: str, system: str | None = None) -> list[int]:
    """Apply the model's own chat template (GGUF `tokenizer.chat_template`) and tokenize."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return render_messages(model, messages)


def render_messages(model, messages: list[dict[str, str]]) -> list[int]:
    """A conversation ({"role", "content"} dicts) through the model's chat template, tokenized,
    ending with the assistant's turn opened (llama_runtime.chat: the GGUF template, else llama.cpp's
    built-in one for the architecture)."""
    from llama_runtime.chat import render_messages as render
    return render(model, messages)


class SyntheticTokenizer:
    """Text for the synthetic vocabulary: token i is '<toki>'; prompts are space-separated ids."""

    def __init__(self, vocab: int = 64):
        self.vocab = vocab
        self.fingerprint = synthetic_fingerprint(vocab)
        self.eog_ids = frozenset({1})

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        ids = [int(t) % self.vocab for t in text.split() if t.strip().lstrip("-").isdigit()]
        return ([0] if add_special else []) + (ids or [2])

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        return f"<tok{token}>".encode()

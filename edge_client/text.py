"""Prompt text in, token ids out: chat templates from GGUF metadata, and the synthetic vocabulary."""
from __future__ import annotations

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from spec_core.synthetic import synthetic_fingerprint


def render_chat(model, prompt: str, system: str | None = None) -> list[int]:
    """Apply the model's own chat template (GGUF `tokenizer.chat_template`) and tokenize."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return render_messages(model, messages)


def render_messages(model, messages: list[dict[str, str]]) -> list[int]:
    """A conversation ({"role", "content"} dicts) through the model's chat template, tokenized,
    ending with the assistant's turn opened."""
    template = model.chat_template()
    if not template:
        raise ValueError(f"{model.name} has no chat template in its GGUF metadata; drop --chat")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.ChainableUndefined)

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    bos = model.token_bytes(model.bos_id, special=True).decode("utf-8", "replace")
    eos = model.token_bytes(model.eos_id, special=True).decode("utf-8", "replace")
    text = env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                            bos_token=bos, eos_token=eos)
    ids = model.tokenize(text, add_special=False, parse_special=True)
    if model.add_bos and (not ids or ids[0] != model.bos_id):
        ids.insert(0, model.bos_id)
    return ids


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

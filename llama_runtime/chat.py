"""Chat templates: a conversation -> the prompt text a model was trained on -> token ids.

The model's own template (GGUF `tokenizer.chat_template`, Jinja, rendered in a sandbox) comes
first. A GGUF file without one (Gemma 3 270M's carries none) gets llama.cpp's built-in template
for its architecture (`llama_chat_apply_template`, e.g. 'gemma' for gemma3); an architecture
llama.cpp has no template for is refused (ValueError) rather than guessed.
"""
from __future__ import annotations

import ctypes

import jinja2
import llama_cpp
from jinja2.sandbox import ImmutableSandboxedEnvironment

# GGUF general.architecture -> the name of llama.cpp's built-in template, where they differ.
BUILTIN_BY_ARCH = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "gemma3n": "gemma",
                   "qwen2": "chatml", "qwen3": "chatml", "phi3": "phi3"}


def has_chat_template(model) -> bool:
    return bool(model.chat_template()) or _builtin_name(model) is not None


def render_messages(model, messages: list[dict[str, str]]) -> list[int]:
    """A conversation ({"role", "content"} dicts) through the model's chat template, tokenized,
    ending with the assistant's turn opened. ValueError (or jinja2.TemplateError) when it cannot."""
    template = model.chat_template()
    text = _render_jinja(model, template, messages) if template else _render_builtin(model, messages)
    ids = model.tokenize(text, add_special=False, parse_special=True)
    if model.add_bos and (not ids or ids[0] != model.bos_id):
        ids.insert(0, model.bos_id)
    return ids


def _render_jinja(model, template: str, messages) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.ChainableUndefined)

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    bos = model.token_bytes(model.bos_id, special=True).decode("utf-8", "replace")
    eos = model.token_bytes(model.eos_id, special=True).decode("utf-8", "replace")
    return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                            bos_token=bos, eos_token=eos)


def _builtin_name(model) -> str | None:
    arch = (model.metadata("general.architecture") or "") if hasattr(model, "metadata") else ""
    name = BUILTIN_BY_ARCH.get(arch)
    return name if name is not None and _apply_builtin(name, [{"role": "user", "content": ""}]) is not None else None


def _apply_builtin(name: str, messages) -> str | None:
    arr = (llama_cpp.llama_chat_message * len(messages))()
    keep = []
    for i, m in enumerate(messages):
        role, content = m["role"].encode(), m["content"].encode()
        keep += [role, content]
        arr[i].role, arr[i].content = role, content
    size = 256 + 2 * sum(len(b) for b in keep)
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_chat_apply_template(name.encode(), arr, len(messages), True, buf, size)
    if n > size:
        buf = ctypes.create_string_buffer(n)
        n = llama_cpp.llama_chat_apply_template(name.encode(), arr, len(messages), True, buf, n)
    return buf.raw[:n].decode("utf-8", "replace") if n >= 0 else None


def _render_builtin(model, messages) -> str:
    name = _builtin_name(model)
    if name is None:
        raise ValueError(f"{model.name} has no chat template in its GGUF metadata and llama.cpp has no built-in "
                         "one for its architecture; send the prompt as text instead of chat messages")
    text = _apply_builtin(name, messages)
    if text is None:
        raise ValueError(f"llama.cpp's built-in '{name}' chat template could not render these messages")
    return text

"""Tiny GGUF models built with the `gguf` package, so tests exercise the real llama.cpp loader in
seconds. A llama-architecture transformer with random f32 weights and a SentencePiece-style
vocabulary (control tokens, 256 byte-fallback tokens, a few word pieces)."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

PIECES = ["▁the", "▁a", "▁of", "▁and", "▁to", "▁is", "▁in", "▁it", "▁that", "▁was", "▁he", "▁for", "▁on",
          "▁are", "▁with", "▁as", "▁I", "▁his", "▁they", "▁be", "▁at", "▁one", "▁have", "▁this", "▁from",
          "▁hello", "▁world", "▁list", "▁def", "▁return", "e", "t", "a", "o", "i", "n", "s", "r", "h", "l"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def vocabulary(variant: int = 0) -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    pieces = list(PIECES)
    if variant:
        pieces[0] = "▁teh"  # one token differs: a different tokenizer
    tokens += pieces
    types += [gguf.TokenType.NORMAL] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, scores, [int(t) for t in types]


def write_tiny_llama(path: Path, seed: int = 0, n_embd: int = 64, n_layer: int = 2, n_head: int = 4,
                     n_head_kv: int = 2, n_ff: int = 128, n_ctx: int = 512, base_seed: int | None = None,
                     noise: float = 0.0, vocab_variant: int = 0, scale: float = 0.6) -> Path:
    """Write a tiny model. With base_seed, weights are the base model's plus `noise` (a draft)."""
    tokens, scores, types = vocabulary(vocab_variant)
    n_vocab = len(tokens)
    head_dim = n_embd // n_head
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"tiny-llama-{seed}")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)

    base = np.random.default_rng(seed if base_seed is None else base_seed)
    extra = np.random.default_rng(seed + 10_000)

    def t(*shape, s=scale):
        x = base.standard_normal(shape).astype(np.float32) * s / np.sqrt(shape[-1])
        if base_seed is not None and noise:
            x += extra.standard_normal(shape).astype(np.float32) * noise * s / np.sqrt(shape[-1])
        return x.astype(np.float32)  # numpy 2 promotes by the float64 scalar; llama.cpp wants f32

    w.add_tensor("token_embd.weight", t(n_vocab, n_embd, s=1.0 * np.sqrt(n_embd)))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("output.weight", t(n_vocab, n_embd, s=4.0))
    kv = n_head_kv * head_dim
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", t(n_embd, n_embd))
        w.add_tensor(f"blk.{i}.attn_k.weight", t(kv, n_embd))
        w.add_tensor(f"blk.{i}.attn_v.weight", t(kv, n_embd))
        w.add_tensor(f"blk.{i}.attn_output.weight", t(n_embd, n_embd))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", t(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_up.weight", t(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_down.weight", t(n_embd, n_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

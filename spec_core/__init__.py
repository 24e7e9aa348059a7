"""The core both ends share: pure code with no sockets and no model runtime.

- `warping`: temperature / top-k / top-p turn logits into the processed distribution p.
- `qcodec`: the draft distribution q on the wire (none, sparse fixed-point, float) and the exact
  sampling from what is shipped ("quantize first, then sample").
- `verify`: one speculative round (accept, corrected, bonus), the function the lossless
  guarantee rests on.
- `fingerprint`: the tokenizer fingerprint both ends compare.
- `crossvocab`: drafting across tokenizers: the token-level intersection (TLI) map, q restricted
  to it, the vocabulary on the wire, and the draft's incremental view of the committed text.
- `costmodel`: expected tokens per round and the γ that maximises tokens per second.
- `kvreuse`: how much of a KV cache a request keeps (the rule every target runtime shares).
"""

__version__ = "0.1.0"

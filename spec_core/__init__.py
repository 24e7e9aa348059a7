"""The core both ends share: pure code with no sockets, no model runtime and no generated wire code.

The round's maths:
- `warping`: temperature / top-k / top-p turn logits into the processed distribution p.
- `drafting`: one draft step: from the draft's logits to a draft token and the q shipped with it.
- `qcodec`: the draft distribution q (none, sparse fixed-point, float) and exact sampling from what
  is shipped ("quantize first, then sample").
- `acceptance`: the accept test and the residual, written once.
- `verify`: one speculative round (accepted, corrected, bonus) and its commit; `tree`: token trees,
  a chain being the tree with one path; `continuations`: next rounds keyed by the outcome they assume.
- `crossvocab`: drafting across tokenizers: the token-level intersection (TLI) map, q restricted to
  it, the vocabulary on the wire, and the draft's incremental view of the committed text.
- `fingerprint`: the tokenizer fingerprint both ends compare.
- `synthetic`: a model pair with exact, cheap distributions for statistical tests and sweeps.

Policies the verifier runs and the fleet model imports (one function each):
- `steering`: the draft budget that pays at the verifier's load; `estimates`: the cost line and
  the acceptance rate both ends keep; `costmodel`: expected tokens per round and the best γ.
- `batchplan`: how a batched pass is filled (fair share, least slack first, prefill chunks).
- `kvpark`: parking idle sessions' KV in host memory, and whose; `kvreuse`: how much of a KV cache a
  request keeps.
- `slo`: when work is due under a latency target, and the verdicts.

Plumbing: `wire` (constants both ends of the wire agree on), `paths` (the cache folder). The
generated stubs and the q payload's wire codec live in `spec_core.proto`.
"""

__version__ = "0.1.0"

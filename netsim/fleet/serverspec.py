"""The second baseline: vLLM speculating for itself on the GPU, with the draft's cost charged there.

What a step of vLLM's own speculative decoding costs (vLLM v1, `vllm/v1/spec_decode/`; the docs'
features/speculative_decoding pages):

  draft model  `draft_model.py` (`DraftModelProposer`, on the shared `SpecDecodeBaseProposer` of
               `llm_base_proposer.py` / `eagle.py`): a second model on the same GPU, its weights beside
               the target's and its KV cache in the same block pool (every session holds both). Each
               step it runs a first pass over the tokens the target just verified, then
               `num_speculative_tokens − 1` more passes of one token per sequence, in a serial loop
               (`for token_index in range(self.num_speculative_tokens - 1)`): γ passes that each read
               the draft's weights and its sessions' KV.
  EAGLE        `eagle.py` (`EagleProposer`, `pass_hidden_states_to_model=True`): the same loop over a
               head of one decoder layer fed the target's hidden states; its weights and its one
               layer of KV are on the GPU.
  n-gram       `ngram_proposer.py`: prompt lookup on the CPU over the token ids (numba), no GPU pass.
               Free to draft here, with its own α (lower on free text than a model's).

The verify pass is the target over γ + 1 tokens per sequence (the drafts and the bonus position),
the rejection sampler on the device after it (vllm/v1/sample/rejection_sampler.py). A step commits
1 + accepted tokens per sequence: E = (1 − α^(γ+1)) / (1 − α), in one burst.

The draft's shapes are derived from the models' config.json: Llama-3.2-1B (the Llama 3 tokenizer, so
a valid draft for both targets) and EAGLE-3 heads (one decoder layer whose attention reads the
concatenation of embedding and fused hidden state, a fc fusing three of the target's hidden
states, a 32k draft vocabulary's output layer), weights in bf16.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from netsim.fleet.costs import RooflineCost


@dataclass(frozen=True)
class Draft:
    """A server-side proposer: what it holds on the GPU and what its passes read."""
    method: str                   # "draft model", "EAGLE", "n-gram"
    name: str
    params: float = 0.0
    model_bytes: float = 0.0      # weights on the GPU
    kv_bytes_per_token: float = 0.0   # at bf16; halved with an fp8 KV cache
    attention_flops: float = 0.0  # per query token per context token

    @property
    def on_gpu(self) -> bool:
        return self.model_bytes > 0


# Llama-3.2-1B (config.json: 16 layers, hidden 2048, 8 KV heads of 64 dims, tied embeddings; 1.24e9
# parameters): KV per token 2 x 16 x 8 x 64 x 2 bytes = 32.8 kB.
LLAMA_1B_DRAFT = Draft("draft model", "Llama-3.2-1B bf16", 1.24e9, 2.47e9, 32_768, 4 * 16 * 2048)


def eagle3_head(hidden: int, intermediate: int, kv_heads: int = 8, head_dim: int = 128,
                draft_vocab: int = 32_000) -> Draft:
    """One decoder layer (q/k/v read 2·hidden), the fc over three hidden states, the draft vocabulary's head."""
    qkv = 2 * hidden * (hidden + 2 * kv_heads * head_dim)
    params = qkv + hidden * hidden + 3 * hidden * intermediate + 3 * hidden * hidden + draft_vocab * hidden
    return Draft("EAGLE", f"EAGLE-3 head (hidden {hidden})", params, 2 * params, 2 * kv_heads * head_dim * 2,
                 4 * hidden)


DRAFTS = {
    "8b-bf16": {"draft model": LLAMA_1B_DRAFT, "EAGLE": eagle3_head(4096, 14336), "n-gram": Draft("n-gram", "prompt lookup")},
    "70b-fp8": {"draft model": LLAMA_1B_DRAFT, "EAGLE": eagle3_head(8192, 28672), "n-gram": Draft("n-gram", "prompt lookup")},
}
METHODS = ("draft model", "EAGLE", "n-gram")


def draft_cost(draft: Draft, target: RooflineCost, kv_scale: float) -> RooflineCost | None:
    """The draft's passes on the target's GPU (same efficiencies, no host path of its own)."""
    if not draft.on_gpu:
        return None
    return replace(target, params=draft.params, model_bytes=draft.model_bytes,
                   kv_bytes_per_token=draft.kv_bytes_per_token * kv_scale,
                   attention_flops_per_context_token=draft.attention_flops, host=None, stream_host=None,
                   name=draft.name)


@dataclass(frozen=True)
class ServerSpecCost:
    """A step of vLLM speculating for itself: the draft's γ passes, then the target's verify pass.

    `pass_s(tokens, sessions)` is one step over `sessions` sequences whose verify pass computes `tokens`
    target tokens (γ + 1 each, and a new request's prompt); the draft's first pass reads as many
    tokens as the target verified, its next γ − 1 one per sequence. `host` of the target cost is the
    rejection sampler on the device (one round per sequence)."""

    target: RooflineCost
    draft: RooflineCost | None
    gamma: int

    @property
    def kv_bytes_per_token(self) -> float:
        return self.target.kv_bytes_per_token + (self.draft.kv_bytes_per_token if self.draft else 0.0)

    @property
    def model_bytes(self) -> float:
        return self.target.model_bytes + (self.draft.model_bytes if self.draft else 0.0)

    @property
    def context_tokens(self) -> int:
        return self.target.context_tokens

    def draft_s(self, tokens: int, sessions: int) -> float:
        if self.draft is None or sessions <= 0:
            return 0.0
        first = self.draft.pass_s(tokens, sessions)
        return first + (self.gamma - 1) * self.draft.pass_s(sessions, sessions)

    def pass_s(self, tokens: int, sessions: int, hybrid: bool = False) -> float:
        # the target's verify pass is charged its rounds' maths on the device (`host`), not the stream sampler
        return self.target.pass_s(tokens, sessions, hybrid=True) + self.draft_s(tokens, sessions)

    def describe(self) -> str:
        return (f"{self.target.describe()}; draft: "
                + (f"{self.draft.name}, {self.draft.model_bytes / 1e9:.2f} GB, "
                   f"{self.draft.kv_bytes_per_token / 1e3:g} kB KV/token, {self.gamma} passes a step"
                   if self.draft else "on the CPU (no GPU pass)"))

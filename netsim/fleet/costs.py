"""What a verifier's forward pass costs: a line for a CPU backend, a roofline for a GPU."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LinearCost:
    """pass_s = fixed_s + per_token_s · tokens: a CPU backend (compute-bound at any batch)."""

    fixed_s: float
    per_token_s: float
    name: str = "linear"

    def pass_s(self, tokens: int, sessions: int) -> float:
        return self.fixed_s + self.per_token_s * tokens

    def describe(self) -> str:
        return f"{self.name}: {self.fixed_s * 1e3:.2f} ms + {self.per_token_s * 1e3:.3f} ms/token"


@dataclass(frozen=True)
class RooflineCost:
    """A GPU pass: the slower of reading the weights and the sessions' KV cache at the achieved
    memory bandwidth, and the FLOPs of `tokens` at the achieved compute rate; plus a launch floor.

    pass_s = max((model_bytes + sessions·context·kv_bytes_per_token) / (bw·bw_eff),
                 2·params·tokens / (flops·flops_eff)) + overhead_s
    """

    params: float                  # model parameters
    model_bytes: float             # weight bytes read per pass
    kv_bytes_per_token: float      # KV cache bytes per token of context (all layers, K and V)
    context_tokens: int            # mean context per session
    hbm_bytes_per_s: float         # peak memory bandwidth
    flops_per_s: float             # peak dense bf16 FLOP/s
    bw_efficiency: float = 0.7     # achieved / peak bandwidth (our assumption)
    flops_efficiency: float = 0.5  # achieved / peak FLOPs (our assumption)
    overhead_s: float = 0.0005     # kernel launches, sampling, scheduling per pass (our assumption)
    name: str = "roofline"

    def pass_s(self, tokens: int, sessions: int) -> float:
        memory_s = (self.model_bytes + sessions * self.context_tokens * self.kv_bytes_per_token) / (
            self.hbm_bytes_per_s * self.bw_efficiency)
        compute_s = 2.0 * self.params * tokens / (self.flops_per_s * self.flops_efficiency)
        return max(memory_s, compute_s) + self.overhead_s

    def describe(self) -> str:
        return (f"{self.name}: {self.params / 1e9:g}B params, {self.model_bytes / 1e9:g} GB weights, "
                f"{self.kv_bytes_per_token / 1e3:g} kB KV/token x {self.context_tokens} tokens/session, "
                f"{self.hbm_bytes_per_s / 1e12:g} TB/s x {self.bw_efficiency:g}, "
                f"{self.flops_per_s / 1e12:g} TFLOP/s x {self.flops_efficiency:g}, +{self.overhead_s * 1e3:g} ms")


# Llama-3.1-8B in bf16 (config.json: 32 layers, 8 KV heads of 128 dims; 8.03e9 parameters):
# KV per token = 2 (K, V) x 32 x 8 x 128 x 2 bytes = 131 kB.
LLAMA_8B = dict(params=8.03e9, model_bytes=16.06e9, kv_bytes_per_token=131_072)
# NVIDIA H100 SXM5 datasheet: 3.35 TB/s HBM3, 989 TFLOP/s dense BF16 (1979 with sparsity).
H100 = dict(hbm_bytes_per_s=3.35e12, flops_per_s=989e12)
# NVIDIA H200 datasheet: 4.8 TB/s HBM3e, 141 GB, same compute as the H100 SXM.
H200 = dict(hbm_bytes_per_s=4.8e12, flops_per_s=989e12)


def gpu_cost(gpu: dict = H200, context_tokens: int = 1024) -> RooflineCost:
    return RooflineCost(**LLAMA_8B, **gpu, context_tokens=context_tokens, name="H200, Llama-3.1-8B bf16"
                        if gpu is H200 else "H100, Llama-3.1-8B bf16")


def kv_sessions(gpu_memory_bytes: float, cost: RooflineCost, usable: float = 0.9) -> int:
    """Sessions whose KV cache fits next to the weights (vLLM's gpu_memory_utilization 0.9)."""
    return int((gpu_memory_bytes * usable - cost.model_bytes) // (cost.kv_bytes_per_token * cost.context_tokens))

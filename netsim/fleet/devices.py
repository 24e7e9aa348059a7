"""The device's side of a hybrid round: how long its draft takes per token, and what its prompt costs.

For the Llama-3.1 targets of the regime map the device drafts with Llama-3.2-1B-Instruct in Q4_0
(llama.cpp: 727.75 MiB of weights; an f16 KV cache of 16 layers x 8 KV heads x 64 dims x 2 (K, V) x
2 bytes = 32,768 B a token), the one model that shares their tokenizer at a size a phone holds. A
device's row is a published llama.cpp measurement (llama-bench `tg128` for decoding one token at a
time, `pp512` for a prompt) of a model of about that size, scaled to this draft by weight bytes for
decoding (memory-bound) and by parameters for the prompt (compute-bound):

  phone        Qualcomm QCS8550 board (Snapdragon 8 Gen 2 class, Radxa Dragon Q8B), CPU, 8 threads:
               TinyLlama-1.1B Q4_K_M (636.18 MiB) tg128 38.81 t/s, pp512 194.49 t/s
               (geerlingguy/ai-benchmarks issue #54).
  laptop-cpu   Apple M2 Pro CPU (Mac mini; the MacBook Pro's chip), llama.cpp: LLaMA-7B Q4_0 (3.56 GiB,
               6.74e9 parameters) 47.81 ms a token generated, 16.99 ms a prompt token
               (XiongjieDai/GPU-Benchmarks-on-LLM-Inference issue #1).
  laptop-gpu   Apple M5 GPU (Metal), llama-bench: TinyLlama-1.1B Q4_0 (0.59 GiB) tg128 149.69 t/s,
               pp512 3,959 t/s (ggml-org/llama.cpp PR #16634).
  this-machine this repository's CI-class VM, the bundled SmolLM2-135M draft as bench/device_speed.py
               times it (one thread), when it has been run: busy unless the load was at most 0.5 per
               core, and a 135M draft, not the 1B (not scaled: it is what our own edge runs). Not in
               the table the map uses (`DEVICES`); the break-even marks it.

Context: decoding reads the weights and the draft's KV cache, so a token at `context` takes
draft_s · (1 + context · kv_bytes_per_token / weight_bytes) (the KV read at the rate the weights
are): 1.35x at 8k and 2.4x at 32k for the 1B draft. A request's new prompt tokens are prefilled by
the device's draft before it drafts (`prefill_s`), after the verifier has them too; the session's
earlier context is in the draft's KV already (its first prefill is a one-time cost per session,
`first_prefill_s`, stated in the tables, not in the steady state).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

MIB = 1 << 20
GIB = 1 << 30
# Llama-3.2-1B-Instruct, Q4_0 in llama.cpp (ggml-org/llama.cpp PR #11390's llama-bench rows:
# "llama 1B Q4_0 | 727.75 MiB | 1.24 B"); config.json: 16 layers, 8 KV heads of 64 dims.
DRAFT_NAME = "Llama-3.2-1B Q4_0"
DRAFT_WEIGHT_BYTES = 727.75 * MIB
DRAFT_PARAMS = 1.24e9
DRAFT_KV_BYTES_PER_TOKEN = 16 * 8 * 64 * 2 * 2


@dataclass(frozen=True)
class Device:
    key: str
    name: str
    draft_s: float             # per token of the draft at short context
    prefill_s: float           # per prompt token
    source: str
    busy: bool = False         # measured on a busy machine: not a published figure
    draft: str = DRAFT_NAME

    def draft_s_at(self, context: int, base_s: float | None = None) -> float:
        """Drafting time per token at `context` tokens of the draft's KV (base_s: at short context)."""
        return draft_s_at(self.draft_s if base_s is None else base_s, context)

    def first_prefill_s(self, context: int) -> float:
        return context * self.prefill_s

    def to_json(self) -> dict:
        return {"key": self.key, "name": self.name, "draft": self.draft, "draft_ms": round(self.draft_s * 1e3, 2),
                "prefill_ms_per_token": round(self.prefill_s * 1e3, 3), "source": self.source, "busy": self.busy}


def draft_s_at(base_s: float, context: int, kv_bytes_per_token: float = DRAFT_KV_BYTES_PER_TOKEN,
               weight_bytes: float = DRAFT_WEIGHT_BYTES) -> float:
    return base_s * (1.0 + context * kv_bytes_per_token / weight_bytes)


def _scaled(name: str, key: str, tg_s: float, pp_s: float, bytes_: float, params: float, source: str) -> Device:
    return Device(key, name, tg_s * DRAFT_WEIGHT_BYTES / bytes_, pp_s * DRAFT_PARAMS / params, source)


DEVICES = {
    "phone": _scaled("phone (Snapdragon 8 Gen 2-class CPU)", "phone", 1 / 38.81, 1 / 194.49, 636.18 * MIB, 1.10e9,
                     "geerlingguy/ai-benchmarks issue #54 (Radxa Dragon Q8B, QCS8550, llama.cpp CPU 8 threads: "
                     "TinyLlama-1.1B Q4_K_M tg128 38.81 t/s, pp512 194.49 t/s)"),
    "laptop-cpu": _scaled("laptop CPU (Apple M2 Pro)", "laptop-cpu", 47.81e-3, 16.99e-3, 3.56 * GIB, 6.74e9,
                          "XiongjieDai/GPU-Benchmarks-on-LLM-Inference issue #1 (M2 Pro CPU, llama.cpp: LLaMA-7B "
                          "Q4_0 47.81 ms/token eval, 16.99 ms/token prompt)"),
    "laptop-gpu": _scaled("laptop GPU (Apple M5, Metal)", "laptop-gpu", 1 / 149.69, 1 / 3959.13, 0.59 * GIB, 1.10e9,
                          "ggml-org/llama.cpp PR #16634 (M5, llama-bench: TinyLlama-1.1B Q4_0 tg128 149.69 t/s, "
                          "pp512 3,959 t/s)"),
}
DEFAULT_DEVICE = "laptop-gpu"


def this_machine(results_dir=None) -> Device | None:
    """Our own edge as bench/device_speed.py timed it here (bench/results/device-this-machine.json),
    busy when the load at its start or end was above 0.5 per core; None when it has not been run."""
    from hybridspec.figures import RESULTS, read_result
    path = (results_dir or RESULTS) / "device-this-machine.json"
    if not path.is_file():
        return None
    result = read_result(path)
    cores = max(1, int((result.machine or {}).get("cores") or os.cpu_count() or 1))
    loads = [v[0] for v in (result.load or {}).values() if v]
    busy = not loads or max(loads) > 0.5 * cores
    return Device("this-machine", "this machine (the CI-class VM)" + (", busy" if busy else ""),
                  float(result.figures["draft-ms"].value) / 1e3, float(result.figures["prefill-ms"].value) / 1e3,
                  f"bench/device_speed.py, {result.date}" + (" (measured busy: not a published figure)" if busy else ""),
                  busy=busy, draft="SmolLM2-135M draft (bundled)")


def get_device(key: str) -> Device:
    if key not in DEVICES:
        raise KeyError(f"no device {key!r}: one of {sorted(DEVICES)}")
    return DEVICES[key]

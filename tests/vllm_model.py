"""Local Hugging Face model folders for the vLLM backend, built without a model hub.

vLLM cannot load GGUF on CPU, so we convert (hybridspec/testing/vllm_model.py: transformers reads
a GGUF file, dequantizing any quantized tensors to float32, and writes an ordinary HF folder with
its tokenizer). Two uses:

  tiny_vllm_pair(dir)        a tiny random llama GGUF target (tests/tiny_gguf.py, head_dim 64 so
                             vLLM's CPU attention takes it), a blurred GGUF draft sharing its
                             tokenizer, and the target converted to an HF folder. Seconds.
  smollm2_folder()           the bundled SmolLM2-135M-Instruct Q4_1, dequantized (about 30 s,
                             517 MB), for benchmarks.

Folders are cached under $HYBRIDSPEC_CACHE (default ~/.cache/hybridspec) keyed by the GGUF's size
and mtime, and written atomically (a temp folder renamed into place).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from hybridspec.testing.vllm_model import hf_folder_from_gguf, smollm2_folder  # noqa: E402
from tiny_gguf import write_tiny_llama  # noqa: E402

# head_dim = 128 / 2 = 64: vLLM's CPU attention kernels take 32..256 in steps of 16, not tests'
# usual 16.
TINY_SHAPE = dict(n_embd=128, n_layer=2, n_head=2, n_head_kv=1, n_ff=256, n_ctx=2048)


def tiny_vllm_pair(directory: str | os.PathLike) -> dict[str, Path]:
    """target.gguf, draft.gguf (same tokenizer, blurred weights) and target_hf (folder)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    target = d / "vtarget.gguf"
    draft = d / "vdraft.gguf"
    if not target.is_file():
        write_tiny_llama(target, seed=0, **TINY_SHAPE)
    if not draft.is_file():
        write_tiny_llama(draft, seed=1, base_seed=0, noise=0.5, **TINY_SHAPE)
    return {"target": target, "draft": draft, "target_hf": hf_folder_from_gguf(target, d / "vtarget-hf")}


if __name__ == "__main__":
    # python tests/vllm_model.py smollm2 | tiny DIR: build (or find) a folder and print its path.
    what = sys.argv[1] if len(sys.argv) > 1 else "smollm2"
    print(smollm2_folder() if what == "smollm2" else tiny_vllm_pair(sys.argv[2])["target_hf"])

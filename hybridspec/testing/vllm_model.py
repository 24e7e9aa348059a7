"""Local Hugging Face model folders for the vLLM backend, built without a model hub.

vLLM cannot load GGUF on CPU, so we convert: transformers reads a GGUF file (dequantizing any
quantized tensors to float32) and writes an ordinary HF folder with its tokenizer.
smollm2_folder() is the bundled SmolLM2-135M-Instruct Q4_1, dequantized (about 30 s, 517 MB), for
benchmarks; tests/vllm_model.py builds tiny folders for tests from the same converter.

Folders are cached under spec_core.paths.cache_root() (~/.cache/hybridspec by default) keyed by the GGUF's size
and mtime, and written atomically (a temp folder renamed into place).
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from spec_core.paths import cache_root


def hf_folder_from_gguf(gguf_path: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Convert a GGUF file into an HF model folder (float32 weights + tokenizer); cached."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = Path(gguf_path).resolve()
    st = src.stat()
    key = hashlib.sha256(f"{src}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    out = Path(out) if out else cache_root() / "hf-from-gguf" / f"{src.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    # The GGUF quantizer marks the model "not serializable"; the weights are plain f32 by now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(out)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def smollm2_folder() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF as a float32 HF folder (cached)."""
    from llama_runtime import bundled_model_path
    return hf_folder_from_gguf(bundled_model_path())

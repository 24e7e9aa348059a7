"""Requantization: the target's own weights at a cheaper quantization type (llama.cpp's quantizer).

Requantizing an already-quantized file (the bundled target is Q4_1) goes through a dequantize
step, so it needs `allow_requantize`; the result is lossier than quantizing from f16, which is
exactly what a draft may be. K-quant types need rows that are a multiple of 256: SmolLM2's
576-wide rows are not, so llama.cpp falls back (Q3_K_S / Q2_K come out as mostly Q4_0 with a
Q3_K ffn_down) -- the file sizes say so.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

# Names as llama-quantize spells them (llama_cpp.LLAMA_FTYPE_MOSTLY_<name>). Resolved when used,
# so that building the CLI's parser does not load llama.cpp.
FTYPES = ("Q8_0", "Q6_K", "Q5_1", "Q5_0", "Q5_K_M", "Q5_K_S", "Q4_1", "Q4_0", "Q4_K_M", "Q4_K_S",
          "IQ4_NL", "IQ4_XS", "Q3_K_L", "Q3_K_M", "Q3_K_S", "Q2_K", "Q2_K_S")

# Tensor types accepted for --embd-type (llama_cpp.GGML_TYPE_<name>): the token embedding, which
# is also the output head when the model ties them, as SmolLM2 does.
TENSOR_TYPES = ("F16", "Q8_0", "Q6_K", "Q5_0", "Q5_1", "Q4_0", "Q4_1", "Q4_K", "Q3_K", "Q2_K")


def requantize(source: str | os.PathLike, out: str | os.PathLike, ftype: str = "Q4_0",
               embd_type: str | None = None, n_threads: int | None = None) -> Path:
    """Write `out`: `source` requantized to `ftype` (a key of FTYPES).

    embd_type, if given, also requantizes the token embedding / output head to that tensor type
    (llama.cpp otherwise keeps it at a higher precision, and on a 49k vocabulary it is a large
    share of each step's work).
    """
    import llama_cpp

    from llama_runtime.model import GGUFModel  # initialises the backend and routes its logging

    if ftype not in FTYPES:
        raise ValueError(f"unknown quantization type {ftype!r}; choose one of {', '.join(FTYPES)}")
    if embd_type is not None and embd_type not in TENSOR_TYPES:
        raise ValueError(f"unknown tensor type {embd_type!r}; choose one of {', '.join(TENSOR_TYPES)}")
    source, out = Path(source), Path(out)
    # A vocab-only load checks that llama.cpp can read the file before the quantizer touches it.
    GGUFModel(source, vocab_only=True).close()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.allow_requantize = True
    params.nthread = n_threads or 0  # 0 = llama.cpp's choice (hardware threads)
    if embd_type is not None:
        params.token_embedding_type = getattr(llama_cpp, f"GGML_TYPE_{embd_type}")
        params.output_tensor_type = getattr(llama_cpp, f"GGML_TYPE_{embd_type}")
    tmp = out.with_name(out.name + ".part")
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), params)
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize({source.name} -> {ftype}) failed with code {rc}; "
                           "run with -v for llama.cpp's log")
    os.replace(tmp, out)
    log.debug("requantized %s -> %s (%s)", source, out, ftype)
    return out

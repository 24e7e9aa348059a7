"""llama.cpp (llama-cpp-python, low-level API) for both ends: load a GGUF once, one KV cache per
sequence with rollback, logits only for the rows a caller needs, vocabulary and chat template.

llama.cpp is compiled for the CPU it runs on by scripts/llama_build.py (flags from the CPU's
features, never AMX, smoke-tested); as a second guard every load sets `use_extra_bufts = False`,
which keeps ggml's AMX/repack buffer types out of the way.
"""
from llama_runtime.kvcontext import KVContext
from llama_runtime.model import (GGUFModel, ModelMissing, ModelUnloadable, bundled_model_path, default_threads,
                                 find_model)
from llama_runtime.sharedkv import ParkedSeq, SharedKV, TreeJob, kv_bytes_per_token
from llama_runtime.treejob import TreeIdsBusy

__all__ = ["GGUFModel", "KVContext", "ModelMissing", "ModelUnloadable", "ParkedSeq", "SharedKV", "TreeIdsBusy",
           "TreeJob", "bundled_model_path", "default_threads", "find_model", "kv_bytes_per_token"]

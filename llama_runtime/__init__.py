"""llama.cpp (llama-cpp-python, low-level API) for both ends: load a GGUF once, one KV cache per
sequence with rollback, logits only for the rows a caller needs, vocabulary and chat template.

The project's pinned build is non-native (see scripts/setup.sh); as a second guard every load
sets `use_extra_bufts = False`, which keeps ggml's AMX/repack buffers (SIGILL on these Xeons in
native builds) out of the way.
"""
from llama_runtime.model import GGUFModel, KVContext, SharedKV, bundled_model_path, default_threads

__all__ = ["GGUFModel", "KVContext", "SharedKV", "bundled_model_path", "default_threads"]

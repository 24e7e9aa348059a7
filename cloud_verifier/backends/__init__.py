"""Target-model backends behind one interface (`base.Backend`)."""
from __future__ import annotations

from cloud_verifier.backends.base import Backend, BackendInfo


def load_backend(name: str, model: str | None, **options) -> Backend:
    """Build a backend by name; imports are lazy so that vLLM is only needed for --backend vllm."""
    if name in ("llama.cpp", "llama", "llamacpp"):
        from cloud_verifier.backends.llama_cpp import LlamaCppBackend
        return LlamaCppBackend(model, **options)
    if name == "synthetic":
        from cloud_verifier.backends.synthetic import SyntheticBackend
        return SyntheticBackend(**options)
    if name == "vllm":
        from cloud_verifier.backends.vllm import VllmBackend
        return VllmBackend(model, **options)
    raise ValueError(f"unknown backend {name!r}: choose llama.cpp, vllm or synthetic")


__all__ = ["Backend", "BackendInfo", "load_backend"]

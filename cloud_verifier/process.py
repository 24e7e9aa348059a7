"""Start a verifier as its own process: hybridspec.launch, re-exported where callers used to find it."""
from hybridspec.launch import VERIFIER_READY as READY, spawn_verifier

__all__ = ["READY", "spawn_verifier"]

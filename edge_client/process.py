"""Start `edge-client serve` as its own process: hybridspec.launch, re-exported where callers used to find it."""
from hybridspec.launch import EDGE_SERVER_READY, spawn_edge_server

__all__ = ["EDGE_SERVER_READY", "spawn_edge_server"]

"""The edge client: draft on the device, verify in the cloud, stream the committed text.

- `drafters`: where drafts come from (a GGUF model on llama.cpp, prompt lookup, synthetic).
- `gamma`: fixed γ, or adaptive γ from the measured cost model.
- `client`: the session loop (deadlines, idempotent retries, replay) and the Python API.
- `cli`: `edge-client generate | info | make-draft | eval-draft`.
"""
from edge_client.client import EdgeClient, EdgeError, Generation, GenerationStats

__all__ = ["EdgeClient", "EdgeError", "Generation", "GenerationStats"]

"""The edge client: draft on the device, verify in the cloud, stream the committed text.

- `drafters`: where drafts come from (a GGUF model on llama.cpp, prompt lookup, synthetic).
- `gamma`: fixed γ, or adaptive γ from the measured cost model.
- `options`: EdgeOptions (speculation, transport, security), built once, from code or from
  the command line (`add_edge_options`, `options_from_args`).
- `client`: the Python API (EdgeClient); `session`: the session loop (rounds, rounds in flight,
  replay); `transport`: the calls to the verifier (deadlines, idempotent retries, back-off);
  `pairing`: same tokenizer or across vocabularies, decided before the first round; `stats`: the
  records of a generation; `protocols`: the interfaces (tokenizer, γ policy).
- `cli`: `edge-client generate | info | serve | make-draft | eval-draft`.
- `serve`: the OpenAI-compatible HTTP API on the edge (`openai_protocol`: request and response
  shapes; `stopstrings`; `metrics`: Prometheus). FastAPI, uvicorn and prometheus_client are
  imported only when `edge-client serve` runs.
"""
from edge_client.client import EdgeClient, EdgeError, Generation, GenerationStats
from edge_client.options import EdgeOptions, Security, Speculation, Transport

__all__ = ["EdgeClient", "EdgeError", "EdgeOptions", "Generation", "GenerationStats", "Security", "Speculation",
           "Transport"]
